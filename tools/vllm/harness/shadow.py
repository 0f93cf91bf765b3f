"""The shadow check: every cached forward of an engine beside vLLM's kernel over the whole set.

``probes.exactness`` compares each cached layer with vLLM's kernel over every expert on random
routes, eagerly, after the measurements. The shadow check compares the forwards the engine
itself runs: with ``install()`` called before the engine is built (``e2e.py run --shadow``),
every cached forward first runs the layer's reference (``probes.reference_forward`` over the
whole expert set, kept on the GPU from the layer's first forward), then the cached forward, and
counts on the device whether the two differ in any bit, by how the forward ran (``eager``, or
``captured`` into a CUDA graph and then replayed) and by its rows (:data:`ROW_BOUNDS`). Nothing
is read on the host during a forward, so the comparison is captured with the forward and runs
at every replay: what differs only in the captured path, or only on the router's own routes,
shows here. ``counts(model)`` reads the counters (through ``llm.apply_model``), and
``uninstall()`` then takes the check off: its counters take no forward outside vLLM's inference
mode, where the exactness probe runs.

The reference runs beside every forward and holds every expert on the GPU: an engine under the
shadow check is a diagnostic, its speeds and memory are not the cache's, and what depends on
them may change under it (gpt-oss's half met no offload's tokens under the check and not
without it, docs/records/2026-12-06-shadow-skew-uva.md; ``harness/trace.py`` compares two
engines without changing what either computes). The hook patches the
plugin's class in this process, so the engine core must run here
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the harness's default for these engines). Layers with
shared experts, and layers ``probes.reference_weights`` builds no reference for, are counted as
skipped. torch is imported when the hook runs, not at import time (``probes``' rule).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tools.vllm.harness import probes

__all__ = ["MODES", "ROW_BOUNDS", "counts", "install", "installed", "uninstall"]

ROW_BOUNDS = (1, 8, 64, 512)
"""Upper bounds of the row buckets a forward is counted in (a last bucket takes the rest):
decode at batch 1 and up to 8, then prefill steps."""

MODES = ("eager", "captured")

_ATTRIBUTE = "_rowcache_shadow"
"""Where a method keeps its :class:`LayerShadow`."""


def bucket_of(rows: int) -> int:
    """The bucket of a forward of ``rows`` rows (:data:`ROW_BOUNDS`)."""
    for index, bound in enumerate(ROW_BOUNDS):
        if rows <= bound:
            return index
    return len(ROW_BOUNDS)


def bucket_names() -> list[str]:
    """The buckets' names, in :func:`bucket_of`'s order: ``1``, ``2-8``, ..., ``513+``."""
    names, low = [], 1
    for bound in ROW_BOUNDS:
        names.append(str(bound) if bound == low else f"{low}-{bound}")
        low = bound + 1
    return [*names, f"{low}+"]


@dataclasses.dataclass
class LayerShadow:
    """One layer's reference and counters: ``forwards`` and ``differing`` ([mode, bucket],
    int64), ``max_abs`` ([mode, bucket], float32), on the layer's device. None ``whole``: the
    layer is not checked (``skipped`` says why)."""

    whole: probes.WholeSet | None
    forwards: Any = None
    differing: Any = None
    max_abs: Any = None
    skipped: str = ""
    first: FirstDiffering | None = None


@dataclasses.dataclass
class FirstDiffering:
    """The inputs of a layer's first forward whose bits differed, kept on the device for an
    eager replay (:func:`counts`): ``x``, ``ids`` and ``weights`` sized for the layer's first
    forward (vLLM's profile run, its largest step; a larger forward is not kept), with the two
    outputs it compared (``reference``, ``cached``, shaped as ``x``), ``rows`` and ``mode``
    (index into :data:`MODES`) of the forward kept, ``kept`` 1 once one is."""

    x: Any
    ids: Any
    weights: Any
    reference: Any
    cached: Any
    rows: Any
    mode: Any
    kept: Any

    @classmethod
    def like(cls, x: Any, ids: Any, weights: Any) -> FirstDiffering:
        import torch

        def scalar() -> Any:
            return torch.zeros((), dtype=torch.int64, device=x.device)

        return cls(
            torch.zeros_like(x),
            torch.zeros_like(ids),
            torch.zeros_like(weights),
            torch.zeros_like(x),
            torch.zeros_like(x),
            scalar(),
            scalar(),
            scalar(),
        )

    def keep(
        self, differs: Any, inputs: tuple[Any, Any, Any], outputs: tuple[Any, Any], mode: int
    ) -> None:
        """Keep these ``inputs`` (``x, ids, weights``) and ``outputs`` (``reference,
        cached``) if the forward differs and none is kept yet: elementwise selects on the
        device, nothing read on the host (captured with the forward)."""
        import torch

        x, ids, weights = inputs
        reference, cached = outputs
        rows = int(x.shape[0])
        if rows > self.x.shape[0] or ids.dtype != self.ids.dtype:
            return
        if reference.shape != x.shape or reference.dtype != x.dtype:
            return
        take = differs & (self.kept == 0)
        pairs = (
            (self.x, x),
            (self.ids, ids),
            (self.weights, weights),
            (self.reference, reference),
            (self.cached, cached),
        )
        for kept, new in pairs:
            kept[:rows] = torch.where(take, new, kept[:rows])
        self.rows.copy_(torch.where(take, rows, self.rows))
        self.mode.copy_(torch.where(take, mode, self.mode))
        self.kept.copy_(torch.where(take, 1, self.kept))


def capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (False without CUDA)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _layer_shadow(
    method: Any, provider: Any, x: Any, ids: Any, weights: Any, shared: Any
) -> LayerShadow:
    """The layer's :class:`LayerShadow`, built at its first cached forward (vLLM's profile run,
    before any capture: the counters must not be allocated inside one)."""
    found: LayerShadow | None = vars(method).get(_ATTRIBUTE)
    if found is not None:
        return found
    import torch

    if capturing():
        raise RuntimeError(
            "shadow check: a cached layer's first forward is being captured into a CUDA "
            "graph; its counters must exist before (install the check before the engine)"
        )
    if shared is not None:
        found = LayerShadow(None, skipped="shared experts")
    else:
        whole = probes.reference_weights(method, provider, str(x.device))
        found = LayerShadow(whole, skipped="" if whole is not None else "no reference")
    if found.whole is not None:
        shape = (len(MODES), len(ROW_BOUNDS) + 1)
        found.forwards = torch.zeros(shape, dtype=torch.int64, device=x.device)
        found.differing = torch.zeros(shape, dtype=torch.int64, device=x.device)
        found.max_abs = torch.zeros(shape, dtype=torch.float32, device=x.device)
        found.first = FirstDiffering.like(x, ids, weights)
    vars(method)[_ATTRIBUTE] = found
    return found


def _count(
    shadow: LayerShadow,
    reference: Any,
    cached: Any,
    captured: bool,
    inputs: tuple[Any, Any, Any],
) -> None:
    """Add one forward to the counters and keep its ``inputs`` (``x, ids, weights``) if it is
    the layer's first to differ, on the device (captured with the forward)."""
    import torch

    cell = (MODES.index("captured" if captured else "eager"), bucket_of(int(cached.shape[0])))
    differs, gap = probes.bit_difference(reference, cached)
    shadow.forwards[cell] += 1
    shadow.differing[cell] += differs.to(torch.int64)
    shadow.max_abs[cell] = torch.maximum(shadow.max_abs[cell], gap)
    if shadow.first is not None:
        shadow.first.keep(differs, inputs, (reference, cached), cell[0])


_UNSHADOWED = "_unshadowed"
"""The attribute of the wrapped forward that holds the plugin's own (for the replay)."""


def install() -> None:
    """Wrap the plugin's cached forward (``CachedForward._cached_apply``) in this process with
    the shadow check; a second call changes nothing."""
    from rowcache.vllm._method import CachedForward

    original = CachedForward._cached_apply
    if hasattr(original, _UNSHADOWED):
        return

    def shadowed(
        self: Any,
        provider: Any,
        layer: Any,
        x: Any,
        topk_weights: Any,
        topk_ids: Any,
        shared_experts: Any,
        shared_experts_input: Any,
    ) -> Any:
        shadow = _layer_shadow(self, provider, x, topk_ids, topk_weights, shared_experts)
        reference = None
        if shadow.whole is not None:
            # Before the cached forward: the input is as the layer got it.
            reference = probes.reference_forward(
                self, layer, shadow.whole, x, topk_weights, topk_ids
            )
        out = original(
            self, provider, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
        )
        if reference is not None:
            _count(shadow, reference, out, capturing(), (x, topk_ids, topk_weights))
        return out

    setattr(shadowed, _UNSHADOWED, original)
    CachedForward._cached_apply = shadowed  # type: ignore[method-assign]


def uninstall() -> None:
    """Give the plugin's cached forward back its own ``_cached_apply`` (after :func:`counts`):
    the counters are inference tensors of vLLM's forwards, and a forward outside inference mode
    (``probes.exactness`` through ``llm.apply_model``) could not add to them. Graphs captured
    before keep the check they captured. Nothing happens where it is not installed."""
    from rowcache.vllm._method import CachedForward

    original = getattr(CachedForward._cached_apply, _UNSHADOWED, None)
    if original is not None:
        CachedForward._cached_apply = original  # type: ignore[method-assign]


def installed() -> bool:
    """Whether :func:`install` has wrapped the plugin's cached forward in this process."""
    from rowcache.vllm._method import CachedForward

    return hasattr(CachedForward._cached_apply, _UNSHADOWED)


def counts(model: Any) -> dict[str, Any]:
    """The shadow check's counters over the model's cached layers: ``{"layers": checked,
    "skipped": {why: n}, "buckets": [names], "by": {mode: {bucket: {"forwards", "differing",
    "layers_differing", "max_abs"}}}, "first_differing": [up to 5 layer names], "replays":
    [each of those layers' first differing forward run again eagerly, :func:`replay`]}``; a
    layer that never ran a cached forward counts as skipped ("no forward"). Read the counters
    before anything else runs a forward: the replays move the cache."""
    import torch

    names = bucket_names()
    by: dict[str, dict[str, dict[str, Any]]] = {
        mode: {
            name: {"forwards": 0, "differing": 0, "layers_differing": 0, "max_abs": 0.0}
            for name in names
        }
        for mode in MODES
    }
    layers = 0
    skipped: dict[str, int] = {}
    replays: list[dict[str, Any]] = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "rowcache_provider", None) is None:
            continue
        shadow: LayerShadow | None = vars(method).get(_ATTRIBUTE)
        if shadow is None or shadow.whole is None:
            why = "no forward" if shadow is None else shadow.skipped
            skipped[why] = skipped.get(why, 0) + 1
            continue
        layers += 1
        if shadow.forwards.is_cuda:
            torch.cuda.synchronize(shadow.forwards.device)
        forwards = shadow.forwards.tolist()
        differing = shadow.differing.tolist()
        gaps = shadow.max_abs.tolist()
        for m, mode in enumerate(MODES):
            for b, bucket in enumerate(names):
                cell = by[mode][bucket]
                cell["forwards"] += forwards[m][b]
                cell["differing"] += differing[m][b]
                cell["layers_differing"] += differing[m][b] > 0
                cell["max_abs"] = max(cell["max_abs"], float(gaps[m][b]))
        if any(v for row in differing for v in row) and len(replays) < 5:
            replays.append({"layer": name, **replay(method, module, shadow)})
    return {
        "layers": layers,
        "skipped": skipped,
        "buckets": names,
        "by": by,
        "first_differing": [r["layer"] for r in replays],
        "replays": replays,
    }


def replay(method: Any, module: Any, shadow: LayerShadow) -> dict[str, Any]:
    """The layer's first differing forward (:class:`FirstDiffering`) run again eagerly, the
    plugin's cached forward (unwrapped) beside the reference, on its kept inputs: whether it
    differs again tells a route that the forward gets wrong wherever it runs from one that
    only the forward's first run got wrong (captured, or with the cache's state of then).
    ``{"kept": False}`` where the forward was larger than the first one (nothing kept).

    ``then_reference_differs`` and ``then_cached_differs``: whether the side's output of the
    forward kept differs from its output now (where the replay is exact, the side that erred
    then). Where it differs again, what is to blame: ``reference_repeat_differs`` (vLLM's
    kernel run twice on the same inputs gives other bits: the kernel is not deterministic),
    ``cached_repeat_differs`` (likewise the cached forward, whose second run meets the cache in
    the state its first left: the exact route's bits do not depend on it),
    ``whole_set_changed`` (the experts whose bytes in the reference's whole set, copied at the
    layer's first forward, differ from a copy of the provider's sources made now, by tensor)
    and ``fresh_replay_differs`` (the cached forward against the reference over that fresh
    copy)."""

    kept = shadow.first
    if kept is None or int(kept.kept.item()) == 0:
        return {"kept": False}
    assert shadow.whole is not None
    rows = int(kept.rows.item())
    x, ids, weights = kept.x[:rows], kept.ids[:rows], kept.weights[:rows]
    from rowcache.vllm._method import CachedForward

    forward = getattr(CachedForward._cached_apply, _UNSHADOWED, CachedForward._cached_apply)

    def cached() -> Any:
        return forward(method, method.rowcache_provider, module, x, weights, ids, None, None)

    def reference(whole: probes.WholeSet) -> Any:
        return probes.reference_forward(method, module, whole, x, weights, ids)

    first_reference = reference(shadow.whole)
    first_cached = cached()
    differs, gap = probes.bit_difference(first_reference, first_cached)
    found: dict[str, Any] = {
        "kept": True,
        "rows": rows,
        "mode": MODES[int(kept.mode.item())],
        "ids": kept.ids[: min(rows, 8)].tolist(),
        "replay_differs": bool(differs.item()),
        "replay_max_abs": float(gap.item()),
    }
    # Which side gave other bits the first time: a side that differs from itself now.
    found["then_reference_differs"] = bool(
        probes.bit_difference(kept.reference[:rows], first_reference)[0].item()
    )
    found["then_cached_differs"] = bool(
        probes.bit_difference(kept.cached[:rows], first_cached)[0].item()
    )
    found["reference_repeat_differs"] = bool(
        probes.bit_difference(first_reference, reference(shadow.whole))[0].item()
    )
    found["cached_repeat_differs"] = bool(probes.bit_difference(first_cached, cached())[0].item())
    fresh = probes.reference_weights(method, method.rowcache_provider, str(x.device))
    if fresh is not None:
        found["whole_set_changed"] = changed_experts(shadow.whole, fresh)
        fresh_differs, fresh_gap = probes.bit_difference(reference(fresh), first_cached)
        found["fresh_replay_differs"] = bool(fresh_differs.item())
        found["fresh_replay_max_abs"] = float(fresh_gap.item())
    return found


def _torch_tensor(value: Any) -> Any:
    """The torch tensor under a whole set's entry: itself, a triton_kernels wrapper's storage,
    or a precision config's ``weight_scale``'s; None for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    storage = getattr(value, "storage", None)
    if storage is not None and isinstance(getattr(storage, "data", None), torch.Tensor):
        return storage.data
    scale = getattr(value, "weight_scale", None)
    return None if scale is None else _torch_tensor(scale)


def whole_set_tensors(whole: probes.WholeSet) -> dict[str, Any]:
    """A whole set's torch tensors by name (``w13``, ``w2``, ``w13.scale``, ``w2.bias``, ...),
    each with the experts as its first dimension."""
    named = {"w13": whole.w13, "w2": whole.w2}
    for key, fields in (("w13", whole.w1_fields), ("w2", whole.w2_fields)):
        named.update({f"{key}.{field}": value for field, value in fields.items()})
    tensors = {name: _torch_tensor(value) for name, value in named.items()}
    return {name: t for name, t in tensors.items() if t is not None}


def changed_experts(before: probes.WholeSet, after: probes.WholeSet) -> dict[str, list[int]]:
    """The experts whose bytes differ between two copies of a whole set, by tensor (a tensor
    whose shape or dtype differs: every expert)."""
    import torch

    old, new = whole_set_tensors(before), whole_set_tensors(after)
    changed: dict[str, list[int]] = {}
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            count = max(int(t.shape[0]) for t in (a, b) if t is not None)
            changed[name] = list(range(count))
            continue
        experts = int(a.shape[0])

        def rows(t: Any, n: int = experts) -> Any:
            return t.contiguous().view(torch.uint8).reshape(n, -1)

        differ = (rows(a) != rows(b)).any(dim=1).nonzero().flatten().tolist()
        if differ:
            changed[name] = differ
    return changed
