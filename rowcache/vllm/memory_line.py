"""The start-up line that says what the cache holds where, so that a user sizing
``moe_expert_cache_size`` reads the memory it took instead of computing it.

Every provider the plugin builds is noted as its layer's weights are processed; the engine's
first cached forward (vLLM's profile run, after every layer is built) logs the totals once and
starts a new tally, so that a second engine in the same process gets a line of its own:

    rowcache: 8 MoE layers cached, 32 of 128 experts a layer in slots: 2.25 GiB of the
    experts' 9.00 GiB on the GPU; 6.29 GiB held in pinned host memory (0.70 of the experts'
    bytes, as bf16 planes)

The figures are the providers' own (``stats()``: ``slot_bytes``, ``host_bytes``); an expert's
bytes are a slot's. This module imports neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["note_layer", "take_line"]

GIB = 2**30


@dataclass
class _Tally:
    layers: int = 0
    slot_bytes: int = 0
    expert_bytes: int = 0
    host_bytes: int = 0
    capacities: set[int] = field(default_factory=set)
    experts: set[int] = field(default_factory=set)


_tally = _Tally()


def note_layer(stats: Mapping[str, int], num_experts: int) -> None:
    """Count one layer's provider: its ``stats()`` and how many experts the layer has."""
    capacity = int(stats["capacity"])
    slot_bytes = int(stats["slot_bytes"])
    _tally.layers += 1
    _tally.slot_bytes += slot_bytes
    _tally.expert_bytes += slot_bytes // capacity * num_experts
    _tally.host_bytes += int(stats["host_bytes"])
    _tally.capacities.add(capacity)
    _tally.experts.add(num_experts)


def _counts(values: set[int]) -> str:
    return " to ".join(str(v) for v in sorted({min(values), max(values)}))


def take_line(planes: bool, load_time_bytes: int = 0) -> str | None:
    """The line for the layers noted since the last one (``planes``: their experts are held as
    bf16 planes), and a new tally; None when no layer was noted. ``load_time_bytes``: pinned
    bytes of the checkpoint tensors' transient slabs (``rowcache.pinned``) still held once every
    layer is built; each layer lets go of its own, so anything here is memory nothing will free,
    and the line says so."""
    global _tally
    tally, _tally = _tally, _Tally()
    if tally.layers == 0:
        return None
    held = f"{tally.host_bytes / tally.expert_bytes:.2f} of the experts' bytes"
    if planes:
        held += ", as bf16 planes"
    return (
        f"rowcache: {tally.layers} MoE layer{'' if tally.layers == 1 else 's'} cached, "
        f"{_counts(tally.capacities)} of "
        f"{_counts(tally.experts)} experts a layer in slots: {tally.slot_bytes / GIB:.2f} GiB of "
        f"the experts' {tally.expert_bytes / GIB:.2f} GiB on the GPU; "
        f"{tally.host_bytes / GIB:.2f} GiB held in pinned host memory ({held})"
    ) + (
        f"; {load_time_bytes / GIB:.2f} GiB of pinned memory from loading the checkpoint "
        "still held (expected none: a leak)"
        if load_time_bytes
        else ""
    )
