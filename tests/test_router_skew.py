"""The skewed-router option of the e2e checkpoint builder, on the CPU."""

from __future__ import annotations

import pytest
import torch

from tools.vllm.make_moe_checkpoint import main, shapes
from tools.vllm.router_skew import estimate_hit_rate, lru_hit_rate, skew_router_, zipf_scales


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
