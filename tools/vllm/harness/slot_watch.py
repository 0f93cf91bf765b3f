"""The slot watch: at every ``prepare`` of a cache engine's first generation, whether each slot
the returned expert map points at holds its expert's bytes, counted on the device.

The slot audit (``rowcache.vllm.expert_cache_slot_check``) reads the slots once, after the
measurements, when the engine is idle: a slot that held the wrong bytes while a forward read it
(a copy not yet landed, two experts mapped to one slot, a map that names another expert than
the slot holds) and the right ones later passes it. The exactness probe and the replay run
their inputs after the generation too, from the state the cache is in then. Here, with
``install()`` called before the engine is built (``e2e.py run --trace``), every provider call
``prepare`` (the device planner's and the host planner's, in eager mode and inside the CUDA
graphs that capture it) is followed, on the same stream and before the kernel that reads the
slots, by a check: each slot's digest of its bytes (per source tensor) against the digest
of the expert the map sends there, read once from the provider's host sources
(``source_weights``) at the provider's first call. While the layer trace is on (its switch,
``trace.start``, ``trace.stop``) each check adds to the provider's counters: prepares, mapped
experts checked, prepares with a wrong slot, wrong experts by source tensor, and the trace's
order number of the first forward with one (``first_bad``, -1 while none); and it keeps the
expert maps of its first calls (``MAPS_KEPT``: the passes of the generation's first forward).

The digests cost a pass over the slot buffers at every call that checks (eagerly while the
trace is on, and at every replay of a captured graph): a diagnostic, not for timings.
torch is imported when a function runs (``probes``' rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tools.vllm.harness.slot_buffers import slot_keys

__all__ = ["COUNTS", "MAPS_KEPT", "install", "installed", "read", "targets", "uninstall"]

COUNTS = ("prepares", "mapped", "bad_prepares", "bad", "first_bad")
"""A provider's counters, in order: its calls of ``prepare`` while the trace was on, the mapped
experts they checked, the calls with at least one slot not holding its expert's bytes, those
experts (summed over calls), and the trace's order number of the first such call's forward
(-1: none)."""

MAPS_KEPT = 8
"""Calls whose expert maps a provider keeps (the first generation's first forward's passes)."""

_ATTRIBUTE = "_rowcache_slot_watch"
"""Where a provider keeps its :class:`ProviderWatch`."""

_MARK = "_unwatched"
"""The attribute of a wrapped ``prepare`` that holds the provider class's own."""


@dataclasses.dataclass
class ProviderWatch:
    """One provider's source digests and counters, on its device."""

    keys: tuple[str, ...]
    """The slot buffers watched (``buf_<key>``), those the provider has."""
    expected: Any
    """``[len(keys), E]`` int64: each expert's digest of each source tensor."""
    counts: Any
    """``[len(COUNTS)]`` int64."""
    by_key: Any
    """``[len(keys)]`` int64: experts found wrong in each source tensor."""
    maps: Any
    """``[MAPS_KEPT, E]`` int64: the expert maps of the first calls while the trace is on."""


def targets() -> tuple[type, ...]:
    """The provider classes the watch wraps: the device planner's and the host planner's."""
    from rowcache.device_plan.provider import DevicePlannedProvider
    from rowcache.row_provider import HostPlannedProvider

    return (DevicePlannedProvider, HostPlannedProvider)


_WORD_TYPES = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


def _row_digests(rows: Any) -> Any:
    """``[n]`` int64: a digest of each of ``rows``' first-dimension entries' bytes, mixed and
    weighted by position as ``trace.digest`` mixes elements (``trace.mixed_sum``), over the
    widest integer words the entry's size divides into: the same bytes give the same digest
    whatever their dtype. A few kernels over the whole buffer (inside a CUDA graph as outside),
    one working copy of it."""
    import torch

    from tools.vllm.harness import trace

    flat = rows.detach().contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    width = next(w for w in _WORD_TYPES if flat.shape[1] % w == 0)
    words = flat.view(getattr(torch, _WORD_TYPES[width]))
    # A copy: the slot buffer is never written.
    return trace.mixed_sum(words.to(torch.int64, copy=True))


_SOURCE_CHUNK = 4
"""Experts a source's digests are read for at a time (one working copy of that many)."""


def _watch(provider: Any, device: Any) -> ProviderWatch:
    found: ProviderWatch | None = vars(provider).get(_ATTRIBUTE)
    if found is not None:
        return found
    import torch

    from tools.vllm.harness import trace

    if trace._capturing():
        raise RuntimeError(
            "slot watch: a provider's first prepare is being captured into a CUDA graph; its "
            "source digests must be read before (install the watch before the engine)"
        )
    keys = slot_keys(provider)
    expected = []
    for key in keys:
        whole = provider.source_weights(key, device)
        chunks = whole.split(_SOURCE_CHUNK)
        expected.append(torch.cat([_row_digests(chunk) for chunk in chunks]))
        del whole, chunks
    found = ProviderWatch(
        keys,
        torch.stack(expected),
        torch.tensor([0, 0, 0, 0, -1], dtype=torch.int64, device=device),
        torch.zeros(len(keys), dtype=torch.int64, device=device),
        torch.full((MAPS_KEPT, expected[0].numel()), -1, dtype=torch.int64, device=device),
    )
    vars(provider)[_ATTRIBUTE] = found
    return found


def check(provider: Any, expert_map: Any) -> None:
    """Add one call's check to ``provider``'s counters while the trace is on (module
    docstring): nothing read on the host, so a CUDA graph captures it."""
    import torch

    from tools.vllm.harness import trace

    device = expert_map.device
    watch = _watch(provider, device)
    on, seq = trace._switch(device)
    mapped = expert_map >= 0
    slot = expert_map.clamp(min=0).long()
    wrong = []
    for index, key in enumerate(watch.keys):
        slots = _row_digests(getattr(provider, f"buf_{key}"))
        wrong.append((slots[slot] != watch.expected[index]) & mapped)
    wrong_by_key = torch.stack(wrong)  # [keys, E]
    bad_experts = wrong_by_key.any(0).sum()
    bad_call = (bad_experts > 0).to(torch.int64)
    counts = watch.counts
    first = torch.where((counts[4] < 0) & (bad_call * on > 0), seq, counts[4])
    step = torch.stack([on, mapped.sum() * on, bad_call * on, bad_experts * on])
    # The map of one of the first MAPS_KEPT calls while on (the row past them rewritten as it
    # was otherwise, as the trace keeps its records).
    row = counts[0].clamp(max=MAPS_KEPT - 1).reshape(1)
    kept = watch.maps.index_select(0, row)
    keep = (counts[0] < MAPS_KEPT) & (on > 0)
    watch.maps.index_copy_(0, row, torch.where(keep, expert_map.long().reshape(1, -1), kept))
    counts[:4].add_(step)
    counts[4].copy_(first)
    watch.by_key.add_(wrong_by_key.sum(1) * on)


def _checks_now() -> bool:
    """Whether a call checks: inside a CUDA graph's capture (the check is replayed with the
    graph, and counts only while the trace is on) and eagerly while the trace is on; an eager
    call with the trace off would count nothing, and skips the digests' cost."""
    from tools.vllm.harness import trace

    return trace._capturing() or bool(trace._SWITCH.get("keep"))


def install(classes: tuple[type, ...] | None = None) -> None:
    """Wrap ``prepare`` of each provider class (:func:`targets` unless a test names others)
    with the check; a second call changes nothing."""
    for cls in targets() if classes is None else classes:
        original: Callable[..., Any] = cls.prepare  # type: ignore[attr-defined]
        if hasattr(original, _MARK):
            continue

        def watched(
            self: Any, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any
        ) -> Any:
            result = _original(self, *args, **kwargs)
            if _checks_now():
                check(self, result.expert_map)
            else:
                _watch(self, result.expert_map.device)  # the digests, before any capture
            return result

        setattr(watched, _MARK, original)
        cls.prepare = watched  # type: ignore[attr-defined]


def installed(classes: tuple[type, ...] | None = None) -> bool:
    return all(
        hasattr(cls.prepare, _MARK)  # type: ignore[attr-defined]
        for cls in (targets() if classes is None else classes)
    )


def uninstall(classes: tuple[type, ...] | None = None) -> None:
    """The providers' own ``prepare`` back (graphs captured before keep the check)."""
    for cls in targets() if classes is None else classes:
        original = getattr(cls.prepare, _MARK, None)  # type: ignore[attr-defined]
        if original is not None:
            cls.prepare = original  # type: ignore[attr-defined]


def read(model: Any) -> dict[str, Any]:
    """Every watched layer's counters: ``{"layers": {name: {count: n, ..., "by_key": {key:
    n}, "maps": [[slot of each expert or -1], ...]}}}`` (:data:`COUNTS`, the kept maps), the
    layers whose provider ran a watched ``prepare``."""
    import torch

    layers: dict[str, Any] = {}
    for name, module in model.named_modules():
        provider = getattr(getattr(module, "quant_method", None), "rowcache_provider", None)
        watch: ProviderWatch | None = vars(provider).get(_ATTRIBUTE) if provider else None
        if watch is None:
            continue
        if watch.counts.is_cuda:
            torch.cuda.synchronize(watch.counts.device)
        counts = [int(v) for v in watch.counts.tolist()]
        by_key = dict(zip(watch.keys, (int(v) for v in watch.by_key.tolist()), strict=True))
        maps = watch.maps[: min(counts[0], MAPS_KEPT)].tolist()
        layers[name] = {**dict(zip(COUNTS, counts, strict=True)), "by_key": by_key, "maps": maps}
    return {"layers": layers}
