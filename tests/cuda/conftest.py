"""tests/cuda: the GPU conformance suite. Without a CUDA device every test here is skipped,
with the reason, except those marked ``nogpu`` (checks of the suite's own machinery)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):  # this folder's helpers; tests/sanitizer_oracle.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from cuda_support import NO_CUDA_REASON  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        # The sanitizer pass: torch enabled the sanitizer as it was imported, so the oracle's
        # import (which takes the handler off where it is not enabled) must have left it on.
        import sanitizer_oracle

        if not sanitizer_oracle.handlers_attached():
            raise pytest.UsageError(
                "TORCH_CUDA_SANITIZER is set but the stream sanitizer gets no GPU events: "
                "tests/sanitizer_oracle.py was imported before the sanitizer was enabled"
            )
    config.addinivalue_line(
        "markers",
        "gpu_mutant: the real CUDA provider running a mutant schedule; passes when the race "
        "fixtures detect the mutant",
    )
    config.addinivalue_line("markers", "nogpu: a tests/cuda check that needs no GPU")
    config.addinivalue_line(
        "markers",
        "csan_subprocess: runs its own stream-sanitizer subprocess (redundant in the "
        "TORCH_CUDA_SANITIZER=1 pass)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if HERE in item.path.parents and "nogpu" not in item.keywords:
            item.add_marker(skip)
