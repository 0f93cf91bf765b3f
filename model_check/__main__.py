"""Entry point: `python -m model_check`."""

import sys

from model_check.cli import main

sys.exit(main())
