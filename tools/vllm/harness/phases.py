"""The phases of ``e2e.py run``, in the order they run whatever order ``--phases`` gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.vllm.harness import engines, model_engines, reruns
from tools.vllm.harness.specs import Checkpoint, EngineSpec

Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Phase:
    """A group of engines. By default they start concurrently (fixed KV memory each), wait
    until all are ready, then take turns for their timed generations; ``one_at_a_time`` starts
    each only after the previous one has exited."""

    name: str
    about: str
    engines: Callable[[Results], list[EngineSpec]]
    """The engines, given the results of the phases run before it in this call."""
    one_at_a_time: bool = False
    min_left_s: float | None = None
    """An engine is not started with less time than this left (recorded as not run)."""
    budgeted: bool = False
    """One engine at a time, each given a deadline from its time estimates
    (:func:`tools.vllm.harness.orchestrate.engine_deadline`); ``run --only`` picks engines
    by label; every record also goes to ``records.jsonl`` as soon as its engine ends."""

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints its engines load (whatever earlier phases gave)."""
        found: list[Checkpoint] = []
        for spec in self.engines({}):
            if spec.checkpoint not in found:
                found.append(spec.checkpoint)
        return found


def _mp(results: Results) -> list[EngineSpec]:
    ran = results.get(engines.TINY_EAGER_NONE, {}).get("ok")
    return engines.mp(with_reference=not ran)


PHASES = (
    Phase(
        "rerun",
        "the 2026-11-29 second run: same-mode references with and without an identity "
        "expert_map, qwen8 (b) to (d)",
        lambda _results: reruns.rerun(),
    ),
    Phase(
        "tiny",
        "2-layer, 16-expert model: eager and piecewise, no cache, cached/row token split and row "
        "expert split with 6 slots, vLLM's DEBUG replay-address check",
        lambda _results: engines.tiny(),
    ),
    Phase(
        "split",
        "the tiny model's piecewise cache engines next to their same-mode reference",
        lambda _results: reruns.split(),
    ),
    Phase(
        "mp",
        "the tiny model in vLLM's multi-process engine, row token split with 6 slots",
        _mp,
    ),
    Phase(
        "qwen8seq",
        "qwen8's (b) and (c) row 128, each engine alone on the machine",
        lambda _results: reruns.qwen8seq(),
        one_at_a_time=True,
    ),
    Phase(
        "qwen8",
        "8 layers of Qwen3-30B-A3B shapes, batch 1, 256 tokens x 3: (a) full graphs, (b) MoE "
        "eager between pieces, references, (c) 128 and (d) 32 slots, cached and row",
        lambda _results: engines.qwen8(),
    ),
    Phase(
        "steps",
        "steps comparison on the 8-layer checkpoint, one engine at a time: b1/b8/b32 decode "
        "and 2,048-token TTFT in each of no offload, UVA 6.75 GiB, prefetch offloader, row 32 "
        "device planner (full graphs), no offload and row 32 eager",
        lambda _results: engines.steps(engines.QWEN8),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "steps_skew",
        "the same on the skewed checkpoint (--router-skew 1.0)",
        lambda _results: engines.steps(engines.QWEN8_SKEW),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "curve",
        "the curve users choose from, one engine at a time on the 8-layer checkpoint, b1 "
        "decode: no offload, UVA offload keeping 0 to 6.75 GiB of the 9.0 GiB of experts, row "
        "with the device planner at 8 to 128 slots (full graphs)",
        lambda _results: engines.curve(engines.QWEN8),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "curve_skew",
        "the curve's two points on the skewed checkpoint (UVA 6.75 GiB offloaded, row 32), "
        "then its no offload",
        lambda _results: engines.curve(engines.QWEN8_SKEW),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "fp8",
        "FP8 experts on the 8-layer checkpoint stored with 128 x 128 block scales, b1 and b8 "
        "decode: no offload, UVA at the expert memory of 32 slots, row device planner at 32 "
        "and 128 slots (full graphs); then online FP8 of the bf16 checkpoint at b1: no "
        "offload, row 32; then row 32 with the slot count alone set (the default planner)",
        lambda _results: engines.fp8(engines.QWEN8_FP8),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "fp8_skew",
        "the block-scaled FP8 engines on the skewed checkpoint (--router-skew 1.0)",
        lambda _results: engines.fp8(engines.QWEN8_FP8_SKEW),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "deepseek",
        "DeepSeek-V2-Lite at full depth (27 layers, bf16), b1/b8 decode and 2,048-token TTFT: "
        "no offload (twice: the control), row (device planner) and UVA at about a quarter and a "
        "half of the routed experts on the GPU (full graphs)",
        lambda _results: model_engines.models(model_engines.DS2),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "deepseek_skew",
        "the same on the skewed DeepSeek-V2-Lite (--router-skew 1.0; its expert shards "
        "hard-linked from the plain checkpoint's)",
        lambda _results: model_engines.models(model_engines.DS2_SKEW),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "deepseek_v3",
        "the DeepSeek-V3 architecture at reduced width and depth (12 layers, 256 experts in 8 "
        "groups, FP8 blocks), the engines of deepseek",
        lambda _results: model_engines.models(model_engines.DS3),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "deepseek_v3_skew",
        "the same on the skewed reduced DeepSeek-V3 (--router-skew 1.0)",
        lambda _results: model_engines.models(model_engines.DS3_SKEW),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "qwen3_full",
        "Qwen3-30B-A3B at full depth (48 layers) in block FP8, 27 GiB of experts: the engines "
        "of deepseek (row at 32 and 64 slots, UVA keeping 12 and 24 layers)",
        lambda _results: model_engines.models(model_engines.QWEN48_FP8),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "qwen3_full_skew",
        "the same on the skewed full-depth Qwen3-30B-A3B (--router-skew 1.0; its expert shards "
        "hard-linked from the plain checkpoint's)",
        lambda _results: model_engines.models(model_engines.QWEN48_FP8_SKEW),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "gpt_oss",
        "gpt-oss-20b at full depth (24 layers, 32 MXFP4 experts, top-4), every engine on "
        "vLLM's triton_unfused MXFP4 backend: the engines of deepseek (row at 8 and 16 "
        "slots, UVA keeping 6 and 12 layers)",
        lambda _results: model_engines.models(model_engines.GPT_OSS),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "gpt_oss_skew",
        "the same on the skewed gpt-oss-20b (--router-skew 1.0; its expert shards hard-linked "
        "from the plain checkpoint's)",
        lambda _results: model_engines.models(model_engines.GPT_OSS_SKEW),
        one_at_a_time=True,
        budgeted=True,
    ),
    Phase(
        "archs",
        "random Mixtral and Qwen2-MoE (gated shared expert) in full graphs: no offload, row "
        "with the device planner at a slot count that misses and one that needs two passes",
        lambda _results: engines.archs(),
    ),
    Phase(
        "story",
        "24 layers (about 30 GB) under gpu_memory_utilization 0.10: no cache, row with 32 slots",
        lambda _results: engines.story(),
        one_at_a_time=True,
        min_left_s=90.0,
    ),
)
DEFAULT_PHASES = "tiny,mp,qwen8,story"


def select(names: list[str]) -> list[Phase]:
    """The named phases in run order; unknown names stop the run."""
    known = {phase.name for phase in PHASES}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"unknown phases {unknown}; known: {', '.join(sorted(known))}")
    return [phase for phase in PHASES if phase.name in names]


BUDGETED_LABELS = tuple(
    dict.fromkeys(
        engines.STEPS_LABELS
        + engines.curve_labels()
        + engines.FP8_LABELS
        + model_engines.models_labels_all()
    )
)
"""Every label ``run --only`` takes (the budgeted phases' engines after their prefix)."""
