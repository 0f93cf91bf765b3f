"""CPU checks of ``python -m rowcache.bench``: the refusal without CUDA, and the JSON -> PNG
path (``--plot-from``). No timings are asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rowcache.bench.__main__ import NO_CUDA, main
from rowcache.bench.report import format_table


def _document() -> dict[str, object]:
    cells = []
    for provider, scale in (("row", 1.0), ("cached", 0.8)):
        for misses in (0, 1, 2):
            copied = misses * 1000
            gbps = None if misses == 0 else 40.0 * scale * misses
            cells.append(
                {
                    "geometry": "bf16",
                    "provider": provider,
                    "misses": misses,
                    "tensors_per_expert": 2,
                    "expert_bytes": 1000,
                    "bytes_per_step": copied,
                    "host_us_median": 20.0,
                    "device_us_median": 50.0,
                    "host_us_p90": 25.0,
                    "device_us_p90": 60.0,
                    "gbps": gbps,
                    "ceiling_gbps": None if misses == 0 else 55.0,
                    "fraction": None if gbps is None else gbps / 55.0,
                }
            )
    return {
        "meta": {"gpu": "test", "torch": torch.__version__, "commit": "abc"},
        "ceilings": [{"bytes": 1 << 20, "mib": 1.0, "gbps": 50.0}],
        "cells": cells,
        "trace": {
            "description": "tiny",
            "results": [
                {
                    "geometry": "bf16",
                    "provider": "row",
                    "steps": 10,
                    "hit_rate": 0.75,
                    "misses_per_step": 2.0,
                    "host_us_median": 20.0,
                    "host_us_mean": 21.0,
                    "device_us_median": 50.0,
                    "device_us_mean": 55.0,
                }
            ],
        },
    }


def test_refuses_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert NO_CUDA in err
    assert "no CUDA device" in err
    assert not any(tmp_path.iterdir())


def test_plot_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(_document()))
    assert main(["--plot-from", str(source)]) == 0
    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "row" in out and "cached" in out and "hit rate" in out


def test_table_marks_zero_miss_cells() -> None:
    table = format_table(_document())
    zero = [line for line in table.splitlines() if line.startswith("bf16     row         0")]
    assert zero and zero[0].rstrip().endswith("-")
