"""Functions an engine runs where its model is, through ``llm.apply_model(fn)``.

In a multi-process engine they run in the engine-core process (vLLM pickles the function
there, by reference to this module, and the result back), so this module imports nothing
beyond the standard library at import time.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


def probe(model: Any) -> dict[str, Any]:
    """GPU memory and where the expert weights live."""
    import torch

    from rowcache.vllm import expert_cache_stats

    expert_param_bytes = 0
    segments = device_segments(torch.cuda.memory_snapshot())  # type: ignore[no-untyped-call]
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "w13_weight"):
            continue
        if getattr(method, "rowcache_provider", None) is not None:
            continue  # host-backed (device views of pinned memory): no GPU memory
        for pname in ("w13_weight", "w2_weight"):
            p = torch_tensor(getattr(module, pname, None))
            if p is not None and p.is_cuda and in_segments(p.data_ptr(), segments):
                expert_param_bytes += p.numel() * p.element_size()
    stats = expert_cache_stats(model)
    slot_bytes = sum(int(s["slot_bytes"]) for s in stats)
    host_bytes = sum(int(s["host_bytes"]) for s in stats)
    return {
        **pinned_host_memory(model),
        "pid": os.getpid(),
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "expert_gpu_bytes": expert_param_bytes + slot_bytes,
        "expert_host_bytes": host_bytes,
        "cached_layers": len(stats),
        "method": sorted(
            {
                type(getattr(m, "quant_method", None)).__name__
                for _n, m in model.named_modules()
                if hasattr(m, "w13_weight")
            }
        ),
        "moe_backend": moe_backends(model),
    }


def device_segments(snapshot: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The address ranges of GPU memory that torch's caching allocator holds, sorted, from
    ``torch.cuda.memory_snapshot()``: where every weight vLLM puts on the GPU lives."""
    return sorted((int(s["address"]), int(s["address"]) + int(s["total_size"])) for s in snapshot)


def in_segments(address: int, segments: list[tuple[int, int]]) -> bool:
    """Whether ``address`` is in GPU memory (one of ``segments``). A CUDA tensor elsewhere is a
    device view of pinned host memory (vLLM's UVA offload makes its offloaded weights so): its
    bytes cross the link at every read and take no GPU memory."""
    at = bisect.bisect_right(segments, (address, 1 << 64)) - 1
    return at >= 0 and segments[at][0] <= address < segments[at][1]


def torch_tensor(value: Any) -> Any:
    """The torch tensor behind a layer's weight: the weight itself, or the storage of a
    ``triton_kernels`` tensor (vLLM's MXFP4 methods replace ``w13_weight`` with one, which has
    no ``is_cuda``); ``None`` for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    data = getattr(getattr(value, "storage", None), "data", None)
    return data if isinstance(data, torch.Tensor) else None


def pinned_host_memory(model: Any) -> dict[str, Any]:
    """What the process pins, as PyTorch's caching host allocator counts it (where the
    plugin's and vLLM's pinned tensors come from), of that what the plugin's two arenas hold
    (``rowcache.pinned``), and how many MoE layers hold their
    ``w13_weight`` on the meta device (released: the cache's planes hold the experts)."""
    import torch

    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    stats: dict[str, Any] = stats_of() if stats_of is not None else {}
    released = sum(
        1
        for _name, module in model.named_modules()
        if getattr(getattr(module, "w13_weight", None), "is_meta", False)
    )
    from rowcache.pinned import pinned_memory

    # The arenas' slabs are part of the allocator's bytes: what they do not hold is vLLM's and
    # torch's own (or a block the allocator cached after an arena let go of it).
    arenas = pinned_memory()
    return {
        "host_pinned_bytes": stats.get("allocated_bytes.current"),
        "host_pinned_active_bytes": stats.get("active_bytes.current"),
        "host_pinned_arena_bytes": arenas["arena_bytes"],
        "host_pinned_transient_bytes": arenas["transient_bytes"],
        "released_layers": released,
    }


def backend_of(method: Any) -> str:
    """The MoE backend a method chose and the experts class its kernel runs, e.g.
    ``TRITON/TritonExperts``: vLLM 0.25.0's ``Fp8MoEMethod`` and ``Fp8PerTensorOnlineMoEMethod``
    keep it in ``fp8_backend``, ``UnquantizedFusedMoEMethod`` in ``unquantized_backend``
    (each beside ``experts_cls``); the kernel's ``fused_experts`` is what runs."""
    backend = getattr(method, "fp8_backend", None) or getattr(method, "unquantized_backend", None)
    kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    experts = type(kernel) if kernel is not None else getattr(method, "experts_cls", None)
    name = getattr(backend, "name", None) or ("?" if backend is None else str(backend))
    return f"{name}/{getattr(experts, '__name__', '?')}"


def moe_backends(model: Any) -> dict[str, int]:
    """:func:`backend_of` every MoE layer's method, counted."""
    counts: dict[str, int] = {}
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "w13_weight"):
            continue
        found = backend_of(method)
        counts[found] = counts.get(found, 0) + 1
    return counts


def identity_expert_map(model: Any) -> int:
    """Give every MoE layer without a cache the identity expert_map.

    vLLM then calls the same Triton path as a cached layer (expert ids mapped through a map),
    so a no-cache run and a cache run differ only by where the weights come from.
    """
    import torch

    count = 0
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if (
            method is None
            or not hasattr(module, "w13_weight")
            or not hasattr(module, "_expert_map")
        ):
            continue
        if getattr(method, "rowcache_provider", None) is not None:
            continue
        experts = int(module.global_num_experts)
        module._expert_map = torch.arange(
            experts, dtype=torch.int32, device=module.w13_weight.device
        )
        count += 1
    return count


def stats(model: Any) -> list[dict[str, Any]]:
    """The provider stats of every cached layer."""
    from rowcache.vllm import expert_cache_stats

    return expert_cache_stats(model)


def slot_check(model: Any) -> dict[str, Any]:
    """Every cached layer's resident slots against their host bytes
    (``rowcache.vllm.expert_cache_slot_check``): layers, slots and mismatches."""
    from rowcache.vllm import expert_cache_slot_check

    return expert_cache_slot_check(model)


def first_moe_method(model: Any) -> Any:
    """The first MoE layer's method (an object: in-process engines only)."""
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(module, "w13_weight"):
            return method
    raise RuntimeError("no MoE layer with w13_weight found")


def route_of(device_planned: bool, split: str | None, tap: str | None, inexact: bool) -> str:
    """Which route a cached layer's steps took, from what the plugin leaves on its objects:
    a step cut by experts (every multi-pass step of the device planner; the host planner's
    expert split) is exact when the layer kernel's ``TritonExperts`` carries the plugin's
    ``moe_sum`` tap (``_MoeSumTap``, installed on the first such forward), and sums its passes
    in float32 when the plugin said so (its one warning, ``_inexact_said``)."""
    if not device_planned and split == "token":
        return "exact: token split (each row in one kernel call)"
    if tap == "_MoeSumTap":
        return "exact: passes' unreduced entries, one moe_sum per step"
    if tap == "MaskedSumTap":
        return "exact: passes' unreduced entries, one masked_moe_sum per step"
    if inexact:
        return "INEXACT: float32 sum of the passes' outputs"
    return "unknown: no cut step has run"


def routes(model: Any) -> dict[str, Any]:
    """The route of every cached layer (:func:`route_of`), counted by route, the planner
    that plans its steps (the provider class's ``planner``: ``device`` for
    ``DevicePlannedProvider``, ``host`` for the others), counted by planner, and how many
    layers hold their experts as bf16 planes (``provider.compressed`` not empty: the
    ``moe_expert_cache_compress`` that served, set or resolved from ``auto``).

    Read from the plugin's private attributes (``RowcacheMoEMethod._inexact_said``, the
    instance attribute ``moe_sum`` of ``moe_kernel.fused_experts``): the plugin does not
    report its route in ``expert_cache_stats`` yet."""
    counts: dict[str, int] = {}
    planners: dict[str, int] = {}
    passes = 0
    planes = 0
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        provider = getattr(method, "rowcache_provider", None)
        if provider is None:
            continue
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        tap = vars(experts).get("moe_sum") if hasattr(experts, "__dict__") else None
        if tap is None and experts is not None:
            # vLLM's OpenAI-Triton experts reduce through a module global, which the MXFP4
            # path taps once for every layer (rowcache.vllm._mxfp4.masked_sum_tap).
            module = sys.modules.get(type(experts).__module__)
            tap = getattr(module, "masked_moe_sum", None)
            tap = tap if type(tap).__name__ == "MaskedSumTap" else None
        device_planned = getattr(provider, "planner", None) == "device"  # the class's own
        route = route_of(
            device_planned,
            getattr(provider, "split", None),
            None if tap is None else type(tap).__name__,
            bool(getattr(method, "_inexact_said", False)),
        )
        counts[route] = counts.get(route, 0) + 1
        planner = "device" if device_planned else "host"
        planners[planner] = planners.get(planner, 0) + 1
        if device_planned:
            passes += int(provider.stats().get("passes", 0))
        planes += bool(getattr(provider, "compressed", ()))
    return {
        "routes": counts,
        "planners": planners,
        "device_passes": passes,
        "planes_layers": planes,
    }


def offloader(model: Any) -> dict[str, Any]:
    """vLLM's weight offloader in this process (``vllm.model_executor.offloader``): its class;
    for the prefetch offloader the layers it offloads and the bytes it saves; for the UVA one
    the bytes it offloaded against its limit, and whether they are pinned and read through
    unified addressing (``vllm/model_executor/offloader/uva.py``)."""
    from vllm.model_executor.offloader.base import get_offloader

    found = get_offloader()
    out: dict[str, Any] = {"offloader": type(found).__name__}
    attrs = (
        "group_size",
        "num_in_group",
        "prefetch_step",
        "total_offloaded_bytes",
        "cpu_offload_bytes",
        "cpu_offload_max_bytes",
        "pin_memory",
        "uva_offloading",
    )
    for attr in attrs:
        if hasattr(found, attr):
            value = getattr(found, attr)
            out[attr] = value if isinstance(value, int | float) else repr(value)
    layers = getattr(found, "module_offloaders", None)
    if layers is not None:
        out["offloaded_layers"] = len(layers)
    return out


EXACTNESS_ROWS = (1, 8, 32, 512, 2048)
"""Rows of the random forwards :func:`exactness` compares: decode batches, and prefill steps
that route to every expert (more passes than one at any slot count below the expert count)."""


def exactness_rows(max_batched_tokens: int) -> tuple[int, ...]:
    """The rows :func:`exactness` compares in an engine that schedules at most
    ``max_batched_tokens`` tokens a step: those of :data:`EXACTNESS_ROWS` it can run, and its
    largest step. More would not be a step of the engine, and vLLM's MoE workspace, sized by
    its largest step and locked after start-up, refuses them (the curve phase's first call:
    512 tokens a step, 2,048 rows asked)."""
    if max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be at least 1, got {max_batched_tokens}")
    rows = [m for m in EXACTNESS_ROWS if m <= max_batched_tokens]  # 1 at least
    if rows[-1] < max_batched_tokens < EXACTNESS_ROWS[-1]:
        rows.append(max_batched_tokens)
    return tuple(rows)


def exactness_in(max_batched_tokens: int) -> Callable[[Any], dict[str, Any]]:
    """:func:`exactness` over :func:`exactness_rows`, for ``llm.apply_model``."""
    return functools.partial(exactness, row_counts=exactness_rows(max_batched_tokens))


def block_fp8_sources(method: Any) -> tuple[Any, Any, Any, Any] | None:
    """A block-scaled FP8 layer's pinned ``(w13, w2, w13 scales, w2 scales)`` (the plugin's
    ``_rowcache_hosts``, by the names ``rowcache.vllm._fp8`` gives them); None for any other
    method (online per-tensor FP8 included: its cut steps are inexact by design)."""
    if type(method).__name__ != "RowcacheFp8MoEMethod":
        return None
    # Imported here: only an engine with FP8 layers has (and needs) vLLM's FP8 modules.
    from rowcache.vllm._fp8 import WEIGHTS, _scale_names

    hosts = method._rowcache_hosts
    w13, w2, w13_scale, w2_scale = (hosts[n] for n in (*WEIGHTS, *_scale_names(method)))
    return w13, w2, w13_scale, w2_scale


def mxfp4_sources(
    method: Any, provider: Any, device: str
) -> tuple[Any, Any, dict[str, Any], dict[str, Any]] | None:
    """A gpt-oss MXFP4 layer's whole expert set as its kernel reads it: ``(w13, w2, w1 fields,
    w2 fields)``, the converted values and the e8m0 scales of every expert (the provider's host
    rows, copied to ``device``) seen with the converted storage's strides and wrapped as the
    plugin wraps its slots (``rowcache.vllm.mxfp4_slots``), and the quant config's weight
    descriptor fields that read them (``scale``: the precision config with the whole set's
    scales; ``bias``: the whole set's float32 biases). None for any other method."""
    if type(method).__name__ != "RowcacheGptOssMxfp4MoEMethod":
        return None
    rows = mxfp4_rows(provider, device)
    return mxfp4_wrapped(method, rows, int(rows["w13"].shape[0]))


def guarded_copy(t: Any) -> Any:
    """A contiguous copy of ``t`` followed by zero bytes, as the slots are
    (``rowcache.sources.SLOT_GUARD_BYTES``)."""
    from tools.vllm.harness.scale_guard import guarded_like

    return guarded_like(t.contiguous())


def mxfp4_rows(provider: Any, device: str) -> dict[str, Any]:
    """Every expert's ``[E, bytes]`` rows of each source ``provider`` has slots for, on
    ``device``, each followed by zeros: the kernel's scale loads run past the last expert and
    must find no NaN byte there (docs/GPT_OSS.md, section 3)."""
    from tools.vllm.harness.slot_buffers import slot_keys

    return {key: guarded_copy(provider.source_weights(key, device)) for key in slot_keys(provider)}


def mxfp4_wrapped(
    method: Any, rows: dict[str, Any], count: int
) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """:func:`mxfp4_sources`'s four over any ``[n, bytes]`` rows by source (``n >= count``:
    the kernel sees ``count`` experts, the rows past them lie in the storage after the last,
    where a read past an expert's range would find them)."""
    # Imported here: only an engine with MXFP4 layers has (and needs) them.
    from rowcache.vllm.mxfp4_slots import rewrapped, slot_view

    def wrap(key: str, wrapper: Any) -> Any:
        return rewrapped(wrapper, slot_view(rows[key], wrapper.storage.data)[:count])

    w13_slots, w2_slots = method._kernel_w
    kept = method.moe_kernel.fused_experts.quant_config
    fields: list[dict[str, Any]] = []
    for key, descriptor in (("w13", kept._w1), ("w2", kept._w2)):
        precision = descriptor.scale
        found = {
            "scale": dataclasses.replace(
                precision, weight_scale=wrap(f"{key}_scale", precision.weight_scale)
            )
        }
        if f"{key}_bias" in rows:
            found["bias"] = rows[f"{key}_bias"][:count]
        fields.append(found)
    return wrap("w13", w13_slots), wrap("w2", w2_slots), fields[0], fields[1]


@contextlib.contextmanager
def whole_set(kernel: Any, w1: dict[str, Any], w2: dict[str, Any]) -> Iterator[None]:
    """For the block below, the kernel's experts read the whole expert set's scales (and
    biases) by expert id instead of the slots vLLM's ``_setup_kernel`` gave them: ``w1`` and
    ``w2`` replace fields of the weight descriptors ``_w1`` and ``_w2`` of vLLM's
    ``FusedMoEQuantConfig`` dataclass (``scale``: block-FP8 scales, or MXFP4's precision
    config; ``bias``). Empty: nothing changes (unquantized layers)."""
    if not w1 and not w2:
        yield
        return
    experts = kernel.fused_experts
    kept = experts.quant_config
    experts.quant_config = dataclasses.replace(
        kept,
        _w1=dataclasses.replace(kept._w1, **w1),
        _w2=dataclasses.replace(kept._w2, **w2),
    )
    try:
        yield
    finally:
        experts.quant_config = kept


@contextlib.contextmanager
def unpinned_tiles(method: Any) -> Iterator[None]:
    """For the block below, a gpt-oss layer's kernel calls choose their tiles as vLLM's own
    do: the plugin pins them from the cached forward that last ran (``_forward_entries``,
    ``rowcache.vllm._mxfp4._pin_tiles``), which the reference is not."""
    kept = getattr(method, "_forward_entries", None)
    if kept is None:
        yield
        return
    method._forward_entries = 0
    try:
        yield
    finally:
        method._forward_entries = kept


@contextlib.contextmanager
def tiles(method: Any, entries: int | None) -> Iterator[None]:
    """For the block below, vLLM's own tiles (``entries`` None: :func:`unpinned_tiles`) or
    those the cached forward pins for a forward of ``entries`` routing entries."""
    if entries is None:
        with unpinned_tiles(method):
            yield
        return
    kept = method._forward_entries
    method._forward_entries = entries
    try:
        yield
    finally:
        method._forward_entries = kept


OPT_FLAGS_LEFT_OUT = ("arch", "target_kernel_kwargs")
"""``OptFlags`` fields :func:`launch_flags` leaves out: the same in every call of one engine."""


def describe_flags(flags: Any) -> str:
    """One ``matmul_ogs`` launch's options (triton_kernels' ``OptFlags`` dataclass) as
    ``name=value`` words in field order."""
    return " ".join(
        f"{f.name}={getattr(flags, f.name)}"
        for f in dataclasses.fields(flags)
        if f.name not in OPT_FLAGS_LEFT_OUT
    )


@contextlib.contextmanager
def launch_flags(experts: Any) -> Iterator[list[str] | None]:
    """The launch options every ``matmul_ogs`` call picks in the block below, in call order
    (:func:`describe_flags`): ``make_opt_flags`` wrapped in the module of the ``matmul_ogs``
    that ``experts``' module calls (triton_kernels', for vLLM's OpenAI-Triton experts). None
    where that module has no ``matmul_ogs``. The kernel's name carries only its tiles and
    split; these carry every option, persistence and the fused scatter among them."""
    module = sys.modules.get(type(experts).__module__)
    matmul = getattr(module, "matmul_ogs", None)
    home = sys.modules.get(getattr(matmul, "__module__", None) or "")
    original = getattr(home, "make_opt_flags", None)
    if original is None:
        yield None
        return
    log: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        flags = original(*args, **kwargs)
        log.append(describe_flags(flags))
        return flags

    home.make_opt_flags = recording  # type: ignore[union-attr]
    try:
        yield log
    finally:
        home.make_opt_flags = original  # type: ignore[union-attr]


@dataclasses.dataclass
class WholeSet:
    """A cached layer's whole expert set on the device, as vLLM's kernel reads it without the
    cache: ``w13`` and ``w2`` for its ``apply``, the quant config's weight descriptor fields
    (:func:`whole_set`), and the hidden size its input has."""

    w13: Any
    w2: Any
    w1_fields: dict[str, Any]
    w2_fields: dict[str, Any]
    hidden: int


def reference_weights(method: Any, provider: Any, device: str) -> WholeSet | None:
    """The whole expert set of a cached layer (:class:`WholeSet`), or None for a layer no
    reference is built for. Unquantized layers (``RowcacheMoEMethod``: ``_host`` is its
    ``(w13, w2)`` in pinned host memory; where the plugin released them for planes, the planes
    decoded on ``device``), block-scaled FP8 layers (``RowcacheFp8MoEMethod``: its pinned
    weights and scales, :func:`block_fp8_sources`) and gpt-oss's MXFP4 layers
    (``RowcacheGptOssMxfp4MoEMethod``: :func:`mxfp4_sources`); not online per-tensor FP8, whose
    steps cut into passes are inexact by design."""
    host = getattr(method, "_host", None)
    if host is not None:
        # The layer's own weights: independent of what the provider holds.
        w13, w2 = (t.to(device, non_blocking=False) for t in host)
        return WholeSet(w13, w2, {}, {}, int(w13.shape[2]))
    if getattr(provider, "compressed", ()):
        # The plugin released them (planes hold every bit): the planes decoded.
        w13, w2 = (provider.source_weights(n, device) for n in ("w13", "w2"))
        return WholeSet(w13, w2, {}, {}, int(w13.shape[2]))
    fp8 = block_fp8_sources(method)
    if fp8 is not None:
        w13, w2, w13_scale, w2_scale = (t.to(device, non_blocking=False) for t in fp8)
        return WholeSet(w13, w2, {"scale": w13_scale}, {"scale": w2_scale}, int(w13.shape[2]))
    mxfp4 = mxfp4_sources(method, provider, device)
    if mxfp4 is not None:
        w13, w2, w1_fields, w2_fields = mxfp4
        # A triton_kernels tensor's shape is logical, [E, K, N] (the kernel asserts the
        # hidden states' width is w1.shape[-2]); a torch tensor's is [E, 2I, H].
        return WholeSet(w13, w2, w1_fields, w2_fields, int(w13.shape[-2]))
    return None


def reference_forward(
    method: Any,
    module: Any,
    whole: WholeSet,
    x: Any,
    weights: Any,
    ids: Any,
    expert_map: Any = None,
    entries: int | None = None,
) -> Any:
    """vLLM's kernel of the layer over ``whole`` (by default every expert resident, no expert
    map, its own tiles; ``expert_map`` and ``entries``, the tiles the cached forward pins for
    that many entries, for other layouts: ``harness/placement.py``), on the router's
    ``weights`` and ``ids``; a copy of its output (the kernel may return a view of its
    workspace, which the next call reuses)."""
    kernel = method.moe_kernel
    with whole_set(kernel, whole.w1_fields, whole.w2_fields), tiles(method, entries):
        return kernel.apply(
            hidden_states=x,
            w1=whole.w13,
            w2=whole.w2,
            topk_weights=weights,
            topk_ids=ids,
            activation=module.activation,
            global_num_experts=module.global_num_experts,
            expert_map=expert_map,
            apply_router_weight_on_input=module.apply_router_weight_on_input,
            shared_experts=None,
            shared_experts_input=None,
        ).clone()


def bit_difference(reference: Any, cached: Any) -> tuple[Any, Any]:
    """Whether two bf16 outputs differ in any bit, and their largest absolute difference: two
    0-d tensors on their device (nothing read on the host, so a CUDA graph can capture it)."""
    import torch

    differs = (reference.view(torch.int16) != cached.view(torch.int16)).any()
    return differs, (reference.float() - cached.float()).abs().amax()


POISON_BLOCKS = (
    (512, 256),
    (8 << 10, 256),
    (64 << 10, 128),
    (512 << 10, 64),
    (2 << 20, 32),
    (16 << 20, 8),
)
"""(bytes, count) of the blocks :func:`poison_device_memory` fills and frees: the sizes of the
caching allocator's small pool (up to 1 MiB, carved from 2 MiB segments) and of its large one,
so that its free blocks, which a forward's ``torch.empty`` gets back, are taken first."""


def poison_device_memory(device: str) -> None:
    """Fill with set bits (NaN in every float format) what a forward may read without having
    written it in that call: vLLM's MoE workspace (one buffer every kernel call of every layer
    reuses) and blocks the caching allocator holds free, taken and filled in
    :data:`POISON_BLOCKS`' sizes, then freed. A forward that reads none of it gives the same
    bits before as after; one that does gives NaN or other bits, where run just after
    another call of the same shape it would read that call's values."""
    import torch

    try:
        from vllm.v1.worker.workspace import (
            current_workspace_manager,
            is_workspace_manager_initialized,
        )
    except ImportError:  # a vLLM without the workspace manager: nothing of it to fill
        pass
    else:
        if is_workspace_manager_initialized():
            # vLLM made the buffer in a forward, under inference mode: an inference tensor,
            # which torch lets only inference mode write in place (this probe runs outside).
            with torch.inference_mode():
                for buffer in current_workspace_manager()._current_workspaces:
                    if buffer is not None:
                        buffer.view(torch.uint8).fill_(0xFF)
    taken = [
        torch.empty(size, dtype=torch.uint8, device=device).fill_(0xFF)
        for size, count in POISON_BLOCKS
        for _ in range(count)
    ]
    del taken


RUNS = ("reference", "cached_first", "reference_poisoned", "cached_after")
"""The runs of one input (:func:`probe_runs`), in order: vLLM's kernel over the whole set on
memory as it is, the cached forward on memory :func:`poison_device_memory` filled, vLLM's kernel
again on poisoned memory (a kernel that reads what it did not write parts from its own first
run), the cached forward just after it (where a forward that reads memory it did not write
finds the kernel's values)."""

POISONED = ("cached_first", "reference_poisoned")
"""The runs :func:`probe_runs` poisons memory before."""

ORDERS = ("first", "after")
"""The cached forward's two runs as :func:`exactness` reports them (``cached_<order>`` of
:data:`RUNS`)."""


def default_poison(device: str) -> Callable[[], None]:
    """:func:`poison_device_memory` on a CUDA ``device``; nothing elsewhere (the CPU tests pass
    their own)."""
    import torch

    if torch.device(device).type == "cuda":
        return functools.partial(poison_device_memory, device)
    return lambda: None


def probe_runs(
    method: Any,
    module: Any,
    whole: WholeSet,
    inputs: tuple[Any, Any, Any],
    poison: Callable[[], None],
) -> tuple[dict[str, Any], list[str] | None, list[str] | None]:
    """One input ``(x, weights, ids)`` of a cached layer run as :data:`RUNS` says: each run's
    output (a copy) by name, and the launch options (:func:`launch_flags`) of the first
    reference's ``matmul_ogs`` calls and of both cached runs' (None where the kernel calls
    none)."""
    x, weights, ids = inputs
    provider = method.rowcache_provider
    experts = method.moe_kernel.fused_experts
    outputs: dict[str, Any] = {}
    reference_flags: list[str] | None = None
    cached_flags: list[str] | None = None
    for run in RUNS:
        if run in POISONED:
            poison()
        with launch_flags(experts) as logged:
            if run.startswith("reference"):
                outputs[run] = reference_forward(method, module, whole, x, weights, ids)
            else:
                out = method._cached_apply(provider, module, x, weights, ids, None, None)
                outputs[run] = out.clone()
        if logged is None:
            continue
        if run == "reference":
            reference_flags = logged
        elif run.startswith("cached"):
            cached_flags = [*(cached_flags or []), *logged]
    return outputs, reference_flags, cached_flags


def larger_gap(so_far: float, gap: Any) -> float:
    """The larger of ``so_far`` and the 0-d ``gap``; NaN where either is (``max`` would keep
    ``so_far`` over a NaN, hiding a difference no number measures)."""
    value = float(gap.item())
    return value if math.isnan(value) or value > so_far else so_far


def exactness(
    model: Any,
    device: str = "cuda",
    row_counts: tuple[int, ...] = EXACTNESS_ROWS,
    poison: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Each cached layer's forward against vLLM's own kernel with every expert resident, in the
    engine, bit for bit: random hidden states and routings of :data:`EXACTNESS_ROWS` rows, the
    cached forward through the plugin (its passes, the tapped reduction, the pinned tile
    configuration), the reference through the layer's kernel over the whole expert set copied
    from the host to the GPU (:func:`reference_weights`, :func:`reference_forward`: the
    reference reads the whole set's scales and biases in place of the slots, with vLLM's own
    tiles). Independent of how two engines compile (their tokens can differ without any
    cache). Layers :func:`reference_weights` builds no reference for are counted as skipped.

    The cached forward runs twice (:func:`probe_runs`): first after ``poison`` (default:
    :func:`default_poison`), then just after the reference's second run. A layer is equal
    where both runs give the first reference's bits: the second alone would miss a forward
    that reads what it did not write, since the reference has just written the right values
    there. The reference runs twice too, on memory as it is and after ``poison``
    (``kernel_again``: layers where both give the same bits, their largest difference, and
    layers where either holds a NaN or infinity): vLLM's kernel reading memory it did not
    write parts from itself.

    ``{"rows": [...], "layers": n, "equal": {rows: layers bit-identical}, "max_abs": {rows:
    largest difference}, "by_order": {order: {"equal": {rows: n}, "max_abs": {rows: d},
    "non_finite": {rows: layers whose output holds a NaN or infinity}}}, "kernel_again":
    {"equal", "max_abs", "non_finite": {rows: ...}}, "missed_with_last_expert": {rows: layers
    not equal whose routes held the last expert}, "skipped": n}`` (a difference no number
    measures, a NaN, makes ``max_abs`` NaN),
    and where the kernel calls ``matmul_ogs`` (:func:`launch_flags`) ``"launch_flags": {rows:
    {"reference": [...], "cached": [...], "layers_differing": n}}``: the distinct launch
    options of the reference's calls and of the cached forward's (every pass, both runs),
    over the layers, and how many layers' two sets differ. ``device`` and ``row_counts``: the
    CPU tests run it on fakes, with seeded inexact routes and a seeded read of a stale
    workspace entry it must catch."""
    import torch

    equal: dict[str, int] = {str(m): 0 for m in row_counts}
    max_abs: dict[str, float] = {str(m): 0.0 for m in row_counts}
    by_order: dict[str, dict[str, dict[str, Any]]] = {
        order: {
            "equal": {str(m): 0 for m in row_counts},
            "max_abs": {str(m): 0.0 for m in row_counts},
            "non_finite": {str(m): 0 for m in row_counts},
        }
        for order in ORDERS
    }
    last_routed: dict[str, int] = {str(m): 0 for m in row_counts}
    kernel: dict[str, dict[str, Any]] = {
        "equal": {str(m): 0 for m in row_counts},
        "max_abs": {str(m): 0.0 for m in row_counts},
        "non_finite": {str(m): 0 for m in row_counts},
    }
    flags: dict[str, dict[str, Any]] = {}
    layers = skipped = 0
    gen = torch.Generator(device=device).manual_seed(0)
    cuda = torch.device(device).type == "cuda"
    poison = default_poison(device) if poison is None else poison
    for _name, module in model.named_modules():
        method: Any = getattr(module, "quant_method", None)
        provider = getattr(method, "rowcache_provider", None)
        if method is None or provider is None:
            continue
        whole = reference_weights(method, provider, device)
        if whole is None:
            skipped += 1
            continue
        layers += 1
        experts_total = int(whole.w13.shape[0])
        top_k = int(method.moe.experts_per_token)
        for rows in row_counts:
            x = torch.randn(rows, whole.hidden, device=device, generator=gen, dtype=torch.bfloat16)
            logits = torch.randn(rows, experts_total, device=device, generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            ids = ids.to(torch.int32)
            outputs, reference_flags, cached_flags = probe_runs(
                method, module, whole, (x, weights, ids), poison
            )
            if cuda:
                torch.cuda.synchronize()
            reference = outputs["reference"]
            again = outputs["reference_poisoned"]
            differs, gap = bit_difference(reference, again)
            kernel["equal"][str(rows)] += not bool(differs.item())
            kernel["max_abs"][str(rows)] = larger_gap(kernel["max_abs"][str(rows)], gap)
            kernel["non_finite"][str(rows)] += not bool(
                (
                    torch.isfinite(reference.float()).all() & torch.isfinite(again.float()).all()
                ).item()
            )
            both = True
            for order in ORDERS:
                cached = outputs[f"cached_{order}"]
                differs, gap = bit_difference(reference, cached)
                same = not bool(differs.item())
                both = both and same
                found_order = by_order[order]
                found_order["equal"][str(rows)] += same
                found_order["max_abs"][str(rows)] = larger_gap(
                    found_order["max_abs"][str(rows)], gap
                )
                found_order["non_finite"][str(rows)] += not bool(
                    torch.isfinite(cached.float()).all().item()
                )
                max_abs[str(rows)] = larger_gap(max_abs[str(rows)], gap)
            equal[str(rows)] += both
            if not both:
                # A kernel reading past its weights' last expert parts only where that
                # expert is routed: count the layers that missed with it routed.
                last_routed[str(rows)] += bool((ids == experts_total - 1).any().item())
            if reference_flags is not None and cached_flags is not None:
                seen = flags.setdefault(
                    str(rows), {"reference": set(), "cached": set(), "layers_differing": 0}
                )
                seen["reference"].update(reference_flags)
                seen["cached"].update(cached_flags)
                seen["layers_differing"] += set(reference_flags) != set(cached_flags)
        del whole
        if cuda:
            torch.cuda.empty_cache()
    found: dict[str, Any] = {
        "rows": list(row_counts),
        "layers": layers,
        "equal": equal,
        "max_abs": max_abs,
        "by_order": by_order,
        "kernel_again": kernel,
        "missed_with_last_expert": last_routed,
        "skipped": skipped,
    }
    if flags:
        found["launch_flags"] = {
            rows: {
                "reference": sorted(seen["reference"]),
                "cached": sorted(seen["cached"]),
                "layers_differing": seen["layers_differing"],
            }
            for rows, seen in flags.items()
        }
    return found
