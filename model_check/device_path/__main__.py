import sys

from model_check.device_path.checks import main

sys.exit(main())
