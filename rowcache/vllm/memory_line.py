"""The start-up line that says what the cache holds where, so that a user sizing
``moe_expert_cache_size`` reads the memory it took instead of computing it.

Every provider the plugin builds is noted as its layer's weights are processed; the engine's
first cached forward (vLLM's profile run, after every layer is built) logs the totals once and
starts a new tally, so that a second engine in the same process gets a line of its own:

    rowcache: 8 MoE layers cached, 32 of 128 experts a layer in slots: 2.25 GiB of the
    experts' 9.00 GiB on the GPU; 6.29 GiB held in pinned host memory (0.70 of the experts'
    bytes, as bf16 planes); set-up T s: P s pinning host memory, B s building the providers

The set-up's two parts are host seconds and disjoint: rowcache's pinning since the last call
(asking the driver for the checkpoint tensors' and the providers' pinned blocks, and giving
the checkpoint tensors' back: ``rowcache.pinned.pinning_seconds``), and the providers'
construction without it (the first slot fills, the planes' encoding). vLLM's own loading
(reading the checkpoint into those tensors) and its own pinned memory are in neither.

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
    build_seconds: float = 0.0
    capacities: set[int] = field(default_factory=set)
    experts: set[int] = field(default_factory=set)


_tally = _Tally()
_pinning_mark = 0.0
"""The process's pinning seconds at the last ``take_line`` that was given them."""


def note_layer(stats: Mapping[str, int], num_experts: int, build_seconds: float = 0.0) -> None:
    """Count one layer's provider: its ``stats()``, how many experts the layer has and the host
    seconds its construction took besides pinning."""
    capacity = int(stats["capacity"])
    slot_bytes = int(stats["slot_bytes"])
    _tally.layers += 1
    _tally.slot_bytes += slot_bytes
    _tally.expert_bytes += slot_bytes // capacity * num_experts
    _tally.host_bytes += int(stats["host_bytes"])
    _tally.build_seconds += build_seconds
    _tally.capacities.add(capacity)
    _tally.experts.add(num_experts)


def _counts(values: set[int]) -> str:
    return " to ".join(str(v) for v in sorted({min(values), max(values)}))


def take_line(
    planes: bool, load_time_bytes: int = 0, pinning_seconds: float | None = None
) -> str | None:
    """The line for the layers noted since the last one (``planes``: their experts are held as
    bf16 planes), and a new tally; None when no layer was noted. ``load_time_bytes``: pinned
    bytes of the checkpoint tensors' transient slabs (``rowcache.pinned``) still held once every
    layer is built; each layer lets go of its own, so anything here is memory nothing will free,
    and the line says so. ``pinning_seconds``: the process's seconds of pinning so far
    (``rowcache.pinned.pinning_seconds``); the line gives those since the last call (one that
    returns no line moves the mark too), and the set-up's time (none given: no times)."""
    global _tally, _pinning_mark
    tally, _tally = _tally, _Tally()
    pinned_since = None
    if pinning_seconds is not None:
        pinned_since, _pinning_mark = pinning_seconds - _pinning_mark, pinning_seconds
    if tally.layers == 0:
        return None
    held = f"{tally.host_bytes / tally.expert_bytes:.2f} of the experts' bytes"
    if planes:
        held += ", as bf16 planes"
    line = (
        f"rowcache: {tally.layers} MoE layer{'' if tally.layers == 1 else 's'} cached, "
        f"{_counts(tally.capacities)} of {_counts(tally.experts)} experts a layer in slots: "
        f"{tally.slot_bytes / GIB:.2f} GiB of the experts' {tally.expert_bytes / GIB:.2f} GiB "
        f"on the GPU; {tally.host_bytes / GIB:.2f} GiB held in pinned host memory ({held})"
    )
    if pinned_since is not None:
        line += (
            f"; set-up {pinned_since + tally.build_seconds:.1f} s: {pinned_since:.1f} s "
            f"pinning host memory, {tally.build_seconds:.1f} s building the providers"
        )
    if load_time_bytes:
        line += (
            f"; {load_time_bytes / GIB:.2f} GiB of pinned memory from loading the checkpoint "
            "still held (expected none: a leak)"
        )
    return line
