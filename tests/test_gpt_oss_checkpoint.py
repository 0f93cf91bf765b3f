"""The gpt-oss checkpoint of tools/vllm/make_moe_checkpoint.py (``--arch gpt_oss``) on the CPU:
gpt-oss-20b's card, the MXFP4 tensors as the released checkpoints store them and vLLM 0.25.0
loads them (literals checked against the wheel), the values' magnitude, determinism and the
router skew."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import vllm_wheels

from tools.vllm import gpt_oss_layout as gl
from tools.vllm import make_moe_checkpoint as mk
from tools.vllm import shards

CPU = torch.device("cpu")


def _small(layers: int = 2) -> dict[str, Any]:
    config = gl.config(layers)
    config.update(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
    )
    return config


def test_the_card() -> None:
    config = gl.config(None)
    assert config["num_hidden_layers"] == 24 and len(config["layer_types"]) == 24
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (32, 4)
    assert config["hidden_size"] == config["intermediate_size"] == 2880
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["swiglu_limit"] == 7.0 and config["sliding_window"] == 128
    assert mk.experts_of(config) == (32, 4)
    assert gl.config(3)["layer_types"] == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    plan = gl.load_plan(config)
    expert = sum(shards.nbytes(*v) for n, v in plan.items() if ".experts." in n)
    # Per layer and expert: 2I x H/2 + H x I/2 bytes of values, a scale per 32 values, biases.
    per_expert = 5760 * 1440 + 2880 * 1440 + (5760 + 2880) * 90 + (5760 + 2880) * 2
    assert expert == 24 * 32 * per_expert


def test_plan_names_shapes_and_dtypes() -> None:
    plan = gl.load_plan(_small())
    p = "model.layers.1."
    assert plan[p + "mlp.experts.gate_up_proj_blocks"] == ((8, 128, 2, 16), torch.uint8)
    assert plan[p + "mlp.experts.gate_up_proj_scales"] == ((8, 128, 2), torch.uint8)
    assert plan[p + "mlp.experts.gate_up_proj_bias"] == ((8, 128), torch.bfloat16)
    assert plan[p + "mlp.experts.down_proj_blocks"] == ((8, 64, 2, 16), torch.uint8)
    assert plan[p + "mlp.experts.down_proj_scales"] == ((8, 64, 2), torch.uint8)
    assert plan[p + "mlp.experts.down_proj_bias"] == ((8, 64), torch.bfloat16)
    assert plan[p + "mlp.router.weight"] == ((8, 64), torch.bfloat16)
    assert plan[p + "mlp.router.bias"] == ((8,), torch.bfloat16)
    assert plan[p + "self_attn.sinks"] == ((4,), torch.bfloat16)
    assert plan[p + "self_attn.o_proj.bias"] == ((64,), torch.bfloat16)
    assert plan[p + "self_attn.k_proj.weight"] == ((32, 64), torch.bfloat16)
    assert gl.router_tensors(_small()) == [
        f"model.layers.{i}.mlp.router.{w}" for i in range(2) for w in ("weight", "bias")
    ]


def test_dequantize_reads_low_nibble_first() -> None:
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x9F  # low nibble 0xF: -6; high nibble 0x9: -0.5
    scales = torch.tensor([128], dtype=torch.uint8)  # 2^1
    values = gl.dequantize_mxfp4(blocks, scales)
    assert values.shape == (32,)
    assert values[:2].tolist() == [-12.0, -1.0] and not values[2:].any()


def test_builder_writes_mxfp4_experts_of_the_builders_magnitude(tmp_path: Path) -> None:
    config = _small()
    mk.build_sharded(tmp_path / "a", "gpt_oss", config, 0, 0.0, device=CPU)
    out = tmp_path / "a"
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_oss"
    name = "model.layers.0.mlp.experts.gate_up_proj_"
    blocks = shards.read_tensor(out, name + "blocks")
    scales = shards.read_tensor(out, name + "scales")
    assert blocks.dtype == torch.uint8 and blocks.shape == (8, 128, 2, 16)
    low, high = gl.SCALE_BYTES
    assert int(scales.min()) >= low and int(scales.max()) < high
    assert len(set(scales.flatten().tolist())) == high - low
    values = gl.dequantize_mxfp4(blocks, scales)
    assert values.shape == (8, 128, 64)
    assert 0.03 < values.pow(2).mean().sqrt().item() < 0.2
    # Seeded: the same bytes again, other bytes from another seed; the skew moves the routers.
    mk.build_sharded(tmp_path / "b", "gpt_oss", config, 0, 0.0, device=CPU)
    mk.build_sharded(tmp_path / "c", "gpt_oss", config, 1, 0.0, device=CPU)
    mk.build_sharded(tmp_path / "s", "gpt_oss", config, 0, 1.0, device=CPU)
    for file in (p.name for p in out.glob("*.safetensors")):
        data = {d: (tmp_path / d / file).read_bytes() for d in "abcs"}
        assert data["a"] == data["b"] and data["a"] != data["c"]
        assert (data["a"] == data["s"]) == (file != shards.ROUTER_SHARD)


SOURCE_FRAGMENTS = (
    '".gate_up_proj_blocks": ".w13_weight"',
    '".down_proj_blocks": ".w2_weight"',
    '".gate_up_proj_scales": ".w13_weight_scale"',
    '".down_proj_scales": ".w2_weight_scale"',
    '".gate_up_proj_bias": ".w13_bias"',
    '".down_proj_bias": ".w2_bias"',
    'prefix=f"{prefix}.router"',
    "self.sinks = torch.nn.Parameter(",
    "sliding_window = config.sliding_window if self.layer_idx % 2 == 0 else None",
    "num_experts=config.num_local_experts,",
    "top_k=config.num_experts_per_tok,",
)


def test_literals_against_the_wheel() -> None:
    path = "vllm/model_executor/models/gpt_oss.py"
    source = vllm_wheels.read("0.25.0", path)[path]
    for fragment in SOURCE_FRAGMENTS:
        assert fragment in source, fragment
