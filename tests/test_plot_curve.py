"""tools/vllm/plot_curve.py on synthetic records of the ``curve`` phases: which engine becomes
which point (GiB of experts on the GPU from its spec, b1 tok/s), the skewed points and their
fallback to the ``steps_skew`` records, failed engines, later files winning, and one SVG written
(its data, not its pixels)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.vllm import plot_curve
from tools.vllm.harness import engines
from tools.vllm.harness.specs import EngineSpec

SPEEDS = {
    "none.full": 661.3,
    "row32dev.full": 143.7,
    "uva675.full": 104.3,
    "row128dev.full": 605.8,
    "uva900.full": 79.6,
    "row8dev.full": 91.1,
    "uva450.full": 150.0,
    "row64dev.full": 300.0,
    "uva225.full": 250.0,
    "row16dev.full": 110.0,
}


def _record(spec: EngineSpec, tok_s: float | None, ok: bool = True) -> dict[str, Any]:
    decode = {"1": {"tok_s": tok_s, "repeats_run": 3 if tok_s else 0}}
    record: dict[str, Any] = {"name": spec.name, "spec": spec.to_json(), "ok": ok}
    record["steps"] = {"decode": decode, "ttft": {"ms": None}}
    if not ok:
        record["error"] = "not run: time (40 s left, needs about 110 s; run again with --resume)"
        del record["steps"]
    return record


def _plain() -> list[dict[str, Any]]:
    return [_record(s, SPEEDS[s.name.split(".", 2)[2]]) for s in engines.curve()]


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_points_of_the_plain_curve(tmp_path: Path) -> None:
    curve = plot_curve.curve_points(plot_curve.read([_write(tmp_path / "r.jsonl", _plain())]))
    assert curve.none is not None and (curve.none.gib, curve.none.tok_s) == (9.0, 661.3)
    assert [(p.gib, p.tok_s) for p in curve.uva] == [
        (0.0, 79.6),
        (2.25, 104.3),
        (4.5, 150.0),
        (6.75, 250.0),
    ]
    assert [(p.label, p.gib, p.tok_s) for p in curve.row] == [
        ("8", 0.5625, 91.1),
        ("16", 1.125, 110.0),
        ("32", 2.25, 143.7),
        ("64", 4.5, 300.0),
        ("128", 9.0, 605.8),
    ]
    assert {p.label for p in curve.uva} == {"UVA"}
    assert curve.skew == [] and curve.skew_none is None and curve.missing == []
    text = plot_curve.table(curve)
    assert "curve.plain.uva900.full" in text and "0.56" in text


def test_skewed_points_from_curve_skew_or_steps_skew(tmp_path: Path) -> None:
    skew = engines.curve(engines.QWEN8_SKEW)
    curve_skew = [_record(s, {0: 400.0, 1: 95.0, 2: 700.0}[i]) for i, s in enumerate(skew)]
    steps = {s.name.split(".", 2)[2]: s for s in engines.steps(engines.QWEN8_SKEW)}
    steps_records = [
        _record(steps["row32dev.full"], 380.0),
        _record(steps["uva675.full"], 90.0),
    ]
    # Only the steps_skew records: both skewed points come from them.
    records = plot_curve.read([_write(tmp_path / "s.jsonl", _plain() + steps_records)])
    curve = plot_curve.curve_points(records)
    assert [(p.name, p.gib, p.tok_s, p.label) for p in curve.skew] == [
        ("steps.skew.row32dev.full", 2.25, 380.0, "32"),
        ("steps.skew.uva675.full", 2.25, 90.0, "UVA"),
    ]
    # With the curve_skew records (in a later file) those win; its no offload is kept apart.
    later = _write(tmp_path / "k.jsonl", curve_skew)
    curve = plot_curve.curve_points(plot_curve.read([tmp_path / "s.jsonl", later]))
    assert sorted((p.name, p.tok_s) for p in curve.skew) == [
        ("curve.skew.row32dev.full", 400.0),
        ("curve.skew.uva675.full", 95.0),
    ]
    assert curve.skew_none is not None and curve.skew_none.tok_s == 700.0


def test_failed_engines_and_later_files_and_results_json(tmp_path: Path) -> None:
    plain = _plain()
    specs = {s.name: s for s in engines.curve()}
    plain[4] = _record(specs[plain[4]["name"]], None, ok=False)  # uva900 not run
    first = _write(tmp_path / "a.jsonl", plain)
    fixed = _record(specs["curve.plain.row8dev.full"], 95.5)
    results = {"meta": {}, "results": {fixed["name"]: fixed}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    curve = plot_curve.curve_points(plot_curve.read([first, tmp_path / "results.json"]))
    assert [p.gib for p in curve.uva] == [2.25, 4.5, 6.75]
    assert curve.missing and curve.missing[0].startswith("curve.plain.uva900.full: not run")
    assert [p.tok_s for p in curve.row if p.label == "8"] == [95.5]
    # Records of other phases are not points.
    other = _record(engines.steps()[0], 500.0)
    curve = plot_curve.curve_points({other["name"]: other})
    assert curve.none is None and not curve.uva and not curve.row


def test_writes_an_svg(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = _write(tmp_path / "r.jsonl", _plain())
    out = tmp_path / "docs" / "curve.svg"
    assert plot_curve.main([str(records), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    again = tmp_path / "again.svg"
    assert plot_curve.main([str(records), "--out", str(again)]) == 0
    assert again.read_text() == text  # no date, fixed ids: the committed plot diffs cleanly


def test_nothing_to_plot(tmp_path: Path) -> None:
    empty = _write(tmp_path / "e.jsonl", [])
    assert plot_curve.main([str(empty), "--out", str(tmp_path / "x.svg")]) == 1
    assert not (tmp_path / "x.svg").exists()
