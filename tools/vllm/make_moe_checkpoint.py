"""Build a random-weight Qwen3-MoE checkpoint (for the e2e; no hub access on the GPU machine).

    python3 tools/vllm/make_moe_checkpoint.py OUTDIR            tiny: 2 layers, 16 experts, top-4
    python3 tools/vllm/make_moe_checkpoint.py OUTDIR --qwen3-30b-a3b --layers 8
        Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts, top-8, moe_intermediate 768)
    ... --router-skew ALPHA   scale every layer's router rows by Zipf factors (router_skew.py)
    python3 tools/vllm/make_moe_checkpoint.py --estimate --qwen3-30b-a3b --router-skew ALPHA
        print the simulated LRU hit rate at 32 slots (isotropic hidden states; no checkpoint)

Prompts are token ids (no tokenizer): run vLLM with ``skip_tokenizer_init=True``. Weights are
drawn N(0, 0.08) after the default init (from ``torch.manual_seed(seed)``), so that greedy
decoding is not decided by ties; without ``--router-skew`` the checkpoint is the same as the
GPU bundle's builder makes from the same seed. The skew is applied after, from its own seeds,
and recorded in ``rowcache_router_skew.json`` beside the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the checkout on the path for tools.vllm
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from tools.vllm.router_skew import estimate_hit_rate, skew_router_

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
    parser.add_argument("--qwen3-30b-a3b", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-skew", type=float, default=0.0, metavar="ALPHA")
    parser.add_argument("--estimate", action="store_true", help="print the simulated hit rate")
    parser.add_argument("--slots", type=int, default=32, help="slots for --estimate")
    args = parser.parse_args(argv)
    config = shapes(args.qwen3_30b_a3b, args.layers)
    if args.router_skew < 0:
        parser.error(f"--router-skew must be >= 0, got {args.router_skew}")
    if args.estimate:
        rate = estimate_hit_rate(
            config["num_experts"], config["num_experts_per_tok"], args.slots, args.router_skew
        )
        print(
            f"simulated LRU hit rate, {args.slots} of {config['num_experts']} slots, top-"
            f"{config['num_experts_per_tok']}, router skew {args.router_skew}: {rate:.3f}"
        )
        return 0
    if args.out is None:
        parser.error("OUTDIR is required unless --estimate is given")
    build(args.out, config, args.seed, args.router_skew)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
