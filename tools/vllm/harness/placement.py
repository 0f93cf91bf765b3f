"""Whether gpt-oss's MXFP4 kernel gives an expert the same bits wherever its bytes lie.

The cache hands vLLM's kernel ``C`` slots and an expert map; no offload hands it the ``E``
experts in id order and no map. Where the cached forward's bits differ from no offload's
with every slot's bytes right (the slot audit, the slot watch, the expert bytes), either the
cache computes something else (a map, a merge) or the kernel's bits for an expert depend on
where its bytes lie: which slot, what lies beside it, the map's path through the kernel.
This probe runs vLLM's kernel on random rows (as ``probes.exactness``) over the same bytes
laid out in several ways (:data:`WAYS`) and counts, by rows, the layers whose output is
bit-identical to the kernel over the whole set in id order:

- ``mapped``: the whole set in id order, with an identity expert map (the map's path);
- ``whole_tail_garbage``: the whole set in id order, no map, with :data:`GARBAGE` bytes past
  the last expert's range (the reference itself is run over the whole set with zero bytes
  there);
- ``permuted``: the whole set in a seeded order, with the map that finds each expert;
- ``slots``: a copy of the cache's slot buffers with its resident map, where every routed
  expert is resident after the cached forward (one pass), its tiles pinned as the cached
  forward pins them; compared with the cached forward too;
- ``others_garbage``: ``slots`` with every slot that holds no routed expert filled with
  :data:`GARBAGE` bytes (a read outside an expert's own range changes its bits);
- ``tail_garbage``: ``slots`` with :data:`GARBAGE` bytes past the last slot's range.

An ``others_garbage`` or ``tail_garbage`` that parts from ``slots`` names a kernel reading
outside an expert's bytes; a ``permuted`` that parts from the reference names a kernel whose
bits depend on placement; ``slots`` equal to the cached forward and unequal to the reference
with both of those clean names the cache. torch is imported when a function runs.
"""

from __future__ import annotations

from typing import Any

from tools.vllm.harness import probes
from tools.vllm.harness.slot_buffers import slot_buffers

__all__ = ["GARBAGE", "ROWS", "WAYS", "placement"]

WAYS = ("mapped", "whole_tail_garbage", "permuted", "slots", "others_garbage", "tail_garbage")
SLOT_WAYS = ("slots", "others_garbage", "tail_garbage")
ROWS = (1, 8, 32)
GARBAGE = 0xFF
"""The byte written where no expert's bytes belong: an e8m0 scale of NaN, e2m1 values -6.0, a
float32 NaN bias. A kernel that multiplies a stray scale by a zero weight hides any finite
byte there (0x7F, scale 1.0, showed nothing on 2026-12-07) but not this one: triton_kernels'
MXFP4 matmul on Hopper loads 64 bytes past each weight-scale row (``rowcache.sources``'
``SLOT_GUARD_BYTES``)."""


def _kernel(
    method: Any,
    module: Any,
    rows: dict[str, Any],
    count: int,
    inputs: tuple[Any, Any, Any],
    expert_map: Any,
    entries: int | None,
) -> Any:
    """vLLM's kernel of the layer over ``rows`` (``count`` experts seen) and ``expert_map``,
    with vLLM's tiles (``entries`` None) or those the cached forward pins."""
    w13, w2, w1_fields, w2_fields = probes.mxfp4_wrapped(method, rows, count)
    whole = probes.WholeSet(w13, w2, w1_fields, w2_fields, int(w13.shape[-2]))
    x, weights, ids = inputs
    return probes.reference_forward(method, module, whole, x, weights, ids, expert_map, entries)


def _with_row(rows: Any, fill: int) -> Any:
    """``rows`` with one more row of ``fill`` bytes after the last."""
    import torch

    more = torch.empty((rows.shape[0] + 1, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    more[:-1].copy_(rows)
    more[-1].view(torch.uint8).fill_(fill)
    return more


def _slot_sets(provider: Any, routed: Any, resident: Any) -> dict[str, dict[str, Any]]:
    """The three slot layouts of :data:`SLOT_WAYS` (copies of the slot buffers)."""
    import torch

    held = torch.zeros(int(provider.capacity), dtype=torch.bool, device=resident.device)
    held[resident[routed].long()] = True
    sets: dict[str, dict[str, Any]] = {way: {} for way in SLOT_WAYS}
    for key, slots in slot_buffers(provider).items():
        sets["slots"][key] = probes.guarded_copy(slots)
        sets["tail_garbage"][key] = _with_row(slots, GARBAGE)
        others = probes.guarded_copy(slots)
        others.view(torch.uint8)[~held] = GARBAGE
        sets["others_garbage"][key] = others
    return sets


def _tally() -> dict[str, Any]:
    return {"ran": 0, "equal_reference": 0, "equal_cached": 0, "max_abs": 0.0}


def placement(
    model: Any, device: str = "cuda", row_counts: tuple[int, ...] = ROWS, seed: int = 1
) -> dict[str, Any]:
    """Each gpt-oss cached layer's kernel over the :data:`WAYS` (module docstring):
    ``{"rows": [...], "layers": n, "ways": {way: {rows: {"ran", "equal_reference",
    "equal_cached", "max_abs"}}}, "cached": {rows: {"equal_reference", "max_abs"}}}``
    (``equal_cached``: slot ways only; ``max_abs`` against the reference)."""
    import torch

    ways: dict[str, dict[str, dict[str, Any]]] = {
        way: {str(m): _tally() for m in row_counts} for way in WAYS
    }
    cached_tally = {str(m): {"equal_reference": 0, "max_abs": 0.0} for m in row_counts}
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = 0
    for index, (_name, module) in enumerate(model.named_modules()):
        method: Any = getattr(module, "quant_method", None)
        provider = getattr(method, "rowcache_provider", None)
        if provider is None or type(method).__name__ != "RowcacheGptOssMxfp4MoEMethod":
            continue
        layers += 1
        whole = probes.mxfp4_rows(provider, device)
        experts = int(whole["w13"].shape[0])
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(seed + index))
        order = order.to(device)
        permuted = {key: probes.guarded_copy(rows[order]) for key, rows in whole.items()}
        tail = {key: _with_row(rows, GARBAGE) for key, rows in whole.items()}
        finds = torch.empty(experts, dtype=torch.int32, device=device)
        finds[order] = torch.arange(experts, dtype=torch.int32, device=device)
        identity = torch.arange(experts, dtype=torch.int32, device=device)
        top_k = int(method.moe.experts_per_token)
        hidden = int(probes.mxfp4_wrapped(method, whole, experts)[0].shape[-2])
        for rows_n in row_counts:
            x = torch.randn(rows_n, hidden, device=device, generator=gen, dtype=torch.bfloat16)
            logits = torch.randn(rows_n, experts, device=device, generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            inputs = (x, weights, ids.to(torch.int32))
            reference = _kernel(method, module, whole, experts, inputs, None, None)
            outs = {
                "mapped": _kernel(method, module, whole, experts, inputs, identity, None),
                "whole_tail_garbage": _kernel(method, module, tail, experts, inputs, None, None),
                "permuted": _kernel(method, module, permuted, experts, inputs, finds, None),
            }
            cached = method._cached_apply(
                provider, module, x, weights, inputs[2], None, None
            ).clone()
            resident = torch.tensor(provider.slot_of(), dtype=torch.int32, device=device)
            routed = ids.reshape(-1).long()
            if bool((resident[routed] >= 0).all()):
                capacity = int(provider.capacity)
                for way, rows in _slot_sets(provider, routed, resident).items():
                    outs[way] = _kernel(
                        method, module, rows, capacity, inputs, resident, int(ids.numel())
                    )
            key = str(rows_n)
            differs, gap = probes.bit_difference(reference, cached)
            cached_tally[key]["equal_reference"] += not bool(differs.item())
            cached_tally[key]["max_abs"] = probes.larger_gap(cached_tally[key]["max_abs"], gap)
            for way, out in outs.items():
                tally = ways[way][key]
                tally["ran"] += 1
                differs, gap = probes.bit_difference(reference, out)
                tally["equal_reference"] += not bool(differs.item())
                tally["max_abs"] = probes.larger_gap(tally["max_abs"], gap)
                if way in SLOT_WAYS:
                    tally["equal_cached"] += not bool(probes.bit_difference(cached, out)[0].item())
        del whole, permuted, tail
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": list(row_counts), "layers": layers, "ways": ways, "cached": cached_tally}
