"""`python -m engine.reward_check`: runs engine/tools/reward_check.py."""

import sys

from engine.tools.reward_check import main

if __name__ == "__main__":
    sys.exit(main())
