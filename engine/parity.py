"""`python -m engine.parity`: runs engine/tools/parity.py."""

import sys

from engine.tools.parity import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
