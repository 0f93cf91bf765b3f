"""pytest that a SIGINT always interrupts, so that a run cut by its time limit still writes its
JUnit XML (the record of the tests it ran).

    python3 tools/interruptible_pytest.py PYTEST_ARGS...

A shell without job control starts its background jobs with SIGINT ignored, and a Python
started with SIGINT ignored never installs its KeyboardInterrupt handler: ``timeout
--signal=INT`` then does nothing, the later SIGKILL ends pytest before it writes anything, and
the run's record is lost (the GPU conformance parts run so). This restores Python's handler
before pytest starts, whatever the caller inherited, and imports as ``python -m pytest`` does
(the working directory first, not this script's folder, whose ``vllm/`` would shadow vLLM).
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path[0] = os.getcwd()
    import pytest

    return int(pytest.main(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
