"""End-to-end run of the rowcache vLLM plugin on a GPU machine (issue 5, section 5).

    python3 tools/vllm/e2e.py run --out OUTDIR [--phases tiny,qwen8,story] [--deadline S]

Phases (each engine is a child process of this script, ``child`` below):

* ``tiny``: a 2-layer, 16-expert, top-4 Qwen3-MoE with random weights; 4 token-id prompts x 32
  greedy tokens; eager and piecewise-graph modes; no cache, ``cached`` and ``row`` with the
  token split and 6 slots (fewer than the experts a step uses), ``row`` with the expert split;
  two more engines under VLLM_LOGGING_LEVEL=DEBUG, where vLLM asserts that every captured piece
  is replayed with its capture-time input addresses: vLLM's MoE op made a splitting op as is,
  and the same with the plugin's capture-stable output.
* ``qwen8``: 8 layers with Qwen3-30B-A3B layer shapes, batch 1, 256 greedy tokens, medians of
  three: (a) no cache, full graphs; (b) no cache, MoE op eager between captured pieces (the
  plugin's baseline mode), with eager and vLLM's own piecewise-with-MoE-split as references;
  (c) ``cached``/``row`` with 128 slots (every expert stays resident); (d) ``cached``/``row``
  with 32 slots.
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
import fcntl
import importlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CKPT_TOOL = os.environ.get("ROWCACHE_CKPT_TOOL", ".gpu/tools/make_moe_checkpoint.py")
MOE_OPS = ["vllm::moe_forward", "vllm::moe_forward_shared"]

TINY_PROMPTS = [
    [1, 17, 42, 99, 123, 7],
    [1, 300, 301, 302],
    [1, *range(50, 90)],
    [1, 5],
]
QWEN_PROMPT = [1, 17, 42, 99, 123, 7, 300, 301]


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
    try:
        from vllm import LLM, SamplingParams

        result["import_s"] = round(time.time() - t0, 1)
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
        cc_final = llm.llm_engine.vllm_config.compilation_config
        result["cudagraph_mode"] = str(cc_final.cudagraph_mode.name)
        result["moe_split"] = [op for op in (cc_final.splitting_ops or []) if op in MOE_OPS]
        result["probe"] = llm.apply_model(_probe)[0]
        if spec.get("identity_expert_map"):
            result["identity_expert_map_layers"] = llm.apply_model(_identity_expert_map)[0]

        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        sp = SamplingParams(
            max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True
        )
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up (first Triton compiles)
        lock = _wait_turn(spec)
        try:
            before = _totals(llm.apply_model(_stats)[0])
            times, outs, runs = [], None, []
            for _ in range(spec.get("repeats", 1)):
                t = time.time()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                times.append(time.time() - t)
                runs.append([list(o.outputs[0].token_ids) for o in outs])
            after_layers = llm.apply_model(_stats)[0]
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
        assert outs is not None
        after = _totals(after_layers)
        generated = spec["max_tokens"] * len(prompts)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["repeats_identical"] = all(r == runs[0] for r in runs)
        result["tok_s_runs"] = [round(generated / t, 1) for t in times]
        result["tok_s"] = round(generated / statistics.median(times), 1)
        if after_layers:
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
    result["wall_s"] = round(time.time() - t0, 1)
    return result


# -- orchestration ------------------------------------------------------------------------------


def _tiny_specs(model: str) -> list[dict[str, Any]]:
    base = {"model": model, "prompts": TINY_PROMPTS, "max_tokens": 32, "max_model_len": 512}
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


def _rerun_specs(tiny: str, qwen8: str) -> list[dict[str, Any]]:
    """The second run: the same-mode references (MoE op eager between pieces, with and without
    an identity expert_map) next to the cache runs, and (a) to (d) again in one phase."""
    tiny_base = {"model": tiny, "prompts": TINY_PROMPTS, "max_tokens": 32, "max_model_len": 512}
    eager_moe = {"moe_eager_between_graphs": True}
    specs = [
        {**tiny_base, "name": "tiny.piecewise.eager_moe", "mode": "default", "rowcache": eager_moe},
        {
            **tiny_base,
            "name": "tiny.piecewise.eager_moe.idmap",
            "mode": "default",
            "rowcache": eager_moe,
            "identity_expert_map": True,
        },
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
    barrier = logs / f"barrier.{specs[0]['name'].split('.')[0]}"
    barrier.mkdir(exist_ok=True)
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


def _build(out: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, CKPT_TOOL, out, *args], stdout=f, stderr=subprocess.STDOUT
        )


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
    refs = {
        "tiny.eager.": "tiny.eager.none",
        "tiny.piecewise.": "tiny.piecewise.none",
        "tiny.debug.": "tiny.piecewise.none",
        "qwen8.": "qwen8.ref.eager",
        "story.": "story.none",
    }
    for name, r in results.items():
        ref = next((v for k, v in refs.items() if name.startswith(k)), "")
        if name.startswith("qwen8.") and ("row" in name or "cached" in name):
            idmap = "qwen8.b.eager_moe.idmap"
            ref = idmap if idmap in results else "qwen8.b.eager_moe"
        if name.startswith("tiny.piecewise.") and "tiny.piecewise.eager_moe.idmap" in results:
            ref = "tiny.piecewise.eager_moe.idmap"
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
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    start = time.time()
    deadline = start + args.deadline
    out = Path(args.out)
    logs = Path(args.work) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    results: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {"phases": phases, "commit": os.environ.get("ROWCACHE_COMMIT", "?")}
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
    if ("tiny" in phases or "rerun" in phases) and not (tiny / "config.json").exists():
        subprocess.run([sys.executable, CKPT_TOOL, str(tiny)], check=True)
    meta["tiny_ckpt_s"] = round(time.time() - t, 1)

    def builder() -> subprocess.Popen[bytes]:
        cmd = (
            f"{sys.executable} {CKPT_TOOL} {qwen8} --qwen3-30b-a3b --layers 8"
            if ("qwen8" in phases or "rerun" in phases) and not (qwen8 / "config.json").exists()
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
    if "qwen8" in phases or "story" in phases:
        build.wait(timeout=max(1.0, deadline - time.time()))
    if "qwen8" in phases:
        for r in _phase(_qwen_specs(str(qwen8)), logs, deadline, None):
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "summary.txt").write_text(summary + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(logs.glob("*.log")) + sorted(logs.glob("*.json")):
            tar.add(path, arcname=path.name)
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
    ap.add_argument("mode", choices=["run"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/rc-e2e")
    ap.add_argument("--phases", default="tiny,qwen8,story")
    ap.add_argument("--deadline", type=float, default=540.0)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
