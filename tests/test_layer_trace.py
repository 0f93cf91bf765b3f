"""The layer trace (tools/vllm/harness/trace.py, ``e2e.py run --trace``) on the CPU: the
digest, the hook on a class shaped as vLLM's ``RoutedExperts``, the switch, the buffer, the
comparison of two engines' traces and its summary line, each shown to catch a seeded change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tools.vllm.harness import probe_lines, trace


@pytest.fixture(autouse=True)
def fresh_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "_SWITCH", {})


def test_the_digest_sees_every_bit_and_its_place() -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert int(trace.digest(x)) == int(trace.digest(x.clone()))
    assert int(trace.digest(x)) == int(trace.digest(x.t().contiguous().t()))  # same values
    changed = x.clone()
    changed.view(torch.int16)[2, 3] ^= 1  # one bit
    assert int(trace.digest(changed)) != int(trace.digest(x))
    swapped = x.clone()
    swapped[[0, 1]] = x[[1, 0]]  # the same elements, other places
    assert int(trace.digest(swapped)) != int(trace.digest(x))
    zero = torch.zeros(3)
    assert int(trace.digest(zero)) != int(trace.digest(-zero))  # signed zeros are bits
    ids = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    assert int(trace.digest(ids)) != int(trace.digest(ids.flip(1)))
    assert int(trace.digest(ids.long())) == int(trace.digest(ids))  # the values, not the width
    wide = ids.long()
    trace.digest(wide)
    assert torch.equal(wide, ids.long())  # an int64 tensor's digest works on a copy


class Experts:
    """vLLM's ``RoutedExperts`` reduced to its ``forward_modular``: the output from the input,
    routes and weights (``scale`` stands for what the layer computes)."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: Any = None,
    ) -> torch.Tensor:
        return x * self.scale + topk_weights.sum(1, keepdim=True) + topk_ids.sum(1, keepdim=True)


class Model:
    def __init__(self, layers: list[Experts]) -> None:
        self.layers = layers

    def named_modules(self) -> list[tuple[str, Any]]:
        return [("", self), *((f"layers.{i}", layer) for i, layer in enumerate(self.layers))]


def _step(model: Model, rows: int, seed: int, ids_of: dict[int, torch.Tensor] | None = None):
    """One step through every layer, each layer's output the next one's input."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g)
    for index, layer in enumerate(model.layers):
        ids = torch.randint(0, 8, (rows, 2), generator=g)
        if ids_of and index in ids_of:
            ids = ids_of[index]
        weights = torch.rand(rows, 2, generator=g)
        x = layer.forward_modular(x, weights, ids)


def _traced(monkeypatch: pytest.MonkeyPatch, scales: list[float], steps: list[Any]) -> Any:
    monkeypatch.setattr(Experts, "forward_modular", Experts.forward_modular)
    trace.install(Experts)
    model = Model([Experts(s) for s in scales])
    # vLLM runs its forwards in inference mode (the buffers are inference tensors) and the
    # switch through llm.apply_model, outside it.
    with torch.inference_mode():
        _step(model, 8, seed=99)  # the profile run: buffers made, nothing kept (trace off)
    assert trace.start(model)
    with torch.inference_mode():
        for step in steps:
            step(model)
    assert trace.stop(model)
    with torch.inference_mode():
        _step(model, 8, seed=98)  # after the first generation: not kept
    found = trace.read(model)
    trace.uninstall(Experts)
    return found


def test_the_trace_keeps_each_layers_forwards_while_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Experts, "forward_modular", Experts.forward_modular)
    own = Experts.forward_modular
    assert not trace.start(None)  # no traced forward yet: nothing to turn on
    trace.install(Experts)
    wrapped = Experts.forward_modular
    trace.install(Experts)  # a second call changes nothing
    assert trace.installed(Experts) and Experts.forward_modular is wrapped
    trace.uninstall(Experts)
    assert not trace.installed(Experts) and Experts.forward_modular is own

    steps = [lambda m: _step(m, 1, seed=1), lambda m: _step(m, 3, seed=2)]
    found = _traced(monkeypatch, [1.0, 2.0], steps)
    assert found["fields"] == list(trace.FIELDS)
    layers = found["layers"]
    assert list(layers) == ["layers.0", "layers.1"]
    for index, name in enumerate(layers):
        assert layers[name]["count"] == 2
        seq = [r[0] for r in layers[name]["records"]]
        rows = [r[1] for r in layers[name]["records"]]
        assert seq == [index, 2 + index] and rows == [1, 3]  # the order they ran in
    # A second trace of the same steps keeps the same digests.
    again = _traced(monkeypatch, [1.0, 2.0], steps)
    assert trace.first_divergence(found, again)["first"] is None


def test_a_layer_past_its_capacity_counts_without_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "CAPACITY", 2)
    found = _traced(monkeypatch, [1.0], [lambda m, s=s: _step(m, 1, seed=s) for s in range(5)])
    layer = found["layers"]["layers.0"]
    assert layer["count"] == 5 and len(layer["records"]) == 2
    assert [r[0] for r in layer["records"]] == [0, 1]  # the first two, not the last


def test_a_first_forward_inside_a_capture_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Experts, "forward_modular", Experts.forward_modular)
    monkeypatch.setattr(trace, "_capturing", lambda: True)
    trace.install(Experts)
    with pytest.raises(RuntimeError, match="first forward is being captured"):
        _step(Model([Experts()]), 1, seed=0)


@pytest.mark.parametrize("change", ["none", "output", "input", "first input", "routes", "count"])
def test_first_divergence_names_where_two_engines_part(
    monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Seeded: layer 1 computes otherwise (its output first differs, then layer 2's input,
    and layer 0's input a step later);
    layer 0's input differs; layer 2's router picks other ids; an engine runs a forward more.
    In each, the first divergence in the order the forwards ran, and the summary line."""
    steps = [lambda m, s=s: _step(m, 2, seed=s) for s in range(3)]
    ours = _traced(monkeypatch, [1.0, 2.0, 3.0], steps)
    scales, their_steps = [1.0, 2.0, 3.0], list(steps)
    if change == "output":
        # Layer 1 computes otherwise from the first step on; layer 0's input of the second
        # step differs too (as a token would): the first in the order they ran is layer 1's.
        scales = [1.0, 2.5, 3.0]
        their_steps[1] = lambda m: _step(m, 2, seed=7)
    elif change == "input":
        their_steps[1] = lambda m: _step(m, 2, seed=7)
    elif change == "first input":
        their_steps[0] = lambda m: _step(m, 2, seed=7)
    elif change == "routes":
        fixed = torch.zeros(2, 2, dtype=torch.int64)
        their_steps[2] = lambda m: _step(m, 2, seed=2, ids_of={2: fixed})
    elif change == "count":
        their_steps.append(lambda m: _step(m, 2, seed=3))
    theirs = _traced(monkeypatch, scales, their_steps)
    found = trace.first_divergence(ours, theirs)
    assert found["layers"] == 3
    results = {
        "p.row.full": {"trace": ours, "spec": {"compare_with": ["p.none.full"]}},
        "p.none.full": {"trace": theirs},
    }
    line = probe_lines.trace_line(results, "p", "row.full")
    assert line is not None
    assert line.startswith("  layer trace of row.full against none.full (the first generation, ")
    first = found["first"]
    if change in ("none", "count"):
        assert first is None and line.endswith(
            ": every digest identical"
            + ("; forward counts differ in 3 layers" if change == "count" else "")
        )
        assert found["mismatched"] == (
            {} if change == "none" else {f"layers.{i}": [3, 4] for i in range(3)}
        )
        return
    if change == "output":
        before = {"layer": "layers.0", "index": 0}
        assert first == {
            "layer": "layers.1",
            "index": 0,
            "rows": 2,
            "differ": ["out"],
            "before": before,
        }
        assert line.endswith(
            "forward 0 (2 rows): its input and routes agree, its output differs (the MoE op)"
        )
    elif change == "input":
        assert first["layer"] == "layers.0" and first["index"] == 1 and "x" in first["differ"]
        assert first["before"] == {"layer": "layers.2", "index": 0}  # the step before's last
        assert line.endswith(
            "its input differs, after layers.2 forward 0 agreed (the difference arose between "
            "that output and this input: attention, norms, or the token sampled)"
        )
    elif change == "first input":
        assert first["layer"] == "layers.0" and first["index"] == 0 and "before" not in first
        assert line.endswith(
            "its input differs at the generation's first MoE forward (the embedding, the first "
            "attention or norms)"
        )
    else:
        assert first["layer"] == "layers.2" and first["index"] == 2
        assert first["differ"] == ["ids", "out"]
        assert line.endswith("its input agrees, the router's ids differ")
    assert probe_lines.trace_line({"p.row.full": {"spec": {}}}, "p", "row.full") is None


def test_a_trace_that_kept_nothing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traces whose switch never came on (no forward while it was on) compare nothing, and the
    line says so rather than "identical"."""
    empty = _traced(monkeypatch, [1.0, 2.0], [])
    assert all(layer["count"] == 0 for layer in empty["layers"].values())
    results = {
        "p.row.full": {"trace": empty, "spec": {"compare_with": ["p.none.full"]}},
        "p.none.full": {"trace": empty},
    }
    line = probe_lines.trace_line(results, "p", "row.full")
    assert line == (
        "  layer trace of row.full against none.full (the first generation, 0 forwards in 2 "
        "layers): nothing to compare (no forward ran while the trace was on)"
    )


def test_the_trace_keeps_each_layers_first_input_while_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer keeps the hidden states, ids and weights of its first forward while the trace
    is on (the replay's input, harness/replay.py): not the profile run's before, not the later
    forwards'; their digests are the trace's digests of that forward."""
    monkeypatch.setattr(Experts, "forward_modular", Experts.forward_modular)
    trace.install(Experts)
    model = Model([Experts(1.0), Experts(2.0)])
    with torch.inference_mode():
        _step(model, 8, seed=99)  # before start: nothing kept
    assert all(trace.kept_inputs(layer) is None for layer in model.layers)
    assert trace.start(model)
    with torch.inference_mode():
        _step(model, 3, seed=1)
        _step(model, 5, seed=2)
    trace.stop(model)
    found = trace.read(model)
    trace.uninstall(Experts)
    fields = found["fields"]
    for index, layer in enumerate(model.layers):
        kept = trace.kept_inputs(layer)
        assert kept is not None and kept[0].shape[0] == 3
        first = found["layers"][f"layers.{index}"]["records"][0]
        for tensor, field in zip(kept, ("x", "ids", "weights"), strict=True):
            assert int(trace.digest(tensor)) == first[fields.index(field)]


def test_the_replay_line_sets_each_run_beside_no_offloads_output() -> None:
    """probe_lines.replay_line: where the trace's first difference is a layer's forward 0 with
    its input and routes agreeing, each replayed run's output digest against no offload's
    output of that forward; an input kept from another forward is said to be one; no line
    where the trace parts elsewhere."""
    fields = list(trace.FIELDS)

    def traced(out: int) -> dict[str, Any]:
        return {
            "fields": fields,
            "layers": {"l0": {"count": 1, "records": [[0, 8, 11, 12, 13, out]]}},
        }

    kept = {"rows": 8, "x": 11, "ids": 12, "weights": 13}
    runs = {"cached_first": 100, "reference": 200, "reference_poisoned": 300, "cached_after": 200}
    results: dict[str, Any] = {
        "p.row.full": {
            "trace": traced(100),
            "replay": {"layers": {"l0": {**kept, **runs}}},
            "spec": {"compare_with": ["p.none.full"]},
        },
        "p.none.full": {"trace": traced(200)},
    }
    line = probe_lines.replay_line(results, "p", "row.full")
    assert line == (
        "  replay of row.full's l0 forward 0 (8 rows), against none.full's output of it: "
        "vLLM's kernel over the cache's sources gives its bits; the cached forward on poisoned "
        "memory does not give its bits; the kernel again on poisoned memory does not give its "
        "bits; the cached forward after the kernel gives its bits"
    )
    # A record from before the kernel's second run names the three runs it has.
    del results["p.row.full"]["replay"]["layers"]["l0"]["reference_poisoned"]
    line = probe_lines.replay_line(results, "p", "row.full")
    assert (
        line is not None
        and "the kernel again" not in line
        and line.endswith("the cached forward after the kernel gives its bits")
    )
    results["p.row.full"]["replay"]["layers"]["l0"]["x"] = 99
    line = probe_lines.replay_line(results, "p", "row.full")
    assert line is not None and line.endswith(
        "is not that forward's (another forward ran first eagerly)"
    )
    del results["p.row.full"]["replay"]
    assert probe_lines.replay_line(results, "p", "row.full") == (
        "  replay of row.full's l0 forward 0 (8 rows): no input kept"
    )
    results["p.row.full"]["trace"] = traced(200)  # no difference: nothing to replay
    assert probe_lines.replay_line(results, "p", "row.full") is None
