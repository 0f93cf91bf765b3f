"""The Triton decode of bf16 planes into slots (``rowcache.compress.triton_decode``), run on the
CPU by Triton's interpreter: exact against the reference decode, nothing written outside the
listed slots or past the miss count, and each seeded bug of the kernel caught
(``tests/decode_kernel_checks.py`` holds the cases; ``tests/cuda`` runs them on a GPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from triton_interpreter import interpreted as run_interpreted

CHECKS = Path(__file__).resolve().parent / "decode_kernel_checks.py"


def interpreted(*args: str) -> subprocess.CompletedProcess[str]:
    return run_interpreted(CHECKS, *args)


@pytest.mark.parametrize("mode", [[], ["--one-miss"]], ids=["miss_list", "one_miss"])
def test_the_kernel_decodes_every_case_exactly(mode: list[str]) -> None:
    done = interpreted(*mode)
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


@pytest.mark.parametrize(
    ("mutant", "symptom"),
    [(1, "values wrong"), (3, "values wrong"), (4, "values written outside"), (5, "values wrong")],
)
def test_each_seeded_bug_is_caught_one_miss_a_launch(mutant: int, symptom: str) -> None:
    # Seeded bug 2 (entries past the count) has no counterpart: a launch decodes one miss.
    done = interpreted("--mutant", str(mutant), "--one-miss")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert symptom in done.stdout


def test_one_miss_outside_the_planes_or_slots_is_refused() -> None:
    import torch

    from rowcache.compress import encode
    from rowcache.compress.triton_decode import SlotDecoder
    from rowcache.errors import InvalidInputError

    slots = torch.full((2, 8, 16), 7.0, dtype=torch.bfloat16)
    decoder = SlotDecoder(encode(torch.randn(3, 8, 16).to(torch.bfloat16)), slots, grid=2)
    for expert, slot, message in [
        (3, 0, "expert 3 outside [0, 3) or slot 0 outside [0, 2)"),
        (-1, 0, "expert -1 outside"),
        (0, 2, "slot 2 outside [0, 2)"),
    ]:
        with pytest.raises(InvalidInputError, match=re.escape(message)):
            decoder.decode_one(expert, slot)
    assert bool((slots == 7.0).all())  # nothing launched


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
