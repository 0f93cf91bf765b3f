"""The verdict of tools/vllm/scale_overread.py (vLLM's MXFP4 matmul reading past its weight
scales, run on the GPU), on the CPU from synthetic findings: the over-read as read, none seen,
and each way a finding parts from the reading, each named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.vllm import scale_overread

LAST = {4, 5, 6, 7}
"""The output rows routed to the last expert in these findings."""


def _found(**changes: Any) -> tuple[dict[str, list[tuple[int, int]]], dict[str, bool]]:
    """The findings the reading predicts (NaN in the last expert's rows at 16 columns with an
    0xFF in the first 32 bytes past the storage), with ``changes`` to the NaN cells."""
    cells = [(r, c) for r in sorted(LAST) for c in range(5744, 5760)]
    nans: dict[str, list[tuple[int, int]]] = {name: [] for name in scale_overread.CASES}
    nans["ff"] = nans["ff_first_32"] = cells
    nans.update(changes)
    same = {name: not nans[name] for name in scale_overread.CASES}
    return nans, same


def test_the_over_read_as_read() -> None:
    nans, same = _found()
    status, reason = scale_overread.verdict(nans, same, LAST, True)
    assert status == 0
    assert reason == (
        "the kernel reads past the weight scales: 0xFF there gives 64 NaN outputs in the last "
        "expert's rows, columns 5744 to 5759 from the first 32 bytes, no column (padding) from "
        "the next 32"
    )
    # Without the rows' padding (512 rows) the second half reaches columns too.
    first = [(r, c) for r in sorted(LAST) for c in range(368, 384)]
    second = [(r, c) for r in sorted(LAST) for c in range(496, 512)]
    narrow, same = _found(ff=first + second, ff_first_32=first, ff_last_32=second)
    status, reason = scale_overread.verdict(narrow, same, LAST, True)
    assert status == 0 and reason.endswith(
        "columns 368 to 383 from the first 32 bytes, columns 496 to 511 from the next 32"
    )


@pytest.mark.parametrize(
    ("changes", "same_moved", "reference_ok", "status", "words"),
    [
        ({"ff": [], "ff_first_32": []}, None, True, 1, "no NaN output with 0xFF"),
        ({"zeros": [(0, 1)]}, None, True, 2, "without an 0xFF byte in the 64"),
        ({"ff_past_guard": [(4, 5800)]}, None, True, 2, "['ff_past_guard']"),
        ({"ff_first_32": [(4, 5744)]}, None, True, 2, "two halves of the 64 bytes does not"),
        ({"ff_last_32": [(4, 100)]}, None, True, 2, "two halves of the 64 bytes does not"),
        ({"ff": [(0, 5744)], "ff_first_32": [(0, 5744)]}, None, True, 2, "other experts"),
        ({}, "finite", True, 2, "outputs moved without an 0xFF byte"),
        ({}, None, False, 2, "not the torch reference's"),
    ],
)
def test_each_other_finding_is_named(
    changes: dict[str, Any], same_moved: str | None, reference_ok: bool, status: int, words: str
) -> None:
    nans, same = _found(**changes)
    if same_moved is not None:
        same[same_moved] = False
    found, reason = scale_overread.verdict(nans, same, LAST, reference_ok)
    assert (found, words in reason) == (status, True), reason


def test_nan_cells_in_order() -> None:
    out = torch.zeros(3, 4)
    out[2, 1] = out[0, 3] = float("nan")
    assert scale_overread.nan_cells(out) == [(0, 3), (2, 1)]
    assert scale_overread.nan_cells(torch.ones(2, 2)) == []


def test_a_run_that_fails_is_a_finding_written_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_args: Any) -> dict[str, Any]:
        raise ImportError("No module named 'triton_kernels'")

    monkeypatch.setattr(scale_overread, "_run", broken)
    out = tmp_path / "o.json"
    assert scale_overread.main(["--json", str(out)]) == 2
    written = json.loads(out.read_text())
    assert written == {"status": 2, "verdict": "ImportError: No module named 'triton_kernels'"}
    assert "scale over-read: ImportError" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        scale_overread.main(["--experts", "1"])
    assert (
        "--experts must be 2 or more (tokens route to the last two): 1" in capsys.readouterr().err
    )


def test_the_scales_are_placed_before_the_bytes_the_cases_set() -> None:
    # vLLM 0.25.0's Hopper swizzle at gpt-oss's w13 shape: the .mT of a contiguous tensor.
    storage = torch.randint(0, 256, (2, 184, 2880), dtype=torch.uint8).mT
    placed, tail = scale_overread.place_before_tail(storage)
    assert torch.equal(placed, storage)
    assert placed.stride() == storage.stride() == (529920, 1, 2880)
    assert tail.numel() == scale_overread.GUARD_BYTES and not tail.any()
    # The tail starts at the storage's last byte + 1, where the kernel's last step reads.
    assert tail.data_ptr() == placed.data_ptr() + storage.numel()


@pytest.mark.parametrize(
    ("storage", "words"),
    [
        (torch.zeros(2, 2880, 184, dtype=torch.uint8), "not the .mT of a contiguous tensor"),
        (torch.zeros(2, 184, 2880, dtype=torch.float32).mT, "torch.float32 of 3 dimensions"),
        (torch.zeros(64, dtype=torch.uint8), "torch.uint8 of 1 dimensions"),
    ],
)
def test_another_scale_layout_is_named(storage: torch.Tensor, words: str) -> None:
    with pytest.raises(RuntimeError, match="another vLLM layout") as raised:
        scale_overread.place_before_tail(storage)
    assert words in str(raised.value)
