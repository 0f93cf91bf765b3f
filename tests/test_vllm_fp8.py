"""vLLM's FP8 MoE methods with the expert cache, against a fake vLLM on the CPU.

The fake keeps what the plugin touches, shaped as vLLM 0.25.0's (docs/PLUGIN.md, "FP8 experts"):
``RoutedExperts._get_quant_method`` asks the quantization config; ``Fp8Config`` gives
``Fp8MoEMethod`` (FP8 checkpoint) or ``Fp8PerTensorOnlineMoEMethod`` (bf16 checkpoint); the
methods create their tensors, build the kernel's quant config through
``get_fused_moe_quant_config`` in ``_setup_kernel`` and the kernel with
``make_fp8_moe_kernel``; the kernel reads the scales from its ``TritonExperts``' quant config,
indexes weights and scales by the slot the ``expert_map`` gives, quantizes activations (per row
and 128 columns with block scales, one scale over each call's whole input per tensor) and
reduces ``[M, top_k, H]`` through ``moe_sum``. Outputs are compared with vLLM's own method (the
knob off) over the same checkpoint.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_vllm_register import (  # noqa: F401 (fixtures)
    FAKE_VLLM,
    _config,
    _engine,
    _moe,
    _rowcache_warnings,
    check_probe,
    fresh_plugin,
)

import rowcache.vllm as plugin

E, TOP_K, HIDDEN, INTER = 8, 2, 256, 128
FP8 = torch.float8_e4m3fn

FAKE_FP8 = {
    "vllm/model_executor/utils.py": """
        import torch

        def set_weight_attrs(weight, attrs):
            for key, value in (attrs or {}).items():
                # As vLLM's: never overwrites.
                assert not hasattr(weight, key), f"Overwriting existing tensor attribute: {key}"
                setattr(weight, key, value)

        def replace_parameter(layer, param_name, new_data):
            # As vLLM's: a new parameter over the data, keeping the weight loader.
            if isinstance(new_data, torch.nn.Parameter):
                new_data = new_data.data
            old = getattr(layer, param_name, None)
            new = torch.nn.Parameter(new_data, requires_grad=False)
            if old is not None and hasattr(old, "weight_loader"):
                set_weight_attrs(new, {"weight_loader": old.weight_loader})
            setattr(layer, param_name, new)
        """,
    "vllm/model_executor/layers/fused_moe/routed_experts.py": """
        import torch

        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        class RoutedExperts(torch.nn.Module):
            def __init__(self, moe_config, quant_config=None, prefix="model.layers.0.mlp"):
                super().__init__()
                self.moe_config = moe_config
                self.quant_method = self._get_quant_method(prefix, quant_config, moe_config)

            def _get_quant_method(self, prefix, quant_config, moe_config):
                method = None
                if quant_config is not None:
                    method = quant_config.get_quant_method(self, prefix)
                if method is None:
                    method = UnquantizedFusedMoEMethod(moe_config)
                return method
        """,
    "vllm/model_executor/layers/fused_moe/oracle/fp8.py": """
        import dataclasses
        import enum

        import torch
        import torch.nn.functional as F

        class Fp8MoeBackend(enum.Enum):
            FLASHINFER_CUTLASS = "FLASHINFER_CUTLASS"
            DEEPGEMM = "DEEPGEMM"
            TRITON = "TRITON"
            MARLIN = "MARLIN"

        @dataclasses.dataclass
        class FusedMoEQuantDesc:
            # vLLM's (fused_moe/config.py), reduced: an activation's or a weight's scales.
            scale: object = None

        @dataclasses.dataclass
        class FusedMoEQuantConfig:
            # vLLM's, reduced: the scales sit in the descriptors, read through properties.
            _a1: FusedMoEQuantDesc
            _a2: FusedMoEQuantDesc
            _w1: FusedMoEQuantDesc
            _w2: FusedMoEQuantDesc
            block_shape: object = None

            def config_name(self, dtype):
                return "fp8_w8a8"

            @property
            def w1_scale(self):
                return self._w1.scale

            @property
            def w2_scale(self):
                return self._w2.scale

            @property
            def a1_scale(self):
                return self._a1.scale

            @property
            def a2_scale(self):
                return self._a2.scale

        def make_fp8_moe_quant_config(fp8_backend, w1_scale, w2_scale, a1_scale, a2_scale,
                                      w1_bias=None, w2_bias=None, block_shape=None,
                                      per_act_token_quant=False, per_out_ch_quant=False,
                                      swiglu_limit=None, gemm1_alpha=None, gemm1_beta=None,
                                      layer=None):
            return FusedMoEQuantConfig(
                FusedMoEQuantDesc(a1_scale), FusedMoEQuantDesc(a2_scale),
                FusedMoEQuantDesc(w1_scale), FusedMoEQuantDesc(w2_scale), block_shape,
            )

        def make_fp8_moe_kernel(moe_quant_config, moe_config, experts_cls, fp8_backend,
                                routing_tables=None, layer=None):
            experts = experts_cls()
            experts.quant_config = moe_quant_config
            return Fp8Kernel(experts)

        def _qdq(a):
            scale = a.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
            return (a / scale).to(torch.float8_e4m3fn).float() * scale

        def quant_act(a, block):
            # Dynamic activation quantization: per row and block[1] columns, or per tensor.
            rows, cols = a.shape
            if block is None:
                return _qdq(a.reshape(1, -1)).reshape(rows, cols)
            return _qdq(a.reshape(rows, cols // block[1], block[1])).reshape(rows, cols)

        def dequant(w, scale, block):
            w = w.float()
            if block is None:
                return w * scale
            s = scale.repeat_interleave(block[0], 0)[: w.shape[0]]
            return w * s.repeat_interleave(block[1], 1)[:, : w.shape[1]]

        class Fp8Kernel:
            # vLLM's modular kernel around TritonExperts, reduced to the arithmetic.
            def __init__(self, fused_experts):
                self.fused_experts = fused_experts
                self.calls = 0
                self.shared_calls = []

            def apply(self, **kw):
                self.calls += 1
                if kw["shared_experts"] is not None:
                    self.shared_calls.append(kw["shared_experts"])
                qc = self.fused_experts.quant_config
                block = qc.block_shape
                x, ids = kw["hidden_states"].float(), kw["topk_ids"]
                weights, expert_map = kw["topk_weights"].float(), kw["expert_map"]
                w1, w2 = kw["w1"], kw["w2"]
                rows, top_k = ids.shape
                inter, hidden = w2.shape[2], x.shape[1]

                def slot(t, j):
                    e = int(ids[t, j])
                    if e < 0:
                        return -1
                    return e if expert_map is None else int(expert_map[e])

                xq = quant_act(x, block)
                mid = x.new_zeros(rows, top_k, inter)
                for t in range(rows):
                    for j in range(top_k):
                        s = slot(t, j)
                        if s >= 0:
                            w = dequant(w1[s], qc.w1_scale[s], block)
                            gate, up = (xq[t] @ w.t()).chunk(2)
                            mid[t, j] = F.silu(gate) * up
                mq = quant_act(mid.reshape(rows * top_k, inter), block).reshape(mid.shape)
                cache3 = x.new_zeros(rows, top_k, hidden)
                for t in range(rows):
                    for j in range(top_k):
                        s = slot(t, j)
                        if s >= 0:
                            w = dequant(w2[s], qc.w2_scale[s], block)
                            cache3[t, j] = weights[t, j] * (mq[t, j] @ w.t())
                out = x.new_empty(rows, hidden)
                self.fused_experts.moe_sum(cache3, out)
                return out
        """,
    "vllm/model_executor/layers/quantization/__init__.py": "",
    "vllm/model_executor/layers/quantization/fp8.py": """
        from abc import ABC

        import torch

        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
            Fp8MoeBackend, make_fp8_moe_kernel, make_fp8_moe_quant_config,
        )
        from vllm.model_executor.utils import replace_parameter, set_weight_attrs

        def cdiv(a, b):
            return -(-a // b)

        class Fp8Config:
            def __init__(self, is_checkpoint_fp8_serialized=True, weight_block_size=None):
                self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
                self.weight_block_size = weight_block_size
                self.activation_scheme = "dynamic"

            def get_quant_method(self, layer, prefix):
                if self.is_checkpoint_fp8_serialized:
                    return Fp8MoEMethod(self, layer)
                from vllm.model_executor.layers.quantization.online.fp8 import (
                    Fp8PerTensorOnlineMoEMethod,
                )

                return Fp8PerTensorOnlineMoEMethod(layer=layer)

        # vLLM's methods descend from abc.ABC (QuantizeMethodBase -> FusedMoEMethodBase):
        # with that ancestry, assigning a cached subclass as the instance's class fails here
        # as it does in vLLM ("object layout differs").
        class QuantizeMethodBase(ABC):
            pass

        class FusedMoEMethodBase(QuantizeMethodBase):
            pass

        class Fp8MoEMethod(FusedMoEMethodBase):
            BACKEND = Fp8MoeBackend.TRITON  # select_fp8_moe_backend's choice on the H200
            EXPERTS = TritonExperts

            def __init__(self, quant_config, layer):
                self.moe = layer.moe_config
                self.quant_config = quant_config
                self.weight_block_size = quant_config.weight_block_size
                self.block_quant = self.weight_block_size is not None
                self.weight_scale_name = (
                    "weight_scale_inv" if self.block_quant else "weight_scale"
                )
                self.fp8_backend, self.experts_cls = self.BACKEND, self.EXPERTS
                self.moe_quant_config = None
                self.moe_kernel = None

            def create_weights(self, layer, num_experts, hidden_size,
                               intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs):
                inter = intermediate_size_per_partition
                shapes = {
                    "w13_weight": (num_experts, 2 * inter, hidden_size),
                    "w2_weight": (num_experts, hidden_size, inter),
                }
                for name, shape in shapes.items():
                    param = torch.nn.Parameter(
                        torch.empty(shape, dtype=torch.float8_e4m3fn), requires_grad=False
                    )
                    layer.register_parameter(name, param)
                    set_weight_attrs(param, extra_weight_attrs)
                if self.block_quant:
                    bn, bk = self.weight_block_size
                    w13_scale = torch.ones(
                        num_experts, 2 * cdiv(inter, bn), cdiv(hidden_size, bk)
                    )
                    w2_scale = torch.ones(num_experts, cdiv(hidden_size, bn), cdiv(inter, bk))
                else:
                    w13_scale = torch.ones(num_experts, 2)
                    w2_scale = torch.ones(num_experts)
                for name, data in (("w13", w13_scale), ("w2", w2_scale)):
                    param = torch.nn.Parameter(data, requires_grad=False)
                    layer.register_parameter(f"{name}_{self.weight_scale_name}", param)
                    kind = "block" if self.block_quant else "tensor"
                    set_weight_attrs(param, {**extra_weight_attrs, "quant_method": kind})
                layer.w13_input_scale = None
                layer.w2_input_scale = None

            def process_weights_after_loading(self, layer):
                self._setup_kernel(
                    layer, layer.w13_weight, layer.w2_weight,
                    getattr(layer, f"w13_{self.weight_scale_name}"),
                    getattr(layer, f"w2_{self.weight_scale_name}"), None, None,
                )

            def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale,
                              w2_input_scale):
                replace_parameter(layer, "w13_weight", w13)
                replace_parameter(layer, "w2_weight", w2)
                replace_parameter(layer, f"w13_{self.weight_scale_name}", w13_scale)
                replace_parameter(layer, f"w2_{self.weight_scale_name}", w2_scale)
                self.moe_quant_config = self.get_fused_moe_quant_config(layer)
                self.moe_kernel = make_fp8_moe_kernel(
                    moe_quant_config=self.moe_quant_config, moe_config=self.moe,
                    experts_cls=self.experts_cls, fp8_backend=self.fp8_backend,
                    routing_tables=None, layer=layer,
                )

            def get_fused_moe_quant_config(self, layer):
                return make_fp8_moe_quant_config(
                    fp8_backend=self.fp8_backend,
                    w1_scale=getattr(layer, f"w13_{self.weight_scale_name}"),
                    w2_scale=getattr(layer, f"w2_{self.weight_scale_name}"),
                    a1_scale=layer.w13_input_scale,
                    a2_scale=layer.w2_input_scale,
                    block_shape=self.weight_block_size,
                    swiglu_limit=getattr(layer, "swiglu_limit", None),
                    layer=layer,
                )

            def apply(self, layer, x, topk_weights, topk_ids, shared_experts,
                      shared_experts_input):
                return self.moe_kernel.apply(
                    hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                    topk_weights=topk_weights, topk_ids=topk_ids,
                    activation=layer.activation,
                    global_num_experts=layer.global_num_experts, expert_map=None,
                    apply_router_weight_on_input=layer.apply_router_weight_on_input,
                    shared_experts=shared_experts,
                    shared_experts_input=shared_experts_input,
                )
        """,
    "vllm/model_executor/layers/quantization/online/__init__.py": "",
    "vllm/model_executor/layers/quantization/online/fp8.py": """
        import torch

        from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
        from vllm.model_executor.utils import set_weight_attrs

        class _Fp8OnlineMoEBase(Fp8MoEMethod):
            # Its create_weights (vLLM: bf16 on the meta device, materialized while loading;
            # here on the CPU), _setup_kernel, get_fused_moe_quant_config and apply are the
            # FP8 checkpoint method's, as in vLLM.
            def __init__(self, *, weight_block_size, layer):
                config = type("Config", (), {"weight_block_size": weight_block_size})()
                super().__init__(config, layer)

            def create_weights(self, layer, num_experts, hidden_size,
                               intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs):
                inter = intermediate_size_per_partition
                shapes = {
                    "w13_weight": (num_experts, 2 * inter, hidden_size),
                    "w2_weight": (num_experts, hidden_size, inter),
                }
                for name, shape in shapes.items():
                    param = torch.nn.Parameter(
                        torch.empty(shape, dtype=params_dtype), requires_grad=False
                    )
                    layer.register_parameter(name, param)
                    set_weight_attrs(param, extra_weight_attrs)
                layer.w13_input_scale = None
                layer.w2_input_scale = None

        class Fp8PerTensorOnlineMoEMethod(_Fp8OnlineMoEBase):
            def __init__(self, *, layer):
                super().__init__(weight_block_size=None, layer=layer)

            def process_weights_after_loading(self, layer):
                if getattr(layer, "_already_called_process_weights_after_loading", False):
                    return
                w13 = torch.empty_like(layer.w13_weight, dtype=torch.float8_e4m3fn)
                w2 = torch.empty_like(layer.w2_weight, dtype=torch.float8_e4m3fn)
                w13_scale = torch.ones(w13.shape[0])
                w2_scale = torch.ones(w2.shape[0])
                for e in range(w13.shape[0]):
                    for q, s, w in ((w13, w13_scale, layer.w13_weight),
                                    (w2, w2_scale, layer.w2_weight)):
                        s[e] = w[e].float().abs().amax() / 448.0
                        q[e] = (w[e].float() / s[e]).to(torch.float8_e4m3fn)
                self._setup_kernel(layer, w13, w2, w13_scale, w2_scale, None, None)
                layer._already_called_process_weights_after_loading = True
        """,
}


@pytest.fixture
def fake_fp8(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_plugin: None,  # noqa: F811 (the fixture)
) -> Any:
    for rel, text in {**FAKE_VLLM, **FAKE_FP8}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("SIZE", "PROVIDER", "SPLIT", "PLANNER", "EAGER_BETWEEN_GRAPHS"):
        monkeypatch.delenv(f"ROWCACHE_MOE_EXPERT_CACHE_{key}", raising=False)
        monkeypatch.delenv(f"ROWCACHE_MOE_{key}", raising=False)
    import vllm.config.vllm as config_module

    assert "site-packages" not in str(config_module.__file__)
    return SimpleNamespace(config=config_module, root=tmp_path)


def _load(param: Any, loaded: torch.Tensor) -> None:
    """vLLM's weight loader reduced to the copy (into ``param.data``: the host tensor)."""
    param.data.copy_(loaded)


def _checkpoint(online: bool, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, HIDDEN, generator=gen) * 0.05
    w2 = torch.randn(E, HIDDEN, INTER, generator=gen) * 0.05
    if online:
        return {"w13_weight": w13.to(torch.bfloat16), "w2_weight": w2.to(torch.bfloat16)}
    return {
        "w13_weight": (w13 * 20).to(FP8),
        "w2_weight": (w2 * 20).to(FP8),
        "w13_weight_scale_inv": torch.rand(E, 2 * INTER // 128, HIDDEN // 128, generator=gen) / 20,
        "w2_weight_scale_inv": torch.rand(E, HIDDEN // 128, INTER // 128, generator=gen) / 20,
    }


def _layer(fake: Any, section: dict[str, object] | None, online: bool = False) -> Any:
    """A MoE layer built as vLLM builds it, its checkpoint loaded and processed."""
    plugin.register()
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    _engine(fake, section, quantization="fp8")
    config = Fp8Config(is_checkpoint_fp8_serialized=not online, weight_block_size=[128, 128])
    if online:
        config.weight_block_size = None
    layer = RoutedExperts(_moe(), config)
    layer.activation = "silu"
    layer.global_num_experts = E
    layer.apply_router_weight_on_input = False
    layer.quant_method.create_weights(layer, E, HIDDEN, INTER, torch.bfloat16, weight_loader=_load)
    for name, tensor in _checkpoint(online).items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _inputs(tokens: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from moe_reference import make_routing

    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids, topk_weights = make_routing(tokens, E, TOP_K, seed=seed)
    return x.to(torch.bfloat16), ids, topk_weights


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# -- what the cache takes over -----------------------------------------------------------------


def test_knob_off_leaves_vllms_fp8_methods(fake_fp8: Any) -> None:
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerTensorOnlineMoEMethod

    assert type(_layer(fake_fp8, None).quant_method) is Fp8MoEMethod
    online = _layer(fake_fp8, None, online=True).quant_method
    assert type(online) is Fp8PerTensorOnlineMoEMethod


def test_block_scaled_checkpoint_lives_in_host_memory_and_the_slots(fake_fp8: Any) -> None:
    from rowcache.row_provider import RowCacheWeightProvider
    from rowcache.vllm._fp8 import RowcacheFp8MoEMethod

    layer = _layer(fake_fp8, {"moe_expert_cache_size": 3})
    method = layer.quant_method
    assert type(method) is RowcacheFp8MoEMethod
    assert method.fp8_backend.name == "TRITON" and method.weight_block_size == [128, 128]
    hosts = method._rowcache_hosts
    names = ["w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"]
    assert sorted(hosts) == sorted(names)
    for name, tensor in _checkpoint(online=False).items():
        # The checkpoint went to the host tensors, which stay the layer's parameters' data.
        assert hosts[name].dtype == tensor.dtype and hosts[name].shape == tensor.shape
        assert torch.equal(hosts[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert getattr(layer, name).data_ptr() == hosts[name].data_ptr()
    provider = method.rowcache_provider
    assert isinstance(provider, RowCacheWeightProvider) and provider.capacity == 3
    assert provider.buf_w13.dtype == FP8 and provider.buf_w13.shape == (3, 2 * INTER, HIDDEN)
    assert provider.buf_w13_scale.shape == (3, 2, 2) and provider.buf_w2_scale.shape == (3, 2, 1)
    # The kernel's quant config was built by vLLM's _setup_kernel over the scale slots.
    quant = method.moe_kernel.fused_experts.quant_config
    assert quant is method.moe_quant_config
    assert quant.w1_scale is provider.buf_w13_scale and quant.w2_scale is provider.buf_w2_scale
    assert quant.block_shape == [128, 128] and quant.a1_scale is None


def test_processing_again_keeps_one_provider_and_refills_the_slots(fake_fp8: Any) -> None:
    layer = _layer(fake_fp8, {"moe_expert_cache_size": 3})
    method = layer.quant_method
    provider = method.rowcache_provider
    x, ids, topk_weights = _inputs(1)
    method.apply(layer, x, topk_weights, ids, None, None)
    assert provider.resident_experts()
    # A reload writes new bytes into the host tensors and processes the layer again.
    reloaded = _checkpoint(online=False, seed=9)
    for name, tensor in reloaded.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    method.process_weights_after_loading(layer)
    assert method.rowcache_provider is provider and provider.resident_experts() == {}
    assert method.moe_kernel.fused_experts.quant_config.w1_scale is provider.buf_w13_scale
    result = provider.prepare(ids)
    slot = int(result.expert_map[int(ids[0, 0])])
    want = reloaded["w13_weight"][int(ids[0, 0])].view(torch.uint8)
    assert torch.equal(provider.buf_w13[slot].view(torch.uint8), want)


@pytest.mark.parametrize(
    ("section", "tokens", "exact_calls"),
    [
        ({"moe_expert_cache_size": 3}, 6, None),  # token split, chunks
        ({"moe_expert_cache_size": 3, "moe_expert_cache_split": "expert"}, 6, None),
        ({"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}, 6, None),
        ({"moe_expert_cache_size": 3, "moe_expert_cache_provider": "cached"}, 6, None),
        ({"moe_expert_cache_size": 8}, 6, 1),  # every expert fits: one call
    ],
)
def test_block_scaled_forward_is_bit_identical_to_vllms(
    fake_fp8: Any, section: dict[str, object], tokens: int, exact_calls: int | None
) -> None:
    """Block scales quantize per row: chunks and passes give one call's bits (the passes
    through the moe_sum tap, reduced once)."""
    reference = _layer(fake_fp8, None)
    cached = _layer(fake_fp8, section)
    for seed in range(3):
        x, ids, topk_weights = _inputs(tokens, seed=seed)
        expected = reference.quant_method.apply(reference, x, topk_weights, ids, None, None)
        shared = object()
        kernel = cached.quant_method.moe_kernel
        kernel.calls, kernel.shared_calls = 0, []
        out = cached.quant_method.apply(cached, x, topk_weights, ids, shared, x)
        assert torch.equal(_bits(out), _bits(expected)), seed
        assert kernel.shared_calls == [shared]
        if exact_calls is not None:
            assert kernel.calls == exact_calls
        else:
            assert kernel.calls > 1  # 6 tokens x top-2 over 8 experts do not fit 3 slots
    # A step cut by experts reduces once through the tap on the FP8 kernel's TritonExperts.
    cut_by_experts = (
        section.get("moe_expert_cache_split") == "expert"
        or section.get("moe_expert_cache_planner") == "device"
    )
    tap = vars(cached.quant_method.moe_kernel.fused_experts).get("moe_sum")
    assert (type(tap).__name__ == "_MoeSumTap") == cut_by_experts
    stats = plugin.expert_cache_stats(SimpleNamespace(named_modules=lambda: [("l0", cached)]))
    assert stats[0]["capacity"] == section["moe_expert_cache_size"] and stats[0]["forwards"] == 3


@pytest.mark.parametrize("route", ["exact", "float32 sum"])
def test_the_engines_exactness_probe_checks_block_fp8_layers(fake_fp8: Any, route: str) -> None:
    """tools/vllm/harness/probes.exactness on block-scaled FP8 layers: the reference kernel
    call reads the whole expert set's scales (by expert id) in place of the scale slots, and
    gets the slots back after; the exact route is bit-identical at steps that need several
    passes, the float32 sum of a cut step (experts that are not TritonExperts) is not. Online
    per-tensor FP8 is counted as skipped."""

    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    layers = []
    for seed in range(2):
        layer = _layer(fake_fp8, section)
        layer.quant_method.moe = _moe(top_k=3)  # three entries a token: a pass's sum rounds
        kernel = layer.quant_method.moe_kernel
        if route == "float32 sum":
            triton = kernel.fused_experts

            class OtherExperts:  # reduces like TritonExperts, but is not one
                moe_sum = triton.moe_sum
                quant_config = triton.quant_config

            kernel.fused_experts = OtherExperts()
        layers.append((f"layers.{seed}.experts", layer))
    layers.append(("layers.2.experts", _layer(fake_fp8, section, online=True)))
    check_probe(layers, route, rows=6, skipped=1)
    for _, layer in layers[:2]:
        method = layer.quant_method
        quant = method.moe_kernel.fused_experts.quant_config
        assert quant.w1_scale is method.rowcache_provider.buf_w13_scale
        assert quant.w2_scale is method.rowcache_provider.buf_w2_scale


def test_online_per_tensor_quantized_then_moved_to_the_host(fake_fp8: Any) -> None:
    from rowcache.vllm._fp8 import RowcacheFp8OnlineMoEMethod

    reference = _layer(fake_fp8, None, online=True)
    layer = _layer(fake_fp8, {"moe_expert_cache_size": 3}, online=True)
    method = layer.quant_method
    assert type(method) is RowcacheFp8OnlineMoEMethod
    hosts = method._rowcache_hosts
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        want = getattr(reference, name)
        # vLLM's quantized tensors, moved: the layer's parameters now view the host copies.
        assert hosts[name].dtype == want.dtype and hosts[name].shape == want.shape
        assert torch.equal(hosts[name].view(torch.uint8), want.data.view(torch.uint8)), name
        assert getattr(layer, name).data_ptr() == hosts[name].data_ptr()
    provider = method.rowcache_provider
    assert provider.buf_w13_scale.shape == (3,) and provider.buf_w13_scale.is_contiguous()
    quant = method.moe_kernel.fused_experts.quant_config
    assert quant.w1_scale is provider.buf_w13_scale and quant.block_shape is None
    # Processing twice (vLLM's reload guard) changes nothing.
    method.process_weights_after_loading(layer)
    assert method.rowcache_provider is provider


def test_online_per_tensor_is_exact_at_batch_1_and_not_when_a_step_is_cut(
    fake_fp8: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """One activation scale per kernel call's whole input: a step that fits is one call with
    vLLM's bits; a step cut into passes quantizes with other scales (documented, warned)."""
    caplog.set_level(logging.WARNING, logger="rowcache.vllm")
    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    reference = _layer(fake_fp8, None, online=True)
    cached = _layer(fake_fp8, section, online=True)
    differing = 0
    for seed in range(4):
        x, ids, topk_weights = _inputs(1, seed=seed)
        expected = reference.quant_method.apply(reference, x, topk_weights, ids, None, None)
        out = cached.quant_method.apply(cached, x, topk_weights, ids, None, None)
        assert torch.equal(_bits(out), _bits(expected))
        x, ids, topk_weights = _inputs(6, seed=seed)
        expected = reference.quant_method.apply(reference, x, topk_weights, ids, None, None)
        out = cached.quant_method.apply(cached, x, topk_weights, ids, None, None)
        torch.testing.assert_close(out, expected, rtol=0.1, atol=0.05)
        differing += not torch.equal(_bits(out), _bits(expected))
    assert differing > 0
    warned = [m for m in _rowcache_warnings(caplog) if "not bit-exact" in m]
    assert len(warned) == 1 and "Fp8PerTensorOnlineMoEMethod" in warned[0]


# -- what it rejects, by name --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["DEEPGEMM", "FLASHINFER_CUTLASS", "MARLIN"])
def test_other_fp8_backends_are_rejected_by_name(
    fake_fp8: Any, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    plugin.register()
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    class OtherExperts:
        pass

    monkeypatch.setattr(Fp8MoEMethod, "BACKEND", Fp8MoeBackend[backend])
    monkeypatch.setattr(Fp8MoEMethod, "EXPERTS", OtherExperts)
    with pytest.raises(RuntimeError) as info:
        _layer(fake_fp8, {"moe_expert_cache_size": 4})
    message = str(info.value)
    assert f"Fp8MoEMethod selected vLLM's FP8 MoE backend {backend} (OtherExperts)" in message
    assert "serves the TRITON backend (TritonExperts) only" in message
    assert "VLLM_USE_DEEP_GEMM" in message and "Fp8PerTensorOnlineMoEMethod" in message
    # Without the cache the backend is vLLM's business.
    assert type(_layer(fake_fp8, None).quant_method) is Fp8MoEMethod


@pytest.mark.parametrize(
    ("block", "fragment"),
    [(None, "Fp8MoEMethod with per-tensor scales"), ([64, 64], "weight_block_size [64, 64]")],
)
def test_other_fp8_checkpoints_are_rejected_by_name(
    fake_fp8: Any, block: list[int] | None, fragment: str
) -> None:
    plugin.register()
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    _engine(fake_fp8, {"moe_expert_cache_size": 4}, quantization="fp8")
    with pytest.raises(RuntimeError) as info:
        RoutedExperts(_moe(), Fp8Config(weight_block_size=block))
    assert fragment in str(info.value) and "moe_expert_cache_size=4" in str(info.value)
    assert "supported: UnquantizedFusedMoEMethod" in str(info.value)


@pytest.mark.parametrize(
    "method_name",
    # NVFP4, and MXFP4 other than gpt-oss's (vLLM 0.25.0's quantization/mxfp4.py:
    # Mxfp4MoEMethod; gpt-oss's GptOssMxfp4MoEMethod is served, tests/test_vllm_mxfp4.py):
    # rejected by name, never served uncached.
    ["ModelOptNvFp4FusedMoE", "Mxfp4MoEMethod"],
)
def test_other_quantized_methods_are_rejected_by_name(fake_fp8: Any, method_name: str) -> None:
    plugin.register()
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    other = type(method_name, (), {"moe": _moe()})
    quant_config = SimpleNamespace(get_quant_method=lambda layer, prefix: other())
    _engine(fake_fp8, {"moe_expert_cache_size": 4}, quantization="fp8")
    with pytest.raises(RuntimeError) as info:
        RoutedExperts(_moe(), quant_config)
    message = str(info.value)
    assert f"does not support vLLM's MoE method {method_name} yet" in message
    assert "Fp8MoEMethod with 128 x 128 block scales" in message
    # The knob off: vLLM's method, whatever it is.
    _engine(fake_fp8, None, quantization="fp8")
    method = RoutedExperts(_moe(), quant_config).quant_method
    assert type(method) is other
    # No quantization: the unquantized method, ours through the registry.
    from rowcache.vllm._method import RowcacheMoEMethod

    _engine(fake_fp8, {"moe_expert_cache_size": 4}, quantization="fp8")
    assert type(RoutedExperts(_moe()).quant_method) is RowcacheMoEMethod


def test_size_below_top_k_is_rejected_for_fp8(fake_fp8: Any) -> None:
    with pytest.raises(plugin.KnobError, match="moe_expert_cache_size=1 is smaller than"):
        _layer(fake_fp8, {"moe_expert_cache_size": 1})


@pytest.mark.parametrize("quantization", ["fp8", "fp8_per_tensor"])
def test_config_guard_lets_fp8_through(fake_fp8: Any, quantization: str) -> None:
    plugin.register()
    config = _config(fake_fp8, {"moe_expert_cache_size": 8}, quantization=quantization)
    assert "vllm::moe_forward" in config.compilation_config.splitting_ops


def test_config_guard_names_unsupported_quantizations(fake_fp8: Any) -> None:
    plugin.register()
    with pytest.raises(RuntimeError) as info:
        _config(fake_fp8, {"moe_expert_cache_size": 8}, quantization="gptq")
    message = str(info.value)
    assert "does not support quantization 'gptq' yet" in message
    assert "'fp8' or 'fp8_per_tensor'" in message and "Fp8MoEMethod" in message


def test_the_rejected_mxfp4_methods_are_vllms_names() -> None:
    """The names the rejection test above uses are vLLM 0.25.0's MXFP4 MoE methods."""
    import vllm_wheels

    path = "vllm/model_executor/layers/quantization/mxfp4.py"
    source = vllm_wheels.read("0.25.0", path)[path]
    assert "class GptOssMxfp4MoEMethod(FusedMoEMethodBase):" in source
    assert "class Mxfp4MoEMethod(FusedMoEMethodBase):" in source
