"""A check script run under Triton's interpreter (``TRITON_INTERPRET=1``) in its own process:
how the CPU runs the Triton kernels (the variable must be set before Triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def interpreted(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` with ``args`` under the interpreter, no GPU visible; its output captured."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
