"""The link bench (``rowcache.bench.link``): its sweep and its refusals, its check of every
read before it is timed (shown catching a reader that drops a word), and the bench on the CPU
under Triton's interpreter."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rowcache.bench import link
from rowcache.bench.link import Launch, gather_launch, launches, main, measure


def test_the_sweep_starts_with_the_gathers_launch() -> None:
    sweep = launches("2,8", "1024,16384", "4", "none,.cg")
    assert sweep[0] == gather_launch() == Launch(8, 2048, 4, "")
    assert len(sweep) == len(set(sweep)) == 2 * 2 * 2  # the gather's launch is in the sweep
    assert Launch(2, 128, 4, ".cg") in sweep
    assert launches("1", "64", "2", ".cv")[1:] == [Launch(1, 8, 2, ".cv")]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("0", "1024", "4", "none"), "programs per SM: 0 must be from 1 to 64"),
        (("2", "1000", "4", "none"), "bytes a load: 1000 must be from 64 to 65536 and a power"),
        (("2", "1024", "3", "none"), "warps: 3 must be from 1 to 32 and a power of two"),
        (("2", "1024", "4", ".ca"), "caches: '.ca' is not one of none, .cg, .cv"),
        (("two", "1024", "4", "none"), "programs per SM: 'two' is not a whole number"),
    ],
)
def test_a_bad_sweep_is_named(args: tuple[str, str, str, str], said: str) -> None:
    with pytest.raises(ValueError, match="^" + said.replace(".", r"\.")):
        launches(*args)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--mib", "0"], "--mib 0 must be from 1 to 4096"),
        (["--mib", "5000"], "--mib 5000 must be from 1 to 4096"),
        (["--repeats", "0"], "--repeats 0 must be at least 1"),
        (["--write-combined"], "--write-combined reads CUDA's write-combined memory"),
        (["--warps", "5"], "warps: 5 must be from 1 to 32"),
    ],
)
def test_main_refuses_bad_arguments_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    assert main(["--out", str(tmp_path / "out"), "--device", "cpu", *argv]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_main_without_cuda_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def _reader(drop: int = 0):  # type: ignore[no-untyped-def]
    """A stand-in for the kernel on the CPU: the words at the address, ``drop`` of them left
    out at the end."""

    def read(address: int, target: torch.Tensor, **_: object) -> None:
        ctypes.memmove(target.data_ptr(), address, (target.numel() - drop) * 8)

    return read


def test_every_read_is_checked_before_it_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = launches("1,2", "64", "4", "none")
    monkeypatch.setattr(link, "read_words", _reader())
    good = measure(torch.device("cpu"), num_bytes=4096, sweep=sweep, repeats=2, warmup=1)
    [row] = good["memories"]
    assert row["memory"] == "pinned" and row["copy"]["exact"]
    assert [Launch(**e["launch"]) for e in row["launches"]] == sweep
    assert all(e["exact"] and e["seconds"] > 0 and e["over_copy"] > 0 for e in row["launches"])
    # A reader that leaves the last word out is caught and not timed.
    monkeypatch.setattr(link, "read_words", _reader(drop=1))
    bad = measure(torch.device("cpu"), num_bytes=4096, sweep=sweep, repeats=2, warmup=1)
    assert all(e == {"exact": False, "launch": e["launch"]} for e in bad["memories"][0]["launches"])
    assert "WRONG" in link.format_rows(bad)


def test_main_fails_on_a_wrong_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(link, "read_words", _reader(drop=1))
    assert main(["--out", str(tmp_path), "--device", "cpu", "--per-sm", "1"]) == 1
    assert "reads gave wrong words" in capsys.readouterr().err
    result = json.loads((tmp_path / "link.json").read_text())
    assert result["meta"]["device"] == "cpu"
    assert not any(e["exact"] for e in result["memories"][0]["launches"])


def test_measure_refuses_a_ragged_size() -> None:
    with pytest.raises(ValueError, match="multiple of 8, got 4095"):
        measure(torch.device("cpu"), num_bytes=4095, sweep=[gather_launch()], repeats=1, warmup=0)


def test_the_bench_runs_under_the_interpreter(tmp_path: Path) -> None:
    bench = ["-m", "rowcache.bench.link", "--out", str(tmp_path), "--device", "cpu"]
    sweep = ["--per-sm", "1", "--blocks", "64,1024", "--warps", "4", "--caches", "none,.cg"]
    done = subprocess.run(
        [sys.executable, *bench, *sweep],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "link.json").read_text())
    [row] = result["memories"]
    assert result["bytes"] == 4096 and row["copy"]["exact"]
    assert len(row["launches"]) == 1 + 4  # the gather's launch, then the sweep
    assert all(e["exact"] for e in row["launches"])
    assert "best:" in done.stdout and "the gather's launch at" in done.stdout
