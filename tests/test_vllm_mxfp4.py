"""gpt-oss's MXFP4 MoE method with the expert cache (``rowcache.vllm._mxfp4``), against a fake
of vLLM 0.25.0's classes on the CPU (docs/GPT_OSS.md).

The fake keeps what the plugin touches: ``GptOssMxfp4MoEMethod`` creates the raw tensors
(packed values ``[E, 2I, H/2]``, e8m0 scales ``[E, 2I, H/32]``, bf16 biases); its
``_setup_kernel`` converts them as the Triton path does in shape (values and scales transposed
into ``.mT`` storage wrapped as triton_kernels tensors, the scales moved into precision configs,
float32 biases) and builds the quant config and kernel; ``UnfusedOAITritonExperts`` maps the
router's ids through the ``expert_map``, computes each mapped entry from the storage of its
slot (NaN rows elsewhere, as the real kernel leaves them) and reduces through the module
global ``masked_moe_sum``. Outputs are compared bit for bit with vLLM's own method (the knob
off) over the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_vllm_fp8 import FAKE_FP8
from test_vllm_register import (  # noqa: F401 (fixtures)
    FAKE_VLLM,
    _engine,
    fresh_plugin,
)

import rowcache.vllm as plugin

E, TOP_K, HIDDEN, INTER = 8, 2, 64, 32

FAKE_MXFP4 = {
    "vllm/model_executor/layers/fused_moe/experts/gpt_oss_triton_kernels_moe.py": """
        from dataclasses import dataclass
        from types import SimpleNamespace

        import torch
        import torch.nn.functional as F

        def masked_moe_sum(intermediate, topk_ids, output):
            # vLLM's: float32 from 0 in k order; entries with an id below 0 are not read.
            acc = torch.zeros(output.shape, dtype=torch.float32)
            for k in range(intermediate.shape[1]):
                valid = (topk_ids[:, k] >= 0).unsqueeze(1)
                acc = torch.where(valid, acc + intermediate[:, k].float(), acc)
            output.copy_(acc.to(output.dtype))

        def dequant(values, scales):
            # Two 4-bit values a byte (low nibble first), times 2**(scale - 127) a block of 32.
            v = torch.stack([values & 0xF, values >> 4], dim=-1).flatten(-2).float() - 8.0
            s = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=-1)
            return v * s

        class UnfusedOAITritonExperts:
            def __init__(self):
                self.quant_config = None

            def _make_routing_data(self, topk_ids, topk_weights, num_local_experts):
                routing = SimpleNamespace(
                    n_expts_tot=num_local_experts, expected_tokens_per_expt=None
                )
                return routing, None, None

        @dataclass
        class OptFlags:  # triton_kernels' (opt_flags.py), reduced
            block_m: int
            split_k: int = 1
            arch: object = None

        def make_opt_flags(out_dtype, lhs_dtype, rhs_dtype, precision_config, m, n, k,
                           routing_data, can_use_persistent_tma, can_use_fused_scatter,
                           epilogue_effective_itemsize):
            # opt_flags.py: the row tile from the expected tokens per expert.
            tokens = routing_data.expected_tokens_per_expt
            if tokens is None:
                tokens = max(1, m // routing_data.n_expts_tot)
            return OptFlags(max(16, min(1 << (tokens - 1).bit_length(), 128)))

        def matmul_ogs(routing, m):
            # triton_kernels' matmul_ogs reduced to its launch options (the module global
            # make_opt_flags, as there); the fake kernel does the arithmetic.
            return make_opt_flags(None, None, None, None, m, 0, 0, routing, False, False, 0)

        WORKSPACE = {}  # one buffer a shape, reused by every call, as vLLM's workspace is
        STALE = []  # seeded bug: a cached call leaves entry (0, 0) unwritten, read stale
        NEIGHBOUR = []  # seeded bug: an entry also reads the next slot's w2 bias
        TAIL = []  # seeded bug: every entry also reads the w2 bias row past the last slot
        MAP_PATH = []  # seeded bug: a call with an expert map rounds its entries otherwise
        STALE_KERNEL = []  # seeded bug: a call without a map (no offload's) reads (0, 0) stale

        class OAITritonMxfp4ExpertsMonolithic:
            def __init__(self):
                self.quant_config = None

        class Mxfp4Kernel:
            # vLLM's modular kernel around the experts, reduced to the arithmetic.
            def __init__(self, fused_experts):
                self.fused_experts = fused_experts
                self.calls = 0
                self.tiles = []

            def apply(self, **kw):
                self.calls += 1
                qc = self.fused_experts.quant_config
                x, ids = kw["hidden_states"], kw["topk_ids"]
                weights, expert_map = kw["topk_weights"].float(), kw["expert_map"]
                w1, w2 = kw["w1"].storage.data, kw["w2"].storage.data  # [slots, ...] raw order
                s1 = qc.w1_precision.weight_scale.storage.data
                s2 = qc.w2_precision.weight_scale.storage.data
                local = ids if expert_map is None else expert_map[ids.long()]
                rows, top_k = ids.shape
                routing, _, _ = self.fused_experts._make_routing_data(local, weights, w1.shape[0])
                tile = matmul_ogs(routing, rows * top_k).block_m
                self.tiles.append(tile)
                shape = (rows, top_k, x.shape[1])
                cache3 = WORKSPACE.setdefault(shape, torch.empty(shape, dtype=x.dtype))
                if not STALE and not STALE_KERNEL:
                    cache3.fill_(float("nan"))  # entries not computed: not what was there
                for t in range(rows):
                    for j in range(top_k):
                        s = int(local[t, j])
                        if s < 0 or (STALE and expert_map is not None and t == j == 0):
                            continue
                        if STALE_KERNEL and expert_map is None and t == j == 0:
                            continue
                        h = x[t].float() @ dequant(w1[s], s1[s]).t() + qc.w1_bias[s]
                        if tile >= 128:  # another tile, another rounding of the first GEMM
                            h = h.to(torch.bfloat16).float()
                        gate, up = h.chunk(2)
                        a = (F.silu(gate) * up).to(torch.bfloat16).float()
                        y = (a @ dequant(w2[s], s2[s]).t() + qc.w2_bias[s]) * weights[t, j]
                        bias = qc.w2_bias
                        if MAP_PATH and expert_map is not None:
                            y = y * 1.01
                        if NEIGHBOUR:
                            y = y + 1e-2 * bias[(s + 1) % bias.shape[0]]
                        room = bias.untyped_storage().nbytes() // bias.element_size()
                        if TAIL and room >= bias.storage_offset() + bias.numel() + bias.shape[1]:
                            rows = (bias.shape[0] + 1, bias.shape[1])
                            past = bias.as_strided(rows, bias.stride())
                            y = y + 1e-2 * past[-1]
                        cache3[t, j] = y.to(x.dtype)
                out = torch.empty_like(x)
                masked_moe_sum(cache3, local, out)  # the module global, as in vLLM
                return out
        """,
    "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py": """
        import enum
        from dataclasses import dataclass, field
        from types import SimpleNamespace
        from typing import Any

        import torch

        from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai

        class Mxfp4MoeBackend(enum.Enum):
            TRITON = "TRITON"
            TRITON_UNFUSED = "TRITON_UNFUSED"
            MARLIN = "MARLIN"

        @dataclass
        class Storage:  # triton_kernels.tensor.Storage
            data: torch.Tensor
            layout: Any = None

        @dataclass
        class Tensor:  # triton_kernels.tensor.Tensor
            storage: Storage
            dtype: Any = None
            shape: list = field(default_factory=list)
            shape_max: list = field(default_factory=list)

        @dataclass
        class PrecisionConfig:  # triton_kernels.matmul_ogs.PrecisionConfig
            weight_scale: Any = None
            out_dtype: Any = None

        HOPPER_LAYOUT = object()

        def swizzled(raw, packed=False):
            # The Hopper value layout in shape: transposed, stored as .mT of contiguous data;
            # the shape logical, [E, K, N] (two FP4 values a byte along K).
            data = raw.transpose(-2, -1).contiguous().transpose(-2, -1)
            shape = [raw.shape[0], raw.shape[2] * (2 if packed else 1), raw.shape[1]]
            return Tensor(Storage(data, HOPPER_LAYOUT), "FP4", shape, list(shape))

        @dataclass
        class FusedMoEQuantDesc:
            # vLLM's (fused_moe/config.py), reduced: a weight's precision config and bias.
            scale: Any = None
            bias: Any = None

        @dataclass
        class FusedMoEQuantConfig:
            # vLLM's, reduced: read through properties, as UnfusedOAITritonExperts reads it.
            _w1: FusedMoEQuantDesc
            _w2: FusedMoEQuantDesc

            @property
            def w1_precision(self):
                return self._w1.scale

            @property
            def w2_precision(self):
                return self._w2.scale

            @property
            def w1_bias(self):
                return self._w1.bias

            @property
            def w2_bias(self):
                return self._w2.bias

        def make_mxfp4_moe_quant_config(mxfp4_backend, w1_scale, w2_scale, w1_bias=None,
                                        w2_bias=None, gemm1_alpha=None, gemm1_beta=None,
                                        swiglu_limit=None, layer=None):
            return FusedMoEQuantConfig(FusedMoEQuantDesc(w1_scale, w1_bias),
                                       FusedMoEQuantDesc(w2_scale, w2_bias))

        def make_mxfp4_moe_kernel(moe_quant_config, moe_config, mxfp4_backend, experts_cls,
                                  routing_tables=None, layer=None):
            experts = experts_cls()
            experts.quant_config = moe_quant_config
            return oai.Mxfp4Kernel(experts)
        """,
    "vllm/model_executor/layers/quantization/mxfp4.py": """
        from abc import ABC

        import torch

        from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
            Mxfp4MoeBackend, PrecisionConfig, make_mxfp4_moe_kernel,
            make_mxfp4_moe_quant_config, swizzled,
        )
        from vllm.model_executor.utils import replace_parameter, set_weight_attrs

        class GptOssMxfp4Config:
            def __init__(self, backend=Mxfp4MoeBackend.TRITON_UNFUSED):
                self.backend = backend

            def get_quant_method(self, layer, prefix):
                return GptOssMxfp4MoEMethod(layer.moe_config, self.backend)

        class FusedMoEMethodBase(ABC):
            pass

        class GptOssMxfp4MoEMethod(FusedMoEMethodBase):
            def __init__(self, moe, backend=Mxfp4MoeBackend.TRITON_UNFUSED):
                self.moe = moe
                self.mxfp4_backend = backend
                self.experts_cls = (
                    oai.UnfusedOAITritonExperts
                    if backend == Mxfp4MoeBackend.TRITON_UNFUSED
                    else oai.OAITritonMxfp4ExpertsMonolithic
                )
                self.moe_kernel = None
                self.w13_precision_config = None
                self.w2_precision_config = None

            def create_weights(self, layer, num_experts, hidden_size,
                               intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs):
                self.num_experts = num_experts
                inter = intermediate_size_per_partition
                shapes = {
                    "w13_weight": ((num_experts, 2 * inter, hidden_size // 2), torch.uint8),
                    "w13_weight_scale": ((num_experts, 2 * inter, hidden_size // 32), torch.uint8),
                    "w2_weight": ((num_experts, hidden_size, inter // 2), torch.uint8),
                    "w2_weight_scale": ((num_experts, hidden_size, inter // 32), torch.uint8),
                    "w13_bias": ((num_experts, 2 * inter), torch.bfloat16),
                    "w2_bias": ((num_experts, hidden_size), torch.bfloat16),
                }
                for name, (shape, dtype) in shapes.items():
                    param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype),
                                               requires_grad=False)
                    layer.register_parameter(name, param)
                    set_weight_attrs(param, extra_weight_attrs)

            def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_bias=None,
                              w2_bias=None):
                assert w13.shape[0] == self.num_experts and w13.dtype == torch.uint8
                # convert_gpt_oss_weight_to_mxfp4_moe_kernel_format on the Triton path: it
                # deletes the four parameters, then _setup_kernel sets plain attributes.
                w13_pc = PrecisionConfig(weight_scale=swizzled(w13_scale))
                w2_pc = PrecisionConfig(weight_scale=swizzled(w2_scale))
                w13, w2 = swizzled(w13, packed=True), swizzled(w2, packed=True)
                del layer.w13_weight, layer.w2_weight
                del layer.w13_weight_scale, layer.w2_weight_scale
                layer.w13_weight, layer.w2_weight = w13, w2
                self.w13_precision_config, self.w2_precision_config = w13_pc, w2_pc
                replace_parameter(layer, "w13_bias", w13_bias.float())
                replace_parameter(layer, "w2_bias", w2_bias.float())
                self.moe_quant_config = self.get_fused_moe_quant_config(layer)
                self.moe_kernel = make_mxfp4_moe_kernel(
                    moe_quant_config=self.moe_quant_config, moe_config=self.moe,
                    mxfp4_backend=self.mxfp4_backend, experts_cls=self.experts_cls,
                    routing_tables=layer._expert_routing_tables(), layer=layer,
                )

            def process_weights_after_loading(self, layer):
                self._setup_kernel(layer, layer.w13_weight, layer.w2_weight,
                                   layer.w13_weight_scale, layer.w2_weight_scale,
                                   layer.w13_bias, layer.w2_bias)

            def get_fused_moe_quant_config(self, layer):
                return make_mxfp4_moe_quant_config(
                    mxfp4_backend=self.mxfp4_backend, w1_scale=self.w13_precision_config,
                    w2_scale=self.w2_precision_config, w1_bias=layer.w13_bias,
                    w2_bias=layer.w2_bias, gemm1_alpha=1.702, gemm1_beta=1.0,
                    swiglu_limit=7.0, layer=layer,
                )

            def apply(self, layer, x, topk_weights, topk_ids, shared_experts,
                      shared_experts_input):
                return self.moe_kernel.apply(
                    hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                    topk_weights=topk_weights, topk_ids=topk_ids, activation=layer.activation,
                    global_num_experts=layer.global_num_experts, expert_map=None,
                    apply_router_weight_on_input=False, shared_experts=shared_experts,
                    shared_experts_input=shared_experts_input,
                )
        """,
}


@pytest.fixture
def fake_mxfp4(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_plugin: None,  # noqa: F811 (the fixture)
) -> Any:
    for rel, text in {**FAKE_VLLM, **FAKE_FP8, **FAKE_MXFP4}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("SIZE", "PROVIDER", "SPLIT", "PLANNER", "COMPRESS", "EAGER_BETWEEN_GRAPHS"):
        monkeypatch.delenv(f"ROWCACHE_MOE_EXPERT_CACHE_{key}", raising=False)
        monkeypatch.delenv(f"ROWCACHE_MOE_{key}", raising=False)
    import vllm.config.vllm as config_module

    assert "site-packages" not in str(config_module.__file__)
    return SimpleNamespace(config=config_module, root=tmp_path)


def _moe() -> SimpleNamespace:
    return SimpleNamespace(
        experts_per_token=TOP_K, num_local_experts=E, has_bias=True, is_act_and_mul=True
    )


def _load(param: Any, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def _checkpoint(seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def uint8(*shape: int, low: int = 0, high: int = 256) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)

    return {
        "w13_weight": uint8(E, 2 * INTER, HIDDEN // 2),
        "w13_weight_scale": uint8(E, 2 * INTER, HIDDEN // 32, low=118, high=124),
        "w2_weight": uint8(E, HIDDEN, INTER // 2),
        "w2_weight_scale": uint8(E, HIDDEN, INTER // 32, low=118, high=124),
        "w13_bias": (torch.randn(E, 2 * INTER, generator=gen) * 0.1).to(torch.bfloat16),
        "w2_bias": (torch.randn(E, HIDDEN, generator=gen) * 0.1).to(torch.bfloat16),
    }


def _layer(
    fake: Any,
    section: dict[str, object] | None,
    backend: str = "TRITON_UNFUSED",
    before_processing: Any = None,
) -> Any:
    """A gpt-oss MoE layer built as vLLM builds it, its checkpoint loaded and processed
    (``before_processing(layer)`` called between the two)."""
    plugin.register()
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    _engine(fake, section, quantization="gpt_oss_mxfp4")
    layer = RoutedExperts(_moe(), GptOssMxfp4Config(Mxfp4MoeBackend[backend]))
    layer.activation = "swigluoai"
    layer.global_num_experts = E
    layer.apply_router_weight_on_input = False
    layer._expert_routing_tables = lambda: None
    layer.quant_method.create_weights(layer, E, HIDDEN, INTER, torch.bfloat16, weight_loader=_load)
    for name, tensor in _checkpoint().items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    if before_processing is not None:
        before_processing(layer)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from moe_reference import make_routing

    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5 + seed))
    ids, topk_weights = make_routing(tokens, E, TOP_K, seed=seed)
    return x.to(torch.bfloat16), ids, topk_weights


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_knob_off_leaves_vllms_method(fake_mxfp4: Any) -> None:
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    assert type(_layer(fake_mxfp4, None).quant_method) is GptOssMxfp4MoEMethod


def test_the_converted_experts_live_in_host_rows_and_the_slots(fake_mxfp4: Any) -> None:
    from rowcache.vllm._mxfp4 import RowcacheGptOssMxfp4MoEMethod

    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3})
    method = layer.quant_method
    assert type(method) is RowcacheGptOssMxfp4MoEMethod
    provider = method.rowcache_provider
    assert provider.capacity == 3 and method._rowcache_hosts == {}
    # Each slot buffer holds whole experts' byte ranges of the converted storage.
    per_expert = 2 * INTER * HIDDEN // 2
    assert provider.buf_w13.shape == (3, per_expert) and provider.buf_w13.dtype == torch.uint8
    assert provider.buf_w13_bias.shape == (3, 2 * INTER)
    assert provider.buf_w13_bias.dtype == torch.float32
    # The layer, its precision configs and the kernel's quant config read the slots.
    assert layer.w13_weight.storage.data.data_ptr() == provider.buf_w13.data_ptr()
    assert layer.w13_weight.shape == [3, HIDDEN, 2 * INTER]  # logical: [E, K, N]
    assert layer.w13_weight.storage.data.stride() == (per_expert, 1, 2 * INTER)  # .mT
    scale = method.w2_precision_config.weight_scale
    assert scale.storage.data.data_ptr() == provider.buf_w2_scale.data_ptr()
    quant = method.moe_kernel.fused_experts.quant_config
    assert quant.w1_precision is method.w13_precision_config
    assert quant.w1_bias.data_ptr() == provider.buf_w13_bias.data_ptr()
    # A slot filled with an expert holds that expert's raw tensors, as the kernel indexes them.
    ids = torch.tensor([[5, 2]])
    result = provider.prepare(ids)
    raw = _checkpoint()
    for expert in (5, 2):
        slot = int(result.expert_map[expert])
        assert torch.equal(layer.w13_weight.storage.data[slot], raw["w13_weight"][expert])
        assert torch.equal(scale.storage.data[slot], raw["w2_weight_scale"][expert])
        want = raw["w2_bias"][expert].float()
        assert torch.equal(provider.buf_w2_bias[slot], want)


def test_the_raw_pinned_tensors_are_freed_once_converted(fake_mxfp4: Any) -> None:
    """vLLM keeps a copy of every parameter's attributes, its weight loader among them, for as
    long as the model lives (its layerwise reload metadata): once the layer's experts are in
    the provider's rows, the raw pinned tensors must not stay pinned through those loaders (on
    the GPU they did: 10.3 GB of gpt-oss-20b's raw experts beside 10.2 GB of rows)."""
    import gc
    import weakref

    from rowcache.vllm._config import RowcacheError

    kept: dict[str, Any] = {}

    def record(layer: Any) -> None:
        for name, host in layer.quant_method._rowcache_hosts.items():
            kept[name] = (weakref.ref(host), dict(vars(getattr(layer, name))))

    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3}, before_processing=record)
    gc.collect()
    assert sorted(kept) == sorted(_checkpoint())
    assert [n for n, (host, _) in kept.items() if host() is not None] == []
    with pytest.raises(RowcacheError, match="reloading weights into this engine"):
        kept["w13_weight"][1]["weight_loader"](layer.w13_weight, _checkpoint()["w13_weight"])


@pytest.mark.parametrize(
    ("section", "cut"),
    [
        ({"moe_expert_cache_size": 3}, False),  # the token split: each row in one call
        ({"moe_expert_cache_size": 3, "moe_expert_cache_split": "expert"}, True),
        ({"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}, True),
        ({"moe_expert_cache_size": 8}, False),  # every expert fits
    ],
)
def test_the_forward_is_bit_identical_to_vllms(
    fake_mxfp4: Any, section: dict[str, object], cut: bool
) -> None:
    """Chunks and passes give one call's bits: a step cut by experts takes each pass's
    entries through the masked-sum tap (NaN rows of unmapped entries never read) and reduces
    once with the step's ids."""
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai

    reference = _layer(fake_mxfp4, None)
    cached = _layer(fake_mxfp4, section)
    for seed in range(3):
        x, ids, topk_weights = _inputs(6, seed)
        expected = reference.quant_method.apply(reference, x, topk_weights, ids, None, None)
        assert not torch.isnan(expected).any()
        kernel = cached.quant_method.moe_kernel
        kernel.calls = 0
        out = cached.quant_method.apply(cached, x, topk_weights, ids, None, None)
        assert torch.equal(_bits(out), _bits(expected)), seed
        assert (kernel.calls > 1) == (section["moe_expert_cache_size"] < E)
    assert (type(oai.masked_moe_sum).__name__ == "MaskedSumTap") == cut
    if cut:  # the engine probe names the route the steps took (tools/vllm/harness/probes.py)
        from tools.vllm.harness import probes

        layers = torch.nn.ModuleList([cached])
        exact = "exact: passes' unreduced entries, one masked_moe_sum per step"
        assert probes.routes(layers)["routes"] == {exact: 1}


def test_a_backend_other_than_triton_unfused_is_refused_by_name(fake_mxfp4: Any) -> None:
    with pytest.raises(RuntimeError) as info:
        _layer(fake_mxfp4, {"moe_expert_cache_size": 3}, backend="TRITON")
    message = str(info.value)
    assert "selected vLLM's MXFP4 MoE backend TRITON (OAITritonMxfp4ExpertsMonolithic)" in message
    assert "--moe-backend triton_unfused" in message


def test_planes_are_refused_for_mxfp4_experts(fake_mxfp4: Any) -> None:
    section = {
        "moe_expert_cache_size": 3,
        "moe_expert_cache_planner": "device",
        "moe_expert_cache_compress": "on",
    }
    with pytest.raises(RuntimeError, match="experts are MXFP4: set it to off or auto"):
        _layer(fake_mxfp4, section)


def test_processing_again_is_refused(fake_mxfp4: Any) -> None:
    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3})
    with pytest.raises(RuntimeError, match="cannot be processed again"):
        layer.quant_method.process_weights_after_loading(layer)


def test_the_config_guard_lets_gpt_oss_through(fake_mxfp4: Any) -> None:
    """By default gpt-oss gets the device planner in full graphs (its record), the MoE op
    captured with the forward; the host planner set makes the MoE op a splitting op."""
    from test_vllm_register import _config
    from vllm.config.compilation import CUDAGraphMode

    from rowcache.vllm.knob import PLANNER_CHOSEN

    plugin.register()
    config = _config(fake_mxfp4, {"moe_expert_cache_size": 8}, quantization="gpt_oss_mxfp4")
    assert config.additional_config["rowcache"][PLANNER_CHOSEN]["planner"] == "device"
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert "vllm::moe_forward" not in config.compilation_config.splitting_ops
    section = {"moe_expert_cache_size": 8, "moe_expert_cache_planner": "host"}
    config = _config(fake_mxfp4, section, quantization="gpt_oss_mxfp4")
    assert "vllm::moe_forward" in config.compilation_config.splitting_ops


@pytest.mark.parametrize(
    "section",
    [
        {"moe_expert_cache_size": 3},
        {"moe_expert_cache_size": 3, "moe_expert_cache_split": "expert"},
        {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"},
    ],
)
def test_every_call_takes_the_tiles_of_one_call_over_every_expert(
    fake_mxfp4: Any, section: dict[str, object]
) -> None:
    """200 tokens: one call over the 8 experts sizes its row tile for 400 // 8 = 50 entries an
    expert (64 rows); a call over 3 slots left alone would size it for 133 (128 rows) and round
    the fake's first GEMM differently. With the tiles pinned every call takes 64 and the bits
    are one call's."""
    reference = _layer(fake_mxfp4, None)
    cached = _layer(fake_mxfp4, section)
    x, ids, topk_weights = _inputs(200, 1)
    expected = reference.quant_method.apply(reference, x, topk_weights, ids, None, None)
    assert reference.quant_method.moe_kernel.tiles == [64]
    kernel = cached.quant_method.moe_kernel
    out = cached.quant_method.apply(cached, x, topk_weights, ids, None, None)
    assert len(kernel.tiles) > 1 and set(kernel.tiles) == {64}
    assert torch.equal(_bits(out), _bits(expected))


def test_the_config_hook_picks_triton_unfused_for_gpt_oss(
    fake_mxfp4: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With the cache on, a gpt-oss engine left at vLLM's automatic choice gets
    triton_unfused, said once; the same given stays; another given is refused, naming it, and
    nothing changes with the cache off or for another quantization."""
    import logging

    from test_vllm_register import _config

    plugin.register()
    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    on = {"moe_expert_cache_size": 8}
    config = _config(fake_mxfp4, on, quantization="gpt_oss_mxfp4")
    assert config.kernel_config.moe_backend == "triton_unfused"
    said = [m for m in caplog.messages if m.startswith("rowcache: moe_backend")]
    assert said == [
        "rowcache: moe_backend triton_unfused for gpt-oss's MXFP4 experts (was auto: the "
        "expert cache serves that backend only)"
    ]
    given = _config(fake_mxfp4, on, quantization="gpt_oss_mxfp4", moe_backend="triton_unfused")
    assert given.kernel_config.moe_backend == "triton_unfused"
    with pytest.raises(RuntimeError) as info:
        _config(fake_mxfp4, on, quantization="gpt_oss_mxfp4", moe_backend="marlin")
    assert "moe_backend is 'marlin'; allowed: auto" in str(info.value)
    off = _config(fake_mxfp4, None, quantization="gpt_oss_mxfp4")
    assert off.kernel_config.moe_backend == "auto"
    fp8 = _config(fake_mxfp4, on, quantization="fp8")
    assert fp8.kernel_config.moe_backend == "auto"


def test_a_vllm_without_the_backend_setting_is_left_to_the_layers_check(
    fake_mxfp4: Any,
) -> None:
    """Where the configuration has no ``moe_backend`` the hook sets nothing and refuses
    nothing: each layer's backend is checked when its method is built."""
    from test_vllm_register import _config

    from rowcache.vllm._config import choose_gpt_oss_backend
    from rowcache.vllm.knob import parse_settings

    plugin.register()
    config = _config(fake_mxfp4, None, quantization="gpt_oss_mxfp4")
    config.kernel_config = None
    settings = parse_settings({"rowcache": {"moe_expert_cache_size": 8}}, {})
    assert choose_gpt_oss_backend(config, settings) is None


@pytest.mark.parametrize("route", ["exact", "float32 sum", "tiles left to the slots"])
def test_the_engines_exactness_probe_checks_mxfp4_layers(fake_mxfp4: Any, route: str) -> None:
    """tools/vllm/harness/probes.exactness on gpt-oss layers: the reference is vLLM's kernel
    over the whole expert set (the provider's host rows wrapped as the slots are, the whole
    set's scales and biases in the quant config for its call, its tiles vLLM's own), and it
    logs every ``matmul_ogs`` launch's options. The exact route is bit-identical where a step
    takes three passes, with the launches of one call over every expert; the float32 sum of
    a cut step is caught, and so are calls left to size their tiles over the slots (100 rows of
    3 entries: tile 128 over 3 slots against 64 over 8 experts), their launch options named."""
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai

    from tools.vllm.harness import probes

    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    layers = []
    for seed in range(2):
        layer = _layer(fake_mxfp4, section)
        method = layer.quant_method
        # Three entries a token: a pass's partial sum rounds (two bf16 entries sum exactly).
        method.moe = SimpleNamespace(**{**vars(_moe()), "experts_per_token": 3})
        experts = method.moe_kernel.fused_experts
        if route == "float32 sum":

            class OtherExperts:  # computes as UnfusedOAITritonExperts, but is not one
                pass

            other = OtherExperts()
            vars(other).update(vars(experts))  # the quant config and the pinned routing
            method.moe_kernel.fused_experts = other
        elif route == "tiles left to the slots":
            del experts._make_routing_data  # the class's own: no pinned tiles
        layers.append((f"layers.{seed}.experts", layer))
    model = SimpleNamespace(named_modules=lambda: iter(layers))
    kept_flags = oai.make_opt_flags
    found = probes.exactness(model, device="cpu", row_counts=(1, 100))
    assert found["layers"] == 2 and found["skipped"] == 0
    assert found["equal"]["1"] == 2  # one row: one pass
    if route == "exact":
        assert found["equal"]["100"] == 2 and found["max_abs"]["100"] == 0.0
    else:
        assert found["equal"]["100"] < 2 and found["max_abs"]["100"] > 0.0
    flags = found.get("launch_flags", {})
    if route == "float32 sum":
        assert flags == {}  # its experts' module calls no matmul_ogs
    else:
        assert flags["1"] == {
            "reference": ["block_m=16 split_k=1"],
            "cached": ["block_m=16 split_k=1"],
            "layers_differing": 0,
        }
        assert flags["100"]["reference"] == ["block_m=64 split_k=1"]
        if route == "exact":
            assert flags["100"]["cached"] == ["block_m=64 split_k=1"]
            assert flags["100"]["layers_differing"] == 0
        else:
            assert "block_m=128 split_k=1" in flags["100"]["cached"]
            assert flags["100"]["layers_differing"] == 2
    # Everything the probe swapped for its reference is back: the slots in the quant config,
    # the forward's pinned entries, the launch options' maker.
    assert oai.make_opt_flags is kept_flags
    for _, layer in layers:
        method = layer.quant_method
        provider = method.rowcache_provider
        quant = method.moe_kernel.fused_experts.quant_config
        assert quant.w1_precision is method.w13_precision_config
        scale = quant.w2_precision.weight_scale.storage.data
        assert scale.data_ptr() == provider.buf_w2_scale.data_ptr()
        assert quant.w1_bias.data_ptr() == provider.buf_w13_bias.data_ptr()
        assert method._forward_entries == 100 * 3


def test_the_exactness_probe_catches_a_forward_reading_what_it_did_not_write(
    fake_mxfp4: Any,
) -> None:
    """A cached call that leaves one entry of vLLM's workspace unwritten (seeded in the fake)
    reads what the call before it left there. Just after the reference that is the
    reference's own value, so the cached forward run after it matches; the probe's first run,
    on poisoned memory (here: the fake workspace filled with NaN), before the reference,
    catches it, and the layer is not counted equal."""
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai

    from tools.vllm.harness import probes

    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    layers = []
    for seed in range(2):
        layer = _layer(fake_mxfp4, section)
        layer.quant_method.moe = SimpleNamespace(**{**vars(_moe()), "experts_per_token": 3})
        layers.append((f"layers.{seed}.experts", layer))
    model = SimpleNamespace(named_modules=lambda: iter(layers))

    def poison() -> None:
        for buffer in oai.WORKSPACE.values():
            buffer.fill_(float("nan"))

    rows = (1, 100)
    clean = probes.exactness(model, device="cpu", row_counts=rows, poison=poison)
    assert clean["equal"] == {"1": 2, "100": 2}
    assert clean["by_order"]["first"]["non_finite"] == {"1": 0, "100": 0}
    oai.STALE.append(True)
    try:
        found = probes.exactness(model, device="cpu", row_counts=rows, poison=poison)
    finally:
        oai.STALE.clear()
    assert found["by_order"]["after"]["equal"] == {"1": 2, "100": 2}  # blind after the kernel
    assert found["by_order"]["first"]["equal"] == {"1": 0, "100": 0}
    assert found["by_order"]["first"]["non_finite"] == {"1": 2, "100": 2}
    assert found["equal"] == {"1": 0, "100": 0}
    # vLLM's own kernel is sound here: its run on poisoned memory repeats its first.
    assert clean["kernel_again"]["equal"] == found["kernel_again"]["equal"] == {"1": 2, "100": 2}
    from tools.vllm.harness import probe_lines

    said = probe_lines.exactness_line({"exactness": clean}, "row3")
    assert said is not None and "vLLM's kernel run again on poisoned memory gives its own " in said
    assert "(1: 2/2, 100: 2/2)" in said and "reads memory it did not write" not in said


def test_the_exactness_probe_names_vllms_kernel_reading_what_it_did_not_write(
    fake_mxfp4: Any,
) -> None:
    """Where vLLM's kernel without a map (the reference, as no offload runs it) reads one
    entry it did not write (seeded in the fake), its run on poisoned memory parts from its
    first run (NaN there); the cached forward, which computes every entry, parts from the
    reference's first run in both orders, and the line says the kernel moves."""
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai

    from tools.vllm.harness import probe_lines, probes

    # One layer: a second would read what the first layer's runs left (poison included).
    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})
    model = SimpleNamespace(named_modules=lambda: iter([("layers.0.experts", layer)]))

    def poison() -> None:
        for buffer in oai.WORKSPACE.values():
            buffer.fill_(float("nan"))

    # What earlier calls left there: finite, wrong (a poison fills every shape's buffer, so
    # one row count: the next would find it poisoned before its first run).
    def probed(rows: int) -> dict[str, Any]:
        oai.WORKSPACE[(rows, TOP_K, HIDDEN)] = torch.full((rows, TOP_K, HIDDEN), 7.0).bfloat16()
        oai.STALE_KERNEL.append(True)
        try:
            return probes.exactness(model, device="cpu", row_counts=(rows,), poison=poison)
        finally:
            oai.STALE_KERNEL.clear()

    # One row: the routes (seed 0) miss the last expert, and the layer misses all the same.
    one = probed(1)
    assert one["equal"] == {"1": 0} and one["missed_with_last_expert"] == {"1": 0}
    found = probed(4)
    again = found["kernel_again"]
    assert again["equal"] == {"4": 0} and again["non_finite"] == {"4": 1}
    assert math.isnan(again["max_abs"]["4"])
    assert found["equal"] == {"4": 0}
    assert found["by_order"]["first"]["non_finite"] == {"4": 0}
    # The probe's routes, drawn as it draws them: did they hold the last expert?
    gen = torch.Generator().manual_seed(0)
    torch.randn(4, HIDDEN, generator=gen, dtype=torch.bfloat16)
    _, ids = torch.topk(torch.softmax(torch.randn(4, E, generator=gen), dim=-1), TOP_K, dim=-1)
    last = int(bool((ids == E - 1).any()))
    assert last == 1 and found["missed_with_last_expert"] == {"4": 1}
    said = probe_lines.exactness_line({"exactness": found}, "row3")
    assert said is not None
    assert f"; of the layers missed, those whose routes held the last expert (4: {last}/1)" in said
    assert (
        said is not None
        and (
            "\n  vLLM's kernel run again on poisoned memory gives its own first run's bits, by "
            "rows (4: 0/1 (max |d| nan) (1 non-finite)): it reads memory it did not write or "
            "is not deterministic, and the reference moves with it\n  matmul_ogs launch options"
        )
        in said
    )


@pytest.mark.parametrize("route", ["exact", "float32 sum", "captured only"])
def test_the_shadow_check_counts_the_engines_own_forwards(
    fake_mxfp4: Any, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tools/vllm/harness/shadow.py (``e2e.py run --shadow``): installed before the engine,
    every cached forward also runs vLLM's kernel over the whole set and counts, by how it ran
    and by rows, whether the bits differ. The exact route never differs, eager or captured;
    the float32 sum of a cut step (16 rows of 3 entries over 3 slots) is counted, and its first
    differing forward, kept on the device, differs again when replayed eagerly; a kernel that
    errs only inside a capture is counted there, and its replay does not differ. A layer with
    shared experts, and one that never ran, are skipped; a first forward inside a capture is
    refused (its counters would be allocated in the graph)."""
    from moe_reference import make_routing

    from rowcache.vllm._method import CachedForward
    from tools.vllm.harness import probe_lines, shadow

    # The class attribute comes back after the test, whatever install() did to it.
    monkeypatch.setattr(CachedForward, "_cached_apply", CachedForward._cached_apply)
    shadow.install()
    wrapped = CachedForward._cached_apply
    shadow.install()  # a second call changes nothing
    assert shadow.installed() and CachedForward._cached_apply is wrapped
    captured = {"now": False}
    monkeypatch.setattr(shadow, "capturing", lambda: captured["now"])

    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}

    def layer_of() -> Any:
        layer = _layer(fake_mxfp4, section)
        method = layer.quant_method
        method.moe = SimpleNamespace(**{**vars(_moe()), "experts_per_token": 3})
        if route == "float32 sum":

            class OtherExperts:  # computes as UnfusedOAITritonExperts, but is not one
                pass

            experts = method.moe_kernel.fused_experts
            other = OtherExperts()
            vars(other).update(vars(experts))
            method.moe_kernel.fused_experts = other
        elif route == "captured only":
            kernel = method.moe_kernel
            apply = kernel.apply

            def erring(**kw: Any) -> Any:  # the cached calls' input doubled, when captured
                if captured["now"] and kw["expert_map"] is not None:
                    kw = {**kw, "hidden_states": kw["hidden_states"] * 2}
                return apply(**kw)

            kernel.apply = erring
        return layer

    def forward(layer: Any, rows: int, seed: int, shared: Any = None) -> torch.Tensor:
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
        ids, weights = make_routing(rows, E, 3, seed=seed)
        out: torch.Tensor = layer.quant_method.apply(
            layer, x.to(torch.bfloat16), weights, ids, shared, None
        )
        return out

    checked = [layer_of(), layer_of()]
    for layer in checked:
        forward(layer, 16, seed=2)  # the first forward, as vLLM's profile run: its largest
        forward(layer, 1, seed=1)
        captured["now"] = True  # as vLLM's capture of the 16-row step, then its replay
        forward(layer, 16, seed=3)
        captured["now"] = False
    with_shared, never_ran, first_captured = layer_of(), layer_of(), layer_of()
    forward(with_shared, 16, seed=4, shared=object())
    captured["now"] = True
    with pytest.raises(RuntimeError, match="first forward is being captured"):
        forward(first_captured, 16, seed=5)
    captured["now"] = False
    named = [(f"layers.{i}.experts", layer) for i, layer in enumerate(checked)]
    named += [("layers.2.experts", with_shared), ("layers.3.experts", never_ran)]
    if route == "float32 sum":  # a first forward smaller than the one that differs later
        small_first = layer_of()
        forward(small_first, 1, seed=1)
        forward(small_first, 16, seed=2)
        named.append(("layers.4.experts", small_first))
    found = shadow.counts(SimpleNamespace(named_modules=lambda: iter(named)))

    assert found["layers"] == 2 + (route == "float32 sum")
    assert found["skipped"] == {"shared experts": 1, "no forward": 1}
    assert found["buckets"] == ["1", "2-8", "9-64", "65-512", "513+"]
    by = found["by"]
    small = route == "float32 sum"
    assert by["eager"]["1"]["forwards"] == 2 + small and by["eager"]["1"]["differing"] == 0
    assert by["eager"]["9-64"]["forwards"] == 2 + small
    assert by["captured"]["9-64"]["forwards"] == 2
    assert by["eager"]["2-8"]["forwards"] == 0 and by["captured"]["1"]["forwards"] == 0
    cut = (by["eager"]["9-64"], by["captured"]["9-64"])
    line = probe_lines.shadow_line({"shadow": found}, "row3dev.full")
    assert line is not None
    assert "2 skipped" not in line and "1 no forward, 1 shared experts skipped" in line
    if route == "exact":
        assert all(cell["differing"] == 0 and cell["max_abs"] == 0.0 for cell in cut)
        assert found["first_differing"] == [] and found["replays"] == []
        assert line.endswith(": met")
        return
    assert found["first_differing"][:2] == ["layers.0.experts", "layers.1.experts"]
    assert ": MISSED; first: layers.0.experts, layers.1.experts" in line
    replay = found["replays"][0]
    assert replay["layer"] == "layers.0.experts" and replay["kept"] and replay["rows"] == 16
    # The reference repeats its bits and its set still holds the provider's; the cached
    # forward repeats its own only on the exact route (a float32 sum's order follows the
    # slots, which its first run moved).
    assert not replay["reference_repeat_differs"]
    assert replay["cached_repeat_differs"] is (route == "float32 sum")
    assert replay["whole_set_changed"] == {}
    assert replay["fresh_replay_differs"] is replay["replay_differs"]
    if route == "float32 sum":
        assert all(cell["differing"] > 0 and cell["max_abs"] > 0.0 for cell in cut)
        # The first differing forward was the eager one, and it is wrong wherever it runs.
        assert replay["mode"] == "eager" and replay["replay_differs"]
        assert replay["replay_max_abs"] > 0.0
        assert (
            "replayed eagerly: layers.0.experts (eager, 16 rows): differs (the cached forward "
            "gave other bits then; the cached forward repeats with other bits; over a fresh "
            "copy: differs), " in line
        )
        assert line.endswith(", layers.4.experts (not kept)")
        # Inputs larger than the layer's first forward's are not kept.
        assert found["replays"][2] == {"layer": "layers.4.experts", "kept": False}
        ids, _ = make_routing(16, E, 3, seed=2)
    else:
        assert by["eager"]["9-64"]["differing"] == 0 and by["captured"]["9-64"]["differing"] == 2
        # Kept from the captured forward; run again eagerly it is exact.
        assert replay["mode"] == "captured" and not replay["replay_differs"]
        assert replay["replay_max_abs"] == 0.0
        # The side that erred then: the cached forward, not the reference.
        assert replay["then_cached_differs"] and not replay["then_reference_differs"]
        assert (
            "replayed eagerly: layers.0.experts (captured, 16 rows): exact (the cached "
            "forward gave other bits then), " in line
        )
        ids, _ = make_routing(16, E, 3, seed=3)
    assert replay["ids"] == ids[:8].tolist()


@pytest.mark.parametrize("bug", ["none", "stale reference", "unsteady reference"])
def test_the_shadow_replay_says_what_is_to_blame(
    fake_mxfp4: Any, bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a kept forward differs again when replayed, the replay says whether the
    reference's whole set still holds the provider's bytes (the experts that differ, by
    tensor), whether either side gives other bits run twice, and whether the cached forward
    meets the reference over a fresh copy. Seeded: one expert's values changed in the
    reference's set after it was copied (named, and the fresh copy meets the cache); a kernel
    whose every call over the whole set adds a little more (the reference's repeat differs)."""
    from moe_reference import make_routing

    from rowcache.vllm._method import CachedForward
    from rowcache.vllm.mxfp4_slots import rewrapped
    from tools.vllm.harness import probe_lines, shadow

    monkeypatch.setattr(CachedForward, "_cached_apply", CachedForward._cached_apply)
    shadow.install()
    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})
    method = layer.quant_method
    if bug == "unsteady reference":
        kernel = method.moe_kernel
        apply, calls = kernel.apply, [0]

        def drifting(**kw: Any) -> Any:  # over the whole set only: each call a bit more
            out = apply(**kw)
            if kw["expert_map"] is None:
                calls[0] += 1
                out = out * (1 + calls[0] / 64)
            return out

        kernel.apply = drifting

    def forward(rows: int, seed: int, first_two: bool = False) -> None:
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
        ids, weights = make_routing(rows, E, TOP_K, seed=seed)
        if first_two:  # experts 0 and 1 on every row
            ids = torch.tensor([[0, 1]] * rows, dtype=ids.dtype)
        layer.quant_method.apply(layer, x.to(torch.bfloat16), weights, ids, None, None)

    forward(16, seed=2)  # the layer's first forward: the reference's set is copied
    if bug == "stale reference":
        # On the CPU the reference's set is the provider's sources themselves (``.to`` the
        # same device copies nothing): give it a copy of its own, expert 0's values changed.
        kept = vars(method)["_rowcache_shadow"]
        data = shadow.whole_set_tensors(kept.whole)["w13"]
        own = torch.empty_strided(data.shape, data.stride(), dtype=data.dtype).copy_(data)
        own[0].bitwise_xor_(0x11)
        kept.whole = dataclasses.replace(kept.whole, w13=rewrapped(kept.whole.w13, own))
    forward(4, seed=3, first_two=True)
    found = shadow.counts(SimpleNamespace(named_modules=lambda: iter([("layers.0", layer)])))
    if bug == "none":
        assert found["replays"] == []
        return
    replay = found["replays"][0]
    assert replay["kept"] and replay["replay_differs"]
    line = probe_lines.shadow_line({"shadow": found}, "row3dev.full")
    assert line is not None
    if bug == "stale reference":
        assert replay["whole_set_changed"] == {"w13": [0]}
        assert not replay["fresh_replay_differs"] and replay["fresh_replay_max_abs"] == 0.0
        assert not replay["reference_repeat_differs"] and not replay["cached_repeat_differs"]
        assert "(reference's set changed since its copy: w13 expert 0; " in line
        assert "over a fresh copy: exact)" in line
    else:
        assert replay["reference_repeat_differs"] and not replay["cached_repeat_differs"]
        assert replay["whole_set_changed"] == {} and replay["fresh_replay_differs"]
        assert replay["then_reference_differs"] and not replay["then_cached_differs"]
        assert "(the reference gave other bits then; the reference repeats with other " in line


def test_the_shadow_check_comes_off_before_the_probe(
    fake_mxfp4: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM runs its forwards in inference mode, so the shadow's counters are inference
    tensors; the exactness probe runs after them outside it (``llm.apply_model``), where a
    shadowed forward cannot add to them (on a GPU, 2026-12-06: "Inplace update to inference
    tensor outside InferenceMode"). ``uninstall`` gives the plugin its own forward back."""
    from moe_reference import make_routing

    from rowcache.vllm._method import CachedForward
    from tools.vllm.harness import shadow

    monkeypatch.setattr(CachedForward, "_cached_apply", CachedForward._cached_apply)
    own = CachedForward._cached_apply
    shadow.uninstall()  # not installed: nothing happens
    assert CachedForward._cached_apply is own
    shadow.install()
    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})

    def forward(rows: int) -> None:
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(0))
        ids, weights = make_routing(rows, E, TOP_K, seed=0)
        layer.quant_method.apply(layer, x.to(torch.bfloat16), weights, ids, None, None)

    with torch.inference_mode():
        forward(4)
    # Two rows: the fake kernel's workspace of that shape is made outside inference mode.
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        forward(2)  # what the probe met
    shadow.uninstall()
    assert not shadow.installed() and CachedForward._cached_apply is own
    forward(2)


def test_expert_bytes_compare_the_sources_with_no_offloads_own_tensors(fake_mxfp4: Any) -> None:
    """tools/vllm/harness/expert_bytes.py: the cache's host sources of a gpt-oss layer digest,
    expert by expert, as the converted tensors of the same checkpoint's layer without the cache;
    one changed byte of one expert's scales in the sources (which the slot audit, comparing
    the slots with those same sources, cannot see) is named, and nothing else."""
    from tools.vllm.harness import expert_bytes

    name = "layers.0.experts"

    def model(layer: Any) -> Any:
        return SimpleNamespace(named_modules=lambda: iter([(name, layer)]))

    cached = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})
    own = _layer(fake_mxfp4, None)
    assert type(own.quant_method).__name__ == "GptOssMxfp4MoEMethod"
    theirs = expert_bytes.digests(model(own), device="cpu")
    ours = expert_bytes.digests(model(cached), device="cpu")
    assert set(ours["layers"][name]) == set(expert_bytes.KEYS) == set(theirs["layers"][name])
    assert expert_bytes.compare(ours, theirs) == {
        "layers": 1,
        "expert_tensors": len(expert_bytes.KEYS) * E,
        "differing": [],
        "unmatched": [],
    }
    provider = cached.quant_method.rowcache_provider
    source = provider.source_weights("w2_scale", "cpu")  # the host tensor itself, on the CPU
    assert source.data_ptr() == provider.source_weights("w2_scale", "cpu").data_ptr()
    source[2, 5] += 1
    ours = expert_bytes.digests(model(cached), device="cpu")
    found = expert_bytes.compare(ours, theirs)
    assert found["differing"] == [[name, "w2_scale", 2]] and found["unmatched"] == []
    ours["layers"][name].pop("w13_bias")
    assert expert_bytes.compare(ours, theirs)["unmatched"] == [f"{name} w13_bias"]


def test_the_replay_runs_a_kept_input_three_ways(fake_mxfp4: Any) -> None:
    """tools/vllm/harness/replay.py on a gpt-oss layer whose trace kept an input: the cached
    forward on poisoned memory, vLLM's kernel over the cache's sources and the cached forward
    after it all give the kernel's bits; with the fake's seeded stale workspace entry the first
    run alone parts (and the one after the kernel, as the old probe, does not)."""
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai

    from tools.vllm.harness import probes, replay, trace

    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})
    x, ids, weights = _inputs(6, seed=2)
    vars(layer)[trace._INPUTS] = (x, ids, weights)  # as the hook keeps them
    model = SimpleNamespace(named_modules=lambda: iter([("layers.0.experts", layer)]))

    def poison() -> None:
        for buffer in oai.WORKSPACE.values():
            buffer.fill_(float("nan"))

    def runs() -> dict[str, Any]:
        found = replay.first_forwards(model, device="cpu", poison=poison)
        kept = found["layers"]["layers.0.experts"]
        assert kept["rows"] == 6 and kept["x"] == int(trace.digest(x))
        return kept

    clean = runs()
    assert clean["cached_first"] == clean["reference"] == clean["cached_after"]
    # The kernel's values left where a stale read finds them: only the poison hides them.
    method = layer.quant_method
    whole = probes.reference_weights(method, method.rowcache_provider, "cpu")
    assert whole is not None
    probes.reference_forward(method, layer, whole, x, weights, ids)
    oai.STALE.append(True)
    try:
        stale = runs()
    finally:
        oai.STALE.clear()
    assert stale["reference"] == clean["reference"]
    assert stale["cached_after"] == stale["reference"] != stale["cached_first"]


def test_the_replay_runs_it_again_from_the_caches_state_at_that_forward(
    fake_mxfp4: Any,
) -> None:
    """tools/vllm/harness/replay.py with the cache's state kept just before the forward
    (``first_state``, as the trace's hook keeps it): the run from that state gives the kernel's
    bits where the state was sound, and other bits where a slot held other bytes then (seeded
    in the copy), while the three runs from the state of the end do not part; the cache's own
    state is back after the replay."""
    from tools.vllm.harness import first_state, replay, trace

    first_state.reset()
    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})
    method = layer.quant_method
    provider = method.rowcache_provider
    x, ids, weights = _inputs(6, seed=2)
    # Outside inference mode: the fake kernel's workspace of a shape is made by its first call.
    with torch.no_grad():
        method.apply(layer, x, weights, ids, None, None)  # the step's last experts resident
        assert first_state.take(layer)
        method.apply(layer, x, weights, ids, None, None)  # the forward the trace keeps
        later = _inputs(5, seed=3)
        method.apply(layer, later[0], later[2], later[1], None, None)
    vars(layer)[trace._INPUTS] = (x, ids, weights)
    model = SimpleNamespace(named_modules=lambda: iter([("layers.0.experts", layer)]))

    def live() -> dict[str, torch.Tensor]:
        fields, slots = first_state._tensors(provider)
        return {**fields, **slots}

    end = {k: t.clone() for k, t in live().items()}

    def replayed() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        for key, tensor in live().items():
            tensor.copy_(end[key])  # each replay from the state of the end
        found = replay.first_forwards(model, device="cpu", poison=lambda: None)
        return found["layers"]["layers.0.experts"], {k: t.clone() for k, t in live().items()}

    def runs() -> dict[str, Any]:
        copy = vars(layer).pop(first_state._ATTRIBUTE)
        without, after_three = replayed()  # the three runs alone
        vars(layer)[first_state._ATTRIBUTE] = copy
        kept, after = replayed()
        assert "from_start_error" not in kept and replay.FROM_START not in without
        assert all(torch.equal(after[k], after_three[k]) for k in after)  # the state put back
        return kept

    clean = runs()
    assert clean[replay.FROM_START] == clean["reference"] == clean["cached_first"]
    assert clean["start_state"] == first_state.summary(layer)
    assert clean["ids_list"] == ids.tolist()
    hits = [s for s, e in enumerate(clean["start_state"]["owners"]) if e >= 0]
    assert hits, "the copy holds resident experts"
    copy = vars(layer)[first_state._ATTRIBUTE]
    copy.slots["w2_bias"][hits] += 1.0  # the slots as a forward would have found them
    seeded = runs()
    assert seeded["cached_first"] == seeded["reference"] == seeded["cached_after"]
    assert seeded[replay.FROM_START] != seeded["reference"]
    first_state.reset()


def test_expert_bytes_skip_a_layer_of_another_backend(fake_mxfp4: Any) -> None:
    """A gpt-oss layer on another backend (Marlin, where UVA offloads) holds plain tensors, not
    the OpenAI-Triton layout: counted as skipped, not read as one."""
    from tools.vllm.harness import expert_bytes

    layer = SimpleNamespace(
        quant_method=type("GptOssMxfp4MoEMethod", (), {})(), w13_weight=torch.zeros(2, 3)
    )
    model = SimpleNamespace(named_modules=lambda: iter([("layers.0.experts", layer)]))
    assert expert_bytes.digests(model, device="cpu") == {"layers": {}, "skipped": 1}


@pytest.mark.parametrize("bug", ["none", "neighbour", "tail", "map path"])
def test_the_placement_probe_names_a_kernel_reading_outside_an_experts_bytes(
    fake_mxfp4: Any, bug: str
) -> None:
    """tools/vllm/harness/placement.py over the MXFP4 fake: a kernel that reads only its
    experts' bytes gives the reference's bits in every layout (the whole set mapped, permuted;
    a copy of the slots with the resident map, with garbage in the other slots, past the last)
    and the cached forward's over the slots; a kernel that also reads the next slot parts in
    the permuted set and with garbage in the other slots; one that reads past the last slot
    parts with garbage there alone; one whose map path computes otherwise parts with any map."""
    from vllm.model_executor.layers.fused_moe.experts import gpt_oss_triton_kernels_moe as oai

    from tools.vllm.harness import placement

    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    layers = [(f"layers.{i}.experts", _layer(fake_mxfp4, section)) for i in range(2)]
    model = SimpleNamespace(named_modules=lambda: iter(layers))
    seeded = {"neighbour": oai.NEIGHBOUR, "tail": oai.TAIL, "map path": oai.MAP_PATH}.get(bug)
    if seeded is not None:
        seeded.append(True)
    try:
        found = placement.placement(model, device="cpu", row_counts=(1, 6))
    finally:
        oai.NEIGHBOUR.clear()
        oai.TAIL.clear()
        oai.MAP_PATH.clear()
    assert found["layers"] == 2 and found["rows"] == [1, 6]
    ways = found["ways"]
    for way in ("mapped", "whole_tail_garbage", "permuted"):
        assert ways[way]["1"]["ran"] == ways[way]["6"]["ran"] == 2
    for way in placement.SLOT_WAYS:
        assert ways[way]["1"]["ran"] == 2  # two experts a row, three slots: all resident
        assert ways[way]["6"]["ran"] == 0  # twelve entries over three slots: never all
    equal = {way: ways[way]["1"]["equal_reference"] for way in placement.WAYS}
    from tools.vllm.harness import probe_lines

    line = probe_lines.placement_line({"placement": found}, "row3")
    assert line is not None and line.startswith("  placement of row3: ")
    assert "a copy of the slots with the resident map (1: " in line and "6: not run" in line
    assert probe_lines.placement_line({"placement_error": "E: x"}, "r") == (
        "  placement of r: not run (E: x)"
    )
    if bug == "map path":
        assert equal == {way: 2 if way == "whole_tail_garbage" else 0 for way in placement.WAYS}
        assert all(ways[w]["1"]["equal_cached"] == 2 for w in placement.SLOT_WAYS)
        return
    assert equal["mapped"] == 2  # an identity map reads what no map reads
    if bug == "none":
        assert all(n == 2 for n in equal.values())
        assert all(ways[w]["1"]["equal_cached"] == 2 for w in placement.SLOT_WAYS)
        assert ways["permuted"]["6"]["equal_reference"] == 2
        assert found["cached"]["1"]["max_abs"] == 0.0
    elif bug == "neighbour":
        assert (
            ways["permuted"]["1"]["equal_reference"] + ways["permuted"]["6"]["equal_reference"] < 4
        )
        assert ways["others_garbage"]["1"]["equal_cached"] < 2
        assert ways["slots"]["1"]["equal_cached"] == 2
    else:
        assert ways["tail_garbage"]["1"]["equal_cached"] == 0
        assert ways["whole_tail_garbage"]["1"]["equal_reference"] == 0
        assert (
            ways["slots"]["1"]["equal_cached"] == ways["others_garbage"]["1"]["equal_cached"] == 2
        )
        assert equal["permuted"] == 2


def test_the_largest_difference_keeps_a_nan() -> None:
    """``probes.larger_gap``: a NaN difference, seen first or later, stays the largest (a plain
    ``max`` would keep the number before it and hide the NaN)."""
    from tools.vllm.harness import probes

    nan = torch.tensor(float("nan"))
    assert probes.larger_gap(2.0, torch.tensor(1.0)) == 2.0
    assert probes.larger_gap(2.0, torch.tensor(3.0)) == 3.0
    assert math.isnan(probes.larger_gap(0.0, nan))
    assert math.isnan(probes.larger_gap(float("nan"), torch.tensor(3.0)))


def test_the_reference_whole_set_runs_past_its_last_expert_in_zeros(fake_mxfp4: Any) -> None:
    """The exactness probe's whole expert set (``probes.reference_weights``) is followed by zero
    bytes, as the slots are (``rowcache.sources.SLOT_GUARD_BYTES``): vLLM's MXFP4 kernel loads
    past each scale row, and the reference must not find a poisoned NaN byte there."""
    from rowcache.sources import SLOT_GUARD_BYTES
    from tools.vllm.harness import probes

    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})
    method = layer.quant_method
    whole = probes.reference_weights(method, method.rowcache_provider, "cpu")
    assert whole is not None
    tensors = [whole.w13.storage.data, whole.w2.storage.data]
    tensors += [f["scale"].weight_scale.storage.data for f in (whole.w1_fields, whole.w2_fields)]
    tensors += [f["bias"] for f in (whole.w1_fields, whole.w2_fields)]
    for tensor in tensors:
        raw = torch.tensor([], dtype=torch.uint8).set_(tensor.untyped_storage())
        end = (tensor.storage_offset() + tensor.shape[0] * tensor.stride(0)) * tensor.element_size()
        assert tensor.shape[0] == E and raw[end:].numel() >= SLOT_GUARD_BYTES
        assert not raw[end:].any()


def test_the_slot_scales_are_followed_by_zeros_where_the_kernel_reads(fake_mxfp4: Any) -> None:
    """tools/vllm/harness/scale_tails.py over a cached gpt-oss layer: the 64 bytes past its w13
    scale slots (where vLLM's kernel reads past the last slot's rows) are the slots' zero guard,
    and every byte was read."""
    from tools.vllm.harness import scale_tails

    def read(raw: torch.Tensor, start: int, count: int) -> list[int]:
        return [int(v) for v in raw[start : start + count].tolist()]

    layer = _layer(fake_mxfp4, {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"})
    model = SimpleNamespace(named_modules=lambda: iter([("layers.0.experts", layer)]))
    found = scale_tails.tails(model, read=read)
    assert found["layers"]["layers.0.experts"] == {"bytes": [0] * 64, "ff": 0}
    assert found["layers_with_ff"] == 0
