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
    assert launches("1", "64", "2", ".cg")[1:] == [Launch(1, 8, 2, ".cg")]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("0", "1024", "4", "none"), "programs per SM: 0 must be from 1 to 64"),
        (("2", "1000", "4", "none"), "bytes a load: 1000 must be from 64 to 65536 and a power"),
        (("2", "1024", "3", "none"), "warps: 3 must be from 1 to 32 and a power of two"),
        (("2", "1024", "4", ".ca"), "caches: '.ca' is not one of none, .cg"),
        (("2", "1024", "4", ".cv"), "caches: '.cv' is not one of none, .cg"),
        (("2", "1024", "4", "none,"), "caches: 'none,' has an empty item"),
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
        (["--device", "cuda:1"], "--device 'cuda:1' must be cpu or cuda"),
        (["--device", "meta"], "--device 'meta' must be cpu or cuda"),
    ],
)
def test_main_refuses_bad_arguments_and_writes_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    said: str,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["--out", str(tmp_path / "out"), "--device", "cpu", *argv]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_main_without_cuda_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_the_cpu_needs_the_interpreter_and_out_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "set TRITON_INTERPRET=1" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "file").write_text("x")
    assert main(["--out", str(tmp_path / "file"), "--device", "cpu"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "x"


def _reader(drop: int = 0, calls: list[dict[str, object]] | None = None):  # type: ignore[no-untyped-def]
    """A stand-in for the kernel on the CPU: the words at the address, ``drop`` of them left
    out at the end; each call's launch kept in ``calls``."""

    def read(address: int, target: torch.Tensor, **launch: object) -> list[str]:
        ctypes.memmove(target.data_ptr(), address, (target.numel() - drop) * 8)
        if calls is not None:
            calls.append(launch)
        return ["ld.global.stand-in"]

    return read


def test_each_launch_reaches_the_kernel_as_swept(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(link, "read_words", _reader(calls=calls))
    sweep = launches("1,4", "64,1024", "2", "none,.cg")
    result = measure(torch.device("cpu"), num_bytes=4096, sweep=sweep, repeats=1, warmup=0)
    # Each launch: its check, then one timed run (no warm-up), programs for the 2 stand-in SMs.
    want = [
        {"programs": 2 * one.per_sm, "block": one.block, "warps": one.warps, "cache": one.cache}
        for one in sweep
        for _ in range(2)
    ]
    assert calls == want
    assert all(e["loads"] == ["ld.global.stand-in"] for e in result["memories"][0]["launches"])


def test_rates_are_the_bytes_over_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy timed at 0.5 s and every read at 2 s: 4,096 bytes at 8.192e-6 GB/s, a read at
    a quarter of the copy's rate."""
    monkeypatch.setattr(link, "read_words", _reader())
    seconds = iter([0.5] + [2.0] * 10)
    monkeypatch.setattr(link._Timer, "__call__", lambda self, run: next(seconds))
    result = measure(
        torch.device("cpu"),
        num_bytes=4096,
        sweep=launches("1", "64", "2", "none"),
        repeats=1,
        warmup=0,
    )
    [row] = result["memories"]
    assert row["copy"]["gbps"] == pytest.approx(4096 / 0.5 / 1e9)
    [_gathers, second] = row["launches"]
    assert second["gbps"] == pytest.approx(4096 / 2.0 / 1e9)
    assert second["over_copy"] == pytest.approx(0.25)


def test_results_reach_on_row_after_every_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link, "read_words", _reader())
    seen: list[tuple[int, bool]] = []

    def on_row(result: dict[str, object]) -> None:
        [row] = result["memories"]  # type: ignore[misc]
        seen.append((len(row["launches"]), row["done"]))

    sweep = launches("1", "64,1024", "2", "none")
    measure(torch.device("cpu"), num_bytes=4096, sweep=sweep, repeats=1, warmup=0, on_row=on_row)
    assert seen == [(0, False), (1, False), (2, False), (3, False), (3, True)]
    # A memory the CPU has not is refused before anything is measured.
    seen.clear()
    with pytest.raises(ValueError, match="write-combined host memory is CUDA's"):
        measure(
            torch.device("cpu"),
            num_bytes=4096,
            sweep=sweep,
            repeats=1,
            warmup=0,
            memories=("pinned", "write_combined"),
            on_row=on_row,
        )
    assert seen == []


def test_a_launch_that_fails_is_recorded_and_the_sweep_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _reader()

    def read(address: int, target: torch.Tensor, **launch: object) -> list[str]:
        if launch["block"] == 8:
            raise RuntimeError("out of resources")
        return good(address, target, **launch)  # type: ignore[no-any-return]

    monkeypatch.setattr(link, "read_words", read)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--per-sm", "1", "--blocks", "64,1024"]
    assert main([*argv, "--warps", "2", "--caches", "none"]) == 1
    result = json.loads((tmp_path / "link.json").read_text())
    [gather, failed, fine] = result["memories"][0]["launches"]
    assert failed["error"] == "RuntimeError: out of resources" and not failed["exact"]
    assert gather["exact"] and fine["exact"]
    out = capsys.readouterr()
    assert "FAILED: RuntimeError: out of resources" in out.out
    assert "reads wrong or failed" in out.err


def test_a_wrong_copy_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def wrong_copy(target: torch.Tensor) -> None:
        target.fill_(3)

    monkeypatch.setattr(link, "read_words", _reader())
    monkeypatch.setattr(link, "_tensor_copy", lambda pinned, device: wrong_copy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["--out", str(tmp_path), "--device", "cpu", "--per-sm", "1"]) == 1
    result = json.loads((tmp_path / "link.json").read_text())
    assert result["memories"][0]["copy"] == {"exact": False}
    assert all("over_copy" not in e for e in result["memories"][0]["launches"])


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
    for entry in bad["memories"][0]["launches"]:
        assert entry == {"exact": False, "launch": entry["launch"], "loads": entry["loads"]}
    assert "WRONG" in link.format_rows(bad)


def test_main_fails_on_a_wrong_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(link, "read_words", _reader(drop=1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["--out", str(tmp_path), "--device", "cpu", "--per-sm", "1"]) == 1
    assert "reads wrong or failed" in capsys.readouterr().err
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


def test_a_wrong_read_is_never_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[object] = []
    monkeypatch.setattr(link, "read_words", _reader(drop=1))
    monkeypatch.setattr(link._Timer, "__call__", lambda self, run: timed.append(run) or 1.0)
    sweep = launches("1", "64", "2", "none")
    measure(torch.device("cpu"), num_bytes=4096, sweep=sweep, repeats=1, warmup=0)
    assert len(timed) == 1  # the copy's; neither wrong read
