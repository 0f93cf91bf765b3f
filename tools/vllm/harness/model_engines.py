"""The engines of the models phases (``deepseek``, ``deepseek_v3``, ``qwen3_full``, ``gpt_oss``
and their ``_skew``) and their checkpoints: the models people offload (DeepSeek-V2-Lite, the
DeepSeek-V3 architecture at reduced depth, Qwen3-30B-A3B's shapes at full depth in block FP8,
gpt-oss-20b), each at two budgets against vLLM's UVA offload at the same expert memory
(issue 34)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from tools.vllm.harness.engines import (
    FP8_EXPERT_BYTES,
    QWEN_EXPERTS,
    QWEN_PROMPT,
    lfu_label,
    lfu_raw_label,
    row_label,
    uva_label,
)
from tools.vllm.harness.specs import (
    Checkpoint,
    EngineSpec,
    Knob,
    Mode,
    Offload,
    OffloadBackend,
    Planner,
    Provider,
    Workload,
)

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
