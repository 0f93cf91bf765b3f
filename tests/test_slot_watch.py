"""The slot watch (tools/vllm/harness/slot_watch.py, ``e2e.py run --trace``) on the CPU: real
providers of both planners, their ``prepare`` wrapped; a correct cache counts every mapped
expert and finds none wrong, a slot corrupted between two calls is found at the next call that
maps it (by source tensor, with the forward's order number), and nothing counts with the
trace's switch off. The summary line names what it found."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rowcache import RowCacheWeightProvider
from rowcache.device_plan.provider import DevicePlannedProvider
from tools.vllm.harness import probe_lines, slot_watch, trace

E, C = 6, 3


@pytest.fixture(autouse=True)
def fresh_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "_SWITCH", {})
    for cls in slot_watch.targets():
        monkeypatch.setattr(cls, "prepare", cls.prepare)


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w13": torch.randn(E, 4, 3, generator=gen),
        "w2": torch.randn(E, 3, 2, generator=gen),
        "w13_bias": torch.randn(E, 4, generator=gen),
        "w2_bias": torch.randn(E, 3, generator=gen),
    }


PROVIDERS = {
    "device": lambda: DevicePlannedProvider(**weights(), capacity=C, device="cpu"),
    "host": lambda: RowCacheWeightProvider(**weights(), capacity=C, device="cpu"),
}


class Layer:
    def __init__(self, provider: Any) -> None:
        self.quant_method = type("Method", (), {"rowcache_provider": provider})()


class Model:
    def __init__(self, provider: Any) -> None:
        self.layer = Layer(provider)

    def named_modules(self) -> list[tuple[str, Any]]:
        return [("", self), ("layers.0.experts", self.layer)]


def _on(value: int) -> None:
    trace._switch(torch.device("cpu"))
    with torch.inference_mode():
        trace._SWITCH["on"].fill_(value)
        trace._SWITCH["seq"].add_(1)  # the next forward's order number
    trace._SWITCH["keep"] = bool(value)  # the host's copy, as trace.start and stop set it


def _prepare(provider: Any, rows: list[list[int]]) -> Any:
    with torch.inference_mode():
        return provider.prepare(torch.tensor(rows))


def test_a_row_digest_sees_each_rows_bits_and_their_places() -> None:
    rows = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(1))
    base = slot_watch._row_digests(rows)
    assert base.shape == (3,) and len(set(base.tolist())) == 3
    changed = rows.clone()
    changed.view(torch.int32)[1, 4, 1] ^= 1  # one bit of row 1
    after = slot_watch._row_digests(changed)
    assert after[1] != base[1] and after[0] == base[0] and after[2] == base[2]
    swapped = rows.clone()
    swapped[2, [0, 1]] = rows[2, [1, 0]]  # row 2's elements, other places
    assert slot_watch._row_digests(swapped)[2] != base[2]
    # The bytes, not the dtype: a uint8 view of the same rows digests alike.
    assert torch.equal(slot_watch._row_digests(rows.view(torch.uint8)), base)
    odd = torch.arange(3 * 7, dtype=torch.uint8).reshape(3, 7)  # 7-byte rows: byte words
    assert slot_watch._row_digests(odd).shape == (3,)
    assert torch.equal(rows, rows.clone())  # the digest wrote nothing


@pytest.mark.parametrize("kind", sorted(PROVIDERS))
def test_a_correct_cache_finds_every_slot_right(kind: str) -> None:
    slot_watch.install()
    provider = PROVIDERS[kind]()
    _on(1)
    mapped = 0
    maps = []
    for rows in ([[0, 1], [2, -1]], [[3, 1]], [[4, 5], [0, 5]]):
        result = _prepare(provider, rows)
        mapped += int((result.expert_map >= 0).sum())
        maps.append(result.expert_map.tolist())
    found = slot_watch.read(Model(provider))["layers"]["layers.0.experts"]
    assert found["maps"] == maps  # each call's map, in order
    assert found["prepares"] == 3 and found["mapped"] == mapped == 3 + 2 + 3
    assert found["bad_prepares"] == found["bad"] == 0 and found["first_bad"] == -1
    assert found["by_key"] == {"w13": 0, "w2": 0, "w13_bias": 0, "w2_bias": 0}


@pytest.mark.parametrize("kind", sorted(PROVIDERS))
def test_a_corrupted_slot_is_found_at_the_next_call_that_maps_it(kind: str) -> None:
    slot_watch.install()
    provider = PROVIDERS[kind]()
    _on(1)
    result = _prepare(provider, [[0, 1]])
    slot = int(result.expert_map[1])
    with torch.inference_mode():
        provider.buf_w2_bias[slot, 2] += 1.0  # one element of expert 1's bias
    _on(1)
    _prepare(provider, [[2, -1]])  # expert 1 not mapped: nothing wrong seen
    _on(1)
    _prepare(provider, [[1, 2]])  # a hit on expert 1: its slot read as it is
    found = slot_watch.read(Model(provider))["layers"]["layers.0.experts"]
    assert found["prepares"] == 3
    assert found["bad_prepares"] == 1 and found["bad"] == 1
    assert found["by_key"] == {"w13": 0, "w2": 0, "w13_bias": 0, "w2_bias": 1}
    assert found["first_bad"] == 3  # the third forward's order number


def test_nothing_counts_with_the_switch_off() -> None:
    slot_watch.install()
    provider = PROVIDERS["device"]()
    _on(0)
    result = _prepare(provider, [[0, 1]])
    with torch.inference_mode():
        provider.buf_w13[int(result.expert_map[0])] += 1.0
    _prepare(provider, [[0, 1]])
    found = slot_watch.read(Model(provider))["layers"]["layers.0.experts"]
    assert found["prepares"] == found["mapped"] == found["bad"] == 0
    assert found["first_bad"] == -1 and found["maps"] == []


def test_the_first_calls_maps_are_kept_and_later_ones_counted() -> None:
    slot_watch.install()
    provider = PROVIDERS["device"]()
    _on(1)
    maps = []
    for step in range(slot_watch.MAPS_KEPT + 3):
        result = _prepare(provider, [[step % E, (step + 2) % E]])
        maps.append(result.expert_map.tolist())
    found = slot_watch.read(Model(provider))["layers"]["layers.0.experts"]
    assert found["prepares"] == slot_watch.MAPS_KEPT + 3
    assert found["maps"] == maps[: slot_watch.MAPS_KEPT]


def test_an_eager_call_with_the_trace_off_skips_the_digests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slot_watch.install()
    provider = PROVIDERS["device"]()
    digested: list[int] = []
    own = slot_watch._row_digests

    def counting(rows: torch.Tensor) -> torch.Tensor:
        digested.append(int(rows.shape[0]))
        return own(rows)

    monkeypatch.setattr(slot_watch, "_row_digests", counting)
    _on(0)
    _prepare(provider, [[0, 1]])  # the first call reads the sources' digests, checks nothing
    sources = len(digested)
    assert sources > 0
    _prepare(provider, [[2, 1]])
    assert len(digested) == sources  # off and eager: nothing digested
    monkeypatch.setattr(trace, "_capturing", lambda: True)
    _prepare(provider, [[3, 1]])  # a capture checks (its replays count while on)
    assert len(digested) == sources + 4  # one digest of each of the four slot buffers
    monkeypatch.setattr(trace, "_capturing", lambda: False)
    _on(1)
    _prepare(provider, [[4, 1]])
    assert len(digested) == sources + 8
    found = slot_watch.read(Model(provider))["layers"]["layers.0.experts"]
    assert found["prepares"] == 1 and found["bad"] == 0


def test_install_wraps_once_and_uninstall_restores() -> None:
    own = DevicePlannedProvider.prepare
    slot_watch.install()
    wrapped = DevicePlannedProvider.prepare
    slot_watch.install()
    assert DevicePlannedProvider.prepare is wrapped is not own
    assert slot_watch.installed()
    slot_watch.uninstall()
    assert DevicePlannedProvider.prepare is own and not slot_watch.installed()


def test_the_summary_line_says_what_the_watch_found() -> None:
    clean = {"prepares": 48, "mapped": 200, "bad_prepares": 0, "bad": 0, "first_bad": -1}
    layers = {
        "model.layers.0.experts": {**clean, "by_key": {"w13": 0, "w2": 0}},
        "model.layers.1.experts": {**clean, "by_key": {"w13": 0, "w2": 0}},
    }
    results = {"p.row": {"slot_watch": {"layers": layers}}}
    line = probe_lines.slot_watch_line(results, "p", "row")
    assert line is not None
    assert "96 prepares in 2 layers, 400 mapped experts" in line
    assert line.endswith("every slot held its expert's bytes: met")
    bad = {**clean, "bad_prepares": 2, "bad": 3, "first_bad": 17}
    layers["model.layers.1.experts"] = {**bad, "by_key": {"w13": 3, "w2": 1}}
    line = probe_lines.slot_watch_line(results, "p", "row")
    assert line is not None
    assert "2 prepares mapped a slot without its expert's bytes" in line
    where = (
        "model.layers.1.experts (2 prepares, 3 experts; w13 3, w2 1; first at the trace's order "
        "number 17)"
    )
    assert where in line
    assert line.endswith("MISSED")
    assert probe_lines.slot_watch_line({"p.row": {}}, "p", "row") is None
    idle = {"prepares": 0, "mapped": 0, "bad_prepares": 0, "bad": 0, "first_bad": -1}
    unchecked = {"p.row": {"slot_watch": {"layers": {"l": {**idle, "by_key": {}}}}}}
    line = probe_lines.slot_watch_line(unchecked, "p", "row")
    assert line is not None and line.endswith("MISSED (nothing checked)")
    errored = {"p.row": {"slot_watch_error": "RuntimeError: boom"}}
    assert probe_lines.slot_watch_line(errored, "p", "row") == (
        "  slot watch of row: not read (RuntimeError: boom)"
    )


def test_a_first_prepare_inside_a_capture_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    slot_watch.install()
    provider = PROVIDERS["device"]()
    monkeypatch.setattr(trace, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="first prepare is being captured"):
        _prepare(provider, [[0, 1]])
    monkeypatch.setattr(trace, "_capturing", lambda: False)
    _prepare(provider, [[0, 1]])  # the digests read outside: later captures only check
    monkeypatch.setattr(trace, "_capturing", lambda: True)
    _prepare(provider, [[2, 1]])
