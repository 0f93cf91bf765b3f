"""The first forward replanned on the CPU (tools/vllm/replan.py): from a real device-planned
provider's state before a two-pass step, the torch planner's maps equal the provider's, every
routed entry is exposed and the verdict says so; a watched map with one slot changed, a plan
that leaves an entry unexposed, a missing start state or ids, each get their own words; bad
start states are refused naming the field and the size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_slot_watch import C, weights

from rowcache.device_plan.provider import DevicePlannedProvider
from tools.vllm import replan

WARM = ([[0, 1], [2, -1]], [[5, -1]])  # expert 5 evicts 0: slot order no longer id order
STEP = [[3, 4], [5, 0]]  # four distinct experts over three slots: two passes


def _state(provider: DevicePlannedProvider) -> dict[str, list[int]]:
    return {k: getattr(provider._state, k).tolist() for k in replan.STATE_FIELDS}


def _traced(policy: str = "lru") -> tuple[dict[str, list[int]], list[list[int]], int]:
    """The start state before ``STEP``, the provider's maps of its passes, the count bound."""
    provider = DevicePlannedProvider(**weights(), capacity=C, device="cpu", policy=policy)
    with torch.inference_mode():
        for rows in WARM:
            provider.prepare(torch.tensor(rows))
        start = _state(provider)
        maps = [
            provider.prepare(torch.tensor(STEP), pass_index=p, passes=2).expert_map.tolist()
            for p in range(2)
        ]
    return start, maps, provider._state.count_max


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_replanned_maps_are_the_providers(policy: str) -> None:
    start, maps, count_max = _traced(policy)
    assert (count_max > 0) == (policy == "lfu")
    row = replan.compare_layer(start, STEP, maps, count_max)
    assert row["replanned"] == maps and row["passes"] == row["compared"] == 2
    assert row["same"] and row["first_difference"] is None
    assert row["unexposed_replanned"] == row["unexposed_watched"] == []
    assert "expose every routed entry" in replan.line("e", "l", row)


def test_a_watched_slot_changed_is_named() -> None:
    start, maps, _ = _traced()
    expert = next(e for e, s in enumerate(maps[1]) if s >= 0)
    wrong = [list(m) for m in maps]
    wrong[1][expert] = (wrong[1][expert] + 1) % C
    row = replan.compare_layer(start, STEP, wrong, 0)
    assert not row["same"]
    assert row["first_difference"] == {
        "pass": 1,
        "expert": expert,
        "replanned": maps[1][expert],
        "watched": wrong[1][expert],
    }
    assert f"pass 1, expert {expert}" in replan.line("e", "l", row)


def test_an_entry_no_watched_map_exposes_is_named() -> None:
    start, maps, _ = _traced()
    hidden = [list(m) for m in maps]
    for m in hidden:
        m[5] = -1  # expert 5 (STEP's row 1, column 0) mapped by neither pass
    row = replan.compare_layer(start, STEP, hidden, 0)
    assert row["unexposed_watched"] == [[1, 0, 5]] and row["unexposed_replanned"] == []
    assert not row["same"]


def test_a_planner_that_exposes_too_little_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    start, maps, _ = _traced()
    monkeypatch.setattr(replan, "num_passes", lambda n, e, c: 1)  # the second pass dropped
    row = replan.compare_layer(start, STEP, maps, 0)
    assert row["passes"] == 1 and row["unexposed_replanned"]
    assert "leaves" in replan.line("e", "l", row)


def _results(start: Any, maps: Any, ids: Any = STEP) -> dict[str, Any]:
    kept: dict[str, Any] = {"start_state": start}
    if ids is not None:
        kept["ids_list"] = ids
    return {
        "models.m.row.eager": {
            "spec": {"knob": {"policy": None}},
            "replay": {"layers": {"layers.0.experts": kept}},
            "slot_watch": {"layers": {"layers.0.experts": {"maps": maps}}},
        },
        "models.m.none.eager": {"spec": {"knob": None}},
    }


def test_the_command_reads_a_results_file(tmp_path: Path, capsys: Any) -> None:
    start, maps, _ = _traced()
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": _results(start, maps)}))
    assert replan.main([str(path), "--json", str(tmp_path / "out.json")]) == 0
    assert "models.m.row.eager layers.0.experts: maps agree (2 of 2" in capsys.readouterr().out
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["models.m.row.eager"]["layers.0.experts"]["replanned"] == maps
    wrong = [list(m) for m in maps]
    wrong[0][0] = 2 if wrong[0][0] != 2 else 1
    path.write_text(json.dumps({"results": _results(start, wrong)}))
    assert replan.main([str(path)]) == 1
    path.write_text(json.dumps({"results": _results(start, maps, ids=None)}))
    assert replan.main([str(path)]) == 1
    assert "not compared: the replay kept no ids" in capsys.readouterr().out
    path.write_text(json.dumps({"results": _results(start, [])}))
    assert replan.main([str(path)]) == 1
    assert "the slot watch kept no maps" in capsys.readouterr().out
    path.write_text(json.dumps({"results": {"models.m.none.eager": {}}}))
    assert replan.main([str(path)]) == 2


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s.pop("owners"), "lacks ['owners']"),
        (lambda s: s.update(stamps=[0]), "stamps has 1 entries, not 3"),
        (lambda s: s.update(counts=[0]), "counts has 1 entries, not 6"),
        (lambda s: s.update(clock=[]), "clock has 0 entries, not 1"),
        (lambda s: s.update(resident=[]), "0 experts"),
    ],
)
def test_a_bad_start_state_is_refused_by_name(change: Any, words: str) -> None:
    start, _, _ = _traced()
    change(start)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        replan.replan(start, STEP, 0)
