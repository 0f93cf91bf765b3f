"""gpt-oss random-weight checkpoints: gpt-oss-20b's config and tensors, experts in MXFP4.

gpt-oss-20b as its model card's ``config.json`` gives it: 24 layers (sliding-window attention
of 128 on every other one, attention sinks, biased projections), hidden 2880, 32 experts of
width 2880, top-4, a biased router, a SwiGLU clamped at ``swiglu_limit`` 7, and the experts
stored as the released checkpoints store them (``quantization_config`` ``{"quant_method":
"mxfp4"}``): per layer ``mlp.experts.gate_up_proj_blocks`` ``uint8 [E, 2I, H/32, 16]`` (two
4-bit e2m1 values a byte, 32 values a block; gate and up rows interleaved),
``gate_up_proj_scales`` ``uint8 [E, 2I, H/32]`` (one e8m0 exponent a block, 127 meaning 1),
``gate_up_proj_bias`` ``bf16 [E, 2I]``, and the same for ``down_proj`` with ``[E, H, I/32, 16]``.
vLLM 0.25.0's ``GptOssForCausalLM`` (``vllm/model_executor/models/gpt_oss.py``,
``_load_weights_mxfp4``) loads them into ``GptOssMxfp4MoEMethod``'s ``w13_weight``,
``w13_weight_scale``, ``w13_bias``, ``w2_*``.

Random values: the packed bytes uniform (every e2m1 code equally likely: magnitudes 0 to 6,
root mean square about 2.9), the block exponents 2^-6 to 2^-4 (scale bytes 121 to 123), so an
expert weight's magnitude is about that of the builder's N(0, 0.08) matrices; everything else
N(0, 0.08), norms 1.
"""

from __future__ import annotations

from typing import Any

import torch

GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "hidden_act": "silu",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
"""openai/gpt-oss-20b's ``config.json`` (the fields vLLM and transformers read)."""

MX_BLOCK = 32
"""Values per MXFP4 block (one e8m0 scale each; 16 bytes of packed e2m1 pairs)."""
SCALE_BYTES = (121, 124)
"""The e8m0 exponent bytes drawn, ``[low, high)``: block scales 2^-6 to 2^-4."""


def config(layers: int | None) -> dict[str, Any]:
    """gpt-oss-20b's ``config.json`` (``--layers``: that many, ``layer_types`` cut to match)."""
    base = dict(GPT_OSS_20B)
    if layers is not None:
        base["num_hidden_layers"] = layers
        base["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2 + 1)
        base["layer_types"] = base["layer_types"][:layers]
    return base


def load_plan(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a gpt-oss checkpoint: its shape and stored dtype (module docstring)."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    bf16, u8 = torch.bfloat16, torch.uint8
    plan: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((v, h), bf16),
        "model.norm.weight": ((h,), bf16),
        "lm_head.weight": ((v, h), bf16),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        plan[p + "input_layernorm.weight"] = ((h,), bf16)
        plan[p + "post_attention_layernorm.weight"] = ((h,), bf16)
        plan[a + "q_proj.weight"] = ((heads * hd, h), bf16)
        plan[a + "q_proj.bias"] = ((heads * hd,), bf16)
        plan[a + "k_proj.weight"] = ((kv * hd, h), bf16)
        plan[a + "k_proj.bias"] = ((kv * hd,), bf16)
        plan[a + "v_proj.weight"] = ((kv * hd, h), bf16)
        plan[a + "v_proj.bias"] = ((kv * hd,), bf16)
        plan[a + "o_proj.weight"] = ((h, heads * hd), bf16)
        plan[a + "o_proj.bias"] = ((h,), bf16)
        plan[a + "sinks"] = ((heads,), bf16)
        plan[m + "router.weight"] = ((experts, h), bf16)
        plan[m + "router.bias"] = ((experts,), bf16)
        for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            blocks = cols // MX_BLOCK
            plan[f"{m}experts.{name}_blocks"] = ((experts, rows, blocks, MX_BLOCK // 2), u8)
            plan[f"{m}experts.{name}_scales"] = ((experts, rows, blocks), u8)
            plan[f"{m}experts.{name}_bias"] = ((experts, rows), bf16)
    return plan


def router_names(config: dict[str, Any]) -> list[str]:
    """The router matrices, one per layer (what ``--router-skew`` scales)."""
    return [f"model.layers.{i}.mlp.router.weight" for i in range(config["num_hidden_layers"])]


def router_tensors(config: dict[str, Any]) -> list[str]:
    """Everything that decides routing (the router shard): router weights and biases."""
    return [n for n in load_plan(config) if ".mlp.router." in n]


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the eight e2m1 codes (the sign is the code's top bit)."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., n, 16]`` packed bytes and ``[..., n]`` e8m0 scales as float32 ``[..., n * 32]``
    (low nibble first, as the checkpoints pack them): for tests and checks, not for serving."""
    table = torch.tensor(E2M1 + tuple(-x for x in E2M1), dtype=torch.float32)
    low = table[(blocks & 0x0F).long()]
    high = table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., n, 32]
    scale = torch.exp2(scales.to(torch.float32) - 127.0).unsqueeze(-1)
    return (values * scale).flatten(-2)
