"""The Mixtral and Qwen2-MoE checkpoints of tools/vllm/make_moe_checkpoint.py on the CPU: the
config fields and the tensor names and shapes vLLM 0.25.0's model classes load (written here as
literals from ``vllm/model_executor/models/mixtral.py`` and ``qwen2_moe.py``, and those
literals checked against the wheel), the safetensors layout, determinism from the seed, and the
harness's ``archs`` phase."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_wheels

from tools.vllm import make_moe_checkpoint as mk
from tools.vllm.harness import engines, phases
from tools.vllm.harness.specs import Mode, Planner

# config.<field> the model classes read (vLLM 0.25.0; getattr(config, "...") included).
CONFIG_FIELDS = {
    "mixtral": {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "num_local_experts",
        "num_experts_per_tok",
        "intermediate_size",
        "tie_word_embeddings",
    },
    "qwen2moe": {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "hidden_act",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "tie_word_embeddings",
    },
}
VLLM_CONFIG_ATTRS = {
    "model_config",
    "cache_config",
    "quant_config",
    "parallel_config",
    "eplb_config",
    "enable_eplb",
}
"""``config.X`` in those modules that are vLLM's own configuration, not the checkpoint's."""

# One layer's tensors besides the experts, and one expert's (E = 0), as the classes name them.
LAYER_TENSORS = {
    "mixtral": {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "block_sparse_moe.gate.weight",
    },
    "qwen2moe": {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.weight",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.weight",
        "self_attn.v_proj.bias",
        "self_attn.o_proj.weight",
        "mlp.gate.weight",
        "mlp.shared_expert_gate.weight",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
    },
}
EXPERT_TENSORS = {
    "mixtral": ("block_sparse_moe.experts.0.", ("w1", "w2", "w3")),
    "qwen2moe": ("mlp.experts.0.", ("gate_proj", "up_proj", "down_proj")),
}
# Fragments of the wheel's sources the literals above rest on.
SOURCE_FRAGMENTS = {
    "vllm/model_executor/models/mixtral.py": (
        'prefix=f"{prefix}.block_sparse_moe"',
        'self.head_dim = getattr(config, "head_dim", None)',
        'prefix=f"{prefix}.gate"',
        'ckpt_names=("w1", "w2", "w3")',
        '".q_proj": (".qkv_proj", "q")',
    ),
    "vllm/model_executor/models/qwen2_moe.py": (
        'prefix=f"{prefix}.shared_expert_gate"',
        'prefix=f"{prefix}.shared_expert"',
        'prefix=f"{prefix}.experts"',
        'prefix=f"{prefix}.mlp"',
        '".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0)',
        "bias=True",
        "self.head_dim = hidden_size // self.total_num_heads",
    ),
    "vllm/model_executor/layers/fused_moe/routed_experts.py": (
        'f"experts.{physical_to_logical_map[expert_id]}.{weight_name}.',
    ),
    "vllm/model_executor/layers/fused_moe/layer.py": (
        'ckpt_names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")',
    ),
}


def _small(arch: str) -> dict[str, Any]:
    """The arch's config with small sizes (the layout is what is tested; seconds matter)."""
    config = mk.arch_config(arch, 2)
    config.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config.update(vocab_size=96)
    if arch == "mixtral":
        config.update(num_local_experts=8, intermediate_size=32)
    else:
        config.update(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return config


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_config_has_every_field_the_model_class_reads(arch: str) -> None:
    config = mk.arch_config(arch, None)
    assert CONFIG_FIELDS[arch] <= set(config)
    assert config["architectures"] == [
        {"mixtral": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}[arch]
    ]
    assert config["model_type"] == {"mixtral": "mixtral", "qwen2moe": "qwen2_moe"}[arch]
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"]
    experts, top_k = mk.experts_of(config)
    assert (experts, top_k) == {"mixtral": (32, 2), "qwen2moe": (32, 4)}[arch]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_load_plan_names_and_shapes(arch: str) -> None:
    config = _small(arch)
    plan = mk.load_plan(arch, config)
    h, i = 64, 32
    layer0 = {n.removeprefix("model.layers.0.") for n in plan if n.startswith("model.layers.0.")}
    prefix, names = EXPERT_TENSORS[arch]
    experts = {n for n in layer0 if ".experts." in n}
    assert layer0 - experts == LAYER_TENSORS[arch]
    assert len(experts) == 8 * 3
    assert {prefix + n + ".weight" for n in names} <= experts
    assert {n for n in plan if not n.startswith("model.layers.")} == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    assert len([n for n in plan if n.startswith("model.layers.1.")]) == len(layer0)
    gate, up, down = (prefix + n + ".weight" for n in names)
    if arch == "mixtral":  # ckpt_names=("w1", "w2", "w3"): gate, down, up
        gate, down, up = (prefix + n + ".weight" for n in names)
    p = "model.layers.0."
    assert plan[p + gate] == (i, h) and plan[p + up] == (i, h) and plan[p + down] == (h, i)
    assert plan[p + "self_attn.q_proj.weight"] == (64, h)
    assert plan[p + "self_attn.k_proj.weight"] == (32, h)
    router = "block_sparse_moe.gate.weight" if arch == "mixtral" else "mlp.gate.weight"
    assert plan[p + router] == (8, h)
    assert mk.router_names(arch, config) == [f"model.layers.{n}.{router}" for n in range(2)]
    if arch == "qwen2moe":
        assert plan[p + "mlp.shared_expert_gate.weight"] == (1, h)
        assert plan[p + "mlp.shared_expert.down_proj.weight"] == (h, 48)
        assert plan[p + "self_attn.v_proj.bias"] == (32,)


def _build(arch: str, out: Path, seed: int, skew: float = 0.0) -> dict[str, Any]:
    config = _small(arch)
    mk.build_direct(out, arch, config, seed, skew)
    return config


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_builder_writes_the_plan_as_safetensors(arch: str, tmp_path: Path) -> None:
    config = _build(arch, tmp_path / "a", seed=0)
    written = json.loads((tmp_path / "a" / "config.json").read_text())
    assert written == json.loads(json.dumps(config))
    path = tmp_path / "a" / "model.safetensors"
    header = mk.read_safetensors_header(path)
    meta = header.pop("__metadata__")
    assert meta == {"format": "pt"}
    plan = mk.load_plan(arch, config)
    assert {n: tuple(h["shape"]) for n, h in header.items()} == plan
    assert {h["dtype"] for h in header.values()} == {"BF16"}
    # Contiguous data after an 8-byte aligned header; the file ends with the last tensor.
    spans = sorted(tuple(h["data_offsets"]) for h in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    size = int.from_bytes(path.read_bytes()[:8], "little")
    assert size % 8 == 0 and path.stat().st_size == 8 + size + spans[-1][1]
    # Values: norms 1, the rest small and random.
    norm = _tensor(path, "model.norm.weight")
    assert torch.equal(norm, torch.ones(64, dtype=torch.bfloat16))
    router = _tensor(path, mk.router_names(arch, config)[0]).float()
    assert 0.05 < router.std().item() < 0.11


def _tensor(path: Path, name: str) -> torch.Tensor:
    header = mk.read_safetensors_header(path)
    start, end = header[name]["data_offsets"]
    data = path.read_bytes()[8 + int.from_bytes(path.read_bytes()[:8], "little") :]
    raw = bytearray(data[start:end])
    return torch.frombuffer(raw, dtype=torch.bfloat16).reshape(header[name]["shape"])


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_builder_is_deterministic_from_the_seed(arch: str, tmp_path: Path) -> None:
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        _build(arch, tmp_path / name, seed)
    data = {n: (tmp_path / n / "model.safetensors").read_bytes() for n in "abc"}
    assert data["a"] == data["b"]
    assert data["a"] != data["c"]
    _build(arch, tmp_path / "skew", 0, skew=1.0)
    record = json.loads((tmp_path / "skew" / "rowcache_router_skew.json").read_text())
    assert record["arch"] == arch and len(record["layers"]) == 2
    skewed = tmp_path / "skew" / "model.safetensors"
    router = mk.router_names(arch, _small(arch))[0]
    assert not torch.equal(
        _tensor(skewed, router), _tensor(tmp_path / "a" / "model.safetensors", router)
    )


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mk.main([str(tmp_path / "m"), "--arch", "mixtral", "--layers", "1"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["model_type"] == "mixtral"
    assert mk.main(["--estimate", "--arch", "qwen2moe", "--slots", "16"]) == 0
    assert "16 of 32 slots, top-4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mk.main([str(tmp_path / "x"), "--arch", "qwen2moe", "--qwen3-30b-a3b"])


def test_the_literals_hold_in_the_vllm_wheel() -> None:
    sources = vllm_wheels.read("0.25.0", *SOURCE_FRAGMENTS)
    for path, fragments in SOURCE_FRAGMENTS.items():
        for fragment in fragments:
            assert fragment in sources[path], (path, fragment)
    for arch, module in (("mixtral", "mixtral.py"), ("qwen2moe", "qwen2_moe.py")):
        source = sources[f"vllm/model_executor/models/{module}"]
        read = set(re.findall(r"\bconfig\.(\w+)", source))
        read |= set(re.findall(r'getattr\(config, "(\w+)"', source))
        read -= VLLM_CONFIG_ATTRS
        # Optional reads with a default the class survives without (getattr with default).
        read -= {"dual_chunk_attention_config"}
        assert read == CONFIG_FIELDS[arch], arch


def test_archs_phase_engines() -> None:
    specs = engines.archs()
    assert [s.name for s in specs] == [
        "archs.mixtral.none.full",
        "archs.mixtral.row16dev.full",
        "archs.mixtral.row4dev.full",
        "archs.qwen2moe.none.full",
        "archs.qwen2moe.row16dev.full",
        "archs.qwen2moe.row8dev.full",
    ]
    assert all(s.mode is Mode.DEFAULT for s in specs)  # vLLM's full graphs
    for spec in specs:
        assert spec.compare_with == (f"archs.{spec.checkpoint.arch}.none.full",)
        if spec.knob is None:
            continue
        assert spec.knob.planner is Planner.DEVICE
        config = mk.arch_config(spec.checkpoint.arch, None)
        experts, top_k = mk.experts_of(config)
        sequences = len(spec.prompts)
        assert top_k <= spec.knob.size < experts  # misses
    for checkpoint, (large, small) in engines.ARCH_SLOTS.items():
        _, top_k = mk.experts_of(mk.arch_config(checkpoint.arch, None))
        assert large >= sequences * top_k  # a decode step of every sequence fits one pass
        assert small < sequences * top_k  # ... and needs more than one here
    assert engines.MIXTRAL.builder_args() == ["--arch", "mixtral"]
    assert engines.QWEN2MOE.builder_args() == ["--arch", "qwen2moe"]
    [phase] = phases.select(["archs"])
    assert [c.directory for c in phase.checkpoints()] == ["mixtral-moe", "qwen2-moe"]
