"""Build a random-weight MoE checkpoint (for the e2e; no hub access on the GPU machine).

    python3 tools/vllm/make_moe_checkpoint.py OUTDIR            tiny: 2 layers, 16 experts, top-4
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --arch mixtral     4 layers, 32 experts, top-2
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --arch qwen2moe    4 layers, 32 experts,
        top-4, and the gated shared expert (shared_expert, shared_expert_gate)
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --qwen3-30b-a3b --layers 8
        Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts, top-8, moe_intermediate 768)
    ... --tokenizer   also write a word-level tokenizer (``word_tokenizer.py``), for text clients
        such as ``vllm bench serve``
    ... --router-skew ALPHA   scale every layer's router rows by Zipf factors (router_skew.py)
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --qwen3-30b-a3b --layers 8 --fp8-block
        the same Qwen3-MoE layout stored in FP8 with 128 x 128 block scales, as Qwen3-30B-A3B-FP8
        and DeepSeek ship it (``--fp8-bf16-attention``: attention projections left in bf16)
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --qwen3-30b-a3b --layers 48 --fp8-block \
        --sharded     Qwen3-30B-A3B at full depth in block FP8 (29 GB of experts), written as
        the sharded layouts are (below; without ``--fp8-block``: bf16, 58 GB)
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --arch deepseek_v2     DeepSeek-V2-Lite at
        full depth, bf16 (27 layers, 64 routed experts top-6 plus 2 shared, MLA; 31 GB)
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --arch deepseek_v3     the DeepSeek-V3
        architecture in FP8 with 128 x 128 block scales, at reduced width and depth
        (``deepseek_layout.V3_REDUCED``; 256 routed experts in 8 groups)
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --arch gpt_oss     gpt-oss-20b at full
        depth, experts in MXFP4 as the released checkpoints store them (24 layers, 32 experts
        top-4, biases; about 14 GB)
    ... --experts-from DIR    (the sharded layouts) hard-link every shard but the routers' from
        DIR, the same checkpoint built before without --router-skew (the skewed twin then costs
        only its routers)
    python3 tools/vllm/make_moe_checkpoint.py --estimate --qwen3-30b-a3b --router-skew ALPHA
        print the simulated LRU hit rate at 32 slots (isotropic hidden states; no checkpoint;
        with --arch deepseek_v3 through its grouped sigmoid routing, --slots 64 a quarter)

Qwen3-MoE (the default ``--arch qwen3``) is built through transformers' model class. Mixtral
and Qwen2-MoE are written directly (``config.json`` and ``model.safetensors``, no transformers
needed): per-expert tensors under the names vLLM 0.25.0's ``MixtralForCausalLM``
(``block_sparse_moe.experts.E.w1/w2/w3``, its ``ckpt_names``) and ``Qwen2MoeForCausalLM``
(``mlp.experts.E.gate_proj/up_proj/down_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``, biased q/k/v projections) load, every parameter of those classes
present (``load_plan``); matrices N(0, 0.08), norms 1, biases N(0, 0.08), drawn in name order
from ``torch.Generator().manual_seed(seed)``, so the bytes depend only on the seed.

Prompts are token ids (no tokenizer): run vLLM with ``skip_tokenizer_init=True``. Weights are
drawn N(0, 0.08) after the default init (from ``torch.manual_seed(seed)``), so that greedy
decoding is not decided by ties; without ``--router-skew`` the checkpoint is the same as the
GPU bundle's builder makes from the same seed. The skew is applied after, from its own seeds,
and recorded in ``rowcache_router_skew.json`` beside the weights.

The DeepSeek and gpt-oss layouts (``deepseek_layout.py``, ``gpt_oss_layout.py``), and Qwen3-MoE with
``--sharded`` (``fp8_plan``'s tensors, or bf16), are written as sharded safetensors one tensor at a
time (``shards.py``): each tensor drawn from a generator of its own, seeded from the seed and the
tensor's name, on the GPU where there is one (``drawn_on`` in the record), so that a 31 GB
checkpoint is built in 36 s there (the H200 machine) without holding more than one tensor; FP8
weights (``deepseek_v3``) are quantized as ``--fp8-block``'s are, one scale per 128 x 128 block.

``--fp8-block`` writes the Qwen3-MoE layout directly too (no transformers), in the format vLLM
0.25.0's ``Fp8Config`` / ``Fp8MoEMethod`` load (``vllm/model_executor/layers/quantization/
fp8.py``): ``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128, 128],
"activation_scheme": "dynamic", "modules_to_not_convert": [...]}``; every expert matrix
(``mlp.experts.E.gate_proj/up_proj/down_proj.weight``) and attention projection
(``self_attn.q/k/v/o_proj.weight``) stored as float8_e4m3fn with a float32
``<name>.weight_scale_inv`` of ``[ceil(rows / 128), ceil(cols / 128)]``, one scale per 128 x 128
block (the block's absolute maximum / 448; the weight is ``fp8 x scale``, the DeepSeek
convention). The routers (``mlp.gate``, a ``ReplicatedLinear`` vLLM would otherwise quantize),
the embeddings, norms and ``lm_head`` stay bf16, the routers and ``lm_head`` listed in
``modules_to_not_convert`` as Qwen3-30B-A3B-FP8 lists them. Values are drawn in name order from
``torch.Generator().manual_seed(seed)`` (matrices N(0, 0.08) in float32, then quantized), so
the bytes depend only on the seed; the router skew is applied to the routers as they are drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

if __package__ in (None, ""):  # run as a script: the checkout on the path for tools.vllm
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from tools.vllm import deepseek_layout, gpt_oss_layout, shards, word_tokenizer
from tools.vllm.router_skew import GroupedSigmoid, estimate_hit_rate, skew_router_, zipf_scales

TINY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 512,
}
QWEN3_30B_A3B = {
    "vocab_size": 4096,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 2048,
}
COMMON = {
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def shapes(qwen: bool, layers: int | None) -> dict[str, Any]:
    base = QWEN3_30B_A3B if qwen else TINY
    return {**base, **COMMON, "num_hidden_layers": layers or (8 if qwen else 2)}


ARCHS = ("qwen3", "mixtral", "qwen2moe", "deepseek_v2", "deepseek_v3", "gpt_oss")
SHARDED_ARCHS = ("deepseek_v2", "deepseek_v3", "gpt_oss")
"""Written one tensor at a time into sharded safetensors (``shards.py``)."""
SHARD_BYTES = 4 << 30
FP8_BLOCK = (128, 128)
"""``weight_block_size``: (rows, columns) of the weight a scale covers (block_n, block_k)."""
FP8_MAX = 448.0
"""The largest float8_e4m3fn value (``torch.finfo(torch.float8_e4m3fn).max``)."""
QWEN3_DIRECT = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_only_layers": [],
    "use_sliding_window": False,
    "sliding_window": None,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "dtype": "bfloat16",
}
"""What ``transformers``' ``Qwen3MoeConfig`` would add to ``shapes`` for a directly written
Qwen3-MoE (the fields vLLM 0.25.0's ``qwen3_moe.py`` reads beyond the shapes)."""
_SMALL = {
    "vocab_size": 512,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
    "attention_dropout": 0.0,
    "output_router_logits": False,
}
MIXTRAL = {
    **_SMALL,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "intermediate_size": 256,  # each expert's
    "num_local_experts": 32,
    "num_experts_per_tok": 2,
    "sliding_window": None,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
}
"""Mixtral's layout at small sizes: 32 experts, top-2 (a decode step of 4 sequences routes to
up to 8 experts: 16 slots miss in one pass, 4 need more than one)."""
QWEN2MOE = {
    **_SMALL,
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "intermediate_size": 1024,  # dense MLP of mlp_only_layers (none here)
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
    "router_aux_loss_coef": 0.001,
}
"""Qwen2-MoE's (Qwen1.5-MoE) layout at small sizes: 32 experts, top-4, and the shared expert
behind its sigmoid gate (16 slots miss in one pass for 4 sequences, 8 need more than one)."""


def arch_config(arch: str, layers: int | None) -> dict[str, Any]:
    """The ``config.json`` of a directly written architecture."""
    base = {"mixtral": MIXTRAL, "qwen2moe": QWEN2MOE}[arch]
    return {**base, "num_hidden_layers": layers or 4}


def fp8_config(qwen: bool, layers: int | None, bf16_attention: bool = False) -> dict[str, Any]:
    """The ``config.json`` of an FP8 block-scaled Qwen3-MoE (``--fp8-block``)."""
    config = {**shapes(qwen, layers), **QWEN3_DIRECT}
    keep = ["lm_head"]
    for i in range(config["num_hidden_layers"]):
        keep.append(f"model.layers.{i}.mlp.gate")
        if bf16_attention:
            keep += [f"model.layers.{i}.self_attn.{p}_proj" for p in ("q", "k", "v", "o")]
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
        "modules_to_not_convert": keep,
    }
    return config


def fp8_quantized(name: str, config: dict[str, Any]) -> bool:
    """Whether ``name`` (a tensor of ``load_plan("qwen3", config)``) is stored in FP8: the
    weights of every linear layer vLLM quantizes, i.e. every expert matrix and attention
    projection whose module is not in ``modules_to_not_convert``."""
    if not name.endswith("_proj.weight"):
        return False
    module = name.removesuffix(".weight")
    return module not in config["quantization_config"]["modules_to_not_convert"]


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a ``[rows, cols]`` weight: one per 128 x 128 block."""
    rows, cols = shape
    return (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))


def fp8_plan(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the ``--fp8-block`` checkpoint: its shape and dtype."""
    plan: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, shape in load_plan("qwen3", config).items():
        if fp8_quantized(name, config):
            plan[name] = (shape, torch.float8_e4m3fn)
            plan[name + "_scale_inv"] = (fp8_scale_shape(shape), torch.float32)
        else:
            plan[name] = (shape, torch.bfloat16)
    return plan


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ([rows, cols], any float dtype) as float8_e4m3fn and its float32 block
    scales: each 128 x 128 block (the last ones cut short) divided by its absolute maximum /
    448, so that ``fp8 x scale`` restores it to FP8 precision."""
    rows, cols = weight.shape
    bn, bk = FP8_BLOCK
    nr, nc = fp8_scale_shape((rows, cols))
    if (rows, cols) == (nr * bn, nc * bk):
        padded = weight.to(torch.float32)  # read only: no copy of a float32 weight
    else:
        padded = torch.zeros(nr * bn, nc * bk, dtype=torch.float32)
        padded[:rows, :cols] = weight
    blocks = padded.view(nr, bn, nc, bk)
    # The contiguous dimension first: several times faster than amax over (1, 3) at once on
    # the CPU, with the same maximum.
    amax = blocks.abs().amax(dim=3).amax(dim=1)
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    quantized = scaled.view(nr * bn, nc * bk)[:rows, :cols].to(torch.float8_e4m3fn)
    return quantized.contiguous(), scale.contiguous()


def dequantize_fp8_block(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``quantized x scale`` per block, in float32 (the inverse of ``quantize_fp8_block``)."""
    rows, cols = quantized.shape
    full = scale.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)
    return quantized.float() * full[:rows, :cols]


def experts_of(config: dict[str, Any]) -> tuple[int, int]:
    """(experts per MoE layer, top_k) of any of the builder's configs."""
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        if key in config:
            experts = config[key]
            break
    return int(experts), int(config["num_experts_per_tok"])


def load_plan(arch: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the vLLM 0.25.0 model class of ``arch`` loads, with its shape.

    From ``vllm/model_executor/models/mixtral.py``, ``qwen2_moe.py`` and ``qwen3_moe.py`` (for
    ``qwen3``: no attention biases, ``q_norm``/``k_norm`` of ``head_dim``, no shared expert;
    used by ``--fp8-block``): q/k/v are stacked into
    ``qkv_proj`` (``hf_to_vllm_mapper``), experts are loaded one by one through the FusedMoE
    layer's expert mapping (``RoutedExperts.build_expert_params_mapping``: names
    ``experts.E.<gate>``, ``.<up>``, ``.<down>``; Mixtral's ``ckpt_names=("w1", "w2",
    "w3")``), Qwen2-MoE's shared expert's gate/up into ``gate_up_proj``.
    """
    h, v = config["hidden_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    # Mixtral's and Qwen3-MoE's classes take head_dim from the config where set; Qwen2-MoE's
    # hidden / heads.
    hd = int(config.get("head_dim") or h // heads) if arch != "qwen2moe" else h // heads
    plan: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    experts, _ = experts_of(config)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        plan[p + "input_layernorm.weight"] = (h,)
        plan[p + "post_attention_layernorm.weight"] = (h,)
        plan[p + "self_attn.q_proj.weight"] = (heads * hd, h)
        plan[p + "self_attn.k_proj.weight"] = (kv * hd, h)
        plan[p + "self_attn.v_proj.weight"] = (kv * hd, h)
        plan[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        if arch == "mixtral":
            inter = config["intermediate_size"]
            moe = p + "block_sparse_moe."
            plan[moe + "gate.weight"] = (experts, h)
            for e in range(experts):
                plan[f"{moe}experts.{e}.w1.weight"] = (inter, h)
                plan[f"{moe}experts.{e}.w2.weight"] = (h, inter)
                plan[f"{moe}experts.{e}.w3.weight"] = (inter, h)
            continue
        if arch == "qwen3":
            inter = config["moe_intermediate_size"]
            mlp = p + "mlp."
            plan[p + "self_attn.q_norm.weight"] = (hd,)
            plan[p + "self_attn.k_norm.weight"] = (hd,)
            plan[mlp + "gate.weight"] = (experts, h)
            for e in range(experts):
                plan[f"{mlp}experts.{e}.gate_proj.weight"] = (inter, h)
                plan[f"{mlp}experts.{e}.up_proj.weight"] = (inter, h)
                plan[f"{mlp}experts.{e}.down_proj.weight"] = (h, inter)
            continue
        plan[p + "self_attn.q_proj.bias"] = (heads * hd,)
        plan[p + "self_attn.k_proj.bias"] = (kv * hd,)
        plan[p + "self_attn.v_proj.bias"] = (kv * hd,)
        inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
        mlp = p + "mlp."
        plan[mlp + "gate.weight"] = (experts, h)
        plan[mlp + "shared_expert_gate.weight"] = (1, h)
        plan[mlp + "shared_expert.gate_proj.weight"] = (shared, h)
        plan[mlp + "shared_expert.up_proj.weight"] = (shared, h)
        plan[mlp + "shared_expert.down_proj.weight"] = (h, shared)
        for e in range(experts):
            plan[f"{mlp}experts.{e}.gate_proj.weight"] = (inter, h)
            plan[f"{mlp}experts.{e}.up_proj.weight"] = (inter, h)
            plan[f"{mlp}experts.{e}.down_proj.weight"] = (h, inter)
    return plan


def router_names(arch: str, config: dict[str, Any]) -> list[str]:
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    return [f"model.layers.{i}.{moe}.gate.weight" for i in range(config["num_hidden_layers"])]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """The safetensors format by hand (8-byte little-endian header size, JSON header, data):
    the checkpoint needs no safetensors package to be written."""
    dtypes = {
        torch.bfloat16: "BF16",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.float8_e4m3fn: "F8_E4M3",
    }
    header: dict[str, Any] = {"__metadata__": meta}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        blob = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": dtypes[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for blob in blobs:
            out.write(blob)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as source:
        size = int.from_bytes(source.read(8), "little")
        header: dict[str, Any] = json.loads(source.read(size))
        return header


def build_direct(out: Path, arch: str, config: dict[str, Any], seed: int, skew: float) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``arch`` (see the module docstring)."""
    started = time.time()
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(load_plan(arch, config).items()):
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=generator) * 0.08
        tensors[name] = value
    layers: list[dict[str, Any]] = []
    if skew > 0:
        for index, name in enumerate(router_names(arch, config)):
            scales = skew_router_(tensors[name], skew, seed=1000 * (seed + 1) + index)
            layers.append({"layer": index, "max_scale": float(scales.max())})
    out.mkdir(parents=True, exist_ok=True)
    bf16 = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    write_safetensors(out / "model.safetensors", bf16, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    record = {"router_skew": skew, "seed": seed, "layers": layers, "arch": arch}
    (out / "rowcache_router_skew.json").write_text(json.dumps(record, indent=1) + "\n")
    params = sum(t.numel() for t in tensors.values())
    print(f"saved {out} ({arch}) params {params} in {time.time() - started:.1f}s")


def build_fp8(out: Path, config: dict[str, Any], seed: int, skew: float) -> None:
    """Write the ``--fp8-block`` checkpoint (see the module docstring): each tensor drawn,
    skewed (routers) and quantized in turn, so that at most one float32 matrix is alive."""
    started = time.time()
    generator = torch.Generator().manual_seed(seed)
    routers = {name: i for i, name in enumerate(router_names("qwen3", config))}
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    params = 0
    for name, shape in sorted(load_plan("qwen3", config).items()):
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=generator) * 0.08
        params += value.numel()
        if name in routers and skew > 0:
            index = routers[name]
            scales = skew_router_(value, skew, seed=1000 * (seed + 1) + index)
            layers.append({"layer": index, "max_scale": float(scales.max())})
        if fp8_quantized(name, config):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_block(value)
        else:
            tensors[name] = value.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    layers.sort(key=lambda entry: int(entry["layer"]))
    record = {"router_skew": skew, "seed": seed, "layers": layers, "arch": "qwen3", "fp8": True}
    (out / "rowcache_router_skew.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved {out} (qwen3, FP8 block) params {params} in {time.time() - started:.1f}s")


def draw_device() -> torch.device:
    """Where the sharded builder draws: the GPU where there is one (seconds for 31 GB)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sharded_tensor(
    name: str,
    arch: str,
    config: dict[str, Any],
    plan: shards.Plan,
    seed: int,
    skew: float,
    routers: dict[str, int],
    device: torch.device,
) -> torch.Tensor:
    """One tensor of a sharded checkpoint as stored: norms 1; DeepSeek-V3's correction biases
    0; gpt-oss's packed MXFP4 values
    uniform random bytes and their e8m0 scales in ``gpt_oss_layout.SCALE_BYTES``; everything
    else N(0, 0.08), each from the tensor's own generator; a router scaled by ``skew`` (its
    layer's own seed, as the other builders); an FP8 weight quantized per 128 x 128 block, and
    its ``_scale_inv`` drawn and quantized again from the weight's generator (the same values:
    no state kept)."""
    shape, dtype = plan[name]
    if name.endswith("_scale_inv"):
        weight = name.removesuffix("_scale_inv")
        rows, cols = plan[weight][0]
        value = shards.draw_normal(weight, (rows, cols), seed, ROUTED_STD, device)
        return quantize_fp8_block(value)[1]
    if arch == "gpt_oss" and name.endswith("_blocks"):
        return shards.draw_bytes(name, shape, seed, device)
    if arch == "gpt_oss" and name.endswith("_scales"):
        low, high = gpt_oss_layout.SCALE_BYTES
        generator = torch.Generator(device=device).manual_seed(shards.tensor_seed(seed, name))
        return torch.randint(low, high, shape, generator=generator, device=device).to(dtype)
    if name.endswith("e_score_correction_bias"):
        # Zeros: drawn N(0, 0.08) like the rest, the bias alone decided DeepSeek-V3's routing
        # (sigmoid scores saturate; router_skew's docstring), a hit rate of 0.97 at a quarter
        # of the experts. A trained model's bias balances load, which a random router is.
        return torch.zeros(shape, dtype=dtype, device=device)
    if name.endswith("norm.weight"):
        value = torch.ones(shape, device=device)
    else:
        value = shards.draw_normal(name, shape, seed, ROUTED_STD, device)
    if name in routers and skew > 0:
        skew_router_(value, skew, seed=1000 * (seed + 1) + routers[name])
    if dtype == torch.float8_e4m3fn:
        quantized, _ = quantize_fp8_block(value)
        return quantized
    return value.to(dtype)


ROUTED_STD = 0.08
"""The sharded layouts' matrices and vectors are N(0, 0.08), like the builder's others."""


def grouped_routing(config: dict[str, Any]) -> GroupedSigmoid | None:
    """How ``--estimate`` routes a config with DeepSeek-V3's sigmoid scores: its groups, the
    logits of the builder's router over unit hidden states (N(0, 0.08) rows of ``hidden_size``)
    and the builder's zero correction bias; None for a top-k of the logits."""
    if config.get("scoring_func") != "sigmoid":
        return None
    logit_std = ROUTED_STD * math.sqrt(int(config["hidden_size"]))
    return GroupedSigmoid(int(config["n_group"]), int(config["topk_group"]), logit_std, 0.0)


def qwen3_plan(config: dict[str, Any]) -> shards.Plan:
    """Every stored tensor of a Qwen3-MoE: ``fp8_plan``'s with a ``quantization_config``
    (``--fp8-block``), else bf16 throughout."""
    if "quantization_config" in config:
        return fp8_plan(config)
    return {name: (shape, torch.bfloat16) for name, shape in load_plan("qwen3", config).items()}


def sharded_config(arch: str, layers: int | None) -> dict[str, Any]:
    if arch == "gpt_oss":
        return gpt_oss_layout.config(layers)
    return deepseek_layout.config(arch, layers)


def sharded_plan(arch: str, config: dict[str, Any]) -> shards.Plan:
    """Every stored tensor of a sharded checkpoint (DeepSeek's FP8 weights with their block
    scales)."""
    if arch == "qwen3":
        return qwen3_plan(config)
    if arch == "gpt_oss":
        return gpt_oss_layout.load_plan(config)
    plan: shards.Plan = {}
    for name, shape in deepseek_layout.load_plan(config).items():
        dtype = deepseek_layout.stored_dtype(name, config)
        plan[name] = (shape, dtype)
        if dtype == torch.float8_e4m3fn:
            rows, cols = shape
            plan[name + "_scale_inv"] = (fp8_scale_shape((rows, cols)), torch.float32)
    return plan


def sharded_routers(arch: str, config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the router matrices ``--router-skew`` scales, in layer order; every tensor of the
    router shard)."""
    if arch == "qwen3":
        names = router_names("qwen3", config)
        return names, names
    layout = gpt_oss_layout if arch == "gpt_oss" else deepseek_layout
    return layout.router_names(config), layout.router_tensors(config)


DISK_MARGIN_BYTES = 1 << 30
"""Free disk a build leaves at the least (vLLM's and torch's caches, logs)."""


def check_disk(out: Path, needed: int) -> None:
    """Stop before writing anything when the disk of ``out`` has less free space than the
    ``needed`` bytes and ``DISK_MARGIN_BYTES``: a build that fills the disk halfway costs its
    time and leaves the engines nothing (a 64 GiB machine holds the full-depth Qwen3 or
    DeepSeek-V2-Lite, not both beside the 8-layer checkpoints)."""
    where = out
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < needed + DISK_MARGIN_BYTES:
        raise SystemExit(
            f"make_moe_checkpoint: {out} needs {needed / 2**30:.1f} GiB and "
            f"{DISK_MARGIN_BYTES / 2**30:.0f} GiB to spare, the disk has {free / 2**30:.1f} "
            "GiB free: remove other checkpoints or build on another machine"
        )


def build_sharded(
    out: Path,
    arch: str,
    config: dict[str, Any],
    seed: int,
    skew: float,
    experts_from: Path | None = None,
    device: torch.device | None = None,
) -> None:
    """Write a sharded checkpoint (``config.json``, the shards, their index, the record)."""
    started = time.time()
    device = device or draw_device()
    plan = sharded_plan(arch, config)
    router_names, router_tensors = sharded_routers(arch, config)
    routers = {name: i for i, name in enumerate(router_names)}
    record: dict[str, Any] = {
        "router_skew": skew,
        "seed": seed,
        "arch": arch,
        "drawn_on": device.type,
        "layers": [],
    }
    files = shards.assign_shards(plan, router_tensors, SHARD_BYTES)
    linked: list[str] = []
    if experts_from is not None:
        linked = _link_experts(experts_from, out, config, record, files)
    written = {name: spec for name, spec in plan.items() if files[name] not in linked}
    check_disk(out, sum(shards.nbytes(*spec) for spec in written.values()))
    shards.write_checkpoint(
        out,
        plan,
        router_tensors,
        lambda name: sharded_tensor(name, arch, config, plan, seed, skew, routers, device),
        SHARD_BYTES,
        skip_files=linked,
    )
    if skew > 0:
        experts, _ = experts_of(config)
        record["layers"] = [
            {
                "layer": index,
                "router": name,
                "max_scale": float(zipf_scales(experts, skew, 1000 * (seed + 1) + index).max()),
            }
            for name, index in routers.items()
        ]
    record["linked_from"] = str(experts_from) if linked else None
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    (out / "rowcache_router_skew.json").write_text(json.dumps(record, indent=1) + "\n")
    params = sum(shards.nbytes(shape, torch.uint8) for shape, _ in plan.values())
    print(
        f"saved {out} ({arch}, {len(set(files.values()))} shards, {len(linked)} linked) "
        f"elements {params} on {device.type} in {time.time() - started:.1f}s"
    )


def _link_experts(
    source: Path,
    out: Path,
    config: dict[str, Any],
    record: dict[str, Any],
    files: dict[str, str],
) -> list[str]:
    """The shards taken from ``source`` as hard links: only from a whole checkpoint (its
    ``.rowcache-built`` marker) of the same config, seed and drawing device, else its bytes
    differ. Anything else stops the build with the reason: writing every shard instead would
    take a second copy of a checkpoint the disk may not hold."""

    def refuse(why: str) -> NoReturn:
        raise SystemExit(f"--experts-from {source}: {why}; build it first (without the skew)")

    if not (source / ".rowcache-built").exists():
        refuse("not a whole checkpoint (no .rowcache-built marker)")
    try:
        theirs = json.loads((source / "rowcache_router_skew.json").read_text())
        same_config = json.loads((source / "config.json").read_text()) == json.loads(
            json.dumps(config)
        )
    except (OSError, ValueError) as exc:
        refuse(f"not a checkpoint of this builder ({exc})")
    for key in ("seed", "arch", "drawn_on"):
        if theirs.get(key) != record[key]:
            refuse(f"its {key} is {theirs.get(key)!r}, this one's {record[key]!r}")
    if not same_config:
        refuse("another config")
    return shards.link_shared_shards(source, out, files)


def build(out: Path, config: dict[str, Any], seed: int, skew: float) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    started = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    layers: list[dict[str, Any]] = []
    if skew > 0:
        for index, layer in enumerate(model.model.layers):
            scales = skew_router_(layer.mlp.gate.weight, skew, seed=1000 * (seed + 1) + index)
            layers.append({"layer": index, "max_scale": float(scales.max())})
    model.save_pretrained(str(out), safe_serialization=True)
    record = {"router_skew": skew, "seed": seed, "layers": layers}
    (out / "rowcache_router_skew.json").write_text(json.dumps(record, indent=1) + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"saved {out} params {params} in {time.time() - started:.1f}s (router skew {skew})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument("--qwen3-30b-a3b", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-skew", type=float, default=0.0, metavar="ALPHA")
    parser.add_argument(
        "--fp8-block",
        action="store_true",
        help="Qwen3-MoE in FP8 with 128 x 128 block scales (vLLM's Fp8Config format)",
    )
    parser.add_argument(
        "--fp8-bf16-attention",
        action="store_true",
        help="with --fp8-block: attention projections in bf16 (modules_to_not_convert)",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="Qwen3-MoE written one tensor at a time into 4 GiB shards, drawn on the GPU where "
        "there is one (what a full-depth Qwen3-30B-A3B needs: 48 layers, 29 GB of FP8 experts)",
    )
    parser.add_argument(
        "--experts-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="a sharded layout: hard-link every shard but the routers' from DIR (the same "
        "checkpoint without --router-skew)",
    )
    parser.add_argument(
        "--tokenizer",
        action="store_true",
        help="also write a word-level tokenizer (tools/vllm/word_tokenizer.py), for text clients",
    )
    parser.add_argument("--estimate", action="store_true", help="print the simulated hit rate")
    parser.add_argument("--slots", type=int, default=32, help="slots for --estimate")
    args = parser.parse_args(argv)
    direct = args.arch != "qwen3"
    if args.sharded and direct:
        parser.error(f"--sharded writes a Qwen3-MoE ({args.arch} is always sharded or never)")
    sharded = args.arch in SHARDED_ARCHS or args.sharded
    if args.experts_from is not None and not sharded:
        parser.error(
            f"--experts-from takes a sharded layout ({', '.join(SHARDED_ARCHS)}, or --sharded)"
        )
    if direct and args.qwen3_30b_a3b:
        parser.error("--qwen3-30b-a3b is a Qwen3-MoE shape; leave it out with --arch " + args.arch)
    if args.fp8_block and direct:
        parser.error("--fp8-block writes a Qwen3-MoE; leave out --arch " + args.arch)
    if args.fp8_bf16_attention and not args.fp8_block:
        parser.error("--fp8-bf16-attention needs --fp8-block")
    if args.fp8_block:
        config = fp8_config(args.qwen3_30b_a3b, args.layers, args.fp8_bf16_attention)
    elif args.arch in SHARDED_ARCHS:
        try:
            config = sharded_config(args.arch, args.layers)
        except ValueError as exc:
            parser.error(str(exc))
    elif direct:
        config = arch_config(args.arch, args.layers)
    else:
        config = shapes(args.qwen3_30b_a3b, args.layers)
    if args.router_skew < 0:
        parser.error(f"--router-skew must be >= 0, got {args.router_skew}")
    if args.estimate:
        experts, top_k = experts_of(config)
        rate = estimate_hit_rate(
            experts, top_k, args.slots, args.router_skew, grouped=grouped_routing(config)
        )
        print(
            f"simulated LRU hit rate, {args.slots} of {experts} slots, top-"
            f"{top_k}, router skew {args.router_skew}: {rate:.3f}"
        )
        return 0
    if args.out is None:
        parser.error("OUTDIR is required unless --estimate is given")
    if sharded:
        arch = "qwen3" if args.sharded else args.arch
        build_sharded(args.out, arch, config, args.seed, args.router_skew, args.experts_from)
    elif args.fp8_block:
        build_fp8(args.out, config, args.seed, args.router_skew)
    elif direct:
        build_direct(args.out, args.arch, config, args.seed, args.router_skew)
    else:
        build(args.out, config, args.seed, args.router_skew)
    if args.tokenizer:
        word_tokenizer.write_tokenizer(args.out, int(config["vocab_size"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
