"""The engines of the phases ``tiny``, ``mp``, ``qwen8``, ``story``, ``steps``, ``archs``,
``curve`` and ``fp8``, and their checkpoints.

The phases that repeat earlier runs (``split``, ``qwen8seq``, ``rerun``) pick from these in
:mod:`tools.vllm.harness.reruns`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

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
                    # lowers them for the host planner (named: in full graphs the default is
                    # the device planner)
                    Mode.EAGER if graphs is Mode.EAGER else Mode.DEFAULT,
                    Knob(size=TINY_SLOTS, provider=provider, split=split, planner=_host(provider)),
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


def _host(provider: Provider) -> Planner | None:
    """The host planner named for a ``row`` engine of the phases that measure it (the default
    in full graphs is the device planner); ``cached`` has only the host planner."""
    return Planner.HOST if provider is Provider.ROW else None


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
                    Knob(size=slots, provider=provider, planner=_host(provider)),
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
STEPS_WORKLOAD = Workload(ttft_kernel_profile=True)
STEPS_LABELS = (
    "none.full",
    "none2.full",
    "row32dev.full",
    "row32planes.full",
    "row32lfu.full",
    "uva675.full",
    "none.eager",
    "row32dev.eager",
    "row32host.eager",
    "row32hostplanes.eager",
    "prefetch.full",
    "none.piecewise",
    "row32dev.piecewise",
)
"""The engines of one checkpoint, in the order they run (``--only`` picks among them). The
last two (``cudagraph_mode`` PIECEWISE, the MoE op captured inside the pieces) made the record
of the device planner's default in piecewise graphs alone (``rowcache.vllm.defaults``: the
piecewise steps run of 2026-12-02, its tokens against no offload there)."""
UVA_OFFLOAD = Offload(OffloadBackend.UVA, cpu_offload_gb=6.75, cpu_offload_params=("experts",))
"""6.75 of the 9.0 GiB of experts in pinned host memory, read through unified addressing."""
PREFETCH_OFFLOAD = Offload(
    OffloadBackend.PREFETCH, group_size=8, num_in_group=7, prefetch_step=1, params=("experts",)
)
"""Layers 1 to 7's experts offloaded, one layer's copied ahead into one static buffer: 1.125
GiB resident and 1.125 GiB in flight, the 2.25 GiB of 32 slots per layer."""

# Estimated seconds (start, then everything once / with every repeat), from steps run 6 at
# 17fd5a4 (docs/records/), the first run whose engines share vLLM's model-info cache: whole
# engines took, plain, everything once: `none.full` 80 s, `row32dev.full` 142, `uva675.full`
# 135, `none.eager` 54, `row32dev.eager` 113, `row32host.eager` 102; skewed, with every
# repeat: `none.full` 73, `row32dev.full` 127, `uva675.full` 154; skewed once: `none.eager`
# 45, `row32dev.eager` 62, `row32host.eager` 62. A repeat adds two generations of each batch
# size (plain `row32dev.full`: b1 1.84 s, b8 14.6 s, b32 33 s a generation; eager engines b8
# 15 s, b32 33 to 40 s). The margins cover a noisier machine; a call's first engine gets
# orchestrate.FIRST_ENGINE_S more (it fills the model-info cache). The prefetch offloader is
# run 4's (64905c3): about 155 ms a step at every batch size (39.4 s a b1 generation).
_TIMES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    # label: ((plain once, plain full), (skewed once, skewed full))
    "none.full": ((105, 120), (100, 110)),
    "none2.full": ((105, 120), (100, 110)),
    "uva675.full": ((160, 250), (130, 185)),
    "prefetch.full": ((370, 610), (370, 610)),
    "row32dev.full": ((170, 280), (110, 150)),
    # Not run yet: as row32dev.full, plus the encode of 9 GiB of experts at start-up.
    "row32planes.full": ((200, 310), (140, 180)),
    # As row32planes.full (the victim policy costs the planner a few lanes); skewed, run once
    # with --repeats 1 on 2026-12-05, three engines in 211 s.
    "row32lfu.full": ((200, 310), (140, 180)),
    "none.eager": ((80, 100), (70, 90)),
    "row32dev.eager": ((140, 250), (90, 140)),
    "row32host.eager": ((130, 240), (90, 140)),
    # Not run yet: as row32host.eager, plus the encode of 9 GiB of experts at start-up.
    "row32hostplanes.eager": ((150, 260), (110, 160)),
    # As the full-graph engines (the same compilation, fewer graphs captured); the piecewise
    # steps run of 2026-12-02 (plain, --repeats 1): 44.8 and 114.8 s whole.
    "none.piecewise": ((105, 120), (100, 110)),
    "row32dev.piecewise": ((170, 280), (110, 150)),
}
_REFERENCE = {Mode.EAGER: "none.eager", Mode.PIECEWISE: "none.piecewise"}
"""Each graph mode's no-offload engine, its engines' token reference (else ``none.full``)."""


def steps(checkpoint: Checkpoint = QWEN8, only: tuple[str, ...] = ()) -> list[EngineSpec]:
    """One checkpoint's engines of the steps comparison, each measuring ``STEPS_WORKLOAD``
    (b1, b8 and b32 decode of 256 greedy tokens, medians of three; the time to first token of
    three distinct 2,048-token prompts, each one step): no offload (vLLM's default full and
    piecewise graphs), twice (the second engine is the control of the token comparison);
    vLLM's UVA offload of 6.75 GiB of experts; vLLM's prefetch offloader at the same expert
    memory; ``row`` with the device planner at 32 slots; no offload and the device planner
    again in eager mode, then the host planner in eager mode (what the device planner must
    match there to become eager mode's default, ``rowcache.vllm.defaults``). Full-graph engines
    are compared with ``none.full``, eager ones with ``none.eager``. ``only``: these labels
    (``STEPS_LABELS``), in run order."""
    prefix = STEPS_PREFIX[checkpoint]
    skewed = 1 if checkpoint.router_skew else 0
    unknown = sorted(set(only) - set(STEPS_LABELS))
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; known: {', '.join(STEPS_LABELS)}")
    # Raw bytes set, not left to ``auto`` (which holds planes in full graphs since the planes'
    # record): row32dev stays the raw-byte cache the planes are measured against.
    row32 = Knob(size=32, provider=Provider.ROW, planner=Planner.DEVICE, compress="off")
    # The same, with bf16 w13 and w2 held as lossless bf16 planes (rowcache.compress).
    row32planes = replace(row32, compress="on")
    # The same, its victims by request count (rowcache.policy): what the policy gains over
    # row32planes, most on the skewed checkpoint (docs/POLICY.md).
    row32lfu = replace(row32planes, policy="lfu")
    # The host planner's expert split: a step cut by experts copies each routed expert once
    # and is exact (the unreduced route); the plugin's default for the host planner, the token
    # split, cuts a 2,048-token prompt into hundreds of row ranges of at most 32 experts each,
    # copying most experts again in each. At b1 the two are one pass alike.
    row32host = Knob(size=32, provider=Provider.ROW, planner=Planner.HOST, split=Split.EXPERT)
    # The same, with w13 and w2 held as planes, decoded in the host planner's copy step.
    row32hostplanes = replace(row32host, compress="on")

    def engine(label: str, mode: Mode, **fields: Any) -> EngineSpec:
        once, full = _TIMES[label][skewed]
        ref = _REFERENCE.get(mode, "none.full")
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
        # The control: a second engine of the reference's configuration. Its tokens must equal
        # the reference's, or no engine's difference from the reference means anything.
        engine("none2.full", Mode.DEFAULT),
        # The cache before the baselines, and the longest engine (prefetch) last: a call that
        # runs out of time keeps what decides the most.
        engine("row32dev.full", Mode.DEFAULT, knob=row32),
        engine("row32planes.full", Mode.DEFAULT, knob=row32planes),
        engine("row32lfu.full", Mode.DEFAULT, knob=row32lfu),
        engine("uva675.full", Mode.DEFAULT, offload=UVA_OFFLOAD),
        # Profiled with ``run --profile``: the host time of an eager decode step, by planner.
        engine("none.eager", Mode.EAGER, profiled=True),
        engine("row32dev.eager", Mode.EAGER, knob=row32, profiled=True),
        engine("row32host.eager", Mode.EAGER, knob=row32host, profiled=True),
        engine("row32hostplanes.eager", Mode.EAGER, knob=row32hostplanes),
        engine("prefetch.full", Mode.DEFAULT, offload=PREFETCH_OFFLOAD),
        engine("none.piecewise", Mode.PIECEWISE),
        engine("row32dev.piecewise", Mode.PIECEWISE, knob=row32),
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
            # Raw bytes, as this phase's records were made (auto holds bf16 planes now).
            knob = Knob(size=size, provider=Provider.ROW, planner=Planner.DEVICE, compress="off")
            spec = tiny_engine(
                f"{prefix}.row{size}dev.full", Mode.DEFAULT, knob, compare_with=(ref,)
            )
            specs.append(replace(spec, checkpoint=checkpoint))
    return specs


# -- the curve users choose from (issue 21, item 3) --------------------------------------------

EXPERT_GIB = 9.0
"""GiB of experts of the 8-layer bf16 checkpoint: 8 layers x 128 experts x 3 x 768 x 2048 x 2
bytes (1.125 GiB a layer, 9 MiB an expert)."""
CURVE_PREFIX = {QWEN8: "curve.plain", QWEN8_SKEW: "curve.skew"}
CURVE_WORKLOAD = Workload(batches=(1,), prefill_prompts=0, ttft_reserve_s=0.0)
"""Batch-1 decode only: 256 greedy tokens, medians of three (the recorded runs' measure)."""


def uva_label(offloaded_gib: float) -> str:
    """``uva675.full`` for 6.75 GiB of experts offloaded (the steps phases' name)."""
    return f"uva{round(offloaded_gib * 100)}.full"


def row_label(slots: int) -> str:
    return f"row{slots}dev.full"


def lfu_label(slots: int) -> str:
    """The label of ``row_label``'s engine with ``moe_expert_cache_policy: lfu``."""
    return f"row{slots}devlfu.full"


def lfu_raw_label(slots: int) -> str:
    """The label of ``lfu_label``'s engine with ``moe_expert_cache_compress: off``."""
    return f"row{slots}devlfuraw.full"


# (label, UVA GiB offloaded or slots, (start and everything once, with every repeat) seconds),
# in run order: the line and the two recorded points first, then the ends, then the rest. A
# compiled engine starts in 70 to 95 s (UVA 70 to 95 s too); a b1 generation of 256 tokens
# takes 0.4 s (no offload) to 3.3 s (every expert offloaded, about 80 tok/s).
CURVE_PLAIN: tuple[tuple[str, float | int | None, tuple[float, float]], ...] = (
    ("none.full", None, (90, 100)),
    (row_label(32), 32, (100, 110)),
    (uva_label(6.75), 6.75, (105, 115)),
    (row_label(128), 128, (95, 105)),
    (uva_label(9.0), 9.0, (110, 125)),
    (row_label(8), 8, (110, 125)),
    (uva_label(4.5), 4.5, (100, 110)),
    (row_label(64), 64, (100, 110)),
    (uva_label(2.25), 2.25, (100, 110)),
    (row_label(16), 16, (105, 120)),
)
CURVE_SKEW: tuple[tuple[str, float | int | None, tuple[float, float]], ...] = (
    (row_label(32), 32, (100, 110)),
    (uva_label(6.75), 6.75, (105, 115)),
    ("none.full", None, (90, 100)),
)
"""The skewed checkpoint's two points of the plot, and its no-offload engine (their tokens'
reference) last."""


def curve_labels() -> tuple[str, ...]:
    return tuple(dict.fromkeys(label for label, _, _ in CURVE_PLAIN + CURVE_SKEW))


def curve(checkpoint: Checkpoint = QWEN8) -> list[EngineSpec]:
    """The curve's engines on ``checkpoint`` (``QWEN8`` or ``QWEN8_SKEW``), each measuring
    ``CURVE_WORKLOAD`` in vLLM's default full graphs: no offload; vLLM's UVA offload of some
    of the 9.0 GiB of experts (``cpu_offload_gb``, ``cpu_offload_params={"experts"}``; 9.0:
    every expert); ``row`` with the device planner at a number of slots per layer (each slot
    one expert's 9 MiB a layer: ``slots / 128 x 9.0`` GiB on the GPU). Tokens against the same
    checkpoint's ``none.full``. Settings as the recorded ``qwen8`` runs: one sequence, graphs
    captured for 1 and 2, 2 GiB of KV cache."""
    prefix = CURVE_PREFIX[checkpoint]
    table = CURVE_SKEW if checkpoint.router_skew else CURVE_PLAIN
    specs = []
    for label, value, (once, full) in table:
        knob, offload = None, None
        if label.startswith("uva"):
            assert isinstance(value, float)
            offload = Offload(
                OffloadBackend.UVA, cpu_offload_gb=value, cpu_offload_params=("experts",)
            )
        elif label.startswith("row"):
            assert isinstance(value, int)
            # Raw bytes, as the curve's records were made (auto holds bf16 planes now).
            knob = Knob(size=value, provider=Provider.ROW, planner=Planner.DEVICE, compress="off")
        specs.append(
            EngineSpec(
                name=f"{prefix}.{label}",
                checkpoint=checkpoint,
                prompts=(QWEN_PROMPT,),
                max_tokens=CURVE_WORKLOAD.decode_tokens,
                mode=Mode.DEFAULT,
                knob=knob,
                repeats=CURVE_WORKLOAD.repeats,
                max_num_seqs=1,
                capture_sizes=(1, 2),
                kv_bytes=2 << 30,
                compare_with=(f"{prefix}.none.full",),
                offload=offload,
                workload=CURVE_WORKLOAD,
                time_once_s=once,
                time_full_s=full,
            )
        )
    return specs


def expert_gib_on_gpu(spec: EngineSpec, total_gib: float = EXPERT_GIB) -> float:
    """GiB of experts an engine keeps on the GPU, from its spec: all of them without offload,
    ``total - cpu_offload_gb`` with UVA offload, ``slots / experts`` of them with the cache."""
    if spec.knob is not None and spec.knob.size:
        return total_gib * spec.knob.size / QWEN_EXPERTS
    if spec.offload is not None and spec.offload.backend is OffloadBackend.UVA:
        return max(0.0, total_gib - spec.offload.cpu_offload_gb)
    return total_gib


# -- FP8 experts (issue 22) ---------------------------------------------------------------------

QWEN8_FP8 = Checkpoint("qwen8-fp8", qwen3_30b_a3b=True, layers=8, fp8_block=True)
QWEN8_FP8_SKEW = Checkpoint(
    "qwen8-fp8-skew", qwen3_30b_a3b=True, layers=8, router_skew=1.0, fp8_block=True
)
FP8_PREFIX = {QWEN8_FP8: "fp8.plain", QWEN8_FP8_SKEW: "fp8.skew"}
FP8_WORKLOAD = Workload(batches=(1, 8), prefill_prompts=0, ttft_reserve_s=0.0)
FP8_ONLINE_WORKLOAD = Workload(batches=(1,), prompt_tokens=1, prefill_prompts=0, ttft_reserve_s=0.0)
"""Online per-tensor FP8 at batch 1, from a one-token prompt: its activation scale is taken
over each kernel call's whole input, so only steps that fit the slots in one call can give no
offload's bits. An 8-token prompt's step routes to up to 64 experts, more than 32 slots (cut
into passes: not bit-exact); a one-token step routes to 8, so every step of this workload
fits, and its tokens can be compared exactly."""
FP8_EXPERT_BYTES = 3 * 768 * 2048 + (2 * 6 * 16 + 16 * 6) * 4
"""One block-scaled FP8 expert of a layer: ``w13`` [1536, 2048] and ``w2`` [2048, 768] in one
byte each, their float32 ``weight_scale_inv`` [12, 16] and [16, 6] (4.5 MiB + 1,152 bytes)."""
FP8_EXPERT_GIB = 8 * QWEN_EXPERTS * FP8_EXPERT_BYTES / 2**30
"""About 4.501 GiB of FP8 experts in the 8-layer checkpoint."""
FP8_UVA_GIB = 3.375
"""UVA offload at the expert memory of 32 slots: 96 of 128 experts' 4.5 MiB a layer x 8 layers
offloaded (vLLM offloads parameter by parameter up to this many bytes, in module order: the
weights of layers 0 to 5, 1.125 GiB of experts left on the GPU as 32 slots hold)."""
FP8_UVA_LABEL = "uva3375.full"
FP8_DEFAULT_LABEL = "row32default.full"
"""The block-scaled checkpoint with only ``moe_expert_cache_size`` 32 set, as a user would:
the planner and everything else the plugin's defaults (the device planner in full graphs)."""
FP8_LABELS = (
    "none.full",
    row_label(32),
    FP8_UVA_LABEL,
    row_label(128),
    "online.none.full",
    "online." + row_label(32),
    FP8_DEFAULT_LABEL,
)
# Estimated seconds as in _TIMES (b1 and b8 decode of 256 tokens, three times each). At b8 a
# layer step routes to about 52 of 128 experts: 32 slots miss about 37 of them, and UVA reads
# those of its 6 offloaded layers, about 1.4 GiB a step, over the host link. The phase's first
# engine compiles DeepGEMM's kernels for the checkpoint's dense FP8 layers (46 to 59 s, shared
# with the engines after it: orchestrate.SHARED_CACHES); online FP8 uses none. Measured in FP8
# runs 1 and 2 of 2026-12-02: none.full 138.7 s (the compile included), row32dev.full 72.7 s,
# online.none.full 50.7 s; uva3375.full started in 110 s with the compile. FP8 run 3's engines
# after the first took 25 to 71 s: these estimates are generous after a call's first engine.
_FP8_TIMES: dict[str, tuple[float, float]] = {
    "none.full": (150, 160),
    row_label(32): (100, 120),
    FP8_UVA_LABEL: (130, 180),
    row_label(128): (90, 100),
    "online.none.full": (70, 80),
    "online." + row_label(32): (90, 110),
    FP8_DEFAULT_LABEL: (100, 120),
}


def fp8(checkpoint: Checkpoint = QWEN8_FP8) -> list[EngineSpec]:
    """The FP8 engines of ``checkpoint`` (``QWEN8_FP8`` or ``QWEN8_FP8_SKEW``: block-scaled
    FP8, vLLM's ``Fp8MoEMethod``), in full graphs, each measuring ``FP8_WORKLOAD`` (b1 and b8
    decode of 256 greedy tokens, medians of three, every sequence's ids): no offload, vLLM's
    UVA offload at the expert memory of 32 slots (``FP8_UVA_GIB``), ``row`` with the device
    planner at 32 and 128 slots, tokens against ``none.full``. On the plain checkpoint also
    online FP8 (``quantization="fp8"`` on the bf16 ``QWEN8``: ``Fp8PerTensorOnlineMoEMethod``)
    at batch 1, no offload and ``row`` 32 with the device planner, tokens against the former;
    and, last, ``FP8_DEFAULT_LABEL``: the block-scaled checkpoint with the slot count alone set
    (the plugin's default planner for it), tokens against ``none.full``. Each record carries
    the MoE backend vLLM chose (``probe.moe_backend``, ``moe_backend_log``)."""
    prefix = FP8_PREFIX[checkpoint]

    def engine(
        label: str,
        knob: Knob | None = None,
        offload: Offload | None = None,
        online: bool = False,
    ) -> EngineSpec:
        once, full = _FP8_TIMES[label]
        work = FP8_ONLINE_WORKLOAD if online else FP8_WORKLOAD
        ref = "online.none.full" if online else "none.full"
        return EngineSpec(
            name=f"{prefix}.{label}",
            checkpoint=QWEN8 if online else checkpoint,
            prompts=(QWEN_PROMPT,),
            max_tokens=work.decode_tokens,
            mode=Mode.DEFAULT,
            knob=knob,
            repeats=work.repeats,
            max_num_seqs=max(work.batches),
            capture_sizes=(1, 2, 4, 8),
            kv_bytes=2 << 30,
            compare_with=(f"{prefix}.{ref}",),
            offload=offload,
            workload=work,
            quantization="fp8" if online else None,
            time_once_s=once,
            time_full_s=full,
        )

    def row(slots: int) -> Knob:
        return Knob(size=slots, provider=Provider.ROW, planner=Planner.DEVICE)

    uva = Offload(OffloadBackend.UVA, cpu_offload_gb=FP8_UVA_GIB, cpu_offload_params=("experts",))
    specs = [
        engine("none.full"),
        engine(row_label(32), row(32)),
        engine(FP8_UVA_LABEL, offload=uva),
        engine(row_label(128), row(QWEN_EXPERTS)),
    ]
    if not checkpoint.router_skew:
        specs += [
            engine("online.none.full", online=True),
            engine("online." + row_label(32), row(32), online=True),
            engine(FP8_DEFAULT_LABEL, Knob(size=32)),
        ]
    return specs


# -- the models people offload (issue 34) ------------------------------------------------------

DS2 = Checkpoint("deepseek-v2-lite", arch="deepseek_v2")
DS2_SKEW = Checkpoint(
    "deepseek-v2-lite-skew", arch="deepseek_v2", router_skew=1.0, experts_from=DS2.directory
)
DS3 = Checkpoint("deepseek-v3-reduced", arch="deepseek_v3")
DS3_SKEW = Checkpoint(
    "deepseek-v3-reduced-skew", arch="deepseek_v3", router_skew=1.0, experts_from=DS3.directory
)
QWEN48_FP8 = Checkpoint(
    "qwen3-30b-a3b-fp8-full", qwen3_30b_a3b=True, layers=48, fp8_block=True, sharded=True
)
QWEN48_FP8_SKEW = Checkpoint(
    "qwen3-30b-a3b-fp8-full-skew",
    qwen3_30b_a3b=True,
    layers=48,
    fp8_block=True,
    sharded=True,
    router_skew=1.0,
    experts_from=QWEN48_FP8.directory,
)
GPT_OSS = Checkpoint("gpt-oss-20b", arch="gpt_oss")
GPT_OSS_SKEW = Checkpoint(
    "gpt-oss-20b-skew", arch="gpt_oss", router_skew=1.0, experts_from=GPT_OSS.directory
)
MODELS_PREFIX = {
    DS2: "models.ds2lite",
    DS2_SKEW: "models.ds2lite-skew",
    DS3: "models.ds3",
    DS3_SKEW: "models.ds3-skew",
    QWEN48_FP8: "models.qwen48fp8",
    QWEN48_FP8_SKEW: "models.qwen48fp8-skew",
    GPT_OSS: "models.gptoss20b",
    GPT_OSS_SKEW: "models.gptoss20b-skew",
}
MODELS_WORKLOAD = Workload(batches=(1, 8), decode_tokens=64, decode_kernel_profile=16)
"""b1 and b8 decode of 64 greedy tokens (medians of three) and the time to first token of three
distinct 2,048-token prompts: a full-depth model's UVA engine takes about 0.2 s a b8 step
(every MoE layer's offloaded experts read over the host link), so 256 tokens would not leave
room for the other engines in one call. Last, 16 b1 decode tokens under the GPU profiler:
where a token's device time goes (on DeepSeek-V2-Lite `row` moved its planes at 25 to 30 GB/s
beside the forward, where the gather alone reached about 50 on the H200:
docs/records/2026-12-06-qwen3-full-depth.md)."""


@dataclass(frozen=True)
class Baseline:
    """vLLM's own offload of a model whose experts it cannot offload on the backend the cache
    serves: another MoE backend, with no offload and with UVA offload, measured beside the cache.
    gpt-oss: on ``triton_unfused`` (and vLLM's default Hopper backend) UVA offload does nothing,
    because the MXFP4 swizzle makes new GPU tensors that are no parameters, so nothing offloads
    them again (measured: all 8.9 GiB of experts stayed on the GPU, docs/GPT_OSS.md); on
    ``marlin`` the repacked weights replace the parameters, which vLLM offloads again
    (``model_loader/utils.py``, ``device_loading_context``)."""

    backend: str
    """vLLM's ``moe_backend`` for the baseline's engines."""
    layer_bytes: int
    """Bytes of one MoE layer's experts as that backend creates them (the UVA offloader counts
    these against ``cpu_offload_gb``)."""
    suffix: str
    """Appended to the baseline engines' labels (``nonemarlin.full``, ``uva774marlin.full``)."""


@dataclass(frozen=True)
class ModelBudget:
    """One model's routed experts and the two budgets its engines compare at: ``row`` at a
    quarter and a half of the experts in slots, UVA offloading whole MoE layers' experts so
    that at least as much expert memory stays on the GPU as the slots take."""

    experts: int
    moe_layers: int
    expert_gib: float
    """GiB of routed experts in the checkpoint (all MoE layers)."""
    top_k: int
    """Routed experts a token asks for in each MoE layer: a b1 decode token of UVA reads this
    many experts of every offloaded layer over the link."""
    baseline: Baseline | None = None
    """Where UVA runs on another backend than the cache (gpt-oss); None: the same one."""
    planes: bool = False
    """Whether the cache holds these experts as planes by default (bf16 in full graphs): then
    the quarter's ``lfu`` engine runs again holding raw bytes (``lfu_raw_label``), the
    format's gain or loss on this model's shapes beside the same policy."""
    scale_guard: bool = False
    """Whether vLLM's kernel for these experts reads past their weight scales (MXFP4 on
    Hopper): then the no-offload engines on the cache's backend are followed by zeros there,
    as the slots are (``EngineSpec.guard_scale_tails``), and :data:`BARE_REFERENCE`, vLLM
    as it comes, runs on demand beside them."""

    def slots(self, fraction: float) -> int:
        return round(self.experts * fraction)

    def layer_gib(self, backend: str | None = None) -> float:
        """GiB of one MoE layer's experts as ``backend`` creates them (the baseline's own size
        on its backend; the checkpoint's elsewhere)."""
        if self.baseline is not None and backend == self.baseline.backend:
            return self.baseline.layer_bytes / 2**30
        return self.expert_gib / self.moe_layers

    @property
    def uva_layer_gib(self) -> float:
        """GiB of one MoE layer's experts as the UVA engines' backend creates them."""
        return self.layer_gib(self.baseline.backend if self.baseline is not None else None)

    def uva_kept_gib(self, offloaded_gib: float, backend: str | None) -> float:
        """GiB of experts a UVA engine on ``backend`` that offloads ``offloaded_gib`` keeps on
        the GPU."""
        return self.layer_gib(backend) * self.moe_layers - offloaded_gib

    def uva_offloaded_layers(self, offloaded_gib: float, backend: str | None) -> int:
        """Whole MoE layers whose experts a UVA engine on ``backend`` with ``cpu_offload_gb``
        of ``offloaded_gib`` keeps in host memory."""
        return round(offloaded_gib / self.layer_gib(backend))

    def expert_bytes(self, backend: str | None = None) -> float:
        """Bytes of one routed expert as ``backend`` creates them (:meth:`layer_gib`)."""
        return self.layer_gib(backend) * 2**30 / self.experts

    def uva_offloaded_gib(self, fraction: float) -> float:
        """``cpu_offload_gb`` that offloads the experts of whole MoE layers, leaving at least
        ``fraction`` of the expert memory on the GPU: vLLM's UVA offloader takes parameters in
        module order while its total is below the limit, so a limit of exactly ``n`` layers'
        experts stops after the ``n``-th layer (``vllm/model_executor/offloader/uva.py``)."""
        layers_on_gpu = math.ceil(self.moe_layers * fraction - 1e-9)
        return (self.moe_layers - layers_on_gpu) * self.uva_layer_gib

    def gpu_gib(self, spec: EngineSpec) -> float:
        """GiB of routed experts an engine keeps on the GPU."""
        if spec.knob is not None and spec.knob.size:
            return self.expert_gib * spec.knob.size / self.experts
        if spec.offload is not None and spec.offload.backend is OffloadBackend.UVA:
            return self.uva_kept_gib(spec.offload.cpu_offload_gb, spec.moe_backend)
        return self.expert_gib


DS2_BUDGET = ModelBudget(experts=64, moe_layers=26, expert_gib=26.8125, top_k=6, planes=True)
"""DeepSeek-V2-Lite: 26 MoE layers x 64 experts x 3 x 1408 x 2048 x 2 bytes (16.5 MiB an
expert, 1.03 GiB a layer). A quarter: 16 slots (6.70 GiB) against UVA keeping 7 layers (7.22
GiB); a half: 32 slots (13.41 GiB) against UVA keeping 13 layers (13.41 GiB). bf16: the cache
holds planes by default, and the phases run the quarter's ``lfu`` engine on raw bytes too (on
the skewed router on an H100 raw bytes ran b1 at 0.834 x the planes: the planes read 0.699 of
the bytes; docs/records/2026-12-06-deepseek-v2-lite-raw.md)."""
DS3_BUDGET = ModelBudget(
    experts=256, moe_layers=9, expert_gib=9 * 256 * FP8_EXPERT_BYTES / 2**30, top_k=8
)
"""The reduced DeepSeek-V3 (``deepseek_layout.V3_REDUCED``): 9 MoE layers x 256 FP8 experts of
``FP8_EXPERT_BYTES`` (1.125 GiB a layer). A quarter: 64 slots (2.53 GiB) against UVA keeping 3
layers (3.38 GiB); a half: 128 slots (5.06 GiB) against UVA keeping 5 layers (5.63 GiB): with
9 layers, whole layers give UVA up to a third more memory than the slots."""
QWEN48_FP8_BUDGET = ModelBudget(
    experts=QWEN_EXPERTS,
    moe_layers=48,
    expert_gib=48 * QWEN_EXPERTS * FP8_EXPERT_BYTES / 2**30,
    top_k=8,
)
"""Qwen3-30B-A3B at full depth in block FP8: 48 MoE layers x 128 experts of
``FP8_EXPERT_BYTES`` (27.0 GiB, 0.563 GiB a layer). A quarter: 32 slots (6.75 GiB) against UVA
keeping 12 layers (6.75 GiB); a half: 64 slots against 24 layers (13.50 GiB each)."""
GPT_OSS_EXPERT_BYTES = 13_282_560
"""A gpt-oss-20b expert as the cache holds it after vLLM's Hopper swizzle: values and scales
with the swizzle's padding and float32 biases (docs/GPT_OSS.md, section 2)."""
GPT_OSS_MARLIN_EXPERT_BYTES = (
    2 * 2944 * 3072 // 2
    + 2 * 2944 * 3072 // 32
    + 2 * 2944 * 2
    + (3072 * 2944 // 2 + 3072 * 2944 // 32 + 3072 * 2)
)
"""A gpt-oss-20b expert as vLLM 0.25.0's Marlin MXFP4 backend creates it: hidden 2,880 rounded
up to 3,072 and intermediate 2,880 to 2,944 (``oracle/mxfp4.py``,
``mxfp4_round_up_hidden_size_and_intermediate_size``), packed values (two a byte), e8m0 scales
(one a block of 32) and bf16 biases of w13 and w2: 14,431,744 bytes."""
GPT_OSS_BUDGET = ModelBudget(
    experts=32,
    moe_layers=24,
    expert_gib=24 * 32 * GPT_OSS_EXPERT_BYTES / 2**30,
    top_k=4,
    baseline=Baseline("marlin", 32 * GPT_OSS_MARLIN_EXPERT_BYTES, "marlin"),
    scale_guard=True,
)
"""gpt-oss-20b at full depth: 24 MoE layers x 32 MXFP4 experts (9.50 GiB, 0.396 GiB a layer). A
quarter: 8 slots (2.38 GiB) against UVA on Marlin keeping 6 layers (2.58 GiB of Marlin's padded
experts); a half: 16 slots (4.75 GiB) against 12 layers (5.16 GiB)."""
MODEL_BUDGETS = {
    DS2: DS2_BUDGET,
    DS2_SKEW: DS2_BUDGET,
    DS3: DS3_BUDGET,
    DS3_SKEW: DS3_BUDGET,
    QWEN48_FP8: QWEN48_FP8_BUDGET,
    QWEN48_FP8_SKEW: QWEN48_FP8_BUDGET,
    GPT_OSS: GPT_OSS_BUDGET,
    GPT_OSS_SKEW: GPT_OSS_BUDGET,
}
QUARTER, HALF = 0.25, 0.5
# Estimated seconds (start and everything once, with every repeat), from the DeepSeek-V2-Lite
# run of 2026-12-03 (72cd29b, vLLM's V2 model runner): engines started in 64 to 101 s and took
# 68 to 106 s whole without misses, 149 and 186 s at 16 slots (b1 18 to 40 tok/s, b8 32 to 69);
# UVA there offloaded nothing (the V2 runner). On the V1 runner UVA pins and reads 19.6 GiB:
# its b8 generation of 64 tokens about 15 s, estimated.
_MODELS_TIMES = {"none": (130, 150), "row": (210, 250), "uva": (250, 330)}
_MODELS_TIMES_BY_ARCH = {
    # gpt-oss-20b on the H200, 2026-12-04 (docs/records/2026-12-04-gpt-oss.md), single
    # generations, start-up included: no offload 78 s whole, row at 8 slots 84 to 138 s, UVA
    # (which offloaded nothing there) 63 s; UVA on Marlin reads 18 layers' experts over the
    # link each step (b8 about 0.2 s a step, estimated).
    "gpt_oss": {"none": (100, 120), "row": (150, 200), "uva": (150, 220)},
    # DeepSeek-V2-Lite on the V1 model runner, H100, 2026-12-05
    # (docs/records/2026-12-05-deepseek-v2-lite-uva.md), single generations, start-up included:
    # no offload 43 to 60 s whole, row at 16 slots 108 to 126 s, UVA keeping 7 layers 110 to
    # 120 s; two more repeats add 20 to 50 s to either (b8 at 24 to 60 tok/s).
    "deepseek_v2": {"none": (80, 100), "row": (160, 220), "uva": (160, 220)},
}


class ModelEngine(NamedTuple):
    """One engine of a model's phase: its label, the cache's knob or vLLM's offload (or
    neither), the MoE backend (None: vLLM's choice) and the label of the no-offload engine its
    tokens are compared with (None: it is that reference)."""

    label: str
    knob: Knob | None
    offload: Offload | None
    backend: str | None
    reference: str | None
    mode: Mode = Mode.DEFAULT
    on_demand: bool = False
    """Run only where ``run --only`` names it (``EngineSpec.on_demand``)."""
    guard_scale_tails: bool = False
    """``EngineSpec.guard_scale_tails``."""


BARE_REFERENCE = "nonebare.full"
"""No offload on the cache's backend with nothing done to what follows its weight scales,
where the others are guarded (``ModelBudget.scale_guard``), on demand: its tokens against the
guarded ``none.full``'s say whether vLLM's read past the scales changes vLLM's own."""

EAGER_REFERENCE = "none.eager"
"""No offload in eager mode: the reference of a model's eager diagnostic (:func:`eager_label`)."""


def eager_label(slots: int) -> str:
    """``row16dev.eager``: ``row_label``'s engine without CUDA graphs or compilation."""
    return row_label(slots).replace(".full", ".eager")


class ModelRoles(NamedTuple):
    """The labels issue 34's targets compare: ``row`` and UVA at a quarter and at a half."""

    row_quarter: str
    uva_quarter: str
    row_half: str
    uva_half: str


def model_roles(budget: ModelBudget) -> ModelRoles:
    labels = {}
    suffix = budget.baseline.suffix if budget.baseline is not None else ""
    for name, fraction in (("quarter", QUARTER), ("half", HALF)):
        labels[f"row_{name}"] = row_label(budget.slots(fraction))
        uva = uva_label(budget.uva_offloaded_gib(fraction))
        labels[f"uva_{name}"] = uva.replace(".full", f"{suffix}.full")
    return ModelRoles(**labels)


CONTROL = "none2.full"
"""The no-offload engine run a second time in a models phase: its tokens against the first's
say whether a comparison at batch 8 can tell the cache from the engine's own noise."""


def controls(budget: ModelBudget) -> tuple[str, ...]:
    """The controls of a model's engines: :data:`CONTROL`, and where UVA runs on another
    backend (``budget.baseline``) that backend's no-offload engine run again (on gpt-oss's
    Marlin, UVA changed the first token of every 2,048-token prompt; so did Marlin without
    offload from one engine to the next, on the skewed checkpoint on an H100: the summary
    judges no token where a control differs from its reference)."""
    if budget.baseline is None:
        return (CONTROL,)
    return (CONTROL, f"none{budget.baseline.suffix}2.full")


def models_labels(budget: ModelBudget, cache_backend: str | None = None) -> list[ModelEngine]:
    """The engines of one model, in run order: no offload, then ``row`` and UVA at a quarter
    (issue 34's targets: next to each other, so that a pair is measured in one call, on one
    machine, wherever the calls end), then the control (no offload again: a token comparison
    at b8 means something only beside one), then ``row`` and UVA at a half; where UVA runs on
    another backend (``budget.baseline``) that backend's own no-offload engine comes right
    after the first, the reference of its UVA engines' tokens, and that engine's control comes
    last."""
    roles = model_roles(budget)
    reference = "none.full"
    guard = budget.scale_guard  # no offload on the cache's backend guarded as the slots are
    out = [ModelEngine(reference, None, None, cache_backend, None, guard_scale_tails=guard)]
    uva_backend, uva_reference = cache_backend, reference
    if budget.baseline is not None:
        uva_backend = budget.baseline.backend
        uva_reference = f"none{budget.baseline.suffix}.full"
        out.append(ModelEngine(uva_reference, None, None, uva_backend, None))
    extra_controls = [
        ModelEngine(label, None, None, uva_backend, uva_reference) for label in controls(budget)[1:]
    ]
    knobs: dict[float, Knob] = {}
    for fraction, row, uva in (
        (QUARTER, roles.row_quarter, roles.uva_quarter),
        (HALF, roles.row_half, roles.uva_half),
    ):
        knob = Knob(size=budget.slots(fraction), provider=Provider.ROW, planner=Planner.DEVICE)
        knobs[fraction] = knob
        offload = Offload(
            OffloadBackend.UVA,
            cpu_offload_gb=budget.uva_offloaded_gib(fraction),
            cpu_offload_params=("experts",),
        )
        out += [
            ModelEngine(row, knob, None, cache_backend, reference),
            ModelEngine(uva, None, offload, uva_backend, uva_reference),
        ]
        if fraction == QUARTER:
            out.append(
                ModelEngine(CONTROL, None, None, cache_backend, reference, guard_scale_tails=guard)
            )
    # Last, after every target and control: the quarter's cache with victims by request
    # count (rowcache.policy), what the policy gains where routing is skewed (docs/POLICY.md).
    lfu = Knob(
        size=budget.slots(QUARTER), provider=Provider.ROW, planner=Planner.DEVICE, policy="lfu"
    )
    by_count = ModelEngine(lfu_label(budget.slots(QUARTER)), lfu, None, cache_backend, reference)
    raw = []
    if budget.planes:
        lfu_raw = replace(lfu, compress="off")
        label = lfu_raw_label(budget.slots(QUARTER))
        raw.append(ModelEngine(label, lfu_raw, None, cache_backend, reference))
    # On demand only, a diagnostic: the half's cache and no offload in eager mode, where their
    # tokens meet without CUDA graphs or compilation (the half's cache in full graphs gave
    # other tokens than no offload on gpt-oss, docs/GPT_OSS.md).
    half = knobs[HALF]
    eager = [
        ModelEngine(
            EAGER_REFERENCE,
            None,
            None,
            cache_backend,
            None,
            Mode.EAGER,
            True,
            guard_scale_tails=guard,
        ),
        ModelEngine(
            eager_label(budget.slots(HALF)),
            half,
            None,
            cache_backend,
            EAGER_REFERENCE,
            Mode.EAGER,
            True,
        ),
    ]
    # On demand, where the no-offload engines are guarded: vLLM as it comes.
    bare = [ModelEngine(BARE_REFERENCE, None, None, cache_backend, reference, on_demand=True)]
    # The baseline's control after the targets: it tells noise from UVA's own effect.
    return [*out, *extra_controls, by_count, *raw, *eager, *(bare if guard else [])]


def models(checkpoint: Checkpoint = DS2) -> list[EngineSpec]:
    """One model's engines (issue 34), in vLLM's default full graphs, each measuring
    ``MODELS_WORKLOAD``: no offload; ``row`` with the device planner and vLLM's UVA offload at
    about a quarter and about half of the routed experts on the GPU (``ModelBudget``); tokens
    against the same checkpoint's no-offload engine on the same backend. On the skewed
    checkpoint the no-offload engines run after the quarter's pair (their tokens the
    references, their speed not a target). Every engine on vLLM's V1 model runner
    (``EngineSpec.model_runner_v1``: the V2 runner, DeepSeek's default in vLLM 0.25.0, ignores
    ``cpu_offload_gb``). gpt-oss's cache engines and their reference run vLLM's
    ``triton_unfused`` MXFP4 backend, the one the cache serves (its default on Hopper rounds
    differently); its UVA engines and theirs run Marlin (``Baseline``), where UVA offloads.
    That backend's kernel reads past the weight scales, so its no-offload engines have zeros
    there as the slots do (``ModelBudget.scale_guard``), and vLLM as it comes runs on demand."""
    prefix = MODELS_PREFIX[checkpoint]
    budget = MODEL_BUDGETS[checkpoint]
    work = MODELS_WORKLOAD
    cache_backend = "triton_unfused" if checkpoint.arch == "gpt_oss" else None
    labels = models_labels(budget, cache_backend)
    if checkpoint.router_skew:
        roles = model_roles(budget)
        first = [e for e in labels if e.label in (roles.row_quarter, roles.uva_quarter)]
        labels = first + [e for e in labels if e not in first]
    specs = []
    for engine in labels:
        kind = "row" if engine.knob is not None else "uva" if engine.offload is not None else "none"
        once, full = _MODELS_TIMES_BY_ARCH.get(checkpoint.arch, _MODELS_TIMES)[kind]
        reference = engine.reference or engine.label
        specs.append(
            EngineSpec(
                name=f"{prefix}.{engine.label}",
                checkpoint=checkpoint,
                prompts=(QWEN_PROMPT,),
                max_tokens=work.decode_tokens,
                mode=engine.mode,
                on_demand=engine.on_demand,
                knob=engine.knob,
                repeats=work.repeats,
                max_model_len=work.prefill_tokens + 256,
                max_num_seqs=max(work.batches),
                max_num_batched_tokens=work.prefill_tokens,
                capture_sizes=(1, 2, 4, 8),
                kv_bytes=2 << 30,
                compare_with=(f"{prefix}.{reference}",),
                offload=engine.offload,
                workload=work,
                guard_scale_tails=engine.guard_scale_tails,
                prefix_caching=False,
                # Every engine of a model on the runner where UVA offload works (specs), so
                # that its engines compare like with like.
                model_runner_v1=True,
                # FP8 models: DeepGEMM's start-up warm-up at 2,048 tokens (specs).
                skip_deep_gemm_warmup=checkpoint.fp8_block or checkpoint.arch == "deepseek_v3",
                moe_backend=engine.backend,
                # The builder's Qwen3 shapes say 2,048 positions; a 2,048-token prompt and its
                # tokens need more (the other architectures' configs say more).
                max_position_embeddings=4096 if checkpoint.arch == "qwen3" else None,
                time_once_s=once,
                time_full_s=full,
            )
        )
    return specs


def models_labels_all() -> tuple[str, ...]:
    return tuple(dict.fromkeys(e.label for b in MODEL_BUDGETS.values() for e in models_labels(b)))


BUDGETED_LABELS = tuple(
    dict.fromkeys(STEPS_LABELS + curve_labels() + FP8_LABELS + models_labels_all())
)
"""Every label ``run --only`` takes (the budgeted phases' engines after their prefix)."""
