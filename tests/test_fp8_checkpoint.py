"""The FP8 block-scaled checkpoint of tools/vllm/make_moe_checkpoint.py (``--fp8-block``) on the
CPU: the config's ``quantization_config``, every tensor's name, shape and dtype (expert and
attention weights float8_e4m3fn with a float32 ``weight_scale_inv`` per 128 x 128 block, the
routers, norms, embeddings and ``lm_head`` bf16), the scales stacked as vLLM 0.25.0's
``Fp8MoEMethod`` creates its per-layer parameters, the quantization's convention (weight =
fp8 x scale, each block's absolute maximum at 448), determinism from the seed, the router skew,
and the literals all this rests on, checked against the wheel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_wheels

from tools.vllm import make_moe_checkpoint as mk
from tools.vllm.harness import engines

SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}


def _read(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, parsed by hand (no safetensors package)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    base = 8 + size
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        raw = torch.frombuffer(bytearray(data[base + start : base + end]), dtype=torch.uint8)
        out[name] = raw.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return out


def test_config_of_the_qwen_shape() -> None:
    config = mk.fp8_config(True, 8)
    q = config["quantization_config"]
    assert q["quant_method"] == "fp8" and q["activation_scheme"] == "dynamic"
    assert q["weight_block_size"] == [128, 128]
    assert q["modules_to_not_convert"] == ["lm_head"] + [
        f"model.layers.{i}.mlp.gate" for i in range(8)
    ]
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe" and config["num_hidden_layers"] == 8
    for key in ("hidden_size", "num_experts", "moe_intermediate_size", "num_experts_per_tok"):
        assert config[key] == mk.QWEN3_30B_A3B[key]
    bf16_attention = mk.fp8_config(True, 2, bf16_attention=True)
    kept = bf16_attention["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.1.self_attn.q_proj" in kept and "model.layers.0.self_attn.o_proj" in kept
    plan = mk.fp8_plan(bf16_attention)
    assert plan["model.layers.0.self_attn.q_proj.weight"][1] is torch.bfloat16
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in plan
    assert plan["model.layers.0.mlp.experts.3.up_proj.weight"][1] is torch.float8_e4m3fn


def test_plan_of_the_qwen_shape() -> None:
    config = mk.fp8_config(True, 8)
    plan = mk.fp8_plan(config)
    p = "model.layers.7."
    e = p + "mlp.experts.127."
    expected = {
        e + "gate_proj.weight": ((768, 2048), torch.float8_e4m3fn),
        e + "gate_proj.weight_scale_inv": ((6, 16), torch.float32),
        e + "up_proj.weight": ((768, 2048), torch.float8_e4m3fn),
        e + "up_proj.weight_scale_inv": ((6, 16), torch.float32),
        e + "down_proj.weight": ((2048, 768), torch.float8_e4m3fn),
        e + "down_proj.weight_scale_inv": ((16, 6), torch.float32),
        p + "self_attn.q_proj.weight": ((4096, 2048), torch.float8_e4m3fn),
        p + "self_attn.q_proj.weight_scale_inv": ((32, 16), torch.float32),
        p + "self_attn.k_proj.weight_scale_inv": ((4, 16), torch.float32),
        p + "self_attn.v_proj.weight": ((512, 2048), torch.float8_e4m3fn),
        p + "self_attn.o_proj.weight": ((2048, 4096), torch.float8_e4m3fn),
        p + "self_attn.o_proj.weight_scale_inv": ((16, 32), torch.float32),
        p + "self_attn.q_norm.weight": ((128,), torch.bfloat16),
        p + "self_attn.k_norm.weight": ((128,), torch.bfloat16),
        p + "mlp.gate.weight": ((128, 2048), torch.bfloat16),
        p + "input_layernorm.weight": ((2048,), torch.bfloat16),
        "model.embed_tokens.weight": ((4096, 2048), torch.bfloat16),
        "lm_head.weight": ((4096, 2048), torch.bfloat16),
        "model.norm.weight": ((2048,), torch.bfloat16),
    }
    for name, want in expected.items():
        assert plan[name] == want, name
    # Per layer: 128 experts x 6 tensors, 4 projections x 2, q/k norm, router, 2 layer norms.
    assert len(plan) == 3 + 8 * (128 * 6 + 4 * 2 + 2 + 1 + 2)
    # vLLM's Fp8MoEMethod parameters of a layer (fp8.py create_weights): w13_weight_scale_inv
    # [E, 2 ceil(I/128), ceil(H/128)], w2_weight_scale_inv [E, ceil(H/128), ceil(I/128)]; the
    # checkpoint's gate/up scales stack into the first, down's into the second.
    gate = plan[e + "gate_proj.weight_scale_inv"][0]
    up = plan[e + "up_proj.weight_scale_inv"][0]
    assert (128, gate[0] + up[0], gate[1]) == (128, 2 * -(-768 // 128), -(-2048 // 128))
    assert (128, *plan[e + "down_proj.weight_scale_inv"][0]) == (128, 16, 6)
    # One expert's bytes as the e2e's UVA budget counts them.
    one = sum(
        torch.Size(shape).numel() * (1 if dtype is torch.float8_e4m3fn else 4)
        for name, (shape, dtype) in plan.items()
        if name.startswith(e)
    )
    assert one == engines.FP8_EXPERT_BYTES


def test_quantization_convention() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn((300, 200), generator=generator) * 0.08
    quantized, scale = mk.quantize_fp8_block(weight)
    assert quantized.dtype is torch.float8_e4m3fn and quantized.shape == (300, 200)
    assert scale.dtype is torch.float32 and scale.shape == (3, 2)
    # Each block's absolute maximum becomes 448 (the DeepSeek convention: weight = fp8 x scale).
    for r in range(3):
        for c in range(2):
            block = weight[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
            assert scale[r, c] == pytest.approx(float(block.abs().max()) / 448.0, rel=1e-6)
            q = quantized[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128].float()
            assert float(q.abs().max()) == 448.0
    restored = mk.dequantize_fp8_block(quantized, scale)
    # e4m3: 3 mantissa bits, a relative step of at most 1/8 (1/16 after rounding) per element.
    assert (restored - weight).abs().max() <= weight.abs().max() / 16
    assert torch.equal(
        weight, torch.randn((300, 200), generator=torch.Generator().manual_seed(3)) * 0.08
    )


@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])
def test_quantization_is_each_blocks_division_by_its_scale(shape: tuple[int, int]) -> None:
    """Bit for bit what one 128 x 128 block at a time gives (the builder vectorizes it), on an
    aligned weight and a ragged one; the weight itself is left as it was."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 0.08
    before = weight.clone()
    quantized, scale = mk.quantize_fp8_block(weight)
    assert torch.equal(weight, before)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            rows, cols = slice(r * 128, (r + 1) * 128), slice(c * 128, (c + 1) * 128)
            block = weight[rows, cols]
            expected = (block.abs().max() / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
            assert torch.equal(scale[r, c], expected)
            want = (block / expected).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            assert torch.equal(quantized[rows, cols].view(torch.uint8), want.view(torch.uint8))


def _build(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    assert mk.main([str(out), "--fp8-block", *args]) == 0
    return out


def test_tiny_checkpoint_written_and_read_back(tmp_path: Path) -> None:
    out = _build(tmp_path, "a")
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads(json.dumps(mk.fp8_config(False, None)))
    header = mk.read_safetensors_header(out / "model.safetensors")
    plan = mk.fp8_plan(config)
    names = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}
    assert set(header) - {"__metadata__"} == set(plan)
    for name, (shape, dtype) in plan.items():
        assert tuple(header[name]["shape"]) == shape, name
        assert names[header[name]["dtype"]] is dtype, name
    tensors = _read(out / "model.safetensors")
    for name, (_shape, dtype) in plan.items():
        if dtype is not torch.float8_e4m3fn:
            continue
        q, s = tensors[name].float(), tensors[name + "_scale_inv"]
        assert bool((s > 0).all()) and float(q.abs().max()) == 448.0
        restored = mk.dequantize_fp8_block(tensors[name], s)
        assert 0.1 < float(restored.std()) / 0.08 < 10  # drawn N(0, 0.08)
    assert torch.equal(tensors["model.norm.weight"].float(), torch.ones(256))
    record = json.loads((out / "rowcache_router_skew.json").read_text())
    assert record["fp8"] is True and record["router_skew"] == 0.0 and record["layers"] == []


def test_seed_and_router_skew(tmp_path: Path) -> None:
    a = (_build(tmp_path, "a") / "model.safetensors").read_bytes()
    assert (_build(tmp_path, "b") / "model.safetensors").read_bytes() == a
    assert (_build(tmp_path, "c", "--seed", "1") / "model.safetensors").read_bytes() != a
    skewed = _build(tmp_path, "s", "--router-skew", "1.0")
    plain, skew = _read(tmp_path / "a" / "model.safetensors"), _read(skewed / "model.safetensors")
    for name in plain:
        if name.endswith("mlp.gate.weight"):
            assert not torch.equal(plain[name], skew[name]), name
        else:  # the skew draws from its own seeds: everything else is the same bytes
            assert torch.equal(plain[name].view(torch.uint8), skew[name].view(torch.uint8)), name
    record = json.loads((skewed / "rowcache_router_skew.json").read_text())
    assert [x["layer"] for x in record["layers"]] == [0, 1]


def test_command_line_errors(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        mk.main(["/tmp/x", "--fp8-block", "--arch", "mixtral"])
    assert "--fp8-block writes a Qwen3-MoE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mk.main(["/tmp/x", "--fp8-bf16-attention"])
    assert "needs --fp8-block" in capsys.readouterr().err


# Fragments of the vLLM 0.25.0 wheel's sources the format rests on.
SOURCE_FRAGMENTS = {
    "vllm/model_executor/layers/quantization/fp8.py": (
        'is_checkpoint_fp8_serialized = "fp8" in quant_method',
        'weight_block_size = cls.get_from_keys_or(config, ["weight_block_size"], None)',
        'config, ["modules_to_not_convert"], None',
        '"weight_scale_inv" if self.block_quant else "weight_scale"',
        'layer.register_parameter("weight_scale_inv", scale)',
        "2 * ((intermediate_size_per_partition + block_n - 1) // block_n),",
        "(hidden_size + block_k - 1) // block_k,",
        "(hidden_size + block_n - 1) // block_n,",
        "(intermediate_size_per_partition + block_k - 1) // block_k,",
        "return Fp8MoEMethod(self, layer)",
        '"The block-wise quantization only supports "',
    ),
    "vllm/model_executor/layers/quantization/utils/quant_utils.py": (
        "return prefix in ignored_layers",
    ),
    "vllm/model_executor/models/qwen3_moe.py": (
        'prefix=f"{prefix}.gate"',
        'prefix=f"{prefix}.mlp"',
        'prefix=f"{prefix}.self_attn"',
        'prefix=f"{prefix}.qkv_proj"',
        'prefix=f"{prefix}.o_proj"',
        "self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)",
        "self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)",
        'qkv_bias=getattr(config, "attention_bias", False)',
        'head_dim=getattr(config, "head_dim", None)',
        '".q_proj": (".qkv_proj", "q")',
    ),
    "vllm/model_executor/layers/fused_moe/layer.py": (
        'ckpt_names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")',
    ),
    "vllm/model_executor/layers/fused_moe/routed_experts.py": (
        'w13 = f"experts.{routed_experts_prefix}{lora_base_layer_prefix}w13_"',
        "FusedMoeWeightScaleSupported.BLOCK.value,",
    ),
}


def test_literals_against_the_wheel() -> None:
    sources = vllm_wheels.read("0.25.0", *SOURCE_FRAGMENTS)
    for path, fragments in SOURCE_FRAGMENTS.items():
        for fragment in fragments:
            assert fragment in sources[path], (path, fragment)
