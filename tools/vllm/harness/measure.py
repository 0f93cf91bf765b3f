"""What one engine with a :class:`~tools.vllm.harness.specs.Workload` measures, in turn,
before its deadline.

Order: every decode batch size once (two short warm-ups, then one timed generation of
``decode_tokens`` greedy tokens per sequence), then the time to first token of the long
prompts (a warm-up prompt, then each timed prompt, all distinct), then the further timed
generations of each batch size, up to ``repeats``. So a deadline that is too short for
everything costs repeats first, and every measurement that fits once is there. Before each
timed generation the time it needs is estimated (the second warm-up scaled to the timed
length, or the previous timed generation); one that would end after the deadline (less the
``ttft_reserve_s`` kept for the long prompts while decode runs) is not started and the
measurement says why. ``save`` gets the record after every generation, so an engine stopped
from outside still leaves what it measured.

vLLM comes in through ``generate`` (token-id prompts and a token count in, one
:class:`Completion` per prompt out) and ``stats`` (the provider stats of every cached layer,
or None), so all of this runs on the CPU with fakes (``tests/test_e2e_steps.py``). Where a
:class:`~tools.vllm.harness.jit_count.JitCounter` is given, every timed figure names the
Triton kernels built inside its timed runs (``jit_compiles``; None: not counted): a build
stalls the step it falls in.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.vllm.harness.jit_count import JitCounter
from tools.vllm.harness.specs import Workload

FIRST_PROMPT = (1, 17, 42, 99, 123, 7, 300, 301)
"""Sequence 0 of every batch: the recorded runs' 8-token prompt (``engines.QWEN_PROMPT``)."""
STAT_KEYS = ("hits", "misses", "evictions", "prepare_calls", "passes", "forwards")


@dataclass(frozen=True)
class Completion:
    """One sequence of a generation: its token ids, and vLLM's own time to first token when it
    reports one (``RequestOutput.metrics.first_token_latency``; None without stats)."""

    tokens: list[int]
    first_token_s: float | None = None


Generate = Callable[[list[list[int]], int], list[Completion]]
Stats = Callable[[], list[dict[str, Any]] | None]
Record = dict[str, Any]
KernelProfile = Callable[[list[int], int], dict[str, Any]]
"""One generation of a prompt and a token count under the GPU profiler: its summary
(``harness/kernel_profile.py``)."""
KERNEL_PROFILE_S = 15.0
"""Time the long prompt's kernel profile is started with at least: a 2,048-token step takes
under 0.3 s, the profiler's start and the processing of its events some seconds."""
DECODE_PROFILE_S = 30.0
"""Time the two b1 decode profiles are started with at least: three generations of 17 decode
tokens (two unprofiled) and one of a single token take a full-depth model's UVA engine about
2 s, the profiles' events some seconds to process, and the engine's probes after the workload
(the slot audit, the exactness probe) need the rest."""
DECODE_PROFILE_ALONE_S = 10.0
"""The same for an engine without the cache, which runs no probe after its workload: on two
H100s on 2026-12-06 both profiles took 0.6 to 2.2 s for no offload and 1.1 to 4.7 s for UVA,
where the 30 s reserve left four no-offload engines unprofiled with 21.7 to 28.1 s to spare."""


def decode_prompts(workload: Workload, batch: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_tokens`` ids: the first ``batch`` of one seeded list, so
    sequence ``i`` has the same prompt at every batch size."""
    prompts = [list(FIRST_PROMPT[: workload.prompt_tokens])]
    for i in range(1, batch):
        rng = random.Random(workload.seed * 1_000_003 + i)
        prompts.append([rng.randrange(3, workload.vocab) for _ in range(workload.prompt_tokens)])
    return prompts


def prefill_prompts(workload: Workload) -> list[list[int]]:
    """The warm-up prompt, then the ``prefill_prompts`` timed ones: ``prefill_tokens`` ids each,
    distinct from their first token on (no prefix-cache block of one serves another)."""
    prompts = []
    for i in range(workload.prefill_prompts + 1):
        rng = random.Random(f"prefill:{workload.seed}:{i}")
        first = 3 + (workload.seed * 7919 + i) % (workload.vocab - 3)
        rest = [rng.randrange(3, workload.vocab) for _ in range(workload.prefill_tokens - 1)]
        prompts.append([first, *rest])
    return prompts


def totals(per_layer: list[dict[str, Any]]) -> dict[str, int]:
    return {k: sum(int(s.get(k, 0)) for s in per_layer) for k in STAT_KEYS}


def counter_difference(
    before: list[dict[str, Any]] | None, after: list[dict[str, Any]] | None
) -> dict[str, int] | None:
    """The cached layers' counters over a span, from their ``stats()`` read before and after
    it (None where either read found none: no cache)."""
    if not before or not after:
        return None
    b, a = totals(before), totals(after)
    return {k: a[k] - b[k] for k in STAT_KEYS}


def hit_rate(counts: dict[str, int]) -> float | None:
    requests = counts.get("hits", 0) + counts.get("misses", 0)
    return round(counts["hits"] / requests, 4) if requests else None


class Measurement:
    """Runs ``run_workload``'s steps against one clock and deadline."""

    def __init__(
        self,
        workload: Workload,
        generate: Generate,
        deadline: float,
        clock: Callable[[], float],
        stats: Stats | None = None,
        save: Callable[[Record], None] | None = None,
        jit: JitCounter | None = None,
        probes_after: bool = True,
    ) -> None:
        self.workload = workload
        self.probes_after = probes_after
        self.generate = generate
        self.deadline = deadline
        self.clock = clock
        self.stats = stats
        self.save = save
        self.jit = jit
        self.record: Record = {
            "decode": {
                str(b): {
                    "batch": b,
                    "times_s": [],
                    "tok_s": None,
                    "tok_s_runs": [],
                    "repeats_run": 0,
                    "tokens": None,
                    "repeats_identical": None,
                    "warmup_s": [],
                    "estimate_s": None,
                    "cache": None,
                    "jit_compiles": None,
                    "skipped": None,
                }
                for b in workload.batches
            },
            "ttft": {
                "prompt_tokens": workload.prefill_tokens,
                "ms": None,
                "ms_runs": [],
                "engine_ms_runs": [],
                "warmup_ms": None,
                "first_tokens": [],
                "cache": None,
                "jit_compiles": None,
                "skipped": None,
            },
            "events": [],
        }
        self._runs: dict[int, list[list[list[int]]]] = {b: [] for b in workload.batches}
        self._times: dict[int, list[float]] = {b: [] for b in workload.batches}
        self._counts: dict[str, dict[str, int]] = {}
        self._built: dict[str, list[str]] = {}

    # -- helpers ------------------------------------------------------------------------

    def left(self, reserve: float = 0.0) -> float:
        return self.deadline - reserve - self.clock()

    def _event(self, what: str) -> None:
        self.record["events"].append(f"{self.left():.1f}s left: {what}")

    def flush(self) -> None:
        self.record["deadline_left_s"] = round(self.left(), 1)
        if self.save is not None:
            self.save(self.record)

    def _timed(
        self, key: str, prompts: list[list[int]], max_tokens: int
    ) -> tuple[float, list[Completion]]:
        """One generation, timed; the cached layers' counters before and after it (outside
        the timed section: reading them may wait for the device) go to ``key``'s counts."""
        before = self.stats() if self.stats is not None else None
        mark = self.jit.mark() if self.jit is not None else 0
        t = self.clock()
        outs = self.generate(prompts, max_tokens)
        elapsed = self.clock() - t
        if self.jit is not None:
            self._built.setdefault(key, []).extend(self.jit.since(mark))
        after = self.stats() if self.stats is not None else None
        span = counter_difference(before, after)
        if span is not None:
            counts = self._counts.setdefault(key, dict.fromkeys(STAT_KEYS, 0))
            for k in STAT_KEYS:
                counts[k] += span[k]
        return elapsed, outs

    def _jit(self, key: str) -> list[str] | None:
        """The Triton kernels built inside ``key``'s timed runs, by name (None: not counted)."""
        if self.jit is None or self.jit.failure is not None:
            return None
        return list(self._built.get(key, []))

    def _cache(self, key: str) -> dict[str, Any] | None:
        counts = self._counts.get(key)
        return None if counts is None else {**counts, "hit_rate": hit_rate(counts)}

    # -- decode -------------------------------------------------------------------------

    def warm_up(self, batch: int) -> bool:
        """Two short generations; the timed one's estimate. False: no time for them."""
        entry = self.record["decode"][str(batch)]
        w = self.workload
        if self.left(w.ttft_reserve_s) <= 0:
            entry["skipped"] = "deadline: no time left for its warm-up"
            self._event(f"b{batch} skipped")
            return False
        prompts = decode_prompts(w, batch)
        for _ in range(2):
            t = self.clock()
            self.generate(prompts, w.warmup_tokens)
            entry["warmup_s"].append(round(self.clock() - t, 3))
        per_token = entry["warmup_s"][-1] / w.warmup_tokens
        entry["estimate_s"] = round(per_token * w.decode_tokens, 2)
        self._event(f"b{batch} warmed up, a generation about {entry['estimate_s']} s")
        return True

    def decode_once(self, batch: int, reserve: float) -> bool:
        """One more timed generation at ``batch``, if it fits; whether it ran."""
        entry = self.record["decode"][str(batch)]
        w = self.workload
        times = self._times[batch]
        estimate = statistics.median(times) if times else float(entry["estimate_s"] or 0.0)
        if estimate > self.left(reserve):
            why = f"deadline: a generation takes about {estimate:.1f} s, "
            why += f"{max(0.0, self.left(reserve)):.1f} s left"
            if not times:
                entry["skipped"] = why
            else:
                entry["repeats_cut"] = why
            self._event(f"b{batch} repeat {len(times) + 1} not run")
            return False
        prompts = decode_prompts(w, batch)
        elapsed, outs = self._timed(f"b{batch}", prompts, w.decode_tokens)
        runs = self._runs[batch]
        runs.append([list(o.tokens) for o in outs])
        times.append(max(elapsed, 1e-9))
        generated = batch * w.decode_tokens
        entry["times_s"] = [round(t, 4) for t in times]
        entry["tok_s_runs"] = [round(generated / t, 1) for t in times]
        entry["tok_s"] = round(generated / statistics.median(times), 1)
        entry["repeats_run"] = len(times)
        entry["tokens"] = runs[-1]
        entry["repeats_identical"] = all(r == runs[0] for r in runs)
        entry["cache"] = self._cache(f"b{batch}")
        entry["jit_compiles"] = self._jit(f"b{batch}")
        self._event(f"b{batch} repeat {len(times)}: {elapsed:.2f} s")
        self.flush()
        return True

    # -- time to first token --------------------------------------------------------------

    def kernels(self, profiler: KernelProfile | None) -> None:
        """The first timed long prompt once more, under the GPU profiler (last: it times
        nothing the other measurements report), where the workload asks for it."""
        w = self.workload
        if not w.ttft_kernel_profile or not w.prefill_prompts or profiler is None:
            return
        self._profile("ttft_kernels", lambda: profiler(prefill_prompts(w)[1], 1))

    def decode_kernels(self, profiler: KernelProfile | None) -> None:
        """b1 decode under the GPU profiler, where the workload asks for it: the decode prompt
        with its first token alone, then with ``decode_kernel_profile`` tokens more. Before
        each profile the longer generation runs unprofiled: with LRU victims both profiles then
        start from the cache state it leaves (greedy tokens route the same way each time), so
        their difference is the tokens more, not also a prefill that found more of its experts
        resident the second time; with ``lfu`` the request counts keep growing between them, so
        the two prefills can still differ. Each profile keeps the cached layers' counters over
        it (``cache``), so a token's misses stand beside its gather time."""
        w = self.workload
        tokens = w.decode_kernel_profile
        if not tokens or profiler is None:
            return
        prompt = decode_prompts(w, 1)[0]

        def profiled(count: int) -> dict[str, Any]:
            self.generate([prompt], 1 + tokens)
            before = self.stats() if self.stats is not None else None
            found = profiler(prompt, count)
            span = counter_difference(before, self.stats() if self.stats is not None else None)
            return found if span is None else {**found, "cache": span}

        def both() -> dict[str, Any]:
            first = profiled(1)
            return {"tokens": tokens, "first": first, "whole": profiled(1 + tokens)}

        needs = DECODE_PROFILE_S if self.probes_after else DECODE_PROFILE_ALONE_S
        self._profile("decode_kernels", both, needs)

    def _profile(
        self, key: str, run: Callable[[], dict[str, Any]], needs: float = KERNEL_PROFILE_S
    ) -> None:
        label = key.replace("_", " ")
        if self.left() < needs:
            self.record[key] = {"skipped": "deadline: no time left"}
            self._event(f"{label} skipped")
            return
        try:
            self.record[key] = run()
        except Exception as error:  # the measurements stand without it
            self.record[key] = {"error": f"{type(error).__name__}: {error}"[:600]}
        self._event(f"{label} profiled")
        self.flush()

    def ttft(self) -> None:
        entry = self.record["ttft"]
        w = self.workload
        if not w.prefill_prompts:
            entry["skipped"] = "not measured (no prefill prompts in the workload)"
            return
        prompts = prefill_prompts(w)
        if self.left() <= 0:
            entry["skipped"] = "deadline: no time left"
            self._event("ttft skipped")
            return
        t = self.clock()
        self.generate([prompts[0]], 1)
        warm = self.clock() - t
        entry["warmup_ms"] = round(warm * 1000, 2)
        for prompt in prompts[1:]:
            ran = entry["ms_runs"]
            estimate = statistics.median(ran) / 1000 if ran else warm
            if estimate > self.left():
                entry["skipped" if not ran else "repeats_cut"] = (
                    f"deadline: a prompt takes about {estimate:.2f} s"
                )
                break
            elapsed, outs = self._timed("ttft", [prompt], 1)
            ran.append(round(elapsed * 1000, 2))
            entry["first_tokens"].append(outs[0].tokens[0] if outs and outs[0].tokens else None)
            engine = outs[0].first_token_s if outs else None
            entry["engine_ms_runs"].append(None if engine is None else round(engine * 1000, 2))
            entry["ms"] = round(statistics.median(ran), 2)
            entry["cache"] = self._cache("ttft")
            entry["jit_compiles"] = self._jit("ttft")
            self.flush()
        self._event(f"ttft: {len(entry['ms_runs'])} prompts")


def cut_short(record: Record) -> list[str]:
    """What the deadline left unmeasured in a workload's record ("b8: ...", "ttft: ..."):
    a record with any is not complete, and ``run --resume`` runs its engine again."""
    entries = [(f"b{b}", e) for b, e in record.get("decode", {}).items()]
    entries.append(("ttft", record.get("ttft", {})))
    return [
        f"{label}: {why}"
        for label, entry in entries
        for why in (entry.get("skipped"), entry.get("repeats_cut"))
        if isinstance(why, str) and why.startswith("deadline")
    ]


def run_workload(
    workload: Workload,
    generate: Generate,
    deadline: float,
    clock: Callable[[], float],
    stats: Stats | None = None,
    save: Callable[[Record], None] | None = None,
    profiler: KernelProfile | None = None,
    jit: JitCounter | None = None,
    probes_after: bool = True,
) -> Record:
    """Every measurement of ``workload`` in the order of the module docstring, then the kernel
    profiles of one long prompt and of b1 decode where the workload asks for them
    (``profiler``); ``probes_after``: the engine's probes run after it (a cache engine's slot
    audit and exactness probe), so the decode profile leaves them their time."""
    m = Measurement(workload, generate, deadline, clock, stats, save, jit, probes_after)
    warmed = []
    for batch in workload.batches:
        if m.warm_up(batch) and m.decode_once(batch, workload.ttft_reserve_s):
            warmed.append(batch)
    m.ttft()
    for _ in range(1, workload.repeats):
        for batch in warmed:
            entry = m.record["decode"][str(batch)]
            if entry.get("repeats_cut") is None:
                m.decode_once(batch, 0.0)
    m.kernels(profiler)
    m.decode_kernels(profiler)
    m.flush()
    return m.record
