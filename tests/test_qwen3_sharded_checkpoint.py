"""``make_moe_checkpoint.py --sharded``: Qwen3-MoE (block FP8 or bf16) written one tensor at a
time into shards, as a full-depth Qwen3-30B-A3B needs (48 layers, 29 GB of FP8 experts), at
tiny shapes on the CPU: the plan's names, shapes and dtypes, FP8 weights that dequantize to
their draw, the routers in their own shard and the skewed twin's links."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.vllm import make_moe_checkpoint as mk
from tools.vllm import shards

FP8 = torch.float8_e4m3fn


def _build(out: Path, fp8: bool = True, skew: float = 0.0, **kw: Any) -> dict[str, Any]:
    config = mk.fp8_config(False, 2) if fp8 else mk.shapes(False, 2)
    mk.build_sharded(out, "qwen3", config, 0, skew, device=torch.device("cpu"), **kw)
    return config


def test_the_full_depth_plan_is_qwen3_30b_a3b_in_block_fp8() -> None:
    config = mk.fp8_config(True, 48)
    plan = mk.sharded_plan("qwen3", config)
    experts = {n: v for n, v in plan.items() if ".mlp.experts." in n}
    weights = {n: v for n, v in experts.items() if n.endswith("_proj.weight")}
    assert len(weights) == 48 * 128 * 3
    assert {dtype for _, dtype in weights.values()} == {FP8}
    assert sum(shards.nbytes(*v) for v in weights.values()) == 48 * 128 * 3 * 2048 * 768
    assert plan["model.layers.47.mlp.experts.127.down_proj.weight_scale_inv"] == (
        (16, 6),
        torch.float32,
    )
    assert plan["model.layers.0.mlp.gate.weight"] == ((128, 2048), torch.bfloat16)
    names, router_shard = mk.sharded_routers("qwen3", config)
    assert names == router_shard == [f"model.layers.{i}.mlp.gate.weight" for i in range(48)]


@pytest.mark.parametrize("fp8", [True, False])
def test_the_shards_hold_the_plan(tmp_path: Path, fp8: bool) -> None:
    config = _build(tmp_path / "a", fp8)
    out = tmp_path / "a"
    plan = mk.sharded_plan("qwen3", config)
    assert plan == (mk.fp8_plan(config) if fp8 else mk.qwen3_plan(config))
    index = json.loads((out / shards.INDEX).read_text())
    assert set(index["weight_map"]) == set(plan)
    for name, file in index["weight_map"].items():
        assert (file == shards.ROUTER_SHARD) == name.endswith(".mlp.gate.weight"), name
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    weight = shards.read_tensor(out, name)
    assert weight.dtype == (FP8 if fp8 else torch.bfloat16)
    drawn = shards.draw_normal(name, tuple(weight.shape), 0, mk.ROUTED_STD, torch.device("cpu"))
    if fp8:
        restored = mk.dequantize_fp8_block(weight, shards.read_tensor(out, name + "_scale_inv"))
        assert torch.allclose(restored, drawn, rtol=0.07, atol=1e-3)
    else:
        assert torch.equal(weight, drawn.to(torch.bfloat16))
    assert torch.equal(shards.read_tensor(out, "model.norm.weight").float(), torch.ones(256))
    record = json.loads((out / "rowcache_router_skew.json").read_text())
    assert record["arch"] == "qwen3" and record["drawn_on"] == "cpu"


def test_the_skewed_twin_links_every_shard_but_the_routers(tmp_path: Path) -> None:
    _build(tmp_path / "plain")
    (tmp_path / "plain" / ".rowcache-built").touch()  # the harness marks a whole build
    _build(tmp_path / "twin", skew=1.0, experts_from=tmp_path / "plain")
    files = sorted((tmp_path / "twin").glob("*.safetensors"))
    assert {p.name for p in files} >= {shards.ROUTER_SHARD}
    for path in files:
        linked = os.stat(path).st_ino == os.stat(tmp_path / "plain" / path.name).st_ino
        assert linked == (path.name != shards.ROUTER_SHARD), path.name
    plain = shards.read_tensor(tmp_path / "plain", "model.layers.0.mlp.gate.weight")
    skewed = shards.read_tensor(tmp_path / "twin", "model.layers.0.mlp.gate.weight")
    assert not torch.equal(plain, skewed)


def test_command_line(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        mk.main([str(tmp_path / "x"), "--arch", "mixtral", "--sharded"])
    assert "--sharded writes a Qwen3-MoE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mk.main([str(tmp_path / "x"), "--layers", "2", "--experts-from", str(tmp_path)])
    assert "--experts-from takes a sharded layout" in capsys.readouterr().err
    assert mk.main([str(tmp_path / "q"), "--layers", "2", "--fp8-block", "--sharded"]) == 0
    assert (tmp_path / "q" / shards.INDEX).exists()
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
