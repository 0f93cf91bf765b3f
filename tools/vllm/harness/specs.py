"""What one engine of the end-to-end run is: typed, and serialised to JSON for its process.

An :class:`EngineSpec` says which checkpoint an engine loads, what it generates, how vLLM runs
the model (:class:`Mode`) and how the plugin is configured (:class:`Knob`). Phases pick engines
by these attributes (``spec.knob.provider``, ``spec.mode``, ...), never by their names; a name
only labels an engine's log, its result and its row of the summary.

To add an engine setting: a field here (with a default that leaves every existing engine as it
is), its effect in :func:`tools.vllm.harness.child.engine_kwargs` (engine arguments) or
:meth:`EngineSpec.env` (environment), and, for a non-scalar field, one line in
:meth:`EngineSpec.from_json` (the round-trip test of every phase's engines catches a missing
one).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]


class Mode(enum.Enum):
    """How vLLM runs the model (the engine's compilation settings)."""

    EAGER = "eager"
    """``enforce_eager``: no torch.compile, no graphs."""
    PIECEWISE = "piecewise"
    """``cudagraph_mode`` PIECEWISE with vLLM's default splitting ops (MoE inside the pieces)."""
    PIECEWISE_MOE_NAIVE = "piecewise_moe_naive"
    """PIECEWISE with vLLM's MoE ops made splitting ops as they are, without the plugin."""
    DEFAULT = "default"
    """vLLM's default compilation settings (with the knob on, the plugin lowers them)."""


class Provider(enum.Enum):
    """``moe_expert_cache_provider``."""

    ROW = "row"
    CACHED = "cached"


class Split(enum.Enum):
    """``moe_expert_cache_split``."""

    TOKEN = "token"
    EXPERT = "expert"


class Planner(enum.Enum):
    """``moe_expert_cache_planner``."""

    HOST = "host"
    DEVICE = "device"


@dataclass(frozen=True)
class Knob:
    """The plugin's configuration, ``additional_config["rowcache"]``: only what is set is passed
    (unset keys take the plugin's defaults)."""

    size: int | None = None
    """``moe_expert_cache_size``: GPU slots per MoE layer."""
    provider: Provider | None = None
    split: Split | None = None
    eager_between_graphs: bool = False
    """``moe_eager_between_graphs``: no cache, the MoE op eager between captured pieces."""
    planner: Planner | None = None
    """``moe_expert_cache_planner``."""
    compress: str | None = None
    """``moe_expert_cache_compress`` (``auto``, ``on``, ``off``)."""
    policy: str | None = None
    """``moe_expert_cache_policy`` (``lru``, ``lfu``)."""

    @property
    def caches(self) -> bool:
        """Whether the engine keeps its experts in the expert cache."""
        return bool(self.size)

    def config(self) -> dict[str, Any]:
        """The keys passed in ``additional_config["rowcache"]``."""
        out: dict[str, Any] = {}
        if self.size is not None:
            out["moe_expert_cache_size"] = self.size
        if self.provider is not None:
            out["moe_expert_cache_provider"] = self.provider.value
        if self.split is not None:
            out["moe_expert_cache_split"] = self.split.value
        if self.eager_between_graphs:
            out["moe_eager_between_graphs"] = True
        if self.planner is not None:
            out["moe_expert_cache_planner"] = self.planner.value
        if self.compress is not None:
            out["moe_expert_cache_compress"] = self.compress
        if self.policy is not None:
            out["moe_expert_cache_policy"] = self.policy
        return out

    @classmethod
    def from_json(cls, data: Json) -> Knob:
        raw = dict(data)
        raw["provider"] = None if raw["provider"] is None else Provider(raw["provider"])
        raw["split"] = None if raw["split"] is None else Split(raw["split"])
        planner = raw.get("planner")
        raw["planner"] = None if planner is None else Planner(planner)
        return cls(**raw)


class OffloadBackend(enum.Enum):
    """vLLM's weight offload backends (``offload_backend``)."""

    UVA = "uva"
    PREFETCH = "prefetch"


OFFLOAD_SET_ARGS = ("cpu_offload_params", "offload_params")
"""Engine arguments vLLM types as ``set[str]``: lists in the spec and in results.json, sets
only in the call of ``LLM`` (:func:`tools.vllm.harness.child.engine_kwargs` for vLLM)."""


@dataclass(frozen=True)
class Offload:
    """vLLM's own expert offload: the baselines the cache is measured against.

    The names, checked in the vLLM 0.25.0 wheel (and the same in 0.33.0):

    * ``vllm/config/offload.py``: ``OffloadConfig.offload_backend`` (``Literal["auto", "uva",
      "prefetch"]``), ``UVAOffloadConfig.cpu_offload_gb`` / ``cpu_offload_params`` (parameter
      name segments: ``"experts"`` matches ``mlp.experts.w13_weight``),
      ``PrefetchOffloadConfig.offload_group_size`` / ``offload_num_in_group`` /
      ``offload_prefetch_step`` / ``offload_params``; its validator requires
      ``offload_num_in_group <= offload_group_size`` and ``offload_prefetch_step >= 1``.
    * ``vllm/engine/arg_utils.py``: ``EngineArgs`` fields of the same names (0.25.0 lines
      516-522, 0.33.0 lines 607-613), folded into ``OffloadConfig(offload_backend=...,
      uva=UVAOffloadConfig(...), prefetch=PrefetchOffloadConfig(...))`` (0.25.0 line 2321).
    * ``vllm/entrypoints/llm.py`` (0.25.0 lines 196-200, 323-327): ``LLM.__init__`` names
      ``cpu_offload_gb``, ``offload_group_size``, ``offload_num_in_group``,
      ``offload_prefetch_step`` and ``offload_params`` (``set[str] | None``); ``offload_backend``
      and ``cpu_offload_params`` reach ``EngineArgs`` through ``**kwargs``.
    * ``vllm/model_executor/offloader/prefetch.py`` (``PrefetchOffloader.wrap_modules``, lines
      175-201): layer ``i`` is offloaded when ``i % group_size >= group_size - num_in_group``,
      its parameters whose name has a segment in ``offload_params``; with 8, 7 on 8 layers:
      layers 1 to 7, one layer's experts resident and ``offload_prefetch_step`` (1) layers in
      the static buffer pool.

    ``tests/test_e2e_steps.py`` checks every argument name passed here against the wheels'
    ``EngineArgs`` where they are at hand.
    """

    backend: OffloadBackend
    cpu_offload_gb: float = 0.0
    cpu_offload_params: tuple[str, ...] = ()
    group_size: int = 0
    num_in_group: int = 1
    prefetch_step: int = 1
    params: tuple[str, ...] = ()

    def engine_args(self) -> dict[str, Any]:
        """The engine arguments, JSON values (lists for vLLM's sets)."""
        if self.backend is OffloadBackend.UVA:
            return {
                "offload_backend": self.backend.value,
                "cpu_offload_gb": self.cpu_offload_gb,
                "cpu_offload_params": list(self.cpu_offload_params),
            }
        return {
            "offload_backend": self.backend.value,
            "offload_group_size": self.group_size,
            "offload_num_in_group": self.num_in_group,
            "offload_prefetch_step": self.prefetch_step,
            "offload_params": list(self.params),
        }

    @classmethod
    def from_json(cls, data: Json) -> Offload:
        raw = dict(data)
        raw["backend"] = OffloadBackend(raw["backend"])
        raw["cpu_offload_params"] = tuple(raw["cpu_offload_params"])
        raw["params"] = tuple(raw["params"])
        return cls(**raw)


@dataclass(frozen=True)
class Workload:
    """Everything one engine measures in turn (``harness/measure.py``), instead of one timed
    generation of ``EngineSpec.prompts``: greedy decode at each batch size, then the time to
    first token of long prompts, each prompt step one scheduler step."""

    batches: tuple[int, ...] = (1, 8, 32)
    decode_tokens: int = 256
    repeats: int = 3
    """Timed generations per measurement (the speed is their median)."""
    warmup_tokens: int = 16
    """Each decode batch size first generates this many tokens twice: the first compiles
    its shapes, the second's time estimates a timed generation."""
    prompt_tokens: int = 8
    """Decode prompts: sequence 0 is the recorded runs' 8-token prompt, the others seeded."""
    prefill_tokens: int = 2048
    prefill_prompts: int = 3
    """Timed distinct long prompts (a further one warms up); 0: no time to first token."""
    vocab: int = 4096
    seed: int = 0
    ttft_reserve_s: float = 5.0
    """Held back for the time to first token while decode runs: its four 2,048-token prompts
    took under 1 s in every engine of steps runs 4 and 5 (the slowest, UVA's, 0.22 s each)."""
    ttft_kernel_profile: bool = False
    """Last, one timed long prompt again under the GPU profiler: where its step's device time
    goes, by kernel (``harness/kernel_profile.py``)."""
    decode_kernel_profile: int = 0
    """Last, this many b1 decode tokens under the GPU profiler (0: none): where a decode
    token's device time goes, by kernel. Profiled twice, the decode prompt with one token (its
    prefill) and with one more than this; the difference is the decode steps'."""

    @classmethod
    def from_json(cls, data: Json) -> Workload:
        raw = dict(data)
        raw["batches"] = tuple(raw["batches"])
        return cls(**raw)


QUANTIZED_ARCHS = ("deepseek_v3", "gpt_oss")
"""The builder's architectures whose checkpoints carry a ``quantization_config``."""


@dataclass(frozen=True)
class Checkpoint:
    """A random-weight MoE checkpoint (Qwen3-MoE unless ``arch`` says), built on the machine by
    the builder
    (``make_moe_checkpoint.py``, see :mod:`tools.vllm.harness.checkpoints`)."""

    directory: str
    """Its directory under the run's work directory."""
    qwen3_30b_a3b: bool = False
    """Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts, top-8); else the builder's tiny
    model (2 layers, 16 experts, top-4, hidden 256)."""
    layers: int | None = None
    router_skew: float = 0.0
    """Zipf exponent of the routers' row scales (``tools/vllm/router_skew.py``); 0: the plain
    random router."""
    foreground: bool = False
    """Built before the first engine starts (it takes seconds); the others are built in one
    background process while the first phases run."""
    arch: str = "qwen3"
    """The builder's ``--arch``: ``qwen3`` (Qwen3-MoE), ``mixtral`` or ``qwen2moe`` (random
    Mixtral and Qwen2-MoE layouts, 4 layers, 32 experts, written without transformers)."""
    fp8_block: bool = False
    """The builder's ``--fp8-block``: stored in FP8 with 128 x 128 block scales (vLLM loads it
    with its ``Fp8MoEMethod``; no ``quantization`` argument needed)."""
    sharded: bool = False
    """The builder's ``--sharded`` (Qwen3-MoE): written one tensor at a time into 4 GiB shards,
    drawn on the GPU (a full-depth Qwen3-30B-A3B: 29 GB of FP8 experts)."""
    experts_from: str | None = None
    """The directory (under the run's work directory) of the same checkpoint without a router
    skew, whose shards but the routers' this one hard-links (the builder's
    ``--experts-from``: a full-depth skewed twin costs only its routers' bytes on disk)."""

    @property
    def quantized(self) -> bool:
        """Whether the checkpoint is stored quantized (``--fp8-block``, or an architecture the
        builder writes quantized: the reduced DeepSeek-V3 in FP8, gpt-oss in MXFP4)."""
        return self.fp8_block or self.arch in QUANTIZED_ARCHS

    def builder_args(self) -> list[str]:
        """The builder's arguments after the output directory."""
        args = [] if self.arch == "qwen3" else ["--arch", self.arch]
        args += ["--qwen3-30b-a3b"] if self.qwen3_30b_a3b else []
        args += ["--fp8-block"] if self.fp8_block else []
        args += ["--sharded"] if self.sharded else []
        if self.layers is not None:
            args += ["--layers", str(self.layers)]
        if self.router_skew:
            args += ["--router-skew", str(self.router_skew)]
        return args


@dataclass(frozen=True)
class EngineSpec:
    """One engine: a process of its own that starts vLLM, generates and reports."""

    name: str
    checkpoint: Checkpoint
    prompts: tuple[tuple[int, ...], ...]
    """Token-id prompts, generated as one batch."""
    max_tokens: int
    """Greedy tokens per prompt (``ignore_eos``)."""
    mode: Mode
    knob: Knob | None = None
    """``None``: no ``additional_config`` at all (the plugin is off)."""
    repeats: int = 1
    """Timed generations (the speed is their median)."""
    max_model_len: int = 1024
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 512
    capture_sizes: tuple[int, ...] = (1, 2, 4)
    """``cudagraph_capture_sizes`` of the compiled modes."""
    kv_bytes: int = 1 << 30
    """Fixed KV cache memory (engines of one phase share the GPU)."""
    gpu_memory_utilization: float | None = None
    """A GPU memory budget instead of fixed KV memory; meaningful only on an idle GPU."""
    multiprocess: bool = False
    """vLLM's multi-process engine (the engine core in a process of its own)."""
    debug_checks: bool = False
    """``VLLM_LOGGING_LEVEL=DEBUG``: vLLM asserts that every captured piece is replayed with
    its capture-time input addresses."""
    identity_expert_map: bool = False
    """Give every uncached MoE layer the identity ``expert_map`` (vLLM then takes the mapped
    kernel path of a cached layer)."""
    profiled: bool = False
    """With ``run --profile``: profile the engine after its timed generations."""
    compare_with: tuple[str, ...] = ()
    """The engines whose tokens this one's are compared with, by preference: the first that
    ran, else the last. An engine that lists itself first is its own reference."""
    offload: Offload | None = None
    """vLLM's own weight offload (UVA or prefetch)."""
    workload: Workload | None = None
    """Measure a workload (``harness/measure.py``) instead of generating ``prompts``."""
    max_position_embeddings: int | None = None
    """Passed as ``hf_overrides``: the builder's Qwen shapes say 2048, which a 2,048-token
    prompt plus its first token exceeds (vLLM rejects a prompt of ``max_model_len`` tokens)."""
    prefix_caching: bool | None = None
    """``enable_prefix_caching``; None: vLLM's default."""
    quantization: str | None = None
    """``quantization`` (``"fp8"``: a bf16 checkpoint quantized online while loading); None:
    what the checkpoint's ``quantization_config`` says, if anything."""
    moe_backend: str | None = None
    """``moe_backend`` (``"triton_unfused"``: gpt-oss's MXFP4 experts on the backend the cache
    serves, and its reference engines on the same kernel); None: vLLM's choice."""
    model_runner_v1: bool = False
    """``VLLM_USE_V2_MODEL_RUNNER=0``: vLLM's V1 model runner. vLLM 0.25.0 runs
    ``DeepseekV2ForCausalLM`` (and ``Qwen2MoeForCausalLM``, ``GraniteMoeForCausalLM``) on its
    V2 model runner by default (``config/vllm.py``, ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``),
    which never sets the weight offloader (only ``v1/worker/gpu_model_runner.py`` calls
    ``set_offloader``): ``cpu_offload_gb`` is then silently ignored, every expert stays on the
    GPU, and a UVA engine measures no offload (seen on the H200, 2026-12-03)."""
    skip_deep_gemm_warmup: bool = False
    """``VLLM_DEEP_GEMM_WARMUP=skip``: vLLM 0.25.0 otherwise compiles DeepGEMM's FP8 GEMMs for
    every dense FP8 layer shape and every token count up to ``max_num_batched_tokens`` at start-up
    (76 shapes at 512 tokens took 49 s on the H200; at 2,048 tokens the full-depth Qwen3 needs
    207, the reduced DeepSeek-V3 685); the sizes an engine runs compile in its untimed warm-ups
    instead (every batch size and the long prompt are warmed up before they are timed)."""
    time_once_s: float = 0.0
    """Estimated seconds to start and run every measurement once (an engine is not started
    with less time left; 0: no estimate)."""
    time_full_s: float = 0.0
    """Estimated seconds to start and run every measurement with all its repeats."""
    on_demand: bool = False
    """A diagnostic engine of a budgeted phase: it runs only where ``run --only`` names it."""
    guard_scale_tails: bool = False
    """gpt-oss without the cache, its MXFP4 weight scales followed by zeros as the cache's
    slots are (``harness/scale_guard.py``): vLLM's kernel reads past them on Hopper."""

    @property
    def graphs(self) -> bool:
        """Whether the engine compiles and captures graphs."""
        return self.mode is not Mode.EAGER

    @property
    def caches(self) -> bool:
        """Whether the engine keeps its experts in the expert cache."""
        return self.knob is not None and self.knob.caches

    @property
    def quantized(self) -> bool:
        """Whether vLLM quantizes the engine's model (an FP8 checkpoint, or ``quantization``)."""
        return self.checkpoint.quantized or self.quantization is not None

    def env(self) -> dict[str, str]:
        """Environment of the engine's process beyond the run's common one."""
        out: dict[str, str] = {}
        if self.multiprocess:
            out["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        if self.debug_checks:
            out["VLLM_LOGGING_LEVEL"] = "DEBUG"
        if self.model_runner_v1:
            out["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if self.skip_deep_gemm_warmup:
            out["VLLM_DEEP_GEMM_WARMUP"] = "skip"
        return out

    def to_json(self) -> Json:
        data: Json = _plain(dataclasses.asdict(self))
        return data

    @classmethod
    def from_json(cls, data: Json) -> EngineSpec:
        raw = dict(data)
        raw["checkpoint"] = Checkpoint(**raw["checkpoint"])
        raw["prompts"] = tuple(tuple(p) for p in raw["prompts"])
        raw["mode"] = Mode(raw["mode"])
        raw["knob"] = None if raw["knob"] is None else Knob.from_json(raw["knob"])
        raw["capture_sizes"] = tuple(raw["capture_sizes"])
        raw["compare_with"] = tuple(raw["compare_with"])
        offload, workload = raw.get("offload"), raw.get("workload")
        raw["offload"] = None if offload is None else Offload.from_json(offload)
        raw["workload"] = None if workload is None else Workload.from_json(workload)
        return cls(**raw)


@dataclass(frozen=True)
class Job:
    """An engine as the orchestrator hands it to its process: the spec, where its checkpoint
    is, and the phase's barrier (the directory of ready markers, ``go`` and the timing lock)."""

    spec: EngineSpec
    model: str
    barrier: str
    barrier_timeout: float
    profile_out: str | None = None
    """Where the profile goes (``run --profile``, profiled engines only)."""
    deadline: float | None = None
    """Epoch seconds by which a workload's measurements end (what does not fit is recorded as
    not run)."""
    shadow: bool = False
    """``run --shadow``: a cache engine runs under the shadow check (``harness/shadow.py``)."""
    trace: bool = False
    """``run --trace``: the engine traces its MoE layers over its first generation
    (``harness/trace.py``)."""

    def to_json(self) -> Json:
        return {
            "spec": self.spec.to_json(),
            "model": self.model,
            "barrier": self.barrier,
            "barrier_timeout": self.barrier_timeout,
            "profile_out": self.profile_out,
            "deadline": self.deadline,
            "shadow": self.shadow,
            "trace": self.trace,
        }

    @classmethod
    def from_json(cls, data: Json) -> Job:
        raw = dict(data)
        raw["spec"] = EngineSpec.from_json(raw["spec"])
        return cls(**raw)


def _plain(value: Any) -> Any:
    """``dataclasses.asdict`` output as JSON values: enums by value, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
