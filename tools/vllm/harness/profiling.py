"""Profiles of one engine's MoE forward (``run --profile``).

After its timed generations, still holding the timing lock, a profiled engine generates
``PROFILE_TOKENS`` more greedy tokens per prompt twice: once with only the MoE path's functions
wrapped in ``perf_counter`` timers (little overhead), once under cProfile. :func:`profile`
writes the text report and the ``.pstats`` file and returns the figures for results.json.
"""

from __future__ import annotations

import cProfile
import inspect
import io
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tools.vllm.harness.probes import first_moe_method

PROFILE_TOKENS = 64
"""Greedy tokens per prompt of each profile generation."""
BREAKDOWN = ("apply", "d2h", "plan", "prepare", "kernel", "stable", "run_with_expert_cache")
"""What one MoE forward's time is broken into (labels of the timers and of the cProfile keys)."""
CodeKey = tuple[str, int, str]
"""cProfile's key of a function: ``(file, first line, name)``."""


def timer_targets(method: Any) -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of everything ``Timers`` wraps, where the callers look it up."""
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


def profile_functions(method: Any) -> dict[str, Any]:
    """The Python functions of one MoE forward, by breakdown label: what ``Timers`` wraps,
    looked up before it does, and vLLM's own ``apply``. ``d2h`` (``Tensor.cpu``) is a builtin,
    which the profile finds by name."""
    funcs: dict[str, Any] = {
        label: getattr(owner, attr)
        for owner, attr, label in timer_targets(method)
        if label != "d2h"
    }
    for base in type(method).__mro__[1:]:  # vLLM's apply, which (b) calls through super()
        if "apply" in vars(base):
            funcs["parent_apply"] = vars(base)["apply"]
            break
    return funcs


class Timers:
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

    def __enter__(self) -> Timers:
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


def code_key(fn: Any) -> CodeKey | None:
    """The key cProfile files a Python function under: ``(file, first line, name)``."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    if code is None:
        return None
    return (code.co_filename, code.co_firstlineno, code.co_name)


def is_d2h(key: CodeKey) -> bool:
    """cProfile's key of ``Tensor.cpu``, a builtin: ``('~', 0, "<method 'cpu' of ...>")``."""
    return key[0] == "~" and "'cpu'" in key[2]


def key_label(key: CodeKey) -> str:
    path, line, name = key
    if path == "~":
        return name
    return f"{'/'.join(Path(path).parts[-2:])}:{line}({name})"


def breakdown(stats: dict[Any, Any], keys: dict[str, CodeKey | None]) -> dict[str, dict[str, Any]]:
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
        if not is_d2h(key):
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


def callees(
    stats: dict[Any, Any], key: CodeKey | None, limit: int = 15
) -> list[tuple[str, int, float]]:
    """What ``key`` calls: (function, calls, cumulative seconds from ``key``), largest first."""
    if key is None:
        return []
    rows = []
    for callee, row in stats.items():
        via = row[4].get(key)
        if via:
            rows.append((key_label(callee), int(via[0]), float(via[3])))
    rows.sort(key=lambda r: -r[2])
    return rows[:limit]


def per_forward(parts: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
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
        if entry is not None and int(entry.get("calls", 0)) > 0:
            per[label] = round(float(entry["cum_s"]) * 1e6 / forwards, 1)
        else:
            per[label] = None
    below = per["run_with_expert_cache"]
    if below is None:
        below = per["kernel"]
    spent = sum(v or 0.0 for v in (per["d2h"], per["stable"], below))
    per["other"] = round(per["apply"] - spent, 1)
    return per


def forward_line(per: dict[str, Any] | None) -> str:
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


def profile(llm: Any, name: str, out: Path, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Two more greedy generations of an in-process engine: under timers, then under cProfile.

    With VLLM_ENABLE_V1_MULTIPROCESSING=0 vLLM 0.25.0 steps the engine core in the calling
    thread (``InprocClient.get_output`` -> ``EngineCore.step`` -> ``UniProcExecutor``, which
    runs the worker's ``execute_model`` directly, also when it does not block), so the model's
    Python, the eager MoE op included, runs in this thread, the one cProfile is enabled in. The
    timers record which threads ``apply`` ran in, to confirm it.

    Writes ``out`` (text) and the same name with ``.pstats``.
    """
    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=PROFILE_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True
    )
    method = llm.apply_model(first_moe_method)[0]
    funcs = profile_functions(method)  # before the timers patch any of them
    keys = {label: code_key(fn) for label, fn in funcs.items()}
    provider = getattr(method, "rowcache_provider", None)
    kernel = getattr(method, "moe_kernel", None)
    report: dict[str, Any] = {
        "tokens": PROFILE_TOKENS * len(prompts),
        "method": f"{type(method).__module__}.{type(method).__qualname__}",
        "provider": None if provider is None else type(provider).__name__,
        "kernel": None if kernel is None else type(kernel).__name__,
        "keys": {label: None if k is None else key_label(k) for label, k in keys.items()},
        "threads": sorted(t.name for t in threading.enumerate()),
    }

    lines = [
        f"profile of {name}: {report['tokens']} greedy tokens, batch {len(prompts)}, "
        "after the timed generations, under the timing lock",
        f"method {report['method']}, provider {report['provider']}, kernel {report['kernel']}",
        f"threads in the engine process: {', '.join(report['threads'])}",
    ]

    # 1. Timers around the MoE path only.
    timers = Timers(timer_targets(method))
    try:
        start = time.perf_counter()
        with timers:
            llm.generate(prompts, sp, use_tqdm=False)
        report["timers_gen_s"] = round(time.perf_counter() - start, 3)
        report["timers"] = timers.parts
        report["timers_per_forward"] = per_forward(timers.parts)
        report["apply_threads"] = len(timers.apply_threads)
        report["apply_in_this_thread_only"] = timers.apply_threads == {threading.get_ident()}
    except Exception as exc:
        report["timers_error"] = f"{type(exc).__name__}: {exc}"[:600]

    # 2. cProfile over the whole generation.
    table: dict[Any, Any] = {}
    st: pstats.Stats | None = None
    buf = io.StringIO()
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
        parts = breakdown(table, keys)
        report["cprofile"] = parts
        report["cprofile_per_forward"] = per_forward(parts)
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
        f"{forward_line(report.get('timers_per_forward'))}",
        f"  cProfile (generate {report.get('cprofile_gen_s')} s): "
        f"{forward_line(report.get('cprofile_per_forward'))}",
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
        where = key_label(key) if key else ("Tensor.cpu" if label.startswith("d2h") else "-")
        lines.append(
            f"  {label:22} {part['calls']:>8} {part['cum_s']:>10.4f} "
            f"{part.get('self_s', 0.0):>10.4f}  {where}"
        )
    for label in ("apply", "parent_apply", "run_with_expert_cache", "prepare", "plan", "kernel"):
        rows = callees(table, keys.get(label))
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
