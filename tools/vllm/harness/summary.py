"""The printed summary of a run's (or merged runs') results.

One row per engine (the steps comparison's engines in tables of their own, from
``steps_report``): graph mode, MoE split, speed, hit rate, prepare calls per forward, expert
GPU memory, allocated memory, and its tokens against its reference (the first engine of its
spec's ``compare_with`` that ran, else the last); then the targets, the multi-process engine's
line and the profiles.
"""

from __future__ import annotations

import json
from typing import Any

from tools.vllm.harness import records, steps_report
from tools.vllm.harness.engines import (
    MP_ENGINE,
    QWEN_B,
    QWEN_C_ROW,
    QWEN_D_CACHED,
    QWEN_D_ROW,
)
from tools.vllm.harness.phases import Results
from tools.vllm.harness.profiling import PROFILE_TOKENS, forward_line


def reference(name: str, results: Results) -> str:
    """The engine whose tokens ``name``'s are compared with ("" for none)."""
    recorded = (results.get(name, {}).get("spec") or {}).get("compare_with")
    candidates = tuple(recorded) if recorded is not None else records.compare_with(name)
    for candidate in candidates:
        if results.get(candidate, {}).get("ok"):
            return str(candidate)
    return str(candidates[-1]) if candidates else ""


def fmt_bytes(n: Any) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def compare(results: Results, ref: str, name: str) -> str:
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


def summarize(results: Results, meta: dict[str, Any]) -> str:
    lines = [f"rowcache e2e  {json.dumps(meta)}", ""]
    header = (
        f"{'engine':34} {'graphs':10} {'moe split':9} {'tok/s':>7} {'hit':>6} "
        f"{'prep/fwd':>9} {'expGPU GiB':>10} {'alloc GiB':>9}  tokens"
    )
    lines.append(header)
    for name, r in results.items():
        if name.startswith("steps.") or r.get("steps") is not None:
            continue  # the steps comparison's table
        ref = reference(name, results)
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
        cmp = "reference" if name == ref else compare(results, ref, name)
        if r.get("repeats_identical") is False:
            cmp += "; REPEATS DIFFER"
        split = "yes" if r.get("moe_split") else "no"
        lines.append(
            f"{name:34} {r.get('cudagraph_mode', '?'):10} {split:9} "
            f"{r.get('tok_s', 0):>7} {('-' if hit is None else f'{hit:.3f}'):>6} {prep:>9} "
            f"{fmt_bytes(probe.get('expert_gpu_bytes')):>10} "
            f"{fmt_bytes(probe.get('allocated')):>9}  {cmp}"
        )

    def speed(name: str) -> float | None:
        r = results.get(name, {})
        return r.get("tok_s") if r.get("ok") else None

    b, c_row, d_row, d_cached = (
        speed(QWEN_B),
        speed(QWEN_C_ROW),
        speed(QWEN_D_ROW),
        speed(QWEN_D_CACHED),
    )
    if b and c_row:
        verdict = "met" if c_row >= 0.9 * b else "NOT met"
        lines.append(f"\ntarget (c) row >= 0.9 x (b): {c_row} / {b} = {c_row / b:.3f} ({verdict})")
    if d_row and d_cached:
        verdict = "met" if d_row >= d_cached else "NOT met"
        lines.append(f"target (d) row >= cached: {d_row} vs {d_cached} ({verdict})")
    if MP_ENGINE in results:
        lines += ["", _mp_line(results, reference(MP_ENGINE, results))]
    lines += _profile_lines(results)
    lines += steps_report.report(results)
    return "\n".join(lines)


def _mp_line(results: Results, ref: str) -> str:
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
        f"{head} {where}; tokens {compare(results, ref, MP_ENGINE)}; {stats}; "
        f"MoE method {probe.get('method', '?')}; engine shutdown {r.get('engine_shutdown', '?')}"
    )


def _profile_lines(results: Results) -> list[str]:
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
            lines.append(f"{name}: per MoE forward: {forward_line(per)} [{source}]")
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

    b, c = timers(QWEN_B), timers(QWEN_C_ROW)
    if b and c:
        labels = ("apply", "d2h", "plan", "prepare", "kernel", "stable", "other")
        diff = ", ".join(f"{k} {(c.get(k) or 0.0) - (b.get(k) or 0.0):+.1f}" for k in labels)
        lines.append(f"(c) row128 minus (b), timers, us per MoE forward: {diff}")
    return lines
