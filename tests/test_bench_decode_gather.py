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


def interpreted(
    tmp_path: Path, *args: str, script: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The bench on the CPU under Triton's interpreter, with ``args`` (``script``: run instead
    of the module, given ``tmp_path`` and ``args``)."""
    bench = ["-m", "rowcache.bench.decode_gather", "--out", str(tmp_path), "--device", "cpu"]
    command = ["-c", script, str(tmp_path), *args] if script else [*bench, *args]
    return subprocess.run(
        [sys.executable, *command],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.parametrize("code_bits", [None, 3])
def test_the_bench_runs_under_the_interpreter(tmp_path: Path, code_bits: int | None) -> None:
    width = [] if code_bits is None else ["--code-bits", str(code_bits)]
    done = interpreted(tmp_path, *width)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "decode_gather.json").read_text())
    assert [r["misses"] for r in result["rows"]] == [1, 2]  # the quick shape has 6 experts
    for row in result["rows"]:
        assert row["decoded_bytes"] == row["misses"] * 2 * (2 * 24 * 64 + 64 * 24)
        assert 0 < row["compressed_bytes_read"] < row["decoded_bytes"]
        assert len(row["decode_s"]) == result["repeats"] == 3
        assert len(row["one_by_one_s"]) == 3 and row["one_by_one_over_copy"] > 0
    assert result["code_bits"] == code_bits  # None: the providers' width, the encoder's choice
    assert result["held_code_bits"] == {"w13": code_bits or 3, "w2": code_bits or 3}
    assert 0.65 < result["planes_ratio"]["w13"] < 0.75
    assert "decode/copy" in done.stdout and "one eager launch a miss" in done.stdout


def test_the_sweep_times_every_launch_each_checked(tmp_path: Path) -> None:
    done = interpreted(tmp_path, "--sweep")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "decode_gather.json").read_text())
    launches = [tuple(c) for c in result["configs"]]
    assert launches[0] == (4, 8)  # the providers' launch first, its figures the row's
    assert sorted(launches) == [(w, p) for w in (4, 8, 16) for p in (4, 8, 16)]
    for row in result["rows"]:
        timed = [(t["num_warps"], t["programs_per_sm"]) for t in row["configs"]]
        assert timed == launches
        assert row["configs"][0]["decode_s"] == row["decode_s"]
        assert all(len(t["decode_s"]) == 3 and t["decode_over_copy"] > 0 for t in row["configs"])
    assert "decode/copy by launch" in done.stdout and done.stdout.count("x") >= 18


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path)]) == 2
    assert "--device cuda needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "decode_gather.json").exists()


@pytest.mark.parametrize("shape", ["qwen3", "deepseek-v2-lite"])
def test_shape_names_the_layer_measured_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """``--shape`` picks the layer measured on a GPU (DeepSeek-V2-Lite's wider experts); an
    unknown name is refused by the parser."""
    import rowcache.bench.decode_gather as bench

    seen: list[dict[str, int]] = []

    def measure(layer: dict[str, int], device: torch.device, **_: object) -> dict[str, object]:
        seen.append(layer)
        return {"rows": [], "configs": [[4, 8]]}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "measure", measure)
    assert main(["--out", str(tmp_path), "--shape", shape]) == 0
    want = {"qwen3": (128, 768), "deepseek-v2-lite": (64, 1408)}[shape]
    assert [(s["experts"], s["intermediate"]) for s in seen] == [want]
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--shape", "mixtral"])


SEEDED = {
    # The sign dropped in every decode.
    "sign": """
import rowcache.compress.triton_decode as kernel
decode = kernel.decode_into_slots
kernel.decode_into_slots = lambda *args, **kwargs: decode(*args, **kwargs, mutant=3)
""",
    # The sign dropped in one launch of the sweep only.
    "one launch": """
import rowcache.compress.triton_decode as kernel
decode = kernel.decode_into_slots
def seeded(*args, num_warps, **kwargs):
    decode(*args, num_warps=num_warps, **kwargs, mutant=3 if num_warps == 16 else 0)
kernel.decode_into_slots = seeded
""",
    # The host planner's decode: slot 1 decoded into slot 0.
    "one by one": """
import rowcache.compress.triton_decode as kernel
one = kernel.SlotDecoder.decode_one
kernel.SlotDecoder.decode_one = lambda self, e, s: one(self, e, max(0, s - 1))
""",
}
RUN = """
import sys
from rowcache.bench.decode_gather import main
sys.exit(main(["--out", sys.argv[1], "--device", "cpu", *sys.argv[2:]]))
"""


@pytest.mark.parametrize(
    ("bug", "args", "message"),
    [
        ("sign", [], "decode_gather: 1 misses decoded wrong bytes"),
        ("one launch", ["--sweep"], "1 misses decoded wrong bytes (16 warps, 4 programs an SM)"),
        ("one by one", [], "decode_gather: 2 misses decoded wrong bytes (one by one)"),
    ],
)
def test_a_wrong_decode_is_reported_not_timed(
    tmp_path: Path, bug: str, args: list[str], message: str
) -> None:
    """A wrong decode of the providers' launches stops the bench, keeping the rows before it; a
    wrong launch of the sweep is recorded as such, never timed, and the bench goes on to the
    end (every other figure kept) and exits non-zero."""
    done = interpreted(tmp_path, *args, script=SEEDED[bug] + RUN)
    assert done.returncode != 0
    assert message in done.stderr
    path = tmp_path / "decode_gather.json"
    if bug == "sign":  # the first launch of the first row
        assert not path.exists()
        return
    rows = json.loads(path.read_text())["rows"]
    if bug == "one by one":  # right at one miss, wrong at two
        assert [r["misses"] for r in rows] == [1]
        return
    assert [r["misses"] for r in rows] == [1, 2]
    for row in rows:
        wrong = [t for t in row["configs"] if not t["exact"]]
        assert [t["num_warps"] for t in wrong] == [16, 16, 16] and not any(
            t["decode_s"] for t in wrong
        )
        assert all(t["decode_s"] for t in row["configs"] if t["exact"])
    assert "WRONG" in done.stdout
    assert "launches decoded wrong bytes (WRONG above)" in done.stderr
