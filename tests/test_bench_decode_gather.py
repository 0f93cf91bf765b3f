"""The decode-gather bench (``rowcache.bench.decode_gather``) on the CPU, under Triton's
interpreter at its quick shapes: it checks every decoded slot before it times anything, and
writes its JSON; without CUDA, ``--device cuda`` is refused with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rowcache.bench.decode_gather import main


@pytest.mark.parametrize("code_bits", [None, 3])
def test_the_bench_runs_under_the_interpreter(tmp_path: Path, code_bits: int | None) -> None:
    width = [] if code_bits is None else ["--code-bits", str(code_bits)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rowcache.bench.decode_gather",
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            *width,
        ],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "decode_gather.json").read_text())
    assert [r["misses"] for r in result["rows"]] == [1, 2]  # the quick shape has 6 experts
    for row in result["rows"]:
        assert row["decoded_bytes"] == row["misses"] * 2 * (2 * 24 * 64 + 64 * 24)
        assert 0 < row["compressed_bytes_read"] < row["decoded_bytes"]
        assert len(row["decode_s"]) == result["repeats"] == 3
    assert result["code_bits"] == code_bits  # None: the providers' width, the encoder's choice
    assert result["held_code_bits"] == {"w13": code_bits or 3, "w2": code_bits or 3}
    assert 0.65 < result["planes_ratio"]["w13"] < 0.75
    assert "decode/copy" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path)]) == 2
    assert "--device cuda needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "decode_gather.json").exists()


SEEDED = """
import sys
import rowcache.compress.triton_decode as kernel
decode = kernel.decode_into_slots
kernel.decode_into_slots = lambda *args, **kwargs: decode(*args, **kwargs, mutant=3)
from rowcache.bench.decode_gather import main
sys.exit(main(["--out", sys.argv[1], "--device", "cpu"]))
"""


def test_a_decode_that_drops_the_sign_is_reported_wrong_not_timed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SEEDED, str(tmp_path)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode != 0
    assert "decode_gather: 1 misses decoded wrong bytes" in done.stderr
    assert not (tmp_path / "decode_gather.json").exists()
