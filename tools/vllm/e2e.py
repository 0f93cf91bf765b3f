"""End-to-end run of the rowcache vLLM plugin on a GPU machine (issue 5, section 5).

    python3 tools/vllm/e2e.py run --out OUTDIR [--phases tiny,mp,qwen8,story] [--profile]
        [--deadline S]
    python3 tools/vllm/e2e.py merge --out OUTDIR A/results.json B/results.json ...

One device call is limited to about 9.5 minutes, so the phases run in several calls (each after the
bundle's assemble step and ``export`` line, see docs/VLLM.md), each under its own deadline and
writing its own $OUT:

    # call A: tiny model, the multi-process engine, the 24-layer user story
    python3 tools/vllm/e2e.py run --out $OUT --phases tiny,mp,story --deadline $((540 - SECONDS))
    # call B: the 8-layer Qwen3-30B-A3B-shaped engines, with profiles of (b) and (c)
    python3 tools/vllm/e2e.py run --out $OUT --phases qwen8 --profile --deadline $((540 - SECONDS))

and, here, one summary of both: ``python3 tools/vllm/e2e.py merge --out merged
A/results.json B/results.json`` (``merge`` needs no GPU and no vLLM).

Phases (each engine is a child process of this script, ``child`` below):

* ``tiny``: a 2-layer, 16-expert, top-4 Qwen3-MoE with random weights; 4 token-id prompts x 32
  greedy tokens; eager and piecewise-graph modes; no cache, ``cached`` and ``row`` with the
  token split and 6 slots (fewer than the experts a step uses), ``row`` with the expert split;
  two more engines under VLLM_LOGGING_LEVEL=DEBUG, where vLLM asserts that every captured piece
  is replayed with its capture-time input addresses: vLLM's MoE op made a splitting op as is,
  and the same with the plugin's capture-stable output.
* ``split``: the tiny model's piecewise cache engines (``cached``/``row`` token, ``row`` expert)
  again, next to their same-mode reference ``tiny.piecewise.eager_moe`` (no cache, the MoE op
  eager between captured pieces), which they are compared with; a third call:
  ``--phases split``.
* ``qwen8seq``: (b) and (c) ``row`` 128 of the ``qwen8`` phase again, each engine started and
  run alone (``--phases qwen8seq``).
* ``mp``: the tiny model in vLLM's default multi-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=1:
  the engine core, and with it the plugin and the model, in a process of its own), eager,
  ``row`` with the token split and 6 slots; its tokens are compared with the tiny phase's eager
  no-cache engine (or, without the tiny phase, an in-process eager no-cache engine started in
  this phase), its provider stats come back through ``llm.apply_model(expert_cache_stats)``
  across the process boundary (a failure there is recorded, the tokens still are).
* ``qwen8``: 8 layers with Qwen3-30B-A3B layer shapes, batch 1, 256 greedy tokens, medians of
  three: (a) no cache, full graphs; (b) no cache, MoE op eager between captured pieces (the
  plugin's baseline mode), with eager and vLLM's own piecewise-with-MoE-split as references;
  (c) ``cached``/``row`` with 128 slots (every expert stays resident); (d) ``cached``/``row``
  with 32 slots. With ``--profile``, (b), (c) ``row`` and (c) ``cached`` then generate 64 more
  greedy tokens twice, still holding the timing lock: once with only the MoE path's functions
  wrapped in ``perf_counter`` timers (little overhead), once under cProfile. Each writes
  OUTDIR/profile_<engine>.txt (per-forward breakdown from both, callees of the MoE functions,
  top 40 functions by cumulative and by self time) and OUTDIR/profile_<engine>.pstats.
* ``rerun``: the 2026-11-29 second run: ``tiny.piecewise.eager_moe`` with and without an identity
  ``expert_map``, and the ``qwen8`` engines (b) (also with an identity ``expert_map``), (c)
  ``row`` and (d) in one phase (``--phases rerun``).
* ``story``: 24 layers of those shapes (about 30 GB of weights) under a GPU budget of
  ``gpu_memory_utilization`` 0.10: no cache (expected not to start), then ``row`` with 32 slots.

Engines of one phase start concurrently (memory is fixed per engine with
``kv_cache_memory_bytes``), then wait until all are ready and take turns, under a file lock,
for the timed generations, so no timed section overlaps any other GPU work. The story engines
run alone, because ``gpu_memory_utilization`` budgets need an otherwise idle GPU.

Writes OUTDIR/results.json, OUTDIR/summary.txt and OUTDIR/logs.tar.gz and prints the summary.
"""

from __future__ import annotations

import argparse
import cProfile
import fcntl
import importlib
import inspect
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CKPT_TOOL = os.environ.get("ROWCACHE_CKPT_TOOL", ".gpu/tools/make_moe_checkpoint.py")

TINY_PROMPTS = [
    [1, 17, 42, 99, 123, 7],
    [1, 300, 301, 302],
    [1, *range(50, 90)],
    [1, 5],
]
QWEN_PROMPT = [1, 17, 42, 99, 123, 7, 300, 301]
# Engines of the qwen8 phase that --profile profiles, and the greedy tokens of each profile run.
PROFILED = ("qwen8.b.eager_moe", "qwen8.c.row128", "qwen8.c.cached128")
PROFILE_TOKENS = 64
MP_ENGINE = "mp.eager.row.token"
MP_REF = "mp.ref.eager.none"
# What one MoE forward's time is broken into (labels of the timers and of the cProfile keys).
BREAKDOWN = ("apply", "d2h", "plan", "prepare", "kernel", "stable", "run_with_expert_cache")


# -- one engine ---------------------------------------------------------------------------------


def _probe(model: Any) -> dict[str, Any]:
    """Runs inside the engine: GPU memory and where the expert weights live."""
    import torch

    from rowcache.vllm import expert_cache_stats

    expert_param_bytes = 0
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "w13_weight"):
            continue
        if getattr(method, "rowcache_provider", None) is not None:
            continue  # host-backed (device views of pinned memory): no GPU memory
        for pname in ("w13_weight", "w2_weight"):
            p = getattr(module, pname, None)
            if p is not None and p.is_cuda:
                expert_param_bytes += p.numel() * p.element_size()
    stats = expert_cache_stats(model)
    slot_bytes = sum(int(s["slot_bytes"]) for s in stats)
    host_bytes = sum(int(s["host_bytes"]) for s in stats)
    return {
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
    }


def _identity_expert_map(model: Any) -> int:
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


def _stats(model: Any) -> list[dict[str, Any]]:
    from rowcache.vllm import expert_cache_stats

    return expert_cache_stats(model)


def _totals(per_layer: list[dict[str, Any]]) -> dict[str, int]:
    keys = ("hits", "misses", "evictions", "prepare_calls", "forwards")
    return {k: sum(int(s.get(k, 0)) for s in per_layer) for k in keys}


# -- profiles (qwen8 --profile) -----------------------------------------------------------------


def _first_moe_method(model: Any) -> Any:
    """Runs inside the engine: the first MoE layer's method (an object: in-process engines)."""
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(module, "w13_weight"):
            return method
    raise RuntimeError("no MoE layer with w13_weight found")


def _timer_targets(method: Any) -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of everything ``_Timers`` wraps, where the callers look it up."""
    import torch

    import rowcache.forward as forward

    cls = type(method)
    module = sys.modules[cls.__module__]  # rowcache.vllm._method: apply's global names
    targets: list[tuple[Any, str, str]] = [(cls, "apply", "apply"), (torch.Tensor, "cpu", "d2h")]
    if hasattr(cls, "_stable_output"):
        targets.append((cls, "_stable_output", "stable"))
    if hasattr(module, "run_with_expert_cache"):
        targets.append((module, "run_with_expert_cache", "run_with_expert_cache"))
    targets.append((forward, "plan_chunks", "plan"))
    provider = getattr(method, "rowcache_provider", None)
    if provider is not None:
        targets.append((type(provider), "prepare", "prepare"))
    kernel = getattr(method, "moe_kernel", None)
    if kernel is not None:
        targets.append((type(kernel), "apply", "kernel"))
    return targets


def _profile_functions(method: Any) -> dict[str, Any]:
    """The Python functions of one MoE forward, by breakdown label: what ``_Timers`` wraps,
    looked up before it does, and vLLM's own ``apply``. ``d2h`` (``Tensor.cpu``) is a builtin,
    which the profile finds by name."""
    funcs: dict[str, Any] = {
        label: getattr(owner, attr)
        for owner, attr, label in _timer_targets(method)
        if label != "d2h"
    }
    for base in type(method).__mro__[1:]:  # vLLM's apply, which (b) calls through super()
        if "apply" in vars(base):
            funcs["parent_apply"] = vars(base)["apply"]
            break
    return funcs


class _Timers:
    """Wall-clock timers around the MoE path's functions, restored on exit.

    Only the listed functions are wrapped (a few calls per layer, about a microsecond each), so
    the figures stay close to an unprofiled run, unlike cProfile's, which pays on every Python
    call. ``d2h`` times ``Tensor.cpu`` only while an ``apply`` runs.
    """

    def __init__(self, targets: list[tuple[Any, str, str]]) -> None:
        self.targets = targets
        self.parts: dict[str, dict[str, Any]] = {}
        self.apply_threads: set[int] = set()
        self._depth = 0
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def _wrap(self, original: Any, label: str) -> Any:
        part = self.parts.setdefault(label, {"calls": 0, "cum_s": 0.0})
        timers = self
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if label == "d2h" and timers._depth == 0:
                return original(*args, **kwargs)
            if label == "apply":
                timers._depth += 1
                timers.apply_threads.add(threading.get_ident())
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                part["cum_s"] += clock() - start
                part["calls"] += 1
                if label == "apply":
                    timers._depth -= 1

        return timed

    def __enter__(self) -> _Timers:
        try:
            for owner, attr, label in self.targets:
                own = attr in vars(owner)
                self._undo.append((owner, attr, own, vars(owner)[attr] if own else None))
                setattr(owner, attr, self._wrap(getattr(owner, attr), label))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, own, saved in reversed(self._undo):
            if own:
                setattr(owner, attr, saved)
            elif attr in vars(owner):
                delattr(owner, attr)
        self._undo.clear()


def _code_key(fn: Any) -> tuple[str, int, str] | None:
    """The key cProfile files a Python function under: ``(file, first line, name)``."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    if code is None:
        return None
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _is_d2h(key: tuple[str, int, str]) -> bool:
    """cProfile's key of ``Tensor.cpu``, a builtin: ``('~', 0, "<method 'cpu' of ...>")``."""
    return key[0] == "~" and "'cpu'" in key[2]


def _key_label(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":
        return name
    return f"{'/'.join(Path(path).parts[-2:])}:{line}({name})"


def _breakdown(
    stats: dict[Any, Any], keys: dict[str, tuple[str, int, str] | None]
) -> dict[str, dict[str, Any]]:
    """Calls and seconds of each labelled function in a ``pstats.Stats(...).stats`` table.

    ``stats[key] = (primitive calls, calls, self s, cumulative s, callers)``, with
    ``callers[caller] = (calls, primitive calls, self s, cumulative s)``. ``d2h``: the
    ``Tensor.cpu`` calls made by ``apply`` itself; ``d2h_any``: all of them, from anywhere.
    """
    out: dict[str, dict[str, Any]] = {}
    for label, key in keys.items():
        row = stats.get(key) if key is not None else None
        out[label] = {
            "calls": int(row[1]) if row else 0,
            "cum_s": float(row[3]) if row else 0.0,
            "self_s": float(row[2]) if row else 0.0,
        }
    apply_key = keys.get("apply")
    d2h: dict[str, Any] = {"calls": 0, "cum_s": 0.0}
    d2h_any: dict[str, Any] = {"calls": 0, "cum_s": 0.0}
    for key, row in stats.items():
        if not _is_d2h(key):
            continue
        d2h_any["calls"] += int(row[1])
        d2h_any["cum_s"] += float(row[3])
        via = row[4].get(apply_key) if apply_key is not None else None
        if via:
            d2h["calls"] += int(via[0])
            d2h["cum_s"] += float(via[3])
    out["d2h"] = d2h
    out["d2h_any"] = d2h_any
    return out


def _callees(
    stats: dict[Any, Any], key: tuple[str, int, str] | None, limit: int = 15
) -> list[tuple[str, int, float]]:
    """What ``key`` calls: (function, calls, cumulative seconds from ``key``), largest first."""
    if key is None:
        return []
    rows = []
    for callee, row in stats.items():
        via = row[4].get(key)
        if via:
            rows.append((_key_label(callee), int(via[0]), float(via[3])))
    rows.sort(key=lambda r: -r[2])
    return rows[:limit]


def _per_forward(parts: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Microseconds per MoE forward (per ``apply`` call) of every breakdown label.

    ``other``: the part of ``apply`` outside d2h, ``_stable_output`` and the call below it
    (``run_with_expert_cache`` with a cache, else the kernel): the capture check, closures,
    vLLM's dispatch down to the kernel, and the wrappers' own cost.
    """
    forwards = int(parts.get("apply", {}).get("calls", 0))
    if forwards == 0:
        return None
    per: dict[str, Any] = {"forwards": forwards}
    for label in BREAKDOWN:
        entry = parts.get(label)
        used = entry is not None and int(entry.get("calls", 0)) > 0
        per[label] = round(float(entry["cum_s"]) * 1e6 / forwards, 1) if used else None
    below = per["run_with_expert_cache"]
    if below is None:
        below = per["kernel"]
    spent = sum(v or 0.0 for v in (per["d2h"], per["stable"], below))
    per["other"] = round(per["apply"] - spent, 1)
    return per


def _forward_line(per: dict[str, Any] | None) -> str:
    """``apply X us, of which d2h Y, plan Z, prepare W, kernel V, stable U`` (and the rest)."""
    if not per:
        return "no MoE forward seen"

    def us(label: str) -> str:
        value = per.get(label)
        return "-" if value is None else f"{value:.1f}"

    return (
        f"apply {us('apply')} us, of which d2h {us('d2h')}, plan {us('plan')}, "
        f"prepare {us('prepare')}, kernel {us('kernel')}, stable {us('stable')} "
        f"(run_with_expert_cache {us('run_with_expert_cache')}, rest of apply {us('other')}; "
        f"{per['forwards']} forwards)"
    )


def _profile(llm: Any, spec: dict[str, Any], prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Two more greedy generations of an in-process engine: under timers, then under cProfile.

    With VLLM_ENABLE_V1_MULTIPROCESSING=0 vLLM 0.25.0 steps the engine core in the calling
    thread (``InprocClient.get_output`` -> ``EngineCore.step`` -> ``UniProcExecutor``, which
    runs the worker's ``execute_model`` directly, also when it does not block), so the model's
    Python, the eager MoE op included, runs in this thread, the one cProfile is enabled in. The
    timers record which threads ``apply`` ran in, to confirm it.

    Writes ``spec["profile_out"]`` (text) and the same name with ``.pstats``.
    """
    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=PROFILE_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True
    )
    method = llm.apply_model(_first_moe_method)[0]
    funcs = _profile_functions(method)  # before the timers patch any of them
    keys = {label: _code_key(fn) for label, fn in funcs.items()}
    provider = getattr(method, "rowcache_provider", None)
    kernel = getattr(method, "moe_kernel", None)
    report: dict[str, Any] = {
        "tokens": PROFILE_TOKENS * len(prompts),
        "method": f"{type(method).__module__}.{type(method).__qualname__}",
        "provider": None if provider is None else type(provider).__name__,
        "kernel": None if kernel is None else type(kernel).__name__,
        "keys": {label: None if k is None else _key_label(k) for label, k in keys.items()},
        "threads": sorted(t.name for t in threading.enumerate()),
    }

    lines = [
        f"profile of {spec['name']}: {report['tokens']} greedy tokens, batch {len(prompts)}, "
        "after the timed generations, under the timing lock",
        f"method {report['method']}, provider {report['provider']}, kernel {report['kernel']}",
        f"threads in the engine process: {', '.join(report['threads'])}",
    ]

    # 1. Timers around the MoE path only.
    timers = _Timers(_timer_targets(method))
    try:
        start = time.perf_counter()
        with timers:
            llm.generate(prompts, sp, use_tqdm=False)
        report["timers_gen_s"] = round(time.perf_counter() - start, 3)
        report["timers"] = timers.parts
        report["timers_per_forward"] = _per_forward(timers.parts)
        report["apply_threads"] = len(timers.apply_threads)
        report["apply_in_this_thread_only"] = timers.apply_threads == {threading.get_ident()}
    except Exception as exc:
        report["timers_error"] = f"{type(exc).__name__}: {exc}"[:600]

    # 2. cProfile over the whole generation.
    table: dict[Any, Any] = {}
    st: pstats.Stats | None = None
    buf = io.StringIO()
    out = Path(spec["profile_out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        try:
            llm.generate(prompts, sp, use_tqdm=False)
        finally:
            prof.disable()
        report["cprofile_gen_s"] = round(time.perf_counter() - start, 3)
        st = pstats.Stats(prof, stream=buf)
        table = st.stats  # type: ignore[attr-defined]
        parts = _breakdown(table, keys)
        report["cprofile"] = parts
        report["cprofile_per_forward"] = _per_forward(parts)
        prof.dump_stats(str(out.with_suffix(".pstats")))
    except Exception as exc:
        report["cprofile_error"] = f"{type(exc).__name__}: {exc}"[:600]

    lines += [
        f"apply ran in {report.get('apply_threads')} thread(s); only in the profiled thread: "
        f"{report.get('apply_in_this_thread_only')}",
        "",
        "Per MoE forward, microseconds per apply call (d2h: Tensor.cpu called by apply, which",
        "waits for the GPU to finish the work queued before it; kernel: the modular kernel's",
        "apply, launches only; GPU time is not measured here):",
        f"  timers   (generate {report.get('timers_gen_s')} s): "
        f"{_forward_line(report.get('timers_per_forward'))}",
        f"  cProfile (generate {report.get('cprofile_gen_s')} s): "
        f"{_forward_line(report.get('cprofile_per_forward'))}",
    ]
    for source in ("timers", "cprofile"):
        if f"{source}_error" in report:
            lines.append(f"  {source} FAILED: {report[f'{source}_error']}")
    lines += ["", "timers per function: calls, cumulative s"]
    for label, part in timers.parts.items():
        lines.append(f"  {label:22} {part['calls']:>8} {part['cum_s']:>10.4f}")
    lines += ["", "cProfile per function: calls, cumulative s, self s"]
    for label, part in (report.get("cprofile") or {}).items():
        key = keys.get(label)
        where = _key_label(key) if key else ("Tensor.cpu" if label.startswith("d2h") else "-")
        lines.append(
            f"  {label:22} {part['calls']:>8} {part['cum_s']:>10.4f} "
            f"{part.get('self_s', 0.0):>10.4f}  {where}"
        )
    for label in ("apply", "parent_apply", "run_with_expert_cache", "prepare", "plan", "kernel"):
        rows = _callees(table, keys.get(label))
        if not rows:
            continue
        lines += ["", f"cProfile: what {label} calls (calls, cumulative s from {label})"]
        lines += [f"  {calls:>8} {cum:>10.4f}  {name}" for name, calls, cum in rows]
    if st is not None:
        for order, title in (("cumulative", "cumulative"), ("tottime", "self")):
            buf.seek(0)
            buf.truncate()
            st.sort_stats(order).print_stats(40)
            lines += ["", f"== top 40 by {title} time ==", buf.getvalue()]
    out.write_text("\n".join(lines) + "\n")
    report["file"] = out.name
    return report


def _wait_turn(spec: dict[str, Any]) -> Any:
    """Mark this engine ready, wait for the parent's go, then take the timing lock."""
    barrier = Path(spec["barrier"])
    (barrier / f"ready.{spec['name']}").write_text("1")
    limit = time.time() + float(spec.get("barrier_timeout", 600))
    while time.time() < limit and not (barrier / "go").exists():
        time.sleep(0.5)
    lock = open(barrier / "lock", "w")  # noqa: SIM115 - held until the timed section ends
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def child(spec: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"name": spec["name"], "spec": spec, "ok": False}
    t0 = time.time()
    # Multi-process engine: the engine core is another process, and apply_model pickles the
    # function there and the result back; a failure of that is recorded, not fatal.
    multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
    llm: Any = None
    try:
        from vllm import LLM, SamplingParams

        result["import_s"] = round(time.time() - t0, 1)
        from rowcache.vllm._config import MOE_OPS  # the plugin's own list (imports vllm.config)

        kw: dict[str, Any] = {
            "model": spec["model"],
            "skip_tokenizer_init": True,
            "dtype": "bfloat16",
            "seed": 0,
            "max_model_len": spec.get("max_model_len", 1024),
            "max_num_seqs": spec.get("max_num_seqs", 4),
            "max_num_batched_tokens": spec.get("max_num_batched_tokens", 512),
        }
        if "gpu_memory_utilization" in spec:
            kw["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
        else:
            # Fixed KV memory: engines of a phase share the GPU. vLLM still checks at start
            # that this fraction of the GPU is free.
            kw["kv_cache_memory_bytes"] = spec.get("kv_bytes", 1 << 30)
            kw["gpu_memory_utilization"] = 0.02
        mode = spec["mode"]
        if mode == "eager":
            kw["enforce_eager"] = True
        else:
            cc: dict[str, Any] = {"cudagraph_capture_sizes": spec.get("capture_sizes", [1, 2, 4])}
            if mode == "piecewise":
                cc["cudagraph_mode"] = "PIECEWISE"
            elif mode == "piecewise_moe_naive":
                from vllm.config import CompilationConfig

                cc["cudagraph_mode"] = "PIECEWISE"
                cc["splitting_ops"] = [
                    *CompilationConfig._attention_ops,
                    "vllm::unified_kv_cache_update",
                    "vllm::unified_mla_kv_cache_update",
                    *MOE_OPS,
                ]
            elif mode != "default":
                raise ValueError(f"unknown mode {mode}")
            kw["compilation_config"] = cc
        if spec.get("rowcache") is not None:
            kw["additional_config"] = {"rowcache": spec["rowcache"]}
        t1 = time.time()
        llm = LLM(**kw)
        result["init_s"] = round(time.time() - t1, 1)
        result["multiprocess"] = multiprocess
        result["client_pid"] = os.getpid()

        def rpc(fn: Any, default: Any) -> Any:
            """``llm.apply_model(fn)[0]``; in a multi-process engine a failure gives default."""
            try:
                return llm.apply_model(fn)[0]
            except Exception as exc:
                if not multiprocess:
                    raise
                errors = result.setdefault("rpc_errors", [])
                errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}"[:600])
                return default

        cc_final = llm.llm_engine.vllm_config.compilation_config
        result["cudagraph_mode"] = str(cc_final.cudagraph_mode.name)
        result["moe_split"] = [op for op in (cc_final.splitting_ops or []) if op in MOE_OPS]
        result["probe"] = rpc(_probe, {})
        if spec.get("identity_expert_map"):
            result["identity_expert_map_layers"] = llm.apply_model(_identity_expert_map)[0]

        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        sp = SamplingParams(
            max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True
        )
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up (first Triton compiles)
        lock = _wait_turn(spec)
        try:
            before_layers = rpc(_stats, None)
            times, runs = [], []
            for _ in range(spec.get("repeats", 1)):
                t = time.time()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                times.append(time.time() - t)
                runs.append([list(o.outputs[0].token_ids) for o in outs])
            after_layers = rpc(_stats, None)
            if spec.get("profile_out"):
                try:
                    result["profile"] = _profile(llm, spec, prompts)
                except Exception as exc:  # the timed results stand without the profile
                    result["profile_error"] = f"{type(exc).__name__}: {exc}"[:600]
                    result["profile_traceback"] = traceback.format_exc()[-3000:]
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
        assert runs
        generated = spec["max_tokens"] * len(prompts)
        result["tokens"] = runs[-1]
        result["repeats_identical"] = all(r == runs[0] for r in runs)
        result["tok_s_runs"] = [round(generated / t, 1) for t in times]
        result["tok_s"] = round(generated / statistics.median(times), 1)
        if after_layers and before_layers is not None:
            before, after = _totals(before_layers), _totals(after_layers)
            delta = {k: after[k] - before[k] for k in after}
            requests = delta["hits"] + delta["misses"]
            result["cache"] = {
                "timed": delta,
                "hit_rate": round(delta["hits"] / requests, 4) if requests else None,
                "layers": len(after_layers),
                "capacity": after_layers[0]["capacity"],
                "provider": after_layers[0]["provider"],
                "split": after_layers[0]["split"],
                "since_start": after,
            }
        result["ok"] = True
    except BaseException as exc:  # recorded, not hidden: the summary prints it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if multiprocess and llm is not None:
        # Stop the engine-core process now: main() leaves through os._exit, and the next phase
        # (the story's gpu_memory_utilization budget) needs its GPU memory back.
        try:
            llm.llm_engine.engine_core.shutdown()
            result["engine_shutdown"] = "ok"
        except Exception as exc:
            result["engine_shutdown"] = f"{type(exc).__name__}: {exc}"[:300]
    result["wall_s"] = round(time.time() - t0, 1)
    return result


# -- orchestration ------------------------------------------------------------------------------


def _tiny_base(model: str) -> dict[str, Any]:
    """What every engine of the tiny model shares: prompts, greedy tokens, context length."""
    return {"model": model, "prompts": TINY_PROMPTS, "max_tokens": 32, "max_model_len": 512}


def _tiny_eager_moe(model: str) -> dict[str, Any]:
    """The tiny model's same-mode reference for its piecewise cache engines: no cache, the MoE
    op eager between captured pieces (the plugin's baseline mode)."""
    return {
        **_tiny_base(model),
        "name": "tiny.piecewise.eager_moe",
        "mode": "default",
        "rowcache": {"moe_eager_between_graphs": True},
    }


def _tiny_specs(model: str) -> list[dict[str, Any]]:
    base = _tiny_base(model)
    cache = {"moe_expert_cache_size": 6}
    specs = []
    for mode in ("eager", "piecewise"):
        specs.append({**base, "name": f"tiny.{mode}.none", "mode": mode})
        for provider, split in (("cached", "token"), ("row", "token"), ("row", "expert")):
            specs.append(
                {
                    **base,
                    "name": f"tiny.{mode}.{provider}.{split}",
                    # piecewise cache runs use vLLM's default graph settings: the plugin lowers
                    "mode": "eager" if mode == "eager" else "default",
                    "rowcache": {
                        **cache,
                        "moe_expert_cache_provider": provider,
                        "moe_expert_cache_split": split,
                    },
                }
            )
    debug = {"env": {"VLLM_LOGGING_LEVEL": "DEBUG"}}
    specs.append({**base, **debug, "name": "tiny.debug.naive", "mode": "piecewise_moe_naive"})
    specs.append(
        {
            **base,
            **debug,
            "name": "tiny.debug.row.token",
            "mode": "default",
            "rowcache": {**cache, "moe_expert_cache_provider": "row"},
        }
    )
    return specs


def _mp_specs(model: str, with_reference: bool) -> list[dict[str, Any]]:
    """vLLM's default multi-process engine with the cache (and an in-process reference when the
    tiny phase's eager no-cache engine is not there to compare with)."""
    base = _tiny_base(model)
    specs = [
        {
            **base,
            "name": MP_ENGINE,
            "mode": "eager",
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
            "rowcache": {
                "moe_expert_cache_size": 6,
                "moe_expert_cache_provider": "row",
                "moe_expert_cache_split": "token",
            },
        }
    ]
    if with_reference:
        specs.append({**base, "name": MP_REF, "mode": "eager"})
    return specs


def _qwen_specs(model: str) -> list[dict[str, Any]]:
    base = {
        "model": model,
        "prompts": [QWEN_PROMPT],
        "max_tokens": 256,
        "repeats": 3,
        "max_num_seqs": 1,
        "capture_sizes": [1, 2],
        "kv_bytes": 2 << 30,
    }
    specs = [
        {**base, "name": "qwen8.a.full", "mode": "default"},
        {
            **base,
            "name": "qwen8.b.eager_moe",
            "mode": "default",
            "rowcache": {"moe_eager_between_graphs": True},
        },
        {**base, "name": "qwen8.ref.eager", "mode": "eager"},
        {**base, "name": "qwen8.ref.piecewise_moe_naive", "mode": "piecewise_moe_naive"},
    ]
    for label, slots in (("c", 128), ("d", 32)):
        for provider in ("cached", "row"):
            specs.append(
                {
                    **base,
                    "name": f"qwen8.{label}.{provider}{slots}",
                    "mode": "default",
                    "rowcache": {
                        "moe_expert_cache_size": slots,
                        "moe_expert_cache_provider": provider,
                    },
                }
            )
    return specs


def _qwen_seq_specs(qwen8: str) -> list[dict[str, Any]]:
    """(b) and (c) ``row`` of the qwen8 phase, to be started one at a time (phase ``qwen8seq``):
    neither compiles nor runs next to another engine, and (c)'s tokens are compared with (b)'s."""
    wanted = {"qwen8.b.eager_moe": "qwen8seq.b.eager_moe", "qwen8.c.row128": "qwen8seq.c.row128"}
    return [
        {**spec, "name": wanted[spec["name"]]}
        for spec in _qwen_specs(qwen8)
        if spec["name"] in wanted
    ]


def _split_specs(tiny: str) -> list[dict[str, Any]]:
    """The tiny model's piecewise cache engines next to their same-mode reference: no cache with
    the MoE op eager between pieces, the plugin's baseline mode (``tiny.piecewise.none`` keeps
    the MoE op inside the pieces, which inductor fuses and rounds differently)."""
    reference = _tiny_eager_moe(tiny)
    cache_runs = [s for s in _tiny_specs(tiny) if s["name"].startswith("tiny.piecewise.")]
    return [reference, *(s for s in cache_runs if s["name"] != "tiny.piecewise.none")]


def _rerun_specs(tiny: str, qwen8: str) -> list[dict[str, Any]]:
    """The second run: the same-mode references (MoE op eager between pieces, with and without
    an identity expert_map) next to the cache runs, and (a) to (d) again in one phase."""
    reference = _tiny_eager_moe(tiny)
    specs = [
        reference,
        {**reference, "name": "tiny.piecewise.eager_moe.idmap", "identity_expert_map": True},
    ]
    for spec in _qwen_specs(qwen8):
        # Left out to fit the device budget: vLLM-only references and one cache run already
        # measured in the first run.
        if spec["name"].startswith("qwen8.ref.") or spec["name"] in (
            "qwen8.a.full",
            "qwen8.c.cached128",
        ):
            continue
        specs.append(spec)
        if spec["name"] == "qwen8.b.eager_moe":
            specs.append({**spec, "name": "qwen8.b.eager_moe.idmap", "identity_expert_map": True})
    return specs


def _story_specs(model: str) -> list[dict[str, Any]]:
    base = {
        "model": model,
        "prompts": [QWEN_PROMPT],
        "max_tokens": 64,
        "repeats": 1,
        "max_num_seqs": 1,
        "mode": "eager",
        "gpu_memory_utilization": 0.10,
    }
    return [
        {**base, "name": "story.none"},
        {
            **base,
            "name": "story.row32",
            "rowcache": {"moe_expert_cache_size": 32, "moe_expert_cache_provider": "row"},
        },
    ]


def _env(extra: dict[str, str] | None, name: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    if name is not None:  # engines of one phase share no vLLM compile cache directory
        env["VLLM_CACHE_ROOT"] = f"/tmp/rc-e2e/vcache/{name}"
    return env


def _launch(spec: dict[str, Any], logs: Path) -> subprocess.Popen[bytes]:
    path = logs / f"{spec['name']}.spec.json"
    path.write_text(json.dumps(spec))
    # An earlier call on the same (warm) machine may have left a result under this name.
    (logs / f"{spec['name']}.result.json").unlink(missing_ok=True)
    log = open(logs / f"{spec['name']}.log", "wb")  # noqa: SIM115 - the child writes it
    return subprocess.Popen(
        [sys.executable, str(HERE), "child", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_env(spec.get("env"), spec["name"]),
    )


def _collect(spec: dict[str, Any], logs: Path, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    out = logs / f"{spec['name']}.result.json"
    if out.exists():
        res: dict[str, Any] = json.loads(out.read_text())
    else:
        res = {"name": spec["name"], "ok": False, "error": f"no result (exit {proc.returncode})"}
    log = (logs / f"{spec['name']}.log").read_text(errors="replace")
    for line in log.splitlines():
        if "Model loading took" in line:
            res["model_loading_log"] = line.split("Model loading took", 1)[1].strip()[:120]
        if "Input addresses for cudagraphs are different" in line:
            res["address_assert"] = line.strip()[-300:]
    res["exit"] = proc.returncode
    return res


def _phase(
    specs: list[dict[str, Any]], logs: Path, deadline: float, gate: Path | None
) -> list[dict[str, Any]]:
    # A fresh barrier per phase: a "go" left by an earlier phase or call would start the timed
    # sections before every engine is ready.
    barrier = logs / f"barrier.{specs[0]['name']}"
    shutil.rmtree(barrier, ignore_errors=True)
    barrier.mkdir(parents=True)
    for spec in specs:
        spec["barrier"] = str(barrier)
        spec["barrier_timeout"] = max(30.0, deadline - time.time() - 60)
    procs = [(spec, _launch(spec, logs)) for spec in specs]
    # Timed sections start once every engine is ready (or gone) and, for the first phase, the
    # checkpoint builder is done: no timed section overlaps a start-up or a build.
    while time.time() < deadline:
        waiting = [
            spec
            for spec, proc in procs
            if proc.poll() is None and not (barrier / f"ready.{spec['name']}").exists()
        ]
        if not waiting and (gate is None or gate.exists()):
            break
        time.sleep(1)
    (barrier / "go").write_text("1")
    results = []
    for spec, proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        results.append(_collect(spec, logs, proc))
    return results


def _fmt_bytes(n: Any) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _compare(results: dict[str, dict[str, Any]], ref: str, name: str) -> str:
    a, b = results.get(ref, {}), results.get(name, {})
    if not (a.get("ok") and b.get("ok")):
        return "n/a"
    ta, tb = a["tokens"], b["tokens"]
    if ta == tb:
        return f"identical to {ref.split('.', 1)[1]} ({sum(len(t) for t in tb)} tokens)"
    same = 0
    first = None
    for p, (x, y) in enumerate(zip(ta, tb, strict=True)):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            if u == v:
                same += 1
            elif first is None:
                first = (p, i, u, v)
    total = sum(len(t) for t in ta)
    assert first is not None
    return (
        f"DIFFERS from {ref.split('.', 1)[1]}: {same}/{total} equal; first divergence prompt "
        f"{first[0]} token {first[1]} ({first[2]} vs {first[3]})"
    )


def summarize(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"rowcache e2e  {json.dumps(meta)}", ""]
    header = (
        f"{'engine':34} {'graphs':10} {'moe split':9} {'tok/s':>7} {'hit':>6} "
        f"{'prep/fwd':>9} {'expGPU GiB':>10} {'alloc GiB':>9}  tokens"
    )
    lines.append(header)
    mp_ref = "tiny.eager.none" if results.get("tiny.eager.none", {}).get("ok") else MP_REF
    refs = {
        "tiny.eager.": "tiny.eager.none",
        "tiny.piecewise.": "tiny.piecewise.none",
        "tiny.debug.": "tiny.piecewise.none",
        "mp.": mp_ref,
        "qwen8.": "qwen8.ref.eager",
        "qwen8seq.": "qwen8seq.b.eager_moe",
        "story.": "story.none",
    }
    for name, r in results.items():
        ref = next((v for k, v in refs.items() if name.startswith(k)), "")
        if name.startswith("qwen8.") and ("row" in name or "cached" in name):
            idmap = "qwen8.b.eager_moe.idmap"
            ref = idmap if idmap in results else "qwen8.b.eager_moe"
        if name.startswith("tiny.piecewise.") and "tiny.piecewise.eager_moe.idmap" in results:
            ref = "tiny.piecewise.eager_moe.idmap"
        elif name.startswith("tiny.piecewise.") and "tiny.piecewise.eager_moe" in results:
            ref = "tiny.piecewise.eager_moe"
        if name.startswith("qwen8.b.eager_moe.") and "qwen8.b.eager_moe" in results:
            ref = "qwen8.b.eager_moe"
        if not r.get("ok"):
            err = r.get("error", "?")[:150]
            lines.append(f"{name:34} FAILED: {err}")
            if r.get("address_assert"):
                lines.append(f"{'':34} vLLM debug check: {r['address_assert'][:150]}")
            continue
        cache = r.get("cache") or {}
        timed = cache.get("timed") or {}
        hit = cache.get("hit_rate")
        prep = f"{timed.get('prepare_calls', 0)}/{timed.get('forwards', 0)}" if timed else "-"
        probe = r.get("probe", {})
        cmp = "reference" if name == ref else _compare(results, ref, name)
        if r.get("repeats_identical") is False:
            cmp += "; REPEATS DIFFER"
        split = "yes" if r.get("moe_split") else "no"
        lines.append(
            f"{name:34} {r.get('cudagraph_mode', '?'):10} {split:9} "
            f"{r.get('tok_s', 0):>7} {('-' if hit is None else f'{hit:.3f}'):>6} {prep:>9} "
            f"{_fmt_bytes(probe.get('expert_gpu_bytes')):>10} "
            f"{_fmt_bytes(probe.get('allocated')):>9}  {cmp}"
        )

    def speed(name: str) -> float | None:
        r = results.get(name, {})
        return r.get("tok_s") if r.get("ok") else None

    b, c_row, d_row, d_cached = (
        speed("qwen8.b.eager_moe"),
        speed("qwen8.c.row128"),
        speed("qwen8.d.row32"),
        speed("qwen8.d.cached32"),
    )
    if b and c_row:
        verdict = "met" if c_row >= 0.9 * b else "NOT met"
        lines.append(f"\ntarget (c) row >= 0.9 x (b): {c_row} / {b} = {c_row / b:.3f} ({verdict})")
    if d_row and d_cached:
        verdict = "met" if d_row >= d_cached else "NOT met"
        lines.append(f"target (d) row >= cached: {d_row} vs {d_cached} ({verdict})")
    if MP_ENGINE in results:
        lines += ["", _mp_line(results, mp_ref)]
    lines += _profile_lines(results)
    return "\n".join(lines)


def _mp_line(results: dict[str, dict[str, Any]], ref: str) -> str:
    r = results[MP_ENGINE]
    head = "multi-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=1; eager, row, token, 6 slots):"
    if not r.get("ok"):
        return f"{head} FAILED: {r.get('error', '?')[:200]}"
    probe = r.get("probe") or {}
    pid = probe.get("pid")
    if pid is None:
        where = "engine process unknown (probe not read back)"
    elif pid != r.get("client_pid"):
        where = f"engine core in its own process (pid {pid}, client {r.get('client_pid')})"
    else:
        where = "engine core in the client process: NOT multi-process"
    cache = r.get("cache") or {}
    timed = cache.get("timed") or {}
    hit = cache.get("hit_rate")
    if cache:
        stats = (
            f"hit rate {'-' if hit is None else f'{hit:.3f}'} ({timed.get('hits')} hits, "
            f"{timed.get('misses')} misses, {cache.get('layers')} layers), read back through "
            "apply_model"
        )
    else:
        errors = "; ".join(r.get("rpc_errors") or []) or "apply_model returned no cached layer"
        stats = f"no provider stats: {errors[:300]}"
    return (
        f"{head} {where}; tokens {_compare(results, ref, MP_ENGINE)}; {stats}; "
        f"MoE method {probe.get('method', '?')}; engine shutdown {r.get('engine_shutdown', '?')}"
    )


def _profile_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """One line per profiled engine and source (cProfile, timers), and (c) row minus (b)."""
    lines: list[str] = []
    for name, r in results.items():
        prof = r.get("profile")
        if not prof and not r.get("profile_error"):
            continue
        if not lines:
            lines += [
                "",
                f"profiles ({PROFILE_TOKENS} greedy tokens per engine after its timed runs; "
                f"OUT/profile_<engine>.txt):",
            ]
        if not prof:
            lines.append(f"{name}: profile FAILED: {r['profile_error'][:200]}")
            continue
        for source in ("cprofile", "timers"):
            per = prof.get(f"{source}_per_forward")
            lines.append(f"{name}: per MoE forward: {_forward_line(per)} [{source}]")
        for source in ("timers", "cprofile"):
            if prof.get(f"{source}_error"):
                lines.append(f"{name}: {source} FAILED: {prof[f'{source}_error'][:200]}")
        if prof.get("apply_in_this_thread_only") is False:
            lines.append(
                f"{name}: apply ran in {prof.get('apply_threads')} thread(s), not only in the "
                "profiled one: the cProfile figures miss those calls"
            )

    def timers(name: str) -> dict[str, Any] | None:
        prof = results.get(name, {}).get("profile") or {}
        per: dict[str, Any] | None = prof.get("timers_per_forward")
        return per

    b, c = timers("qwen8.b.eager_moe"), timers("qwen8.c.row128")
    if b and c:
        labels = ("apply", "d2h", "plan", "prepare", "kernel", "stable", "other")
        diff = ", ".join(f"{k} {(c.get(k) or 0.0) - (b.get(k) or 0.0):+.1f}" for k in labels)
        lines.append(f"(c) row128 minus (b), timers, us per MoE forward: {diff}")
    return lines


def run(args: argparse.Namespace) -> int:
    start = time.time()
    deadline = start + args.deadline
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # the profiled engines write into it
    logs = Path(args.work) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    unknown = set(phases) - {"tiny", "split", "mp", "qwen8", "qwen8seq", "story", "rerun"}
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}")
    results: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {
        "phases": phases,
        "profile": bool(args.profile),
        "deadline_s": args.deadline,
        "commit": os.environ.get("ROWCACHE_COMMIT", "?"),
    }
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["torch"] = torch.__version__
        from importlib.metadata import version

        meta["vllm"] = version("vllm")
    except Exception as exc:
        meta["env_error"] = repr(exc)

    work = Path(args.work)
    tiny, qwen8, story = work / "tiny-moe", work / "qwen8", work / "qwen24"
    built = work / "ckpt.done"
    builder_log = logs / "checkpoints.log"
    t = time.time()
    if {"tiny", "split", "mp", "rerun"} & set(phases) and not (tiny / "config.json").exists():
        subprocess.run([sys.executable, CKPT_TOOL, str(tiny)], check=True)
    meta["tiny_ckpt_s"] = round(time.time() - t, 1)

    def builder() -> subprocess.Popen[bytes]:
        cmd = (
            f"{sys.executable} {CKPT_TOOL} {qwen8} --qwen3-30b-a3b --layers 8"
            if {"qwen8", "qwen8seq", "rerun"} & set(phases) and not (qwen8 / "config.json").exists()
            else "true"
        )
        cmd2 = (
            f"{sys.executable} {CKPT_TOOL} {story} --qwen3-30b-a3b --layers 24"
            if "story" in phases and not (story / "config.json").exists()
            else "true"
        )
        script = f"set -e; date +%s; {cmd}; date +%s; {cmd2}; date +%s; touch {built}"
        with open(builder_log, "ab") as f:
            return subprocess.Popen(["bash", "-c", script], stdout=f, stderr=subprocess.STDOUT)

    # A marker left by an earlier call on a warm machine would let engines start before this
    # call's checkpoints exist.
    built.unlink(missing_ok=True)
    build = builder()
    # register()'s cost, in fresh processes: with vLLM's config imported (as when vLLM loads
    # plugins) and its fused-MoE package not yet, and with both imported. Run one after the
    # other, so that neither times the other's imports.
    probe = subprocess.Popen(
        [
            "bash",
            "-c",
            f"{sys.executable} {HERE} register-probe {logs / 'register.json'}; "
            f"{sys.executable} {HERE} register-probe {logs / 'register_preloaded.json'} "
            "--fused-moe-first",
        ],
        stdout=open(logs / "register.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=_env(None),
    )
    if "rerun" in phases:
        build.wait(timeout=max(1.0, deadline - time.time()))
        for r in _phase(_rerun_specs(str(tiny), str(qwen8)), logs, deadline, None):
            results[r["name"]] = r
        meta["after_rerun_s"] = round(time.time() - start, 1)
    if "tiny" in phases:
        for r in _phase(_tiny_specs(str(tiny)), logs, deadline, built):
            results[r["name"]] = r
        meta["after_tiny_s"] = round(time.time() - start, 1)
    if "split" in phases:
        for r in _phase(_split_specs(str(tiny)), logs, deadline, None):
            results[r["name"]] = r
        meta["after_split_s"] = round(time.time() - start, 1)
    if "mp" in phases:
        reference = results.get("tiny.eager.none", {}).get("ok")
        for r in _phase(_mp_specs(str(tiny), not reference), logs, deadline, None):
            results[r["name"]] = r
        meta["after_mp_s"] = round(time.time() - start, 1)
    if {"qwen8", "qwen8seq", "story"} & set(phases):
        build.wait(timeout=max(1.0, deadline - time.time()))
    if "qwen8seq" in phases:
        # One engine at a time: no other engine starts or compiles while one compiles or runs.
        for spec in _qwen_seq_specs(str(qwen8)):
            for r in _phase([spec], logs, deadline, None):
                results[r["name"]] = r
        meta["after_qwen8seq_s"] = round(time.time() - start, 1)
    if "qwen8" in phases:
        specs = _qwen_specs(str(qwen8))
        if args.profile:
            for spec in specs:
                if spec["name"] in PROFILED:
                    spec["profile_out"] = str((out / f"profile_{spec['name']}.txt").resolve())
        for r in _phase(specs, logs, deadline, None):
            results[r["name"]] = r
        meta["after_qwen8_s"] = round(time.time() - start, 1)
    if "story" in phases:
        for spec in _story_specs(str(story)):
            if time.time() > deadline - 90:
                skipped = {"name": spec["name"], "ok": False, "error": "not run: time"}
                results[spec["name"]] = skipped
                continue
            for r in _phase([spec], logs, deadline, None):
                results[r["name"]] = r
        meta["after_story_s"] = round(time.time() - start, 1)
    for key in ("register", "register_preloaded"):
        try:
            probe.wait(timeout=5)
            meta[key] = json.loads((logs / f"{key}.json").read_text())
        except Exception as exc:
            meta[key] = repr(exc)
    meta["wall_s"] = round(time.time() - start, 1)
    summary = summarize(results, meta)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "summary.txt").write_text(summary + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(logs.glob("*.log")) + sorted(logs.glob("*.json")):
            tar.add(path, arcname=path.name)
    print(summary, flush=True)
    return 0


def merge(paths: list[str], out_dir: str) -> int:
    """One results.json and summary from the results.json of several calls (later ones win)."""
    results: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {"merged_from": []}
    for path in paths:
        data = json.loads(Path(path).read_text())
        part = data.get("meta", {})
        meta["merged_from"].append(
            {"path": path, **{k: part.get(k) for k in ("phases", "profile", "commit", "wall_s")}}
        )
        for key in ("gpu", "torch", "vllm"):
            meta.setdefault(key, part.get(key))
        results.update(data.get("results", {}))
    summary = summarize(results, meta)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "summary.txt").write_text(summary + "\n")
    print(summary, flush=True)
    return 0


def register_probe(path: str, fused_moe_first: bool) -> None:
    """Time register() alone, then the fused-MoE import that installs the MoE method."""
    # What vLLM has imported when it loads plugins: its configuration (``import vllm`` alone is
    # lazy and would leave vllm.config to be timed as part of register()).
    import vllm.config  # noqa: F401

    fused_moe = "vllm.model_executor.layers.fused_moe"
    if fused_moe_first:
        importlib.import_module(fused_moe)
    preloaded = fused_moe in sys.modules
    t = time.perf_counter()
    import rowcache.vllm as plugin

    plugin.register()
    register_s = time.perf_counter() - t
    imported_by_register = not preloaded and fused_moe in sys.modules
    state_after_register = plugin._state.method
    t = time.perf_counter()
    importlib.import_module(fused_moe)  # fires the post-import hook when it was deferred
    fused_moe_s = time.perf_counter() - t
    from vllm.model_executor.custom_op import op_registry_oot

    Path(path).write_text(
        json.dumps(
            {
                "register_ms": round(register_s * 1000, 1),
                "fused_moe_imported_first": preloaded,
                "fused_moe_imported_by_register": imported_by_register,
                "method_after_register": state_after_register,
                "fused_moe_import_after_register_ms": round(fused_moe_s * 1000, 1),
                "method_after_fused_moe": plugin._state.method,
                "oot": {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()},
            }
        )
    )


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "child":
        spec = json.loads(Path(sys.argv[2]).read_text())
        res = child(spec)
        Path(sys.argv[2].replace(".spec.json", ".result.json")).write_text(json.dumps(res))
        print("CHILD_DONE", res["name"], res["ok"], res.get("error", ""), flush=True)
        os._exit(0)  # skip vLLM's shutdown path; the process holds nothing to flush
    if len(sys.argv) >= 3 and sys.argv[1] == "register-probe":
        register_probe(sys.argv[2], fused_moe_first="--fused-moe-first" in sys.argv[3:])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "merge"])
    ap.add_argument("inputs", nargs="*", help="merge: the results.json files to merge")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/rc-e2e")
    ap.add_argument("--phases", default="tiny,mp,qwen8,story")
    ap.add_argument(
        "--profile",
        action="store_true",
        help=f"qwen8: profile {', '.join(PROFILED)} after their timed runs",
    )
    ap.add_argument("--deadline", type=float, default=540.0)
    args = ap.parse_intermixed_args()  # merge: files after --out too
    if args.mode == "merge":
        if not args.inputs:
            ap.error("merge needs one or more results.json files")
        return merge(args.inputs, args.out)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
