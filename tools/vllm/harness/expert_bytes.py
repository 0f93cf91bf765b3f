"""Every expert's bytes as vLLM's kernel reads them, by engine: one digest an expert a tensor.

The slot audit (``rowcache.vllm.expert_cache_slot_check``) compares the slots with the cache's
host sources, and the exactness probe (``probes.exactness``) builds its reference from the same
sources: neither can see a source that differs from what vLLM's engine without the cache
holds. This compares the sources with that engine itself. Each engine of a gpt-oss run
(``e2e.py run``, MXFP4 layers on the OpenAI-Triton path) reports, for every MoE layer, a
digest (``trace.digest``) of each expert's byte range of each tensor the kernel reads after
vLLM's conversion: the swizzled values and scales and the float32 biases. In the cache's
engine they are its host sources (``provider.source_weights``), in no offload's the layer's
own converted tensors (``rowcache.vllm.mxfp4_slots.expert_rows``). :func:`compare` lists the
experts whose digests differ.

Layers of any other method are counted as skipped. torch is imported when a function runs
(``probes``' rule).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEYS", "compare", "digests"]

KEYS = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")
"""The tensors of a gpt-oss MoE layer the kernel reads, as the cache's sources name them."""

_MXFP4_METHODS = ("GptOssMxfp4MoEMethod", "RowcacheGptOssMxfp4MoEMethod")


def _layer_rows(method: Any, module: Any, device: str) -> dict[str, Any] | None:
    """Each of :data:`KEYS`' ``[E, n]`` rows (a tensor without biases left out), None for a
    layer of another method or of another backend than the OpenAI-Triton one."""
    if type(method).__name__ not in _MXFP4_METHODS:
        return None
    provider = getattr(method, "rowcache_provider", None)
    if provider is not None:
        rows = {}
        for key in KEYS:
            if key.endswith("_bias") and getattr(provider, f"buf_{key}", None) is None:
                continue
            rows[key] = provider.source_weights(key, device)
        return rows
    import torch

    from rowcache.vllm.mxfp4_slots import expert_rows

    if isinstance(module.w13_weight, torch.Tensor):
        return None  # another backend's plain tensors (Marlin's, for UVA): not this layout
    own = {
        "w13": module.w13_weight.storage.data,
        "w2": module.w2_weight.storage.data,
        "w13_scale": method.w13_precision_config.weight_scale.storage.data,
        "w2_scale": method.w2_precision_config.weight_scale.storage.data,
    }
    for key in ("w13_bias", "w2_bias"):
        bias = getattr(module, key, None)
        if bias is not None:
            own[key] = bias.data
    return {key: expert_rows(t) for key, t in own.items()}


def digests(model: Any, device: str = "cuda") -> dict[str, Any]:
    """``{"layers": {name: {key: [digest of expert 0, ...]}}, "skipped": n}`` over the model's
    MoE layers (module docstring)."""
    from tools.vllm.harness import trace

    layers: dict[str, dict[str, list[int]]] = {}
    skipped = 0
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "w13_weight"):
            continue
        rows = _layer_rows(method, module, device)
        if rows is None:
            skipped += 1
            continue
        layers[name] = {
            key: [int(trace.digest(row).item()) for row in t.to(device)] for key, t in rows.items()
        }
    return {"layers": layers, "skipped": skipped}


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The experts whose digests differ between two engines' :func:`digests`: ``{"layers":
    compared, "expert_tensors": compared, "differing": [[layer, key, expert], ...] (in layer, key,
    expert order), "unmatched": [layers or tensors only one side has]}``."""
    differing: list[list[Any]] = []
    unmatched: list[str] = []
    compared = tensors = 0
    for name, mine in ours["layers"].items():
        other = theirs["layers"].get(name)
        if other is None:
            unmatched.append(name)
            continue
        compared += 1
        for key in sorted(set(mine) | set(other)):
            if key not in mine or key not in other or len(mine[key]) != len(other[key]):
                unmatched.append(f"{name} {key}")
                continue
            tensors += len(mine[key])
            differing += [
                [name, key, e]
                for e, (a, b) in enumerate(zip(mine[key], other[key], strict=True))
                if a != b
            ]
    unmatched += [name for name in theirs["layers"] if name not in ours["layers"]]
    return {
        "layers": compared,
        "expert_tensors": tensors,
        "differing": differing,
        "unmatched": unmatched,
    }
