"""`python -m engine.plot`: runs engine/tools/plot.py."""

import sys

from engine.tools.plot import main

if __name__ == "__main__":
    sys.exit(main())
