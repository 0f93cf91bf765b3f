"""The summary's lines of the in-engine probes and audits, one function a probe: each reads an
engine's record (and, where it compares, the record of the no-offload engine it is compared
with) and gives its line, or None where the probe did not run in that engine.

Runs on the host from the records, as ``steps_report`` does, which places these lines under
each model's targets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tools.vllm.harness import expert_bytes, placement, probes, trace
from tools.vllm.harness.phases import Results
from tools.vllm.harness.replay import FROM_START

RecordLine = Callable[[dict[str, Any] | None, str], str | None]
"""A probe's line from one engine's record and its label."""
ResultsLine = Callable[[Results, str, str], str | None]
"""A probe's line from the results, the checkpoint's prefix and the engine's label (those that
compare with the engine's reference)."""


def of_record(record: dict[str, Any] | None, label: str, *lines: RecordLine) -> list[str]:
    """The lines of ``lines`` that one engine's record has, in order."""
    return [line for probe in lines if (line := probe(record, label)) is not None]


def of_results(results: Results, prefix: str, label: str, *lines: ResultsLine) -> list[str]:
    """The lines of ``lines`` that an engine has in ``results``, in order."""
    return [line for probe in lines if (line := probe(results, prefix, label)) is not None]


def slots_line(record: dict[str, Any] | None, label: str) -> str | None:
    """The end-of-run audit (``probes.slot_check``): every resident slot's bytes against its
    expert's host bytes, in every cached layer."""
    found = (record or {}).get("slots")
    if not found:
        return None
    bad = found.get("mismatches") or []
    verdict = "met" if not bad and found.get("slots") else "MISSED"
    detail = f"; first: {bad[0]}" if bad else ""
    return (
        f"  slots of {label} byte-identical to their host bytes ({found.get('slots')} slots in "
        f"{found.get('layers')} layers, {len(bad)} differ{detail}): {verdict}"
    )


def scale_guard_line(record: dict[str, Any] | None, label: str) -> str | None:
    """``harness/scale_guard.py``: the layers of a no-offload engine whose weight scales were
    followed by zeros, as the cache's slots are (None where the engine was not guarded)."""
    guarded = (record or {}).get("scale_guard")
    if not guarded:
        return None
    return (
        f"  scale guard of {label}: {guarded['layers']} layers' w13 and w2 weight scales "
        "followed by zeros, as the cache's slots are (what vLLM's kernel reads past them)"
    )


def scale_tails_line(record: dict[str, Any] | None, label: str) -> str | None:
    """``harness/scale_tails.py``: the layers whose w13 weight scales are followed by an
    ``0xFF`` where vLLM's MXFP4 kernel reads past them, or the probe's error."""
    record = record or {}
    if record.get("scale_tails_error"):
        return f"  scale tails of {label}: not read ({record['scale_tails_error']})"
    found = record.get("scale_tails")
    if not found or not found.get("layers"):
        return None
    layers = found["layers"]
    head = (
        f"  scale tails of {label} ({len(layers)} layers, {found['tail_bytes']} bytes past each "
        "w13 scale tensor, where vLLM's MXFP4 kernel reads)"
    )
    bad = {name: c["ff"] for name, c in layers.items() if c["ff"]}
    if not bad:
        return f"{head}: no 0xFF byte"
    named = ", ".join(f"{name} ({n})" for name, n in list(bad.items())[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    return (
        f"{head}: {len(bad)} layers hold 0xFF bytes there: {named}{more}; where one is among "
        "the 32 that reach outputs, the last expert's outputs in that layer are not the "
        "kernel's arithmetic over the experts' bytes"
    )


def exactness_line(record: dict[str, Any] | None, label: str) -> str | None:
    """The in-engine comparison (``probes.exactness``): every cached layer's forward against
    vLLM's kernel with every expert resident, bit for bit, at each row count."""
    found = (record or {}).get("exactness")
    if not found or not found.get("layers"):
        return None
    layers = int(found["layers"])
    cells = [
        f"{rows}: {found['equal'][str(rows)]}/{layers}"
        + (
            ""
            if found["equal"][str(rows)] == layers
            else f" (max |d| {found['max_abs'][str(rows)]:.3g})"
        )
        for rows in found["rows"]
    ]
    every = all(found["equal"][str(rows)] == layers for rows in found["rows"])
    head = f"  layers of {label} bit-identical to vLLM's kernel with every expert resident"
    last = found.get("missed_with_last_expert")
    with_last = (
        "; of the layers missed, those whose routes held the last expert ("
        + ", ".join(f"{r}: {last[str(r)]}/{layers - found['equal'][str(r)]}" for r in found["rows"])
        + ")"
        if last is not None and not every
        else ""
    )
    return (
        f"{head}, by rows ({', '.join(cells)}): {'met' if every else 'MISSED'}"
        + ("" if every else _order_cells(found, layers))
        + with_last
        + kernel_again_line(found, layers)
        + launch_flags_lines(found)
    )


def kernel_again_line(found: dict[str, Any], layers: int) -> str:
    """The exactness probe's second run of vLLM's kernel, on poisoned memory, against its
    first (``kernel_again``), as a line to follow its line; empty for records from before."""
    again = found.get("kernel_again")
    if not again:
        return ""
    rows = [str(r) for r in found["rows"]]
    cells = []
    for r in rows:
        cell = f"{r}: {again['equal'][r]}/{layers}"
        if again["equal"][r] != layers:
            cell += f" (max |d| {again['max_abs'][r]:.3g})"
        if again["non_finite"][r]:
            cell += f" ({again['non_finite'][r]} non-finite)"
        cells.append(cell)
    same = all(again["equal"][r] == layers and not again["non_finite"][r] for r in rows)
    return (
        "\n  vLLM's kernel run again on poisoned memory gives its own first run's bits, by rows "
        f"({', '.join(cells)})"
        + (
            ""
            if same
            else ": it reads memory it did not write or is not deterministic, and the "
            "reference moves with it"
        )
    )


PLACEMENT_WORDS = {
    "mapped": "the whole set with an identity map",
    "whole_tail_garbage": "the whole set with garbage past the last expert",
    "permuted": "the whole set permuted",
    "slots": "a copy of the slots with the resident map",
    "others_garbage": "the same with garbage in the other slots",
    "tail_garbage": "the same with garbage past the last slot",
}
"""How :func:`placement_line` names ``harness/placement.py``'s layouts (its ``WAYS``)."""


def placement_line(record: dict[str, Any] | None, label: str) -> str | None:
    """``harness/placement.py``: vLLM's kernel over the same bytes in other layouts, layers
    bit-identical to it over the whole set in id order (and, over the slots, to the cached
    forward), by rows; or the probe's error."""
    record = record or {}
    if record.get("placement_error"):
        return f"  placement of {label}: not run ({record['placement_error']})"
    found = record.get("placement")
    if not found or not found.get("layers"):
        return None
    rows = [str(r) for r in found["rows"]]

    def cells(tallies: dict[str, Any], also_cached: bool) -> str:
        said = []
        for r in rows:
            t = tallies[r]
            if not t.get("ran", 1):
                said.append(f"{r}: not run")
                continue
            cell = f"{r}: {t['equal_reference']}/{t.get('ran', found['layers'])}"
            if also_cached:
                cell += f", to the cached {t['equal_cached']}"
            if t["max_abs"]:
                cell += f" (max |d| {t['max_abs']:.3g})"
            said.append(cell)
        return "; ".join(said)

    parts = [f"the cached forward ({cells(found['cached'], False)})"]
    for way, words in PLACEMENT_WORDS.items():
        if way in found["ways"]:
            parts.append(f"{words} ({cells(found['ways'][way], way in placement.SLOT_WAYS)})")
    return (
        f"  placement of {label}: layers bit-identical to vLLM's kernel over the whole set in "
        f"id order ({found['layers']} layers), by rows: " + " | ".join(parts)
    )


ORDER_WORDS = {
    "first": "the cached forward on poisoned memory",
    "after": "run again just after vLLM's kernel",
}
"""How :func:`exactness_line` names the probe's two runs of a cached forward
(``probes.ORDERS``)."""


def _order_cells(found: dict[str, Any], layers: int) -> str:
    """Where a layer missed: each run of the cached forward alone, by rows (layers equal, and
    those whose output held a NaN or infinity); empty for records from before the probe ran
    the cached forward twice."""
    by_order = found.get("by_order")
    if not by_order:
        return ""
    parts = []
    for order, words in ORDER_WORDS.items():
        cell = by_order[order]
        counts = ", ".join(
            f"{rows}: {cell['equal'][str(rows)]}/{layers}"
            + (
                f" ({cell['non_finite'][str(rows)]} non-finite)"
                if cell["non_finite"][str(rows)]
                else ""
            )
            for rows in found["rows"]
        )
        parts.append(f"{words} ({counts})")
    return "; " + "; ".join(parts)


def shadow_line(record: dict[str, Any] | None, label: str) -> str | None:
    """The shadow check (``harness/shadow.py``, ``run --shadow``): the engine's own cached
    forwards against vLLM's kernel over the whole set, by how they ran and by rows; a forward
    bucket that never ran is left out."""
    found = (record or {}).get("shadow")
    if not found or not found.get("layers"):
        return None
    cells = []
    differing = 0
    for mode, buckets in found["by"].items():
        for bucket, cell in buckets.items():
            if not cell["forwards"]:
                continue
            differing += cell["differing"]
            text = f"{mode} {bucket} rows: {cell['differing']}/{cell['forwards']}"
            if cell["differing"]:
                text += f" in {cell['layers_differing']} layers (max |d| {cell['max_abs']:.3g})"
            cells.append(text)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(found.get("skipped", {}).items()))
    first = found.get("first_differing") or []
    replays = [
        f"{r['layer']} ("
        + (
            f"{r['mode']}, {r['rows']} rows): "
            + (f"differs{_blame(r)}" if r["replay_differs"] else f"exact{_then(r)}")
            if r.get("kept")
            else "not kept)"
        )
        for r in found.get("replays") or []
    ]
    return (
        f"  shadow check of {label} (speeds not the cache's): forwards differing from vLLM's "
        f"kernel over the whole set of {found['layers']} layers"
        + (f", {skipped} skipped" if skipped else "")
        + f" ({'; '.join(cells) or 'none ran'}): {'MISSED' if differing else 'met'}"
        + (f"; first: {', '.join(first)}" if first else "")
        + (
            f"; their first differing forward replayed eagerly: {', '.join(replays)}"
            if replays
            else ""
        )
    )


def _with_reference(
    results: Results, prefix: str, label: str
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """An engine's record, the record of the no-offload engine it is compared with
    (``compare_with``; empty where there is none), and that engine's label."""
    record = results.get(f"{prefix}.{label}") or {}
    other = ((record.get("spec") or {}).get("compare_with") or [""])[0]
    return record, results.get(other) or {}, other.removeprefix(prefix + ".")


def expert_bytes_line(results: Results, prefix: str, label: str) -> str | None:
    """A cache engine's host sources against the converted tensors of the no-offload engine
    it is compared with (``harness/expert_bytes.py``), expert by expert; None where either
    has no digests."""
    record, reference, against = _with_reference(results, prefix, label)
    ours, theirs = record.get("expert_digests"), reference.get("expert_digests")
    if not ours or not theirs:
        error = record.get("expert_digests_error")
        return f"  expert bytes of {label}: not read ({error})" if error else None
    found = expert_bytes.compare(ours, theirs)
    head = (
        f"  expert bytes of {label}'s sources against {against}'s own tensors "
        f"({found['layers']} layers, {found['expert_tensors']} expert tensors)"
    )
    differing = found["differing"]
    unmatched = (
        f"; only one side has {', '.join(found['unmatched'][:4])}" if found["unmatched"] else ""
    )
    if not differing:
        verdict = "met" if not found["unmatched"] and found["expert_tensors"] else "MISSED"
        return f"{head}: every digest identical{unmatched}: {verdict}"
    shown = ", ".join(f"{name} {key} expert {e}" for name, key, e in differing[:6])
    more = f" and {len(differing) - 6} more" if len(differing) > 6 else ""
    return f"{head}: {len(differing)} differ ({shown}{more}){unmatched}: MISSED"


def slot_watch_line(results: Results, prefix: str, label: str) -> str | None:
    """The slot watch of a cache engine's first generation (``harness/slot_watch.py``): whether
    every slot a ``prepare`` mapped held its expert's bytes when the forward read it, and where
    not, which layers, source tensors and first forward; None where the engine has no watch."""
    record = results.get(f"{prefix}.{label}") or {}
    head = f"  slot watch of {label}"
    found = record.get("slot_watch")
    if not found:
        error = record.get("slot_watch_error")
        return f"{head}: not read ({error})" if error else None
    layers = found.get("layers") or {}
    prepares = sum(c["prepares"] for c in layers.values())
    mapped = sum(c["mapped"] for c in layers.values())
    head += (
        f" (the first generation, {prepares} prepares in {len(layers)} layers, "
        f"{mapped} mapped experts)"
    )
    bad = {name: c for name, c in layers.items() if c["bad_prepares"]}
    if not bad:
        verdict = "met" if prepares else "MISSED (nothing checked)"
        return f"{head}: every slot held its expert's bytes: {verdict}"
    cells = []
    for name, c in list(bad.items())[:4]:
        keys = ", ".join(f"{k} {n}" for k, n in c["by_key"].items() if n)
        cells.append(
            f"{name} ({c['bad_prepares']} prepares, {c['bad']} experts; {keys}; "
            f"first at the trace's order number {c['first_bad']})"
        )
    more = f" and {len(bad) - 4} more layers" if len(bad) > 4 else ""
    total = sum(c["bad_prepares"] for c in bad.values())
    return (
        f"{head}: {total} prepares mapped a slot without its expert's bytes: "
        f"{'; '.join(cells)}{more}: MISSED"
    )


REPLAY_WORDS = {
    "reference": "vLLM's kernel over the cache's sources",
    "cached_first": "the cached forward on poisoned memory",
    "reference_poisoned": "the kernel again on poisoned memory",
    "cached_after": "the cached forward after the kernel",
    "cached_from_start": "the cached forward from the cache's state at that forward",
}
"""How :func:`replay_line` names ``probes.RUNS`` and ``replay.FROM_START``."""


def replay_line(results: Results, prefix: str, label: str) -> str | None:
    """Where the trace's first difference is a MoE op's first forward in its layer (input and
    routes agreeing), that forward's real input run again in the cache engine
    (``harness/replay.py``), each run's output against no offload's output of that forward;
    None where the trace parts elsewhere or nothing was replayed."""
    record, reference, against = _with_reference(results, prefix, label)
    ours, theirs = record.get("trace"), reference.get("trace")
    if not ours or not theirs:
        return None
    first = trace.first_divergence(ours, theirs)["first"]
    if first is None or first["index"] != 0 or first["differ"] != ["out"]:
        return None
    head = f"  replay of {label}'s {first['layer']} forward 0 ({first['rows']} rows)"
    error = record.get("replay_error")
    kept = ((record.get("replay") or {}).get("layers") or {}).get(first["layer"])
    if kept is None:
        return f"{head}: not run ({error})" if error else f"{head}: no input kept"
    fields = theirs["fields"]
    there = theirs["layers"][first["layer"]]["records"][0]
    if any(kept[f] != there[fields.index(f)] for f in ("x", "ids", "weights")):
        return f"{head}: the kept input is not that forward's (another forward ran first eagerly)"
    out = there[fields.index("out")]
    # Records from before a run was added name fewer runs.
    runs = [run for run in (*probes.RUNS, FROM_START) if run in kept]
    cells = [
        f"{REPLAY_WORDS[run]} {'gives' if kept[run] == out else 'does not give'} its bits"
        for run in runs
    ]
    if kept.get("from_start_error"):
        cells.append(
            f"the run from the cache's state at that forward failed: {kept['from_start_error']}"
        )
    return f"{head}, against {against}'s output of it: " + "; ".join(cells)


def trace_line(results: Results, prefix: str, label: str) -> str | None:
    """The layer trace (``harness/trace.py``, ``run --trace``) of an engine against the
    no-offload engine it is compared with, over the first generation: where they first part,
    and what differs there; None where either has no trace."""
    record, reference, against = _with_reference(results, prefix, label)
    ours, theirs = record.get("trace"), reference.get("trace")
    if not ours or not theirs:
        return None
    found = trace.first_divergence(ours, theirs)
    counted = f"{found['forwards']} forwards in {found['layers']} layers"
    head = f"  layer trace of {label} against {against} (the first generation, {counted})"
    if not found["forwards"]:
        return f"{head}: nothing to compare (no forward ran while the trace was on)"
    mismatched = found["mismatched"]
    tail = f"; forward counts differ in {len(mismatched)} layers" if mismatched else ""
    first = found["first"]
    if first is None:
        return f"{head}: every digest identical{tail}"
    differ = first["differ"]
    if "x" in differ:
        before = first.get("before")
        where = (
            f"its input differs, after {before['layer']} forward {before['index']} agreed "
            "(the difference arose between that output and this input: attention, norms, or "
            "the token sampled)"
            if before
            else "its input differs at the generation's first MoE forward (the embedding, "
            "the first attention or norms)"
        )
    elif "ids" in differ or "weights" in differ:
        where = (
            "its input agrees, the router's "
            + " and ".join(d for d in ("ids", "weights") if d in differ)
            + " differ"
        )
    else:
        where = "its input and routes agree, its output differs (the MoE op)"
    return (
        f"{head}: first differs at {first['layer']} forward {first['index']} "
        f"({first['rows']} rows): {where}{tail}"
    )


def _erred_then(replay: dict[str, Any]) -> list[str]:
    """Which side of a replay gave other bits in the forward kept than it gives now
    (``shadow.replay``): none, one or both clauses (none where it was not recorded)."""
    sides = [
        side
        for side, key in (
            ("the reference", "then_reference_differs"),
            ("the cached forward", "then_cached_differs"),
        )
        if replay.get(key)
    ]
    return [f"{' and '.join(sides)} gave other bits then"] if sides else []


def _then(replay: dict[str, Any]) -> str:
    """:func:`_erred_then` of a replay that is exact now, in parentheses (or empty)."""
    said = _erred_then(replay)
    return f" ({said[0]})" if said else ""


def _blame(replay: dict[str, Any]) -> str:
    """What a replay that differs again says of its cause (``shadow.replay``), in parentheses;
    empty where it says nothing."""
    said = _erred_then(replay)
    if replay.get("reference_repeat_differs"):
        said.append("the reference repeats with other bits")
    if replay.get("cached_repeat_differs"):
        said.append("the cached forward repeats with other bits")
    changed = replay.get("whole_set_changed") or {}
    if changed:
        said.append(
            "reference's set changed since its copy: "
            + ", ".join(
                f"{name} expert{'s' if len(ids) > 1 else ''} "
                + ", ".join(str(i) for i in ids[:8])
                + (f" (+{len(ids) - 8})" if len(ids) > 8 else "")
                for name, ids in changed.items()
            )
        )
    if "fresh_replay_differs" in replay:
        said.append(
            "over a fresh copy: " + ("differs" if replay["fresh_replay_differs"] else "exact")
        )
    return f" ({'; '.join(said)})" if said else ""


def launch_flags_lines(found: dict[str, Any]) -> str:
    """The exactness probe's ``matmul_ogs`` launch options (gpt-oss's kernel), as lines to
    follow its line: by rows, whether every layer's cached calls took the reference's options,
    and for each row count where not, both sets."""
    flags = found.get("launch_flags")
    if not flags:
        return ""
    layers = int(found["layers"])
    cells, details = [], []
    for rows in found["rows"]:
        seen = flags.get(str(rows))
        if seen is None:
            continue
        differing = int(seen["layers_differing"])
        cells.append(f"{rows}: " + (f"{differing}/{layers} differ" if differing else "same"))
        if differing:
            details.append(
                f"\n    {rows} rows: reference {'; '.join(seen['reference'])} | cached "
                + "; ".join(seen["cached"])
            )
    return (
        "\n  matmul_ogs launch options of the cached calls against the reference's, by rows "
        f"({', '.join(cells)})" + "".join(details)
    )
