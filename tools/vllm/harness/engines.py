"""The engines of the phases ``tiny``, ``mp``, ``qwen8`` and ``story``, and their checkpoints.

The phases that repeat earlier runs (``split``, ``qwen8seq``, ``rerun``) pick from these in
:mod:`tools.vllm.harness.reruns`.
"""

from __future__ import annotations

from typing import Any

from tools.vllm.harness.specs import Checkpoint, EngineSpec, Knob, Mode, Provider, Split

TINY = Checkpoint("tiny-moe", foreground=True)
QWEN8 = Checkpoint("qwen8", qwen3_30b_a3b=True, layers=8)
QWEN24 = Checkpoint("qwen24", qwen3_30b_a3b=True, layers=24)

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
