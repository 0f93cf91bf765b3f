"""vLLM's released wheels, read as zips (never installed): the tests that check names rowcache
relies on against vLLM's own source.

The wheels are downloaded once per machine with pip (no install) into
``$ROWCACHE_VLLM_WHEELS`` (default: ``<tmp>/rowcache-vllm-wheels``, outside the checkout). A
failed download fails the test that asked: such a check is never skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest


def wheel_dir() -> Path:
    default = Path(tempfile.gettempdir()) / "rowcache-vllm-wheels"
    return Path(os.environ.get("ROWCACHE_VLLM_WHEELS", default))


def wheel(version: str) -> Path:
    """The vLLM ``version`` wheel, downloaded if this machine has none yet."""
    directory = wheel_dir()
    found = sorted(directory.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"vllm=={version}",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(directory),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    found = sorted(directory.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not found:
        pytest.fail(
            f"could not download the vLLM {version} wheel ({' '.join(command)}): exit "
            f"{done.returncode}\n{done.stderr[-2000:]}"
        )
    return found[0]


def read(version: str, *paths: str) -> dict[str, str]:
    """The text of each of ``paths`` (e.g. ``vllm/engine/arg_utils.py``) in that wheel."""
    with zipfile.ZipFile(wheel(version)) as zipped:
        return {path: zipped.read(path).decode() for path in paths}
