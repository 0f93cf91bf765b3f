"""The skewed-router option of the e2e checkpoint builder, on the CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tools.vllm.make_moe_checkpoint import grouped_routing, main, shapes, sharded_config
from tools.vllm.router_skew import (
    GroupedSigmoid,
    estimate_hit_rate,
    grouped_sigmoid_topk,
    lru_hit_rate,
    skew_router_,
    zipf_scales,
)


def test_zero_skew_leaves_the_router_as_it_is() -> None:
    assert torch.equal(zipf_scales(16, 0.0, seed=3), torch.ones(16))
    weight = torch.randn(16, 8)
    before = weight.clone()
    skew_router_(weight, 0.0, seed=3)
    assert torch.equal(weight, before)


def test_scales_are_zipf_with_unit_rms_in_a_seeded_order() -> None:
    scales = zipf_scales(128, 1.0, seed=7)
    assert torch.allclose(scales.square().mean(), torch.tensor(1.0))
    ordered = scales.sort(descending=True).values
    assert torch.allclose(ordered / ordered[0], 1.0 / torch.arange(1, 129, dtype=torch.float32))
    assert torch.equal(scales, zipf_scales(128, 1.0, seed=7))
    assert not torch.equal(scales, zipf_scales(128, 1.0, seed=8))  # another layer, other experts
    with pytest.raises(ValueError, match="alpha must be >= 0, got -1"):
        zipf_scales(4, -1.0, seed=0)


def test_skew_scales_each_row() -> None:
    weight = torch.ones(4, 3)
    scales = skew_router_(weight, 1.0, seed=0)
    assert torch.allclose(weight, scales.unsqueeze(1).expand(4, 3))


def test_lru_hit_rate_by_hand() -> None:
    # capacity 2: [0,1] miss miss; [1,2] hit miss (evicts 0); [0,2] miss hit (evicts 1)
    assert lru_hit_rate([[0, 1], [1, 2], [0, 2]], capacity=2) == pytest.approx(2 / 6)
    assert lru_hit_rate([[3, 4]] * 4, capacity=2) == pytest.approx(6 / 8)


def test_skew_raises_the_simulated_hit_rate() -> None:
    rates = [estimate_hit_rate(128, 8, 32, alpha, steps=600) for alpha in (0.0, 0.8, 1.2)]
    assert rates[0] < 0.35 < rates[1] < rates[2]
    assert rates[2] > 0.85


def test_estimate_prints_and_needs_no_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--estimate", "--qwen3-30b-a3b", "--router-skew", "1.0"]) == 0
    assert "32 of 128 slots, top-8, router skew 1.0" in capsys.readouterr().out
    assert shapes(True, None)["num_hidden_layers"] == 8
    assert shapes(False, 3)["num_experts"] == 16
    with pytest.raises(SystemExit):
        main(["--router-skew", "-1", "--estimate"])


def test_grouped_sigmoid_picks_inside_the_best_groups_by_hand() -> None:
    # 4 experts in 2 groups of 2; one group kept. Group 0 (experts 0, 1) sums 0.6 + 0.6 with
    # the bias; group 1 holds the single best expert (3) but sums less: 0.9 + 0.15. Without
    # the bias in the group scores group 1 would win (1.05 against 1.0).
    logits = torch.logit(torch.tensor([[0.5, 0.5, 0.15, 0.9]]))
    bias = torch.tensor([0.1, 0.1, 0.0, 0.0])
    assert grouped_sigmoid_topk(logits, bias, 2, 1, 2).sort().values.tolist() == [[0, 1]]
    assert grouped_sigmoid_topk(logits, bias, 2, 2, 1).tolist() == [[3]]
    one_group = grouped_sigmoid_topk(logits, torch.tensor([0.1, 0.0, 0.0, 0.0]), 1, 1, 2)
    assert one_group.sort().values.tolist() == [[0, 3]]


def test_deepseek_v3s_plain_router_is_balanced_without_a_drawn_bias() -> None:
    """The reduced DeepSeek-V3 of 2026-12-06 hit 0.97 at 64 of 256 slots on both routers: its
    N(0, 0.08) correction bias decided among saturated sigmoid scores. The builder's routing
    (zero bias) gives about a quarter; the drawn bias gives what the engine measured."""
    grouped = grouped_routing(sharded_config("deepseek_v3", None))
    assert grouped == GroupedSigmoid(8, 4, pytest.approx(0.08 * 2048**0.5), 0.0)
    plain = estimate_hit_rate(256, 8, 64, 0.0, steps=600, grouped=grouped)
    skewed = estimate_hit_rate(256, 8, 64, 1.0, steps=600, grouped=grouped)
    drawn = estimate_hit_rate(256, 8, 64, 0.0, steps=600, grouped=replace(grouped, bias_std=0.08))
    assert 0.2 < plain < 0.3 < 0.9 < skewed
    assert drawn > 0.9
    assert grouped_routing(shapes(True, None)) is None  # Qwen3: softmax, a top-k of the logits


def test_estimate_follows_deepseek_v3s_routing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--estimate", "--arch", "deepseek_v3", "--slots", "64"]) == 0
    out = capsys.readouterr().out
    assert "64 of 256 slots, top-8, router skew 0.0: 0.2" in out
