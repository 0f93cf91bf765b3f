"""The Triton decode of bf16 planes into slots (``rowcache.compress.triton_decode``), run on the
CPU by Triton's interpreter: exact against the reference decode, nothing written outside the
listed slots or past the miss count, and each seeded bug of the kernel caught
(``tests/decode_kernel_checks.py`` holds the cases; ``tests/cuda`` runs them on a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).resolve().parent / "decode_kernel_checks.py"


def interpreted(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, str(CHECKS), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_kernel_decodes_every_case_exactly() -> None:
    done = interpreted()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "ok: 20 cases"


@pytest.mark.parametrize(
    ("mutant", "symptom"),
    [
        (1, "values wrong"),  # escapes taken one late
        (2, "values wrong"),  # entries past the miss count decoded
        (3, "values wrong"),  # the sign dropped
        (4, "values written outside"),  # the last block not cut at the expert's end
        (5, "values wrong"),  # 3-bit code groups read 2 bytes apart
    ],
)
def test_each_seeded_bug_of_the_kernel_is_caught(mutant: int, symptom: str) -> None:
    done = interpreted("--mutant", str(mutant))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("FAILED:")
    assert symptom in done.stdout


def test_a_decoder_with_bad_slots_or_launch_is_refused() -> None:
    import torch

    from rowcache.compress import encode
    from rowcache.compress.triton_decode import SlotDecoder
    from rowcache.errors import InvalidInputError

    planes = encode((torch.randn(3, 8, 16) * 0.02).to(torch.bfloat16))
    slots = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    SlotDecoder(planes, slots, grid=4, num_warps=8)  # accepted: nothing launched
    refusals = [
        ({"slots": slots.float()}, "decode into 16-bit [C, ...] slots of as many values"),
        ({"slots": torch.zeros(2, 8, 15, dtype=torch.bfloat16)}, "got torch.bfloat16 of shape"),
        ({"grid": 0}, "got strides (128, 16, 1) and grid 0"),
        ({"num_warps": 3}, "num_warps must be a power of two <= 32, got 3"),
        ({"num_warps": 64}, "got 64"),
    ]
    for change, message in refusals:
        kwargs = {"slots": slots, "grid": 4, **change}
        with pytest.raises(InvalidInputError, match=re.escape(message)):
            SlotDecoder(planes, **kwargs)  # type: ignore[arg-type]
