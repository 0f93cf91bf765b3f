"""The layer trace: what every MoE layer took and gave in one generation, for two engines.

The shadow check (``harness/shadow.py``) compares a cache engine's forwards with vLLM's kernel
inside the same engine, which changes what it checks (the reference runs before every forward,
holds every expert on the GPU and moves every later allocation). The trace changes nothing the
forward computes: with ``install()`` called before the engine is built (``e2e.py run
--trace``), every call of vLLM's ``RoutedExperts.forward_modular`` (the routed experts' call
into the quant method, vLLM's or the plugin's) writes one digest a tensor of its hidden states,
the router's ids and weights and its output into a buffer on the device, in CUDA graphs as in
eager mode, while the trace is on (``start``, ``stop``: a flag on the device). Run over the
same first generation in a cache engine and in its no-offload reference, ``first_divergence``
finds the first forward, in the order they ran, whose digests differ: one whose input and
routes agree but whose output differs is the MoE op's; one whose input differs arose after the
forward that ran just before it, which agreed (attention, norms, the token sampled); one whose
input agrees but whose routes differ, the router's.

Each layer also keeps the hidden states, ids and weights of its first forward that runs eagerly
while the trace is on (``kept_inputs``), which ``harness/replay.py`` runs again at the end; just
before that forward, the first layer with a device-planned cache keeps a copy of the cache
(``harness/first_state.py``), which the replay runs the input from once more.

A digest is the sum of a tensor's elements' bits, each mixed and times a weight of its
position, in int64: integer arithmetic, so the same bits give the same digest whatever the
reduction order, and moved or changed elements give another (with the odds of a collision of a
64-bit sum).
torch is imported when the hook runs (``probes``' rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = [
    "CAPACITY",
    "FIELDS",
    "digest",
    "first_divergence",
    "install",
    "installed",
    "kept_inputs",
    "mixed_sum",
    "read",
    "start",
    "stop",
    "uninstall",
]

CAPACITY = 2048
"""Forwards a layer keeps (a generation of 64 tokens is 64 forwards a layer); later ones are
counted, not kept."""

FIELDS = ("seq", "rows", "x", "ids", "weights", "out")
"""What each kept forward holds: its place in the order of every traced forward, its rows, and
the digests of its hidden states, router ids and weights, and output."""

_ATTRIBUTE = "_rowcache_trace"
"""Where a layer keeps its :class:`LayerTrace`."""

_MARK = "_untraced"
"""The attribute of the wrapped ``forward_modular`` that holds vLLM's own."""

_INPUTS = "_rowcache_trace_inputs"
"""Where a layer keeps the inputs of its first eager forward while the trace is on
(:func:`kept_inputs`)."""

_SWITCH: dict[str, Any] = {}
"""The process's ``on`` flag and ``seq`` counter (0-d int64 on the layers' device), made at the
first traced forward (vLLM's profile run, before any capture), and ``keep``, the host's copy of
``on`` that tells an eager forward to keep its input (:func:`kept_inputs`)."""


@dataclasses.dataclass
class LayerTrace:
    """One layer's kept forwards (``records``: ``[CAPACITY, len(FIELDS)]`` int64) and how many
    it ran while the trace was on (``count``, 0-d int64), on the layer's device."""

    records: Any
    count: Any


_INTEGER_VIEWS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def digest(t: Any) -> Any:
    """A 0-d int64 tensor of ``t``'s bits (module docstring), on its device, nothing read on
    the host (a CUDA graph captures it)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int8)
    if flat.is_floating_point() or flat.dtype not in (torch.int64,):
        flat = flat.view(getattr(torch, _INTEGER_VIEWS[flat.element_size()]))
    return mixed_sum(flat.to(torch.int64, copy=True))


def mixed_sum(values: Any) -> Any:
    """The digests' sum over ``values``' last dimension (int64, overwritten: pass a copy).

    Each value mixed (multiply, xor-shift) and weighted by a large odd number of its position,
    all wrapping in int64: a swap of two elements or a changed bit moves the sum. In place, so
    that a large buffer's digest holds one working copy of it (``harness/slot_watch.py``)."""
    import torch

    position = torch.arange(values.shape[-1], device=values.device, dtype=torch.int64)
    weights = (position * 0x9E3779B97F4A7C1 + 0x7F4A7C15) | 1
    values.add_(0x632BE5AB).mul_(0x85EBCA77C2B2AE3)
    values.bitwise_xor_(values >> 29)
    return values.mul_(weights).sum(-1)


def _switch(device: Any) -> tuple[Any, Any]:
    import torch

    if "on" not in _SWITCH:
        _SWITCH["on"] = torch.zeros((), dtype=torch.int64, device=device)
        _SWITCH["seq"] = torch.zeros((), dtype=torch.int64, device=device)
    return _SWITCH["on"], _SWITCH["seq"]


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _layer_trace(layer: Any, device: Any) -> LayerTrace:
    found: LayerTrace | None = vars(layer).get(_ATTRIBUTE)
    if found is not None:
        return found
    import torch

    if _capturing():
        raise RuntimeError(
            "layer trace: a MoE layer's first forward is being captured into a CUDA graph; "
            "its buffer must exist before (install the trace before the engine)"
        )
    found = LayerTrace(
        torch.zeros((CAPACITY, len(FIELDS)), dtype=torch.int64, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
    )
    vars(layer)[_ATTRIBUTE] = found
    return found


def _output_digest(out: Any) -> Any:
    """The digest of a forward's output: a tensor's, or a tuple's (shared and routed) summed
    with their places' weights."""
    if not isinstance(out, tuple | list):
        return digest(out)
    total = None
    for place, part in enumerate(out):
        if part is None:
            continue
        term = digest(part) * (place + 1)
        total = term if total is None else total + term
    assert total is not None, "a MoE forward returned no tensor"
    return total


def record(layer: Any, x: Any, ids: Any, weights: Any, out: Any) -> None:
    """Keep one forward's digests in ``layer``'s trace while the trace is on: on the device,
    nothing read on the host. Every forward writes the row past the kept ones (below
    ``CAPACITY``); only a forward while the trace is on counts it, so ``read`` sees kept rows
    alone."""
    import torch

    trace = _layer_trace(layer, x.device)
    on, seq = _switch(x.device)
    rows = torch.full((), int(x.shape[0]), dtype=torch.int64, device=x.device)
    row = torch.stack([seq, rows, digest(x), digest(ids), digest(weights), _output_digest(out)])
    slot = trace.count.clamp(max=CAPACITY - 1).reshape(1)
    kept = trace.records.index_select(0, slot)  # the last kept row, once the buffer is full
    trace.records.index_copy_(0, slot, torch.where(trace.count < CAPACITY, row, kept))
    trace.count.add_(on)
    seq.add_(on)


def _routed_experts() -> Any:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts


def install(target: Any = None) -> None:
    """Wrap ``target.forward_modular`` (vLLM's ``RoutedExperts`` unless a test names another
    class) in this process with the trace; a second call changes nothing."""
    cls = _routed_experts() if target is None else target
    original: Callable[..., Any] = cls.forward_modular
    if hasattr(original, _MARK):
        return

    def traced(
        self: Any,
        x: Any,
        topk_weights: Any,
        topk_ids: Any,
        shared_experts: Any = None,
        shared_experts_input: Any = None,
    ) -> Any:
        first = bool(_SWITCH.get("keep")) and _INPUTS not in vars(self) and not _capturing()
        if first:
            # The cache as this forward finds it, for the replay (harness/first_state.py).
            from tools.vllm.harness import first_state

            first_state.take(self)
        out = original(self, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        record(self, x, topk_ids, topk_weights, out)
        if first:
            # Its first forward while on, run eagerly: the input to replay (harness/replay.py).
            vars(self)[_INPUTS] = (x.clone(), topk_ids.clone(), topk_weights.clone())
        return out

    setattr(traced, _MARK, original)
    cls.forward_modular = traced


def installed(target: Any = None) -> bool:
    cls = _routed_experts() if target is None else target
    return hasattr(cls.forward_modular, _MARK)


def uninstall(target: Any = None) -> None:
    """vLLM's own ``forward_modular`` back (graphs captured before keep the trace)."""
    cls = _routed_experts() if target is None else target
    original = getattr(cls.forward_modular, _MARK, None)
    if original is not None:
        cls.forward_modular = original


def _set(value: int) -> bool:
    """Set the switch, inside inference mode: it was made in one (vLLM's forwards), and an
    inference tensor takes no in-place update outside it (``llm.apply_model`` runs outside)."""
    on = _SWITCH.get("on")
    if on is None:
        return False
    import torch

    with torch.inference_mode():
        on.fill_(value)
    _SWITCH["keep"] = bool(value)
    return True


def kept_inputs(layer: Any) -> tuple[Any, Any, Any] | None:
    """The hidden states, router ids and weights of ``layer``'s first forward that ran eagerly
    while the trace was on (in CUDA graphs the hook runs only while they are captured), or
    None."""
    found: tuple[Any, Any, Any] | None = vars(layer).get(_INPUTS)
    return found


def start(model: Any = None) -> bool:
    """Turn the trace on (through ``llm.apply_model``: ``model`` is unused); False where no
    layer has run a traced forward yet (nothing to turn on)."""
    return _set(1)


def stop(model: Any = None) -> bool:
    """Turn the trace off; False where it never ran."""
    return _set(0)


def read(model: Any) -> dict[str, Any]:
    """Every traced layer's kept forwards: ``{"fields": FIELDS, "layers": {name: {"count": n,
    "records": [[...], ...]}}}`` (``count`` may exceed the records kept, ``CAPACITY``)."""
    import torch

    layers: dict[str, Any] = {}
    for name, module in model.named_modules():
        trace: LayerTrace | None = vars(module).get(_ATTRIBUTE)
        if trace is None:
            continue
        if trace.records.is_cuda:
            torch.cuda.synchronize(trace.records.device)
        count = int(trace.count.item())
        layers[name] = {"count": count, "records": trace.records[: min(count, CAPACITY)].tolist()}
    return {"fields": list(FIELDS), "layers": layers}


def first_divergence(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Where two engines' traces of the same generation first part (module docstring), in the
    order ``ours`` ran its forwards: ``{"forwards": n compared, "layers": n, "first": None}``
    where every kept forward agrees, else ``first`` names the layer, the forward's index in it,
    its rows, which of ``x``, ``ids``, ``weights`` and ``out`` differ, and the forward that ran
    just before it (``before``: its layer and index; it agreed in every digest), so an input
    that differs arose between that forward's output and this one's input. Layers that one trace
    lacks, or whose forward counts differ, are listed under ``mismatched`` (and not compared
    past the shorter count)."""
    fields = list(FIELDS)
    at = {name: fields.index(name) for name in FIELDS}
    mine, other = ours.get("layers", {}), theirs.get("layers", {})
    mismatched = {}
    order = []
    for name, found in mine.items():
        there = other.get(name)
        if there is None or there["count"] != found["count"]:
            mismatched[name] = [found["count"], None if there is None else there["count"]]
        if there is None:
            continue
        for index, (a, b) in enumerate(zip(found["records"], there["records"], strict=False)):
            order.append((a[at["seq"]], name, index, a, b))
    mismatched.update({name: [None, other[name]["count"]] for name in other if name not in mine})
    order.sort(key=lambda item: item[0])
    first = None
    for place, (_, name, index, a, b) in enumerate(order):
        differ = [f for f in ("rows", "x", "ids", "weights", "out") if a[at[f]] != b[at[f]]]
        if differ:
            first = {"layer": name, "index": index, "rows": a[at["rows"]], "differ": differ}
            if place:  # the forward that ran just before, which agreed in every digest
                _, before, before_index, _, _ = order[place - 1]
                first["before"] = {"layer": before, "index": before_index}
            break
    return {
        "forwards": len(order),
        "layers": len(set(mine) & set(other)),
        "first": first,
        "mismatched": mismatched,
    }
