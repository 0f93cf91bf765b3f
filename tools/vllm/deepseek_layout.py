"""DeepSeek-V2 and -V3 random-weight checkpoints: their configs and the tensors vLLM loads.

``deepseek_v2`` is DeepSeek-V2-Lite as its model card's ``config.json`` gives it (27 layers, the
first dense; hidden 2048; MLA with ``kv_lora_rank`` 512 and no query compression; 64 routed
experts of width 1408, top-6, softmax scores, plus 2 shared experts), in bf16. ``deepseek_v3``
is the DeepSeek-V3 architecture (also Moonlight's and Kimi's) with every routing and attention
field of DeepSeek-V3's card (256 routed experts in 8 groups, top-8 from the best 4 groups,
sigmoid scores with ``e_score_correction_bias``, ``routed_scaling_factor`` 2.5, one shared
expert, the first 3 layers dense, MLA with ``q_lora_rank`` 1536 and ``kv_lora_rank`` 512, FP8
with 128 x 128 block scales) at reduced width and depth: the real model (671 billion parameters,
about 700 GB in FP8) does not fit the GPU machine's 64 GB disk. ``V3_REDUCED`` names what is
reduced and to what.

The tensors (``load_plan``) are those vLLM 0.25.0's ``DeepseekV2ForCausalLM`` /
``DeepseekV3ForCausalLM`` (``vllm/model_executor/models/deepseek_v2.py``) load: MLA projections
``q_proj`` (or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; a dense MLP (``gate_proj``, ``up_proj``,
``down_proj``) in layers below ``first_k_dense_replace``; above, the router ``mlp.gate``
(``GateLinear``, never quantized; with ``gate.e_score_correction_bias`` in float32 where
``topk_method`` is ``noaux_tc``, written as zeros by the builder), the routed experts
``mlp.experts.E.gate_proj/up_proj/down_proj`` (loaded into the FusedMoE layer by
``fused_moe_make_expert_params_mapping``) and the shared experts ``mlp.shared_experts.*`` of
width ``moe_intermediate_size x n_shared_experts``, a dense MLP beside the routed ones that
vLLM passes to its FusedMoE layer as ``shared_experts``: never in the expert cache.
"""

from __future__ import annotations

from typing import Any

import torch

V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}
"""deepseek-ai/DeepSeek-V2-Lite's ``config.json`` (the fields vLLM and transformers read)."""

V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "num_nextn_predict_layers": 1,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "ep_size": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}
"""deepseek-ai/DeepSeek-V3's ``config.json`` (the fields vLLM and transformers read)."""

V3_REDUCED: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32768,
    "num_nextn_predict_layers": 0,
}
"""What ``deepseek_v3`` changes of ``V3`` so that it fits the GPU machine: width (hidden 7168 to
2048, expert width 2048 to 768: one FP8 expert 4.5 MiB, as a Qwen3-30B-A3B-FP8 expert; dense
width 18432 to 6144; 128 to 16 heads), depth (61 to 12 layers: the 3 dense, then 9 MoE
layers, 2,304 experts, 10.1 GiB), a smaller vocabulary, and no multi-token-prediction layer (a
speculative head vLLM skips when it loads the main model). Every routing and MLA field is the
card's."""

ARCH_CONFIGS = {"deepseek_v2": V2_LITE, "deepseek_v3": {**V3, **V3_REDUCED}}


def config(arch: str, layers: int | None) -> dict[str, Any]:
    """The ``config.json`` of ``arch`` (``--layers``: that many layers, the dense ones among
    them, instead of the card's depth)."""
    base = dict(ARCH_CONFIGS[arch])
    if layers is not None:
        if layers <= base["first_k_dense_replace"]:
            raise ValueError(
                f"--layers {layers}: {arch} has {base['first_k_dense_replace']} dense layers "
                "first; give more layers than that, so that some are MoE layers"
            )
        base["num_hidden_layers"] = layers
    return base


def moe_layers(config: dict[str, Any]) -> list[int]:
    """The layers with routed experts (vLLM's ``DeepseekV2DecoderLayer``: from
    ``first_k_dense_replace`` on, every ``moe_layer_freq``-th)."""
    freq = int(config.get("moe_layer_freq", 1))
    first = int(config["first_k_dense_replace"])
    return [i for i in range(config["num_hidden_layers"]) if i >= first and i % freq == 0]


def load_plan(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM 0.25.0's DeepSeek-V2/V3 class loads, with its shape (module docstring)."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    nope, rope, vd = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_rank, q_rank = config["kv_lora_rank"], config["q_lora_rank"]
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    shared = inter * config["n_shared_experts"]
    plan: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    routed = set(moe_layers(config))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        plan[p + "input_layernorm.weight"] = (h,)
        plan[p + "post_attention_layernorm.weight"] = (h,)
        if q_rank is None:
            plan[a + "q_proj.weight"] = (heads * (nope + rope), h)
        else:
            plan[a + "q_a_proj.weight"] = (q_rank, h)
            plan[a + "q_a_layernorm.weight"] = (q_rank,)
            plan[a + "q_b_proj.weight"] = (heads * (nope + rope), q_rank)
        plan[a + "kv_a_proj_with_mqa.weight"] = (kv_rank + rope, h)
        plan[a + "kv_a_layernorm.weight"] = (kv_rank,)
        plan[a + "kv_b_proj.weight"] = (heads * (nope + vd), kv_rank)
        plan[a + "o_proj.weight"] = (h, heads * vd)
        m = p + "mlp."
        if i not in routed:
            dense = config["intermediate_size"]
            plan[m + "gate_proj.weight"] = (dense, h)
            plan[m + "up_proj.weight"] = (dense, h)
            plan[m + "down_proj.weight"] = (h, dense)
            continue
        plan[m + "gate.weight"] = (experts, h)
        if config.get("topk_method") == "noaux_tc":
            plan[m + "gate.e_score_correction_bias"] = (experts,)
        plan[m + "shared_experts.gate_proj.weight"] = (shared, h)
        plan[m + "shared_experts.up_proj.weight"] = (shared, h)
        plan[m + "shared_experts.down_proj.weight"] = (h, shared)
        for e in range(experts):
            plan[f"{m}experts.{e}.gate_proj.weight"] = (inter, h)
            plan[f"{m}experts.{e}.up_proj.weight"] = (inter, h)
            plan[f"{m}experts.{e}.down_proj.weight"] = (h, inter)
    return plan


def router_names(config: dict[str, Any]) -> list[str]:
    """The router matrices, one per MoE layer in layer order (what ``--router-skew`` scales)."""
    return [f"model.layers.{i}.mlp.gate.weight" for i in moe_layers(config)]


def router_tensors(config: dict[str, Any]) -> list[str]:
    """Everything that decides routing (the router shard): routers and correction biases."""
    plan = load_plan(config)
    return [n for n in plan if n.endswith(".mlp.gate.weight") or n.endswith("_correction_bias")]


def stored_dtype(name: str, config: dict[str, Any]) -> torch.dtype:
    """How ``name`` is stored: the correction bias in float32 (vLLM's parameter); with a
    ``quantization_config`` (``deepseek_v3``), every linear layer's weight but the routers' in
    FP8 (``fp8_quantized``); the rest bf16."""
    if name.endswith("e_score_correction_bias"):
        return torch.float32
    if fp8_quantized(name, config):
        return torch.float8_e4m3fn
    return torch.bfloat16


def fp8_quantized(name: str, config: dict[str, Any]) -> bool:
    """Whether ``name`` is an FP8 weight: the weight of every projection (``*_proj``,
    ``kv_a_proj_with_mqa``) of a checkpoint with a ``quantization_config``, as DeepSeek-V3
    ships (its routers, norms, embeddings and ``lm_head`` stay bf16, and its
    ``quantization_config`` lists no modules to leave out)."""
    if "quantization_config" not in config or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return module.endswith("_proj") or module == "kv_a_proj_with_mqa"
