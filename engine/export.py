"""`python -m engine.export`: runs engine/tools/export.py."""

from engine.tools.export import main

if __name__ == "__main__":
    main()
