"""The DeepSeek checkpoints of tools/vllm/make_moe_checkpoint.py (``--arch deepseek_v2`` and
``deepseek_v3``) on the CPU: the cards' config values, the tensors vLLM 0.25.0's DeepSeek class
loads (literals checked against the wheel), the sharded writer, determinism, the router skew
and the skewed twin's hard-linked shards."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_wheels

from tools.vllm import deepseek_layout as dl
from tools.vllm import make_moe_checkpoint as mk
from tools.vllm import shards

CPU = torch.device("cpu")


def _small(arch: str, layers: int | None = None) -> dict[str, Any]:
    """``arch``'s config at small widths (the layout is what is tested), its routing kept:
    V3's 8 groups of top-4 need at least 8 experts (16 here)."""
    config = dl.config(arch, layers)
    config.update(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_hidden_layers=layers or config["first_k_dense_replace"] + 2,
    )
    if arch == "deepseek_v3":
        config.update(q_lora_rank=48, n_routed_experts=16)
    else:
        config.update(n_routed_experts=8)
    return config


def test_v2_lite_is_the_model_card() -> None:
    config = dl.config("deepseek_v2", None)
    assert config["num_hidden_layers"] == 27 and config["first_k_dense_replace"] == 1
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (64, 6)
    assert (config["n_shared_experts"], config["moe_intermediate_size"]) == (2, 1408)
    assert config["q_lora_rank"] is None and config["kv_lora_rank"] == 512
    assert config["topk_method"] == "greedy" and config["scoring_func"] == "softmax"
    assert "quantization_config" not in config
    assert mk.experts_of(config) == (64, 6)
    assert dl.moe_layers(config) == list(range(1, 27))
    plan = mk.sharded_plan(config["model_type"], config)
    experts = sum(shards.nbytes(*v) for n, v in plan.items() if ".experts." in n)
    assert experts == 26 * 64 * 3 * 2048 * 1408 * 2  # 26.8 GiB of routed experts in bf16


def test_v3_keeps_every_routing_and_mla_field_of_the_card() -> None:
    config = dl.config("deepseek_v3", None)
    for key in (
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "topk_method",
        "scoring_func",
        "routed_scaling_factor",
        "norm_topk_prob",
        "first_k_dense_replace",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "quantization_config",
        "rope_scaling",
    ):
        assert config[key] == dl.V3[key], key
    assert (config["n_routed_experts"], config["n_group"], config["topk_group"]) == (256, 8, 4)
    reduced = {k for k in dl.V3 if config[k] != dl.V3[k]}
    assert reduced == set(dl.V3_REDUCED)
    assert dl.moe_layers(config) == list(range(3, 12))
    with pytest.raises(ValueError, match="3 dense layers"):
        dl.config("deepseek_v3", 3)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_load_plan_names_and_shapes(arch: str) -> None:
    config = _small(arch)
    plan = dl.load_plan(config)
    dense = config["first_k_dense_replace"] - 1
    moe = dense + 1
    h, heads = 64, 2
    attention = {
        "self_attn.kv_a_proj_with_mqa.weight": (32 + 8, h),
        "self_attn.kv_a_layernorm.weight": (32,),
        "self_attn.kv_b_proj.weight": (heads * (16 + 16), 32),
        "self_attn.o_proj.weight": (h, heads * 16),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if arch == "deepseek_v2":
        attention["self_attn.q_proj.weight"] = (heads * (16 + 8), h)
    else:
        attention["self_attn.q_a_proj.weight"] = (48, h)
        attention["self_attn.q_a_layernorm.weight"] = (48,)
        attention["self_attn.q_b_proj.weight"] = (heads * (16 + 8), 48)

    def layer(i: int) -> dict[str, tuple[int, ...]]:
        p = f"model.layers.{i}."
        return {n.removeprefix(p): s for n, s in plan.items() if n.startswith(p)}

    assert layer(dense) == {
        **attention,
        "mlp.gate_proj.weight": (96, h),
        "mlp.up_proj.weight": (96, h),
        "mlp.down_proj.weight": (h, 96),
    }
    experts = config["n_routed_experts"]
    shared = 32 * config["n_shared_experts"]
    want = {
        **attention,
        "mlp.gate.weight": (experts, h),
        "mlp.shared_experts.gate_proj.weight": (shared, h),
        "mlp.shared_experts.up_proj.weight": (shared, h),
        "mlp.shared_experts.down_proj.weight": (h, shared),
    }
    if arch == "deepseek_v3":
        want["mlp.gate.e_score_correction_bias"] = (experts,)
    for e in range(experts):
        want[f"mlp.experts.{e}.gate_proj.weight"] = (32, h)
        want[f"mlp.experts.{e}.up_proj.weight"] = (32, h)
        want[f"mlp.experts.{e}.down_proj.weight"] = (h, 32)
    assert layer(moe) == want
    assert {n for n in plan if not n.startswith("model.layers.")} == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    assert dl.router_names(config) == [
        f"model.layers.{moe}.mlp.gate.weight",
        f"model.layers.{moe + 1}.mlp.gate.weight",
    ]


def test_v3_stores_fp8_weights_with_block_scales_and_a_float32_bias() -> None:
    config = _small("deepseek_v3")
    plan = mk.sharded_plan(config["model_type"], config)
    p = "model.layers.3."
    assert plan[p + "mlp.experts.0.gate_proj.weight"] == ((32, 64), torch.float8_e4m3fn)
    assert plan[p + "mlp.experts.0.gate_proj.weight_scale_inv"] == ((1, 1), torch.float32)
    assert plan[p + "self_attn.kv_a_proj_with_mqa.weight"][1] == torch.float8_e4m3fn
    assert plan[p + "mlp.gate.weight"] == ((16, 64), torch.bfloat16)  # routers stay bf16
    assert plan[p + "mlp.gate.e_score_correction_bias"] == ((16,), torch.float32)
    assert plan["lm_head.weight"][1] == torch.bfloat16
    assert plan[p + "self_attn.kv_a_layernorm.weight"][1] == torch.bfloat16
    fp8 = [n for n, (_, dtype) in plan.items() if dtype == torch.float8_e4m3fn]
    assert all(n + "_scale_inv" in plan for n in fp8)
    assert all(n.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight")) for n in fp8)
    v2 = mk.sharded_plan("deepseek_v2", _small("deepseek_v2"))
    assert {dtype for _, dtype in v2.values()} == {torch.bfloat16}


def _build(out: Path, arch: str, seed: int = 0, skew: float = 0.0, **kw: Any) -> dict[str, Any]:
    config = _small(arch)
    mk.build_sharded(out, arch, config, seed, skew, device=CPU, **kw)
    return config


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_builder_writes_the_plan_in_shards(arch: str, tmp_path: Path) -> None:
    config = _build(tmp_path / "a", arch)
    out = tmp_path / "a"
    assert json.loads((out / "config.json").read_text()) == json.loads(json.dumps(config))
    index = json.loads((out / shards.INDEX).read_text())
    plan = mk.sharded_plan(config["model_type"], config)
    assert set(index["weight_map"]) == set(plan)
    assert index["metadata"]["total_size"] == sum(shards.nbytes(*v) for v in plan.values())
    routers = set(dl.router_tensors(config))
    for name, file in index["weight_map"].items():
        assert (file == shards.ROUTER_SHARD) == (name in routers), name
    written: dict[str, Any] = {}
    for file in set(index["weight_map"].values()):
        header = shards.read_header(out / file)
        assert header.pop("__metadata__") == {"format": "pt"}
        spans = sorted(tuple(entry["data_offsets"]) for entry in header.values())
        size = int.from_bytes((out / file).read_bytes()[:8], "little")
        assert (out / file).stat().st_size == 8 + size + spans[-1][1]
        written.update(header)
    assert {n: tuple(e["shape"]) for n, e in written.items()} == {
        n: s for n, (s, _) in plan.items()
    }
    assert not list(out.glob("*.partial"))
    norm = shards.read_tensor(out, "model.norm.weight")
    assert torch.equal(norm, torch.ones(64, dtype=torch.bfloat16))
    router = shards.read_tensor(out, dl.router_names(config)[0]).float()
    assert 0.04 < router.std().item() < 0.12
    record = json.loads((out / "rowcache_router_skew.json").read_text())
    assert record["drawn_on"] == "cpu" and record["arch"] == arch
    # DeepSeek-V3's correction biases are zeros: a drawn one decided the routing on its own.
    biases = [n for n in plan if n.endswith("e_score_correction_bias")]
    assert len(biases) == (len(dl.moe_layers(config)) if arch == "deepseek_v3" else 0)
    for name in biases:
        bias = shards.read_tensor(out, name)
        assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros_like(bias))


def test_fp8_weights_dequantize_to_their_draw(tmp_path: Path) -> None:
    config = _build(tmp_path / "a", "deepseek_v3")
    name = "model.layers.3.mlp.experts.5.down_proj.weight"
    quantized = shards.read_tensor(tmp_path / "a", name)
    scale = shards.read_tensor(tmp_path / "a", name + "_scale_inv")
    drawn = shards.draw_normal(name, (64, 32), 0, mk.ROUTED_STD, CPU)
    restored = mk.dequantize_fp8_block(quantized, scale)
    assert torch.allclose(restored, drawn, rtol=0.07, atol=1e-3)
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_seed_decides_the_bytes_and_skew_only_the_routers(tmp_path: Path) -> None:
    arch = "deepseek_v3"
    for name, seed, skew in (("a", 0, 0.0), ("b", 0, 0.0), ("c", 1, 0.0), ("s", 0, 1.0)):
        _build(tmp_path / name, arch, seed, skew)
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards.ROUTER_SHARD in files

    def data(name: str, file: str) -> bytes:
        return (tmp_path / name / file).read_bytes()

    for file in files:
        assert data("a", file) == data("b", file)
        assert data("a", file) != data("c", file)
        assert (data("a", file) == data("s", file)) == (file != shards.ROUTER_SHARD), file
    record = json.loads((tmp_path / "s" / "rowcache_router_skew.json").read_text())
    assert [layer["layer"] for layer in record["layers"]] == [0, 1]
    assert all(layer["max_scale"] > 1 for layer in record["layers"])


def test_the_skewed_twin_links_the_other_shards(tmp_path: Path, capsys: Any) -> None:
    arch = "deepseek_v2"
    _build(tmp_path / "plain", arch)
    with pytest.raises(SystemExit, match=r"no \.rowcache-built marker"):
        _build(tmp_path / "early", arch, skew=1.0, experts_from=tmp_path / "plain")
    (tmp_path / "plain" / ".rowcache-built").touch()  # the harness marks a whole build
    _build(tmp_path / "alone", arch, skew=1.0)
    _build(tmp_path / "twin", arch, skew=1.0, experts_from=tmp_path / "plain")
    for path in (tmp_path / "twin").glob("*.safetensors"):
        source = tmp_path / "plain" / path.name
        linked = os.stat(path).st_ino == os.stat(source).st_ino
        assert linked == (path.name != shards.ROUTER_SHARD), path.name
        assert path.read_bytes() == (tmp_path / "alone" / path.name).read_bytes()
    record = json.loads((tmp_path / "twin" / "rowcache_router_skew.json").read_text())
    assert record["linked_from"] == str(tmp_path / "plain")
    # Another seed's checkpoint is not taken: the build stops, saying why.
    with pytest.raises(SystemExit, match="its seed is 0, this one's 1"):
        _build(tmp_path / "other", arch, seed=1, skew=1.0, experts_from=tmp_path / "plain")


def test_command_line(tmp_path: Path, capsys: Any) -> None:
    assert mk.main(["--estimate", "--arch", "deepseek_v2", "--slots", "16"]) == 0
    assert "16 of 64 slots, top-6" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mk.main([str(tmp_path / "x"), "--arch", "deepseek_v3", "--layers", "2"])
    assert "3 dense layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mk.main([str(tmp_path / "x"), "--arch", "mixtral", "--experts-from", str(tmp_path)])
    assert "--experts-from takes a sharded layout" in capsys.readouterr().err


def test_assign_shards_caps_each_file() -> None:
    plan: shards.Plan = {f"t{i}": ((10,), torch.float32) for i in range(5)}  # 40 bytes each
    files = shards.assign_shards(plan, ["t2"], shard_bytes=80)
    assert files == {
        "t0": "model-00001.safetensors",
        "t1": "model-00001.safetensors",
        "t2": shards.ROUTER_SHARD,
        "t3": "model-00002.safetensors",
        "t4": "model-00002.safetensors",
    }
    with pytest.raises(ValueError, match="routers not in the plan"):
        shards.assign_shards(plan, ["nope"], 80)


def test_a_tensor_off_its_plan_stops_the_shard(tmp_path: Path) -> None:
    plan: shards.Plan = {"a": ((2, 2), torch.bfloat16)}
    with pytest.raises(ValueError, match=r"a: made \(2, 3\)"):
        shards.write_shard(
            tmp_path / "x.safetensors",
            plan,
            ["a"],
            lambda n: torch.zeros(2, 3, dtype=torch.bfloat16),
            {},
        )
    assert not (tmp_path / "x.safetensors").exists()


SOURCE_FRAGMENTS = (
    'if getattr(config, "topk_method", None) == "noaux_tc":',
    "self.gate.e_score_correction_bias = nn.Parameter(",
    "torch.empty(config.n_routed_experts, dtype=torch.float32)",
    "intermediate_size = config.moe_intermediate_size * config.n_shared_experts",
    'prefix=f"{prefix}.shared_experts"',
    "shared_experts=self.shared_experts,",
    'prefix=f"{prefix}.kv_a_proj_with_mqa"',
    "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)",
    "self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)",
    'prefix=f"{prefix}.q_b_proj"',
    'prefix=f"{prefix}.kv_b_proj"',
    'prefix=f"{prefix}.q_proj"',
    '("fused_qkv_a_proj", "q_a_proj", 0)',
    '("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)',
    'ckpt_gate_proj_name="gate_proj"',
    'ckpt_down_proj_name="down_proj"',
    'ckpt_up_proj_name="up_proj"',
    "and layer_idx >= config.first_k_dense_replace",
    "and layer_idx % moe_layer_freq == 0",
    "self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)",
    "use_grouped_topk=True,",
)


def test_literals_against_the_wheel() -> None:
    path = "vllm/model_executor/models/deepseek_v2.py"
    source = vllm_wheels.read("0.25.0", path)[path]
    for fragment in SOURCE_FRAGMENTS:
        assert fragment in source, fragment


def test_a_build_the_disk_cannot_hold_stops_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's bytes (less the shards a skewed twin links) against the disk's free space,
    before any shard is written."""
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    config = _small("deepseek_v3")
    needed = sum(shards.nbytes(*v) for v in mk.sharded_plan("deepseek_v3", config).values())
    free = needed + mk.DISK_MARGIN_BYTES - 1
    monkeypatch.setattr(mk.shutil, "disk_usage", lambda p: usage(0, 0, free))
    with pytest.raises(SystemExit, match=r"needs 0\.\d GiB and 1 GiB to spare"):
        mk.build_sharded(tmp_path / "a", "deepseek_v3", config, 0, 0.0, device=CPU)
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").iterdir())
    monkeypatch.setattr(mk.shutil, "disk_usage", lambda p: usage(0, 0, free + 1))
    mk.build_sharded(tmp_path / "a", "deepseek_v3", config, 0, 0.0, device=CPU)
    (tmp_path / "a" / ".rowcache-built").touch()
    # The skewed twin writes its routers' shard only: the links take no space.
    routers = sum(
        shards.nbytes(*mk.sharded_plan("deepseek_v3", config)[n]) for n in dl.router_tensors(config)
    )
    monkeypatch.setattr(
        mk.shutil, "disk_usage", lambda p: usage(0, 0, routers + mk.DISK_MARGIN_BYTES)
    )
    mk.build_sharded(
        tmp_path / "b", "deepseek_v3", config, 0, 1.0, experts_from=tmp_path / "a", device=CPU
    )
