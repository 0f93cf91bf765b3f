"""The engines of the phases ``tiny``, ``mp``, ``qwen8``, ``story``, ``steps`` and ``archs``,
and their checkpoints.

The phases that repeat earlier runs (``split``, ``qwen8seq``, ``rerun``) pick from these in
:mod:`tools.vllm.harness.reruns`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tools.vllm.harness.specs import (
    Checkpoint,
    EngineSpec,
    Knob,
    Mode,
    Offload,
    OffloadBackend,
    Planner,
    Provider,
    Split,
    Workload,
)

TINY = Checkpoint("tiny-moe", foreground=True)
QWEN8 = Checkpoint("qwen8", qwen3_30b_a3b=True, layers=8)
QWEN24 = Checkpoint("qwen24", qwen3_30b_a3b=True, layers=24)
QWEN8_SKEW = Checkpoint("qwen8-skew", qwen3_30b_a3b=True, layers=8, router_skew=1.0)

TINY_PROMPTS = (
    (1, 17, 42, 99, 123, 7),
    (1, 300, 301, 302),
    (1, *range(50, 90)),
    (1, 5),
)
QWEN_PROMPT = (1, 17, 42, 99, 123, 7, 300, 301)
QWEN_EXPERTS = 128
TINY_SLOTS = 6  # fewer than the up to 16 experts a step of the tiny model routes to

# Names the summary reads (targets, the multi-process line, profile differences) and the
# references engines are compared with.
TINY_EAGER_NONE = "tiny.eager.none"
TINY_PIECEWISE_NONE = "tiny.piecewise.none"
TINY_EAGER_MOE = "tiny.piecewise.eager_moe"
TINY_EAGER_MOE_IDMAP = "tiny.piecewise.eager_moe.idmap"
MP_ENGINE = "mp.eager.row.token"
MP_REF = "mp.ref.eager.none"
QWEN_B = "qwen8.b.eager_moe"
QWEN_B_IDMAP = "qwen8.b.eager_moe.idmap"
QWEN_C_ROW = "qwen8.c.row128"
QWEN_D_ROW = "qwen8.d.row32"
QWEN_D_CACHED = "qwen8.d.cached32"
STORY_NONE = "story.none"

TINY_PIECEWISE_REFS = (TINY_EAGER_MOE_IDMAP, TINY_EAGER_MOE, TINY_PIECEWISE_NONE)
"""The tiny model's piecewise engines: compared with the same-mode reference (no cache, the MoE
op eager between pieces; with an identity map where that ran), else vLLM's piecewise engine."""


def tiny_engine(name: str, mode: Mode, knob: Knob | None = None, **fields: Any) -> EngineSpec:
    """An engine of the tiny model: 4 prompts x 32 greedy tokens, context 512."""
    return EngineSpec(
        name=name,
        checkpoint=TINY,
        prompts=TINY_PROMPTS,
        max_tokens=32,
        mode=mode,
        knob=knob,
        max_model_len=512,
        **fields,
    )


def tiny_eager_moe() -> EngineSpec:
    """The tiny model's same-mode reference for its piecewise cache engines: no cache, the MoE
    op eager between captured pieces (the plugin's baseline mode)."""
    return tiny_engine(
        TINY_EAGER_MOE,
        Mode.DEFAULT,
        Knob(eager_between_graphs=True),
        compare_with=TINY_PIECEWISE_REFS,
    )


def tiny() -> list[EngineSpec]:
    """Eager and piecewise: no cache, ``cached``/``row`` token split and ``row`` expert split
    with 6 slots; then vLLM's DEBUG replay-address check on vLLM's MoE op as a splitting op and
    on the plugin's engine."""
    specs = []
    for graphs, refs in ((Mode.EAGER, (TINY_EAGER_NONE,)), (Mode.PIECEWISE, TINY_PIECEWISE_REFS)):
        specs.append(tiny_engine(f"tiny.{graphs.value}.none", graphs, compare_with=refs))
        for provider, split in (
            (Provider.CACHED, Split.TOKEN),
            (Provider.ROW, Split.TOKEN),
            (Provider.ROW, Split.EXPERT),
        ):
            specs.append(
                tiny_engine(
                    f"tiny.{graphs.value}.{provider.value}.{split.value}",
                    # piecewise cache engines take vLLM's default graph settings: the plugin
                    # lowers them
                    Mode.EAGER if graphs is Mode.EAGER else Mode.DEFAULT,
                    Knob(size=TINY_SLOTS, provider=provider, split=split),
                    compare_with=refs,
                )
            )
    debug_refs = (TINY_PIECEWISE_NONE,)
    specs.append(
        tiny_engine(
            "tiny.debug.naive",
            Mode.PIECEWISE_MOE_NAIVE,
            debug_checks=True,
            compare_with=debug_refs,
        )
    )
    specs.append(
        tiny_engine(
            "tiny.debug.row.token",
            Mode.DEFAULT,
            Knob(size=TINY_SLOTS, provider=Provider.ROW),
            debug_checks=True,
            compare_with=debug_refs,
        )
    )
    return specs


def mp(with_reference: bool) -> list[EngineSpec]:
    """vLLM's default multi-process engine with the cache, and an in-process eager no-cache
    reference when the tiny phase's is not there to compare with."""
    refs = (TINY_EAGER_NONE, MP_REF)
    specs = [
        tiny_engine(
            MP_ENGINE,
            Mode.EAGER,
            Knob(size=TINY_SLOTS, provider=Provider.ROW, split=Split.TOKEN),
            multiprocess=True,
            compare_with=refs,
        )
    ]
    if with_reference:
        specs.append(tiny_engine(MP_REF, Mode.EAGER, compare_with=refs))
    return specs


def qwen8(prefix: str = "qwen8") -> list[EngineSpec]:
    """8 layers of Qwen3-30B-A3B shapes, batch 1, 256 greedy tokens, three timed generations:
    (a) no cache, full graphs; (b) no cache, MoE op eager between pieces; eager and vLLM's own
    MoE split as references; (c) 128 slots (every expert resident) and (d) 32 slots, each with
    ``cached`` and ``row``. (b) and (c) are profiled with ``--profile``."""

    def engine(label: str, mode: Mode, knob: Knob | None = None, **fields: Any) -> EngineSpec:
        return EngineSpec(
            name=f"{prefix}.{label}",
            checkpoint=QWEN8,
            prompts=(QWEN_PROMPT,),
            max_tokens=256,
            mode=mode,
            knob=knob,
            repeats=3,
            max_num_seqs=1,
            capture_sizes=(1, 2),
            kv_bytes=2 << 30,
            **fields,
        )

    ref = (f"{prefix}.ref.eager",)
    specs = [
        engine("a.full", Mode.DEFAULT, compare_with=ref),
        engine(
            "b.eager_moe",
            Mode.DEFAULT,
            Knob(eager_between_graphs=True),
            profiled=True,
            compare_with=ref,
        ),
        engine("ref.eager", Mode.EAGER, compare_with=ref),
        engine("ref.piecewise_moe_naive", Mode.PIECEWISE_MOE_NAIVE, compare_with=ref),
    ]
    for label, slots in (("c", QWEN_EXPERTS), ("d", 32)):
        for provider in (Provider.CACHED, Provider.ROW):
            specs.append(
                engine(
                    f"{label}.{provider.value}{slots}",
                    Mode.DEFAULT,
                    Knob(size=slots, provider=provider),
                    profiled=slots == QWEN_EXPERTS,
                    compare_with=(f"{prefix}.b.eager_moe.idmap", f"{prefix}.b.eager_moe"),
                )
            )
    return specs


def story() -> list[EngineSpec]:
    """24 layers of those shapes (about 30 GB of weights) under ``gpu_memory_utilization``
    0.10, eager, 64 greedy tokens: no cache (expected not to start), then ``row`` with 32
    slots."""

    def engine(name: str, knob: Knob | None = None) -> EngineSpec:
        return EngineSpec(
            name=name,
            checkpoint=QWEN24,
            prompts=(QWEN_PROMPT,),
            max_tokens=64,
            mode=Mode.EAGER,
            knob=knob,
            max_num_seqs=1,
            gpu_memory_utilization=0.10,
            compare_with=(STORY_NONE,),
        )

    return [engine(STORY_NONE), engine("story.row32", Knob(size=32, provider=Provider.ROW))]


# -- the steps comparison (issue 18, item 4) --------------------------------------------------

STEPS_PREFIX = {QWEN8: "steps.plain", QWEN8_SKEW: "steps.skew"}
STEPS_WORKLOAD = Workload()
STEPS_LABELS = (
    "none.full",
    "uva675.full",
    "prefetch.full",
    "row32dev.full",
    "none.eager",
    "row32dev.eager",
)
"""The engines of one checkpoint, in the order they run (``--only`` picks among them)."""
UVA_OFFLOAD = Offload(OffloadBackend.UVA, cpu_offload_gb=6.75, cpu_offload_params=("experts",))
"""6.75 of the 9.0 GiB of experts in pinned host memory, read through unified addressing."""
PREFETCH_OFFLOAD = Offload(
    OffloadBackend.PREFETCH, group_size=8, num_in_group=7, prefetch_step=1, params=("experts",)
)
"""Layers 1 to 7's experts offloaded, one layer's copied ahead into one static buffer: 1.125
GiB resident and 1.125 GiB in flight, the 2.25 GiB of 32 slots per layer."""

# Estimated seconds (start, then everything once / with every repeat), from the recorded runs
# (docs/vllm, ../shared/DESIGN.md section 9): a compiled engine starts in 70 to 95 s, an eager
# one in about 40 s; decode per step from the b1 and b8 figures, b32 copy-bound engines at
# about 125 (UVA) to 160 ms (32 slots, hit rate near 0) per step, the prefetch offloader at
# about 165 ms per step at every batch size (7 x 1.125 GiB per step at about 50 GB/s).
_TIMES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    # label: ((plain once, plain full), (skewed once, skewed full))
    "none.full": ((90, 100), (90, 100)),
    "uva675.full": ((150, 250), (150, 250)),
    "prefetch.full": ((240, 500), (240, 500)),
    "row32dev.full": ((160, 280), (120, 180)),
    "none.eager": ((60, 80), (60, 80)),
    "row32dev.eager": ((130, 270), (100, 170)),
}


def steps(checkpoint: Checkpoint = QWEN8, only: tuple[str, ...] = ()) -> list[EngineSpec]:
    """One checkpoint's engines of the steps comparison, each measuring ``STEPS_WORKLOAD``
    (b1, b8 and b32 decode of 256 greedy tokens, medians of three; the time to first token of
    three distinct 2,048-token prompts, each one step): no offload (vLLM's default full and
    piecewise graphs); vLLM's UVA offload of 6.75 GiB of experts; vLLM's prefetch offloader
    at the same expert memory; ``row`` with the device planner at 32 slots; no offload and the
    device planner again in eager mode. Full-graph engines are compared with ``none.full``,
    eager ones with ``none.eager``. ``only``: these labels (``STEPS_LABELS``), in run order."""
    prefix = STEPS_PREFIX[checkpoint]
    skewed = 1 if checkpoint.router_skew else 0
    unknown = sorted(set(only) - set(STEPS_LABELS))
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; known: {', '.join(STEPS_LABELS)}")
    row32 = Knob(size=32, provider=Provider.ROW, planner=Planner.DEVICE)

    def engine(label: str, mode: Mode, **fields: Any) -> EngineSpec:
        once, full = _TIMES[label][skewed]
        ref = "none.eager" if mode is Mode.EAGER else "none.full"
        return EngineSpec(
            name=f"{prefix}.{label}",
            checkpoint=checkpoint,
            prompts=(QWEN_PROMPT,),
            max_tokens=STEPS_WORKLOAD.decode_tokens,
            mode=mode,
            repeats=STEPS_WORKLOAD.repeats,
            max_model_len=2304,
            max_num_seqs=max(STEPS_WORKLOAD.batches),
            max_num_batched_tokens=STEPS_WORKLOAD.prefill_tokens,
            capture_sizes=(1, 2, 4, 8, 16, 32),
            kv_bytes=2 << 30,
            compare_with=(f"{prefix}.{ref}",),
            workload=STEPS_WORKLOAD,
            max_position_embeddings=4096,
            prefix_caching=False,
            time_once_s=once,
            time_full_s=full,
            **fields,
        )

    specs = [
        engine("none.full", Mode.DEFAULT),
        engine("uva675.full", Mode.DEFAULT, offload=UVA_OFFLOAD),
        engine("prefetch.full", Mode.DEFAULT, offload=PREFETCH_OFFLOAD),
        engine("row32dev.full", Mode.DEFAULT, knob=row32),
        engine("none.eager", Mode.EAGER),
        engine("row32dev.eager", Mode.EAGER, knob=row32),
    ]
    return [s for s in specs if not only or s.name.removeprefix(prefix + ".") in only]


MIXTRAL = Checkpoint("mixtral-moe", foreground=True, arch="mixtral")
QWEN2MOE = Checkpoint("qwen2-moe", foreground=True, arch="qwen2moe")
ARCH_SLOTS = {MIXTRAL: (16, 4), QWEN2MOE: (16, 8)}
"""Per checkpoint (32 experts; top-2 and top-4), the device planner's slot counts: the first
misses but fits a decode step of the 4 sequences in one pass (4 x top_k experts at most), the
second needs more than one pass for such a step (fewer slots than 4 x top_k, at least top_k).
Prefill steps route to more experts than either and take several passes at both."""


def archs() -> list[EngineSpec]:
    """Mixtral and Qwen2-MoE (its gated shared expert) in full graphs (vLLM's default): no
    offload, and ``row`` with the device planner at the two slot counts of ``ARCH_SLOTS``; each
    cache engine's tokens against the same checkpoint's no-offload engine. The tiny model's
    prompts (4 x 32 greedy tokens, one batch), context 512."""
    specs = []
    for checkpoint, slots in ARCH_SLOTS.items():
        prefix = f"archs.{checkpoint.arch}"
        ref = f"{prefix}.none.full"
        specs.append(
            replace(tiny_engine(ref, Mode.DEFAULT, compare_with=(ref,)), checkpoint=checkpoint)
        )
        for size in slots:
            knob = Knob(size=size, provider=Provider.ROW, planner=Planner.DEVICE)
            spec = tiny_engine(
                f"{prefix}.row{size}dev.full", Mode.DEFAULT, knob, compare_with=(ref,)
            )
            specs.append(replace(spec, checkpoint=checkpoint))
    return specs
