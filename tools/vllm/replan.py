"""Replan a traced engine's first forward on the CPU and set its maps beside the GPU's.

An engine run with ``e2e.py run --trace`` records, for the first layer with a device-planned
cache, the cache's state just before the generation's first forward (the replay's
``start_state``: resident map, owners, stamps, clock, counts) and the router's ids of that
forward (``ids_list``); its slot watch keeps the expert maps the GPU's planner gave that
forward's passes (``maps``). Here the torch planner (``rowcache.device_plan.torch_planner``,
the fused planner's reference) plans the same forward from the same state, pass by pass, and
each pass's map is compared with the watched one. A difference names the planner on the GPU
(or the copy of its state); maps that agree but leave a routed entry unexposed by every pass
name the plan itself; maps that agree and expose every entry clear the planner, and a wrong
output must then come from the slots' bytes or the kernel.

    PYTHONPATH=. python3 tools/vllm/replan.py docs/vllm/RUN/e2e/results.json [--json OUT]

Exit status 0 when every layer with a kept start state agrees and exposes every entry, 1 when
one does not or cannot be compared (no ids or no watched maps kept, each named), 2 when no
record kept a start state (no trace, or no device-planned cache).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from rowcache.device_plan.passes import num_passes
from rowcache.device_plan.state import new_state
from rowcache.device_plan.torch_planner import plan_pass
from rowcache.policy import COUNT_MAX

__all__ = ["compare_layer", "compare_results", "main", "replan"]

STATE_FIELDS = ("resident", "owners", "stamps", "clock", "counts")
"""The start state's fields, as ``harness/first_state.summary`` writes them."""


def _check_state(start: dict[str, list[int]]) -> tuple[int, int]:
    missing = [k for k in STATE_FIELDS if k not in start]
    if missing:
        raise ValueError(f"replan: the start state lacks {missing} (it has {sorted(start)})")
    experts, capacity = len(start["resident"]), len(start["owners"])
    if experts < 1 or capacity < 1:
        raise ValueError(f"replan: {experts} experts and {capacity} slots; both must be >= 1")
    for key, size in (("counts", experts), ("stamps", capacity), ("clock", 1)):
        if len(start[key]) != size:
            raise ValueError(f"replan: start state {key} has {len(start[key])} entries, not {size}")
    return experts, capacity


def replan(start: dict[str, list[int]], ids: list[list[int]], count_max: int) -> list[list[int]]:
    """The forward map of each pass the torch planner gives ``ids`` from ``start``
    (``count_max`` 0: policy lru)."""
    experts, capacity = _check_state(start)
    state = new_state(experts, capacity, torch.device("cpu"), count_max)
    for key in STATE_FIELDS:
        tensor = getattr(state, key)
        tensor.copy_(torch.tensor(start[key], dtype=tensor.dtype))
    topk = torch.tensor(ids, dtype=torch.int64).reshape(len(ids), -1)
    passes = num_passes(topk.numel(), experts, capacity)
    maps = []
    for index in range(passes):
        plan_pass(state, topk, index, passes)
        maps.append([int(v) for v in state.forward.tolist()])
    return maps


def _unexposed(maps: list[list[int]], ids: list[list[int]]) -> list[list[int]]:
    """``[row, column, expert]`` of each routed entry that no map in ``maps`` exposes."""
    return [
        [row, column, expert]
        for row, entries in enumerate(ids)
        for column, expert in enumerate(entries)
        if 0 <= expert < len(maps[0]) and all(m[expert] < 0 for m in maps)
    ]


def compare_layer(
    start: dict[str, list[int]], ids: list[list[int]], watched: list[list[int]], count_max: int
) -> dict[str, Any]:
    """The replanned maps beside ``watched`` (the GPU's first maps, as many as were kept):
    ``same`` (every kept pass equal), ``first_difference`` (pass, expert, replanned slot,
    watched slot) and the entries each side leaves unexposed."""
    planned = replan(start, ids, count_max)
    compared = min(len(planned), len(watched))
    difference = next(
        (
            {"pass": p, "expert": e, "replanned": planned[p][e], "watched": watched[p][e]}
            for p in range(compared)
            for e in range(len(planned[p]))
            if planned[p][e] != watched[p][e]
        ),
        None,
    )
    return {
        "passes": len(planned),
        "compared": compared,
        "same": difference is None and compared == len(planned),
        "first_difference": difference,
        "unexposed_replanned": _unexposed(planned, ids),
        "unexposed_watched": _unexposed(watched[: len(planned)], ids) if watched else None,
        "replanned": planned,
    }


def _count_max(record: dict[str, Any]) -> int:
    knob = (record.get("spec") or {}).get("knob") or {}
    return COUNT_MAX if knob.get("policy") == "lfu" else 0


def compare_results(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{engine: {layer: compare_layer(...) or {"error": why}}}`` for every record of
    ``results`` (an ``e2e.py`` results file's ``results``) whose replay kept a start state."""
    found: dict[str, dict[str, Any]] = {}
    for engine, record in sorted(results.items()):
        layers = (record.get("replay") or {}).get("layers") or {}
        watch = (record.get("slot_watch") or {}).get("layers") or {}
        for layer, kept in sorted(layers.items()):
            if "start_state" not in kept:
                continue
            row: dict[str, Any]
            if "ids_list" not in kept:
                row = {"error": "the replay kept no ids (more entries than it keeps)"}
            elif not (watch.get(layer) or {}).get("maps"):
                row = {"error": "the slot watch kept no maps of this layer"}
            else:
                row = compare_layer(
                    kept["start_state"], kept["ids_list"], watch[layer]["maps"], _count_max(record)
                )
            found.setdefault(engine, {})[layer] = row
    return found


def line(engine: str, layer: str, row: dict[str, Any]) -> str:
    """One verdict in words."""
    head = f"replan of {engine} {layer}:"
    if "error" in row:
        return f"{head} not compared: {row['error']}"
    passes = f"{row['compared']} of {row['passes']} pass(es) compared"
    if row["first_difference"] is not None:
        d = row["first_difference"]
        return (
            f"{head} the GPU's map differs ({passes}): pass {d['pass']}, expert {d['expert']}: "
            f"replanned slot {d['replanned']}, watched slot {d['watched']}"
        )
    gaps = [
        f"{side} leaves {len(row[key])} entries unexposed (first {row[key][0]})"
        for side, key in (("replanned", "unexposed_replanned"), ("watched", "unexposed_watched"))
        if row[key]
    ]
    if gaps:
        return f"{head} maps agree ({passes}) but " + "; ".join(gaps)
    if not row["same"]:
        return f"{head} maps agree on the passes kept ({passes}); later passes not watched"
    return f"{head} maps agree ({passes}) and expose every routed entry"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="an e2e.py results.json")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    found = compare_results(json.loads(args.results.read_text())["results"])
    if not found:
        print(f"replan: no traced record in {args.results} kept a start state", file=sys.stderr)
        return 2
    verdicts = []
    for engine, layers in found.items():
        for layer, row in layers.items():
            print(line(engine, layer, row))
            verdicts.append("error" not in row and row["same"] and not row["unexposed_replanned"])
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
