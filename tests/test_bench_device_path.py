"""The device-path bench on the CPU: its command line, the refusal without CUDA, and the
targets, table and plot recomputed from a synthetic document."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rowcache.bench.device_path import LAYERS, main, parse
from rowcache.bench.device_report import evaluate, format_table, sample_stats
from rowcache.bench.plot_device_path import main as plot_main


def _cell(
    geometry: str, layout: str, misses: int, us: float, fraction: float | None
) -> dict[str, Any]:
    return {
        "geometry": geometry,
        "layout": layout,
        "misses": misses,
        "layers": LAYERS,
        "bytes_per_layer_step": misses * 1000,
        "device_us_per_layer": sample_stats([us, us * 1.01, us * 0.99]),
        "step_us_per_layer": sample_stats([us + 1.0]),
        "gbps": misses * 1000 / (us * 1e-6) / 1e9 if misses else None,
        "ceiling_gbps": 55.0 if misses else None,
        "fraction": fraction,
        "replay_ms_samples": [us * LAYERS / 1e3] * 3,
        "step_ms_samples": [(us + 1.0) * LAYERS / 1e3] * 3,
    }


def _document() -> dict[str, Any]:
    cells = []
    for misses, us, good, poor in (
        (0, 6.0, None, None),
        (2, 400.0, 0.93, 0.80),
        (4, 780.0, 0.95, 0.86),
    ):
        cells.append(_cell("bf16", "separate", misses, us, good))
        cells.append(_cell("nvfp4", "packed", misses, us / 3, poor))
    cells[1]["device_us_per_layer"] = sample_stats([9.5])  # nvfp4 0 misses: over 8 us
    return {
        "meta": {
            "layers": LAYERS,
            "gpu": "NVIDIA H200",
            "torch": "2.11",
            "triton": "3.6",
            "commit": "abc",
        },
        "ceilings": [{"bytes": m * 1000, "gbps": 55.0} for m in (2, 4)],
        "device_cells": cells,
        "host_cells": [
            {
                "geometry": "bf16",
                "provider": "row_packed",
                "misses": 2,
                "bytes_per_step": 2000,
                "device_us_median": 420.0,
            },
        ],
        "fixed_costs": [
            {
                "geometry": "bf16",
                "layout": "separate",
                "planner_us_per_layer": 3.7,
                "pass_us_per_layer": 4.9,
            },
        ],
        "trace": [
            {
                "geometry": "bf16",
                "planner": "device",
                "layout": "separate",
                "device_us_per_layer_mean": 390.0,
            },
            {"geometry": "bf16", "planner": "host", "layout": "packed", "device_us_mean": 416.0},
            {
                "geometry": "nvfp4",
                "planner": "device",
                "layout": "packed",
                "device_us_per_layer_mean": 200.0,
            },
            {"geometry": "nvfp4", "planner": "host", "layout": "packed", "device_us_mean": 185.0},
        ],
    }


def _verdicts(document: dict[str, Any]) -> dict[tuple[str, str], bool]:
    return {(c["geometry"], c["check"].split()[0]): c["met"] for c in evaluate(document)}


def test_refuses_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), "--quick"])
    assert exit_info.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_quick_and_full_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    quick = parse(["--quick", "--commit", "x"])
    full = parse(["--commit", "x"])
    assert quick.steps < full.steps and quick.trace_steps < full.trace_steps
    assert parse(["--quick", "--steps", "3", "--commit", "x"]).steps == 3
    assert full.layers == LAYERS == 8
    assert full.geometries == ["bf16", "nvfp4", "bf16_large"]
    assert full.misses == (0, 1, 2, 4, 8)
    assert full.experts_of == {"bf16": 128, "nvfp4": 128, "bf16_large": 40}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--geometries", "fp64"], "unknown geometry"),
        (["--layouts", "interleaved"], "unknown layout"),
        (["--misses", "0,9"], "--misses must lie"),
        (["--large-experts", "39"], "at least capacity + top_k"),
    ],
)
def test_rejects_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse([*argv, "--commit", "x"])
    assert message in capsys.readouterr().err


def test_targets_and_regression_checks() -> None:
    verdicts = _verdicts(_document())
    assert verdicts[("bf16", "copy")] is True  # 0.93 >= 0.90
    assert verdicts[("nvfp4", "copy")] is False  # worst 0.80 < 0.85
    assert verdicts[("bf16", "0")] is True
    assert verdicts[("nvfp4", "0")] is False  # 9.5 us > 8 us
    assert verdicts[("bf16", "trace:")] is True  # 390 <= 416
    assert verdicts[("nvfp4", "trace:")] is False  # 200 > 185


def test_a_cell_not_measured_is_missed() -> None:
    document = _document()
    document["device_cells"][2]["fraction"] = None  # bf16 at 2 misses
    document["trace"] = []
    verdicts = _verdicts(document)
    assert verdicts[("bf16", "copy")] is False
    assert verdicts[("bf16", "trace:")] is False


def test_table_marks_every_check() -> None:
    table = format_table(_document())
    assert "met    bf16" in table and "MISSED nvfp4" in table
    assert table.splitlines()[-1] == "device-path bench: 3/6 checks met"
    assert len(table.splitlines()) < 40


def test_sample_stats() -> None:
    stats = sample_stats([4.0, 1.0, 3.0, 2.0])
    assert stats["median"] == 2.5 and stats["min"] == 1.0 and stats["max"] == 4.0
    assert stats["p10"] == pytest.approx(1.3) and stats["p90"] == pytest.approx(3.7)


def test_plot_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    source = tmp_path / "device_path.json"
    source.write_text(json.dumps(_document()))
    assert plot_main([str(source)]) == 0
    assert (tmp_path / "device_path.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "checks met" in capsys.readouterr().out
