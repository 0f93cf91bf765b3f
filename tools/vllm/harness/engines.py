"""The engines of the phases ``tiny``, ``mp``, ``qwen8``, ``story``, ``steps``, ``archs``,
``curve`` and ``fp8``, and their checkpoints.

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
