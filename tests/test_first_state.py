"""The cache's state at the first traced forward (tools/vllm/harness/first_state.py), on the
CPU over a real device-planned provider: the copy is taken before the forward's ``prepare``,
the replay's run from it sees that state (its plan and its slots' bytes) and the cache's own
state comes back after, whatever the run did; host-planned caches and layers without a cache
keep nothing; one layer keeps a copy. The replay line names the run's verdict or its error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_slot_watch import C, weights

from rowcache import RowCacheWeightProvider
from rowcache.device_plan.provider import DevicePlannedProvider
from tools.vllm.harness import first_state, probe_lines, trace


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "_SWITCH", {})
    monkeypatch.setattr(first_state, "_TAKEN", {"layers": 0})


class Experts:
    """Shaped as vLLM's ``RoutedExperts`` for the trace's hook: its forward prepares the cache
    for the step's ids and returns the first slot buffer's rows the map names, summed."""

    def __init__(self, provider: Any) -> None:
        self.quant_method = type("Method", (), {"rowcache_provider": provider})()

    def forward_modular(
        self, x: Any, topk_weights: Any, topk_ids: Any, shared: Any = None, inp: Any = None
    ) -> Any:
        provider = self.quant_method.rowcache_provider
        result = provider.prepare(topk_ids)
        slots = result.expert_map[topk_ids.long()].long()
        return x + provider.buf_w13[slots].sum((1, 2, 3))[:, None]


def device_provider() -> DevicePlannedProvider:
    return DevicePlannedProvider(**weights(), capacity=C, device="cpu")


def _prepare(provider: Any, rows: list[list[int]]) -> Any:
    with torch.inference_mode():
        return provider.prepare(torch.tensor(rows))


def _live(provider: Any) -> dict[str, torch.Tensor]:
    fields, slots = first_state._tensors(provider)
    return {**{f"state.{k}": t.clone() for k, t in fields.items()}, **slots}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_run_from_the_copy_sees_that_state_and_the_state_comes_back() -> None:
    provider = device_provider()
    layer = Experts(provider)
    _prepare(provider, [[0, 1], [2, 0]])
    before = {k: v.clone() for k, v in _live(provider).items()}
    assert first_state.take(layer) and first_state.kept(layer)
    first_map = _prepare(provider, [[3, 4], [5, 1]]).expert_map.clone()
    for step in ([[0, 5], [4, 3]], [[2, 3], [1, 0]]):
        _prepare(provider, step)
    after = {k: v.clone() for k, v in _live(provider).items()}
    assert not _equal(before, after)
    with first_state.restored(layer):
        assert _equal(_live(provider), before)
        # The same step from the same state: the same plan.
        assert torch.equal(_prepare(provider, [[3, 4], [5, 1]]).expert_map, first_map)
        provider.buf_w13.add_(1.0)  # whatever the block writes
    assert _equal(_live(provider), after)
    summary = first_state.summary(layer)
    assert summary is not None and list(summary) == list(first_state.SUMMARY_FIELDS)
    assert summary["resident"] == before["state.resident"].tolist()
    assert summary["owners"] == before["state.owners"].tolist()


def test_the_copy_holds_the_slots_bytes_as_they_were() -> None:
    provider = device_provider()
    layer = Experts(provider)
    _prepare(provider, [[0, 1], [2, 0]])
    slots = provider.buf_w2.clone()
    first_state.take(layer)
    provider.buf_w2.mul_(2.0)  # a slot's bytes change after the copy (a later copy lands)
    with first_state.restored(layer):
        assert torch.equal(provider.buf_w2, slots)
    assert torch.equal(provider.buf_w2, slots * 2.0)


def test_only_a_device_planned_cache_keeps_a_copy_and_only_one_layer() -> None:
    host = Experts(RowCacheWeightProvider(**weights(), capacity=C, device="cpu"))
    bare = Experts(None)
    assert not first_state.take(host) and not first_state.take(bare)
    assert first_state.summary(host) is None
    with pytest.raises(RuntimeError, match="kept no state"), first_state.restored(bare):
        pass
    first, second = Experts(device_provider()), Experts(device_provider())
    assert first_state.take(first)
    kept = first_state.summary(first)
    _prepare(first.quant_method.rowcache_provider, [[0, 1]])
    assert not first_state.take(first)  # no second copy over the first
    assert first_state.summary(first) == kept
    assert not first_state.take(second) and not first_state.kept(second)  # LAYERS_KEPT


def test_the_trace_takes_the_copy_before_its_first_forward_while_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Experts, "forward_modular", Experts.forward_modular)
    trace.install(Experts)
    provider = device_provider()
    layer = Experts(provider)
    x = torch.zeros(2, 1)

    def step(ids: list[list[int]]) -> None:
        with torch.inference_mode():
            layer.forward_modular(x, torch.ones(2, 2), torch.tensor(ids))

    step([[0, 1], [2, 0]])  # the profile run: the trace is off, nothing kept
    assert not first_state.kept(layer)
    before = provider.forward_map(), [int(v) for v in provider._state.owners.tolist()]
    assert trace.start(None)
    step([[3, 4], [5, 1]])  # the first forward while on: its copy is of the state before it
    step([[0, 5], [4, 3]])
    trace.stop(None)
    trace.uninstall(Experts)
    summary = first_state.summary(layer)
    assert summary is not None and summary["owners"] == before[1]
    assert provider.forward_map() != before[0]


def test_the_replay_line_names_the_run_from_the_first_state() -> None:
    fields = list(trace.FIELDS)

    def traced(out: int) -> dict[str, Any]:
        return {"fields": fields, "layers": {"l0": {"count": 1, "records": [[0, 8, 1, 2, 3, out]]}}}

    kept: dict[str, Any] = {"rows": 8, "x": 1, "ids": 2, "weights": 3}
    runs = {"cached_first": 200, "reference": 200, "cached_after": 200, "cached_from_start": 100}
    results: dict[str, Any] = {
        "p.row.eager": {
            "trace": traced(100),
            "replay": {"layers": {"l0": {**kept, **runs}}},
            "spec": {"compare_with": ["p.none.eager"]},
        },
        "p.none.eager": {"trace": traced(200)},
    }
    line = probe_lines.replay_line(results, "p", "row.eager")
    assert line is not None and line.endswith(
        "the cached forward after the kernel gives its bits; the cached forward from the "
        "cache's state at that forward does not give its bits"
    )
    layer = results["p.row.eager"]["replay"]["layers"]["l0"]
    del layer["cached_from_start"]
    layer["from_start_error"] = "RuntimeError: no"
    line = probe_lines.replay_line(results, "p", "row.eager")
    assert line is not None and line.endswith(
        "the cached forward after the kernel gives its bits; the run from the cache's state "
        "at that forward failed: RuntimeError: no"
    )
