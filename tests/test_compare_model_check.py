"""tools/compare_model_check.py: two recorded runs are the same when only their timings differ,
and a changed count, a changed trace or a missing file is found (the seeded differences)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.compare_model_check import compare, main

CHECK = {"ok": True, "columns": [{"checker": "hb/3e2c/d6", "states": 12611, "seconds": 1.14}]}
MUTANTS = {"ok": True, "mutants": [{"name": "no_release_wait", "hb": "P1", "seconds": 0.5}]}


def _run(folder: Path, check: object = CHECK, explain: str = "=== m\nstep 1\n") -> Path:
    folder.mkdir()
    (folder / "check.json").write_text(json.dumps(check))
    (folder / "mutants.json").write_text(json.dumps(MUTANTS))
    (folder / "explain.txt").write_text(explain)
    (folder / "diagram.txt").write_text("table\n")
    return folder


def test_runs_that_differ_only_in_their_timings_are_the_same(tmp_path: Path) -> None:
    slower = json.loads(json.dumps(CHECK))
    slower["columns"][0]["seconds"] = 9.9
    before, after = _run(tmp_path / "a"), _run(tmp_path / "b", check=slower)
    same, report = compare(before, after)
    assert same
    assert report == [
        f"{n}: same" for n in ("check.json", "mutants.json", "explain.txt", "diagram.txt")
    ]
    assert main([str(before), str(after)]) == 0


def test_a_changed_state_count_is_found(tmp_path: Path) -> None:
    changed = json.loads(json.dumps(CHECK))
    changed["columns"][0]["states"] = 12612
    same, report = compare(_run(tmp_path / "a"), _run(tmp_path / "b", check=changed))
    assert not same
    assert "check.json: DIFFERS" in report
    assert any(line.startswith("+") and "12612" in line for line in report)


def test_a_changed_trace_and_a_missing_file_are_found(tmp_path: Path) -> None:
    before = _run(tmp_path / "a")
    after = _run(tmp_path / "b", explain="=== m\nstep 2\n")
    (after / "diagram.txt").unlink()
    same, report = compare(before, after)
    assert not same
    assert "explain.txt: DIFFERS" in report
    assert report[-1].startswith("diagram.txt: MISSING")
    assert main([str(before), str(after)]) == 1
    assert main([str(before)]) == 2
