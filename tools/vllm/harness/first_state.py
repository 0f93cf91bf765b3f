"""The device planner's cache as it stood when the layer trace kept a layer's first input.

The replay (``harness/replay.py``) runs each cached layer's first traced input again at the
end of a run, from the state the cache is in then: a forward whose bits depend on which
experts sat in which slots, or on what a slot held, at the generation's first forward gives
the right bits there and no answer. Here, just before that first forward runs (the trace's
hook, ``trace.install``), the first :data:`LAYERS_KEPT` layers with a device-planned provider
keep a copy of its state tensors (``DeviceCacheState``: the resident map, the owners, the
stamps, the counts, every scratch buffer the planner reads) and of its slot buffers; the replay
runs the input once more from that copy (:func:`restored`) and puts the cache's own state back
after. A host-planned provider keeps nothing (its plan is on the host, not captured here).

The copies stay on the device (taking them reads nothing on the host, so the forward's timing
is not changed by a synchronization). torch is imported when a function runs (``probes``'
rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tools.vllm.harness.slot_buffers import slot_buffers

__all__ = ["LAYERS_KEPT", "kept", "reset", "restored", "summary", "take"]

LAYERS_KEPT = 1
"""Layers that keep a copy, the first to run (the trace's first difference so far was always
the first layer's first forward; each copy holds a layer's slots, about 210 MB for gpt-oss-20b
at 16 slots)."""

_ATTRIBUTE = "_rowcache_first_state"
"""Where a layer keeps its copy."""

_TAKEN: dict[str, int] = {"layers": 0}
"""Layers that took a copy in this process."""

SUMMARY_FIELDS = ("resident", "owners", "stamps", "clock", "counts")
"""The state tensors the record names (:func:`summary`): small, and what the plan reads."""


@dataclasses.dataclass
class FirstState:
    """One layer's copy: every tensor field of its ``DeviceCacheState`` and its slot buffers."""

    state: dict[str, Any]
    slots: dict[str, Any]


def _provider(layer: Any) -> Any:
    """The layer's device-planned provider, or None."""
    provider = getattr(getattr(layer, "quant_method", None), "rowcache_provider", None)
    state = getattr(provider, "_state", None)
    return provider if state is not None and dataclasses.is_dataclass(state) else None


def _tensors(provider: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The provider's state tensors by field and slot buffers by source name (live, not
    copies)."""
    import torch

    state = provider._state
    fields = {
        f.name: getattr(state, f.name)
        for f in dataclasses.fields(state)
        if isinstance(getattr(state, f.name), torch.Tensor)
    }
    return fields, slot_buffers(provider)


def take(layer: Any) -> bool:
    """Keep a copy of ``layer``'s cache (module docstring) if it has a device-planned provider,
    holds none yet and fewer than :data:`LAYERS_KEPT` layers took one; True where it took."""
    if _ATTRIBUTE in vars(layer) or _TAKEN["layers"] >= LAYERS_KEPT:
        return False
    provider = _provider(layer)
    if provider is None:
        return False
    vars(layer)[_ATTRIBUTE] = _copy(*_tensors(provider))
    _TAKEN["layers"] += 1
    return True


def kept(layer: Any) -> bool:
    return isinstance(vars(layer).get(_ATTRIBUTE), FirstState)


def _copy(fields: dict[str, Any], slots: dict[str, Any]) -> FirstState:
    """Clones of ``fields`` and ``slots`` (on their device)."""
    return FirstState(
        {k: t.clone() for k, t in fields.items()}, {k: t.clone() for k, t in slots.items()}
    )


def _copy_into(live: dict[str, Any], values: dict[str, Any]) -> None:
    for key, tensor in live.items():
        tensor.copy_(values[key])


@contextmanager
def restored(layer: Any) -> Iterator[None]:
    """Inside the block ``layer``'s cache is in the state it kept (its tensors written in
    place: a captured graph holds their addresses); after it, the state it was in before the
    block, whatever the block did."""
    import torch

    first = vars(layer).get(_ATTRIBUTE)
    provider = _provider(layer)
    if not isinstance(first, FirstState) or provider is None:
        raise RuntimeError("first_state: this layer kept no state of a device-planned cache")
    fields, slots = _tensors(provider)
    with torch.no_grad():
        now = _copy(fields, slots)
        _copy_into(fields, first.state)
        _copy_into(slots, first.slots)
    try:
        yield
    finally:
        with torch.no_grad():
            _copy_into(fields, now.state)
            _copy_into(slots, now.slots)


def summary(layer: Any) -> dict[str, list[int]] | None:
    """The kept state's :data:`SUMMARY_FIELDS` as lists (None where none was kept)."""
    first = vars(layer).get(_ATTRIBUTE)
    if not isinstance(first, FirstState):
        return None
    return {k: [int(v) for v in first.state[k].tolist()] for k in SUMMARY_FIELDS}


def reset() -> None:
    """Forget how many layers took a copy (tests; a process runs one engine)."""
    _TAKEN["layers"] = 0
