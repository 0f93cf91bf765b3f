"""Entry point: `python -m model_check`."""

import sys

from model_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
