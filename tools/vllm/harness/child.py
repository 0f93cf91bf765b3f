"""What runs inside one engine's process (``e2e.py child JOB.json``).

Starts vLLM's ``LLM`` for the job's spec, reads the engine's memory and MoE methods, warms up,
marks itself ready and waits for the phase's ``go``, then, holding the timing lock, runs the
timed generations (and the profile), and writes ``<name>.result.json`` beside the job file.
Every failure is recorded in the result (the summary prints it), never raised.
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import IO, Any

from tools.vllm.harness import (
    expert_bytes,
    jit_count,
    kernel_profile,
    placement,
    probes,
    replay,
    scale_guard,
    scale_tails,
    shadow,
    slot_watch,
    trace,
)
from tools.vllm.harness.jit_count import JitCounter
from tools.vllm.harness.measure import Completion, decode_prompts, run_workload
from tools.vllm.harness.measure import totals as measure_totals
from tools.vllm.harness.profiling import profile
from tools.vllm.harness.specs import OFFLOAD_SET_ARGS, EngineSpec, Job, Mode
from tools.vllm.harness.zygote import FORKED_ENV

JOB_SUFFIX = ".job.json"
RESULT_SUFFIX = ".result.json"


DEADLINE_MARGIN_S = 15.0
"""A workload's measurements end this long before the job's deadline (writing the result and
leaving take the rest; the orchestrator stops the process after the deadline)."""


def main(job_path: str) -> None:
    job = Job.from_json(json.loads(Path(job_path).read_text()))
    out = Path(job_path.replace(JOB_SUFFIX, RESULT_SUFFIX))
    res = run(job, lambda partial: write_atomic(out, partial))
    write_atomic(out, res)
    print("CHILD_DONE", res["name"], res["ok"], res.get("error", ""), flush=True)
    os._exit(0)  # skip vLLM's shutdown path; the process holds nothing to flush


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, never half written (a process stopped from outside leaves
    the previous version)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def llm_arguments(kw: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` as ``vllm.LLM`` takes them: vLLM's set-typed arguments as sets."""
    return {k: set(v) if k in OFFLOAD_SET_ARGS else v for k, v in kw.items()}


def engine_kwargs(spec: EngineSpec, model: str) -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` for ``spec`` (vLLM is imported for the naive split only)."""
    kw: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
    }
    if spec.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = spec.gpu_memory_utilization
    else:
        # Fixed KV memory: engines of a phase share the GPU. vLLM still checks at start that
        # this fraction of the GPU is free.
        kw["kv_cache_memory_bytes"] = spec.kv_bytes
        kw["gpu_memory_utilization"] = 0.02
    if spec.mode is Mode.EAGER:
        kw["enforce_eager"] = True
    else:
        cc: dict[str, Any] = {"cudagraph_capture_sizes": list(spec.capture_sizes)}
        if spec.mode is Mode.PIECEWISE:
            cc["cudagraph_mode"] = "PIECEWISE"
        elif spec.mode is Mode.PIECEWISE_MOE_NAIVE:
            from vllm.config import CompilationConfig

            from rowcache.vllm._config import MOE_OPS

            cc["cudagraph_mode"] = "PIECEWISE"
            cc["splitting_ops"] = [
                *CompilationConfig._attention_ops,
                "vllm::unified_kv_cache_update",
                "vllm::unified_mla_kv_cache_update",
                *MOE_OPS,
            ]
        cc["inductor_compile_config"] = deterministic_inductor()
        kw["compilation_config"] = cc
    if spec.knob is not None:
        kw["additional_config"] = {"rowcache": spec.knob.config()}
    if spec.offload is not None:
        kw.update(spec.offload.engine_args())
    if spec.max_position_embeddings is not None:
        kw["hf_overrides"] = {"max_position_embeddings": spec.max_position_embeddings}
    if spec.prefix_caching is not None:
        kw["enable_prefix_caching"] = spec.prefix_caching
    if spec.quantization is not None:
        kw["quantization"] = spec.quantization
    if spec.moe_backend is not None:
        kw["moe_backend"] = spec.moe_backend
    return kw


def check_offloader(spec: EngineSpec, found: dict[str, Any] | None) -> None:
    """Stop an engine configured with vLLM's offload whose offloader (``probes.offloader``)
    is vLLM's no-op one, or a UVA offloader that offloaded 0 bytes: nothing was offloaded, and
    it would be measured as an offload engine while it runs as no offload (vLLM 0.25.0's V2
    model runner ignores the offload settings: ``EngineSpec.model_runner_v1``)."""
    if spec.offload is None:
        return
    found = found or {}
    if found.get("offloader") == "UVAOffloader" and found.get("cpu_offload_bytes") == 0:
        raise RuntimeError(
            f"vLLM's UVA offload is configured ({spec.offload.engine_args()}) but it offloaded "
            "0 bytes: no parameter matched cpu_offload_params, and this engine would measure "
            "no offload"
        )
    if found.get("offloader") != "NoopOffloader":
        return
    raise RuntimeError(
        f"vLLM's offload is configured ({spec.offload.engine_args()}) but its offloader is "
        "NoopOffloader: nothing was offloaded, and this engine would measure no offload "
        "(vLLM 0.25.0's V2 model runner ignores the offload settings; VLLM_USE_V2_MODEL_RUNNER=0 "
        "runs the V1 runner, EngineSpec.model_runner_v1)"
    )


def wait_turn(job: Job) -> IO[str]:
    """Mark this engine ready, wait for the parent's go, then take the timing lock."""
    barrier = Path(job.barrier)
    (barrier / f"ready.{job.spec.name}").write_text("1")
    limit = time.time() + job.barrier_timeout
    while time.time() < limit and not (barrier / "go").exists():
        time.sleep(0.5)
    lock = open(barrier / "lock", "w")  # noqa: SIM115 - held until the timed section ends
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def built_after_start(jit: JitCounter | None, started: int) -> dict[str, Any]:
    """The Triton kernels the engine built after its start-up (warm-ups, timed runs, probes):
    by name, and the first builds' specializations as Triton describes them."""
    if jit is None:
        return {"counted": False, "why": "the engine core runs in another process"}
    if jit.failure is not None:
        return {"counted": False, "why": f"a build could not be counted: {jit.failure}"}
    return {"counted": True, "kernels": jit.since(started), "described": list(jit.descriptions)}


def totals(per_layer: list[dict[str, Any]]) -> dict[str, int]:
    keys = ("hits", "misses", "evictions", "prepare_calls", "forwards")
    return {k: sum(int(s.get(k, 0)) for s in per_layer) for k in keys}


def completions(outs: list[Any]) -> list[Completion]:
    """vLLM's ``RequestOutput``s as :class:`Completion`s (vLLM's own time to first token
    where it reports one: ``metrics.first_token_latency``, kept only with stats logging)."""
    found = []
    for o in outs:
        latency = getattr(getattr(o, "metrics", None), "first_token_latency", None)
        first = float(latency) if isinstance(latency, int | float) and latency > 0 else None
        found.append(Completion(list(o.outputs[0].token_ids), first))
    return found


def workload(
    job: Job,
    llm: Any,
    rpc: Any,
    result: dict[str, Any],
    save: Any,
    sampling: Any,
    jit: JitCounter | None = None,
) -> None:
    """The spec's workload (``harness/measure.py``) and the route the MoE op took."""
    spec = job.spec
    assert spec.workload is not None
    deadline = (job.deadline or time.time() + 3600.0) - DEADLINE_MARGIN_S

    tracing = [job.trace]  # the first generation only: the same in every engine

    def generate(prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        sp = sampling(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in prompts]
        if tracing[0]:
            rpc(trace.start, None)
        try:
            return completions(llm.generate(batch, sp, use_tqdm=False))
        finally:
            if tracing[0]:
                tracing[0] = False
                rpc(trace.stop, None)

    def stats() -> list[dict[str, Any]] | None:
        found: list[dict[str, Any]] | None = rpc(probes.stats, None) if spec.caches else None
        return found

    def keep(partial: dict[str, Any]) -> None:
        result["steps"] = partial
        save({**result, "partial": True})

    def kernels(prompt: list[int], tokens: int) -> dict[str, Any]:
        return kernel_profile.profile_step(lambda: generate([prompt], tokens))

    result["steps"] = run_workload(
        spec.workload, generate, deadline, time.time, stats, keep, kernels, jit, spec.caches
    )
    if job.trace and spec.checkpoint.arch == "gpt_oss":
        # Before any probe allocates: what lies past each layer's w13 scales, where the
        # forwards above read it (harness/scale_tails.py).
        try:
            result["scale_tails"] = rpc(scale_tails.tails, None)
        except Exception as exc:
            result["scale_tails_error"] = f"{type(exc).__name__}: {exc}"[:600]
    if spec.caches:
        result["route"] = rpc(probes.routes, None)
        after = stats()
        if after:
            result["cache"] = {
                "since_start": measure_totals(after),
                "layers": len(after),
                "capacity": after[0].get("capacity"),
                "provider": after[0].get("provider"),
                "split": after[0].get("split"),
            }
        # Every resident slot's bytes against its host bytes, at the end of the measurements.
        result["slots"] = rpc(probes.slot_check, None)
    if job.profile_out is not None and time.time() < deadline:
        # After every measurement, as in ``single``: where a decode step's host time goes.
        prompts = [{"prompt_token_ids": p} for p in decode_prompts(spec.workload, 1)]
        profile_into(result, llm, spec.name, Path(job.profile_out), prompts)
    if job.trace:
        result["trace"] = rpc(trace.read, None)
        trace.uninstall()
        if spec.caches:
            # Every prepare of the first generation checked (harness/slot_watch.py).
            try:
                result["slot_watch"] = rpc(slot_watch.read, None)
            except Exception as exc:
                result["slot_watch_error"] = f"{type(exc).__name__}: {exc}"[:600]
        slot_watch.uninstall()
        if spec.caches and time.time() < deadline:
            # The kept real inputs, run again (harness/replay.py); a failure leaves the rest.
            try:
                result["replay"] = rpc(replay.first_forwards, None)
            except Exception as exc:
                result["replay_error"] = f"{type(exc).__name__}: {exc}"[:600]
    if job.shadow and spec.caches:
        # Before the exactness probe, whose own forwards it would count: read, then taken
        # off (its counters take no forward outside vLLM's inference mode).
        result["shadow"] = rpc(shadow.counts, None)
        shadow.uninstall()
    if spec.checkpoint.arch == "gpt_oss" and time.time() < deadline:
        # Every expert's bytes as the kernel reads them, to compare the cache's sources with no
        # offload's own tensors (harness/expert_bytes.py); a failure leaves the rest standing.
        try:
            result["expert_digests"] = rpc(expert_bytes.digests, None)
        except Exception as exc:
            result["expert_digests_error"] = f"{type(exc).__name__}: {exc}"[:600]
    # Last: its random forwards move the cache (after the stats above are taken).
    if spec.caches and time.time() < deadline:
        result["exactness"] = rpc(probes.exactness_in(spec.max_num_batched_tokens), None)
    if job.trace and spec.caches and spec.checkpoint.arch == "gpt_oss" and time.time() < deadline:
        # vLLM's kernel over the same bytes laid out otherwise (harness/placement.py): where
        # the cached forward parts from it with every slot's bytes right.
        try:
            result["placement"] = rpc(placement.placement, None)
        except Exception as exc:
            result["placement_error"] = f"{type(exc).__name__}: {exc}"[:600]


def profile_into(
    result: dict[str, Any], llm: Any, name: str, out: Path, prompts: list[dict[str, Any]]
) -> None:
    """``profiling.profile`` of ``prompts`` into ``result["profile"]``; a failure is recorded
    beside the measurements, which stand without it."""
    try:
        result["profile"] = profile(llm, name, out, prompts)
    except Exception as exc:
        result["profile_error"] = f"{type(exc).__name__}: {exc}"[:600]
        result["profile_traceback"] = traceback.format_exc()[-3000:]


def single(job: Job, llm: Any, rpc: Any, result: dict[str, Any], sampling: Any) -> None:
    """One timed generation of the spec's prompts, ``repeats`` times (and the profile)."""
    spec = job.spec
    if spec.identity_expert_map:
        result["identity_expert_map_layers"] = llm.apply_model(probes.identity_expert_map)[0]

    prompts = [{"prompt_token_ids": list(p)} for p in spec.prompts]
    sp = sampling(max_tokens=spec.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up (first Triton compiles)
    lock = wait_turn(job)
    try:
        before_layers = rpc(probes.stats, None)
        times: list[float] = []
        runs: list[list[list[int]]] = []
        for _ in range(spec.repeats):
            t = time.time()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.time() - t)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
        after_layers = rpc(probes.stats, None)
        if job.profile_out is not None:
            profile_into(result, llm, spec.name, Path(job.profile_out), prompts)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    assert runs
    generated = spec.max_tokens * len(prompts)
    result["tokens"] = runs[-1]
    result["repeats_identical"] = all(r == runs[0] for r in runs)
    result["tok_s_runs"] = [round(generated / t, 1) for t in times]
    result["tok_s"] = round(generated / statistics.median(times), 1)
    if after_layers and before_layers is not None:
        before, after = totals(before_layers), totals(after_layers)
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


def deterministic_inductor() -> dict[str, Any]:
    """Inductor options of every compiled engine: no kernel choice by timing on the device
    (pointwise and reduction configurations, max-autotune, coordinate descent). Each engine
    compiles its model afresh, and a choice by timing can change a reduction's summation order
    from engine to engine: two no-offload engines of one configuration gave different greedy
    tokens (docs/records/2026-12-01-steps-runs-1-2.md). ``deterministic``
    only where this torch has it (vLLM passes unknown options on, and inductor rejects them).

    vLLM turns on inductor's horizontal fusion (``combo_kernels``) and decides each fusion by
    timing it (``benchmark_combo_kernel``) unless the caller names either option; deterministic
    mode refuses that timing (every compiled engine failed so on the H200, 2026-12-01). So the
    fusion stays on, decided without timing."""
    import torch._inductor.config as inductor

    options: dict[str, Any] = {
        "triton.autotune_pointwise": False,
        "max_autotune": False,
        "coordinate_descent_tuning": False,
        "combo_kernels": True,
        "benchmark_combo_kernel": False,
    }
    if hasattr(inductor, "deterministic"):
        options["deterministic"] = True
    return options


def install_hooks(job: Job, multiprocess: bool) -> None:
    """The in-process diagnostics ``job`` asks for (``--shadow``, ``--trace``) and the scale
    guard its spec asks for (``guard_scale_tails``), installed before its engine is built so
    that the engine's CUDA graphs capture them; refused, naming the option, where the engine
    core runs in another process (``multiprocess``)."""
    hooks = (
        ("--shadow", job.shadow, "the plugin", shadow),
        ("--trace", job.trace, "vLLM", trace),
        ("--trace", job.trace, "the providers", slot_watch),
        ("guard_scale_tails", job.spec.guard_scale_tails, "vLLM's MXFP4 method", scale_guard),
    )
    for option, asked, patched, hook in hooks:
        if not asked:
            continue
        if multiprocess:
            raise RuntimeError(
                f"{option} patches {patched} in this process, and this engine's core runs in "
                "another (VLLM_ENABLE_V1_MULTIPROCESSING is not 0)"
            )
        hook.install()


def run(job: Job, save: Any = None) -> dict[str, Any]:
    spec = job.spec
    result: dict[str, Any] = {"name": spec.name, "spec": spec.to_json(), "ok": False}
    result["job"] = {k: v for k, v in job.to_json().items() if k != "spec"}
    t0 = time.time()
    # Multi-process engine: the engine core is another process, and apply_model pickles the
    # function there and the result back; a failure of that is recorded, not fatal. vLLM's
    # default (the variable unset) is another process; the harness sets it either way.
    multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"
    llm: Any = None
    try:
        from vllm import LLM, SamplingParams

        result["import_s"] = round(time.time() - t0, 1)
        if FORKED_ENV in os.environ:  # forked from the zygote, which imported vLLM once
            result["forked"] = json.loads(os.environ[FORKED_ENV])
        from rowcache.vllm._config import MOE_OPS  # the plugin's own list (imports vllm.config)

        kw = engine_kwargs(spec, job.model)
        result["llm_kwargs"] = kw
        # Before the engine: vLLM's JIT monitor chains the hook it finds (harness/jit_count);
        # only where the core runs in this process.
        jit = None if multiprocess else jit_count.counting()
        install_hooks(job, multiprocess)
        t1 = time.time()
        llm = LLM(**llm_arguments(kw))
        result["init_s"] = round(time.time() - t1, 1)
        if spec.guard_scale_tails:
            result["scale_guard"] = scale_guard.record()
        started = 0
        if jit is not None:
            started = jit.mark()
            jit.describe_from(started)
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
        result["probe"] = rpc(probes.probe, {})
        if spec.caches and not result["probe"].get("cached_layers"):
            raise RuntimeError(
                "the cache is configured (additional_config rowcache) but no MoE layer is "
                f"cached (probe: {result['probe']}): the plugin did not load; this engine "
                "would measure vLLM without the cache"
            )
        if spec.offload is not None:
            result["offloader"] = rpc(probes.offloader, None)
            check_offloader(spec, result["offloader"])
        if spec.workload is not None:
            lock = wait_turn(job)
            try:
                workload(job, llm, rpc, result, save or (lambda _r: None), SamplingParams, jit)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
                lock.close()
            result["jit"] = built_after_start(jit, started)
        else:
            single(job, llm, rpc, result, SamplingParams)
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
