"""The real input of each cached layer's first traced forward, run again at the end of a run.

The layer trace (``harness/trace.py``) names the first forward where a cache engine's MoE op
parts from no offload's with the same input and routes, and keeps, in each layer, the input of
its first forward that ran eagerly while it was on (``trace.kept_inputs``). Here that input
runs four times in the cache engine: vLLM's kernel over the whole expert set built from the
cache's host sources (``probes.reference_forward``), the cached forward on poisoned memory
(``probes.poison_device_memory``), the kernel again on poisoned memory, and the cached forward
just after it (``probes.probe_runs``, as the exactness probe runs its random inputs); and where
the layer
kept a copy of its cache as that forward found it (``harness/first_state.py``), the cached
forward once more from that copy (:data:`FROM_START`), the cache's own state put back after.
Each output's
digest, beside the digest of that forward's output in the no-offload engine's trace
(``probe_lines.replay_line``), says which gives no offload's bits: the kernel over the sources
(are the sources and the kernel no offload's?), the cached forward on its own memory, or only
after the kernel has written its values where the cached forward reads, or only from the
cache's state at the generation's first forward.

torch is imported when a function runs (``probes``' rule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["FROM_START", "first_forwards"]

FROM_START = "cached_from_start"
"""The run from the cache's state at the first forward (after ``probes.RUNS``)."""

IDS_KEPT = 512
"""A kept input's router ids are written out as a list up to this many entries."""


def first_forwards(
    model: Any, device: str = "cuda", poison: Callable[[], None] | None = None
) -> dict[str, Any]:
    """``{"layers": {name: {"rows": n, "x", "ids", "weights": digests of the kept input, and
    one output digest for each of ``probes.RUNS``}}}`` over the cached layers whose first eager
    forward the trace kept (module docstring); a layer that kept its cache's state adds an
    output digest for :data:`FROM_START` and ``"start_state"`` (``first_state.summary``), or
    ``"from_start_error"`` where that run failed; ``"ids_list"``: the router's ids, up to
    :data:`IDS_KEPT` entries."""
    import torch

    from tools.vllm.harness import first_state, probes, trace

    poison = probes.default_poison(device) if poison is None else poison
    layers: dict[str, Any] = {}
    for name, module in model.named_modules():
        kept = trace.kept_inputs(module)
        method: Any = getattr(module, "quant_method", None)
        provider = getattr(method, "rowcache_provider", None)
        if kept is None or provider is None:
            continue
        whole = probes.reference_weights(method, provider, device)
        if whole is None:
            continue
        # Copies made here, outside inference mode: normal tensors, which a kernel may write
        # in place (the kept ones are inference tensors of vLLM's forward).
        x, ids, weights = (t.clone() for t in kept)
        outputs, _, _ = probes.probe_runs(method, module, whole, (x, weights, ids), poison)
        extra: dict[str, Any] = {}
        if ids.numel() <= IDS_KEPT:
            # The routes themselves, small: what the planner planned from (``start_state``).
            extra["ids_list"] = [[int(v) for v in row] for row in ids.tolist()]
        if first_state.kept(module):
            try:
                extra["start_state"] = first_state.summary(module)
                with first_state.restored(module):
                    out = method._cached_apply(provider, module, x, weights, ids, None, None)
                    outputs[FROM_START] = out.clone()
            except Exception as exc:  # the three runs above stand; say why this one is missing
                extra["from_start_error"] = f"{type(exc).__name__}: {exc}"[:600]
        digests = {"x": x, "ids": ids, "weights": weights, **outputs}
        layers[name] = {
            "rows": int(x.shape[0]),
            **{key: int(trace.digest(t).item()) for key, t in digests.items()},
            **extra,
        }
        del whole
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return {"layers": layers}
