"""CPU checks of ``python -m rowcache.bench``: the refusal without CUDA, and the JSON -> PNG
path (``--plot-from``). No timings are asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rowcache.bench.__main__ import NO_CUDA, main
from rowcache.bench.geometry import GEOMETRIES
from rowcache.bench.providers import PROVIDERS
from rowcache.bench.report import format_table


def _document() -> dict[str, object]:
    cells = []
    for provider, scale, path in (
        ("row", 1.0, "batched"),
        ("row_pt", 0.9, "per_tensor"),
        ("cached", 0.8, None),
    ):
        for misses in (0, 1, 2):
            copied = misses * 1000
            gbps = None if misses == 0 else 40.0 * scale * misses
            copy_gbps = None if misses == 0 or path is None else 50.0 * scale
            cells.append(
                {
                    "geometry": "bf16",
                    "provider": provider,
                    "copy_path": path,
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
                    "copy_us_median": None if copy_gbps is None else copied / copy_gbps / 1e3,
                    "copy_gbps": copy_gbps,
                    "copy_fraction": None if copy_gbps is None else copy_gbps / 55.0,
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
    assert "row" in out and "row_pt" in out and "cached" in out and "hit rate" in out


def _cell_line(table: str, provider: str, misses: int) -> list[str]:
    """The table line of one bf16 cell, split into its columns."""
    for line in table.splitlines():
        fields = line.split()
        if fields[:3] == ["bf16", provider, str(misses)]:
            return fields
    raise AssertionError(f"no line for bf16 {provider} {misses} in\n{table}")


def test_table_marks_zero_miss_cells() -> None:
    table = format_table(_document())
    fields = _cell_line(table, "row", 0)
    # GB/s, ceiling, frac, copy us, copy GB/s, copy frac: nothing was copied.
    assert fields[-6:] == ["-"] * 6


def test_table_has_copy_path_columns() -> None:
    table = format_table(_document())
    assert "copy GB/s" in table
    row = _cell_line(table, "row", 2)
    assert row[-2:] == ["50.00", "90.9%"]
    per_tensor = _cell_line(table, "row_pt", 2)
    assert per_tensor[-2:] == ["45.00", "81.8%"]
    # The cached baseline has no copy stream, so no copy-path figures.
    assert _cell_line(table, "cached", 2)[-3:] == ["-", "-", "-"]


def test_table_reads_documents_without_copy_columns() -> None:
    """JSON of runs before the copy-path column (docs/bench/bench.json) still prints."""
    document = _document()
    cells = document["cells"]
    assert isinstance(cells, list)
    for cell in cells:
        for key in ("copy_path", "copy_us_median", "copy_gbps", "copy_fraction"):
            del cell[key]
    fields = _cell_line(format_table(document), "row", 2)
    assert fields[-3:] == ["-", "-", "-"]


def test_large_geometry_and_providers() -> None:
    assert GEOMETRIES["bf16_large"].expert_bytes >= 100_000_000
    assert set(PROVIDERS) == {"row", "row_packed", "row_pt", "cached"}


@pytest.mark.parametrize(
    "argv",
    [["--geometries", "bf17"], ["--providers", "row,nope"], ["--misses", "9"], ["--misses", "x"]],
)
def test_rejects_unknown_choices(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--out", str(tmp_path)])
    assert stopped.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_refuses_without_cuda_with_a_subset(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--geometries", "nvfp4,mxfp4", "--providers", "row,row_pt", "--misses", "0,8"]
    assert main([*argv, "--trace-steps", "0", "--out", str(tmp_path)]) == 2
    assert NO_CUDA in capsys.readouterr().err


def test_the_named_geometries_are_known_but_not_defaults() -> None:
    from rowcache.bench.geometry import KNOWN_GEOMETRIES

    assert set(GEOMETRIES) == {"bf16", "nvfp4", "bf16_large"}
    assert set(KNOWN_GEOMETRIES) == {*GEOMETRIES, "fp8_block", "mxfp4", "deepseek_v2_lite"}
    assert KNOWN_GEOMETRIES["deepseek_v2_lite"].expert_bytes == 3 * 2048 * 1408 * 2 == 17_301_504
