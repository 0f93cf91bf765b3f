"""Sources held as bf16 planes (``ExpertSources(compress=True)``) behind the device planner on
the CPU: slots hold every bit of the source experts, the host holds about three quarters of the
bytes, the audit decodes, a wrong decode is caught, and settings the format cannot take are
refused with the value and the limit, before anything is built. (The lockstep of
``tests/test_device_planner.py`` drives the same provider through random steps; the GPU's decode
is ``tests/cuda/test_decode_kernel_cuda.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import rowcache.device_plan.kernels as kernels
from rowcache import DevicePlannedProvider, InvalidInputError, RowCacheWeightProvider
from rowcache.compress import decode_experts
from rowcache.device_plan.forward import run_passes_unreduced
from rowcache.sources import ExpertSources

E, H, INTER, C = 8, 256, 96, 3


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w13": (torch.randn(E, 2 * INTER, H, generator=gen) * 0.02).to(torch.bfloat16),
        "w2": (torch.randn(E, H, INTER, generator=gen) * 0.02).to(torch.bfloat16),
        "w13_scale": torch.rand(E, 2, generator=gen),
        "w2_scale": torch.rand(E, 1, generator=gen),
    }


def provider(seed: int = 0, **kwargs: Any) -> DevicePlannedProvider:
    built = RowCacheWeightProvider(
        **weights(seed), capacity=C, device="cpu", planner="device", compress=True, **kwargs
    )
    assert isinstance(built, DevicePlannedProvider)
    return built


def steps(p: DevicePlannedProvider, routes: list[list[int]]) -> None:
    for route in routes:
        ids = torch.tensor([route])
        total = p.num_passes(ids)
        for index in range(total):
            p.prepare(ids, pass_index=index, passes=total)


def test_slots_hold_every_bit_and_the_host_holds_less_than_three_quarters() -> None:
    w = weights()
    p = provider()
    plain = RowCacheWeightProvider(**w, capacity=C, device="cpu", planner="device")
    routes = [[0, 5], [3, 1], [7, 5], [2, 6, 4, 0]]
    steps(p, routes)
    steps(plain, routes)  # type: ignore[arg-type]
    assert p.slot_mismatches(p.resident_experts()) == []
    for expert, slot in p.resident_experts().items():
        assert torch.equal(p.buf_w13[slot].view(torch.int16), w["w13"][expert].view(torch.int16))
        assert torch.equal(p.buf_w2[slot].view(torch.int16), w["w2"][expert].view(torch.int16))
        assert torch.equal(p.buf_w13_scale[slot], w["w13_scale"][expert])  # type: ignore[index]
    raw = sum(t.numel() * t.element_size() for t in w.values())
    assert plain.stats()["host_bytes"] == raw
    weights_bytes = raw - sum(w[n].numel() * 4 for n in ("w13_scale", "w2_scale"))
    saved = raw - p.stats()["host_bytes"]
    # The encoder's width (3 bits on these Gaussian weights: 0.70 of the bytes, plus the
    # codebook and the escapes' starts) saves about 0.30 of the weights' bytes.
    assert {p._sources.planes[n].code_bits for n in ("w13", "w2")} == {3}
    assert 0.29 * weights_bytes < saved < 0.31 * weights_bytes
    assert p.stats()["slot_bytes"] == plain.stats()["slot_bytes"]
    for name in ("misses", "hits", "evictions", "last_copy_bytes"):
        assert p.stats()[name] == plain.stats()[name], name
    assert p.resident_experts() == plain.resident_experts()


def test_the_exact_route_over_compressed_slots_equals_one_call() -> None:
    """A step of more experts than slots, through the exact route: the same bits as one call
    over the uncompressed experts."""
    w = weights(1)
    p = provider(1)
    x = torch.randn(2, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1, 2], [5, 6, 7]])

    def entries(w13: torch.Tensor, w2: torch.Tensor, lookup: Any) -> torch.Tensor:
        out = torch.zeros(2, 3, H, dtype=torch.bfloat16)
        for t in range(2):
            for j, e in enumerate(ids[t].tolist()):
                slot = lookup(e)
                if slot is not None:
                    gate, up = (x[t] @ w13[slot].t()).chunk(2)
                    out[t, j] = (torch.nn.functional.silu(gate) * up) @ w2[slot].t()
        return out

    def reduce(part: torch.Tensor, output: torch.Tensor) -> None:
        torch.sum(part, dim=1, out=output)

    def run(result: Any, rows: slice, shared: bool) -> torch.Tensor:
        table = result.expert_map.tolist()
        return entries(result.w1, result.w2, lambda e: table[e] if table[e] >= 0 else None)

    got = run_passes_unreduced(p, ids, run, reduce)
    assert p.num_passes(ids) > 1
    expected = torch.empty(2, H, dtype=torch.bfloat16)
    reduce(entries(w["w13"], w["w2"], lambda e: e), expected)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_a_wrong_decode_is_caught_by_the_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded decode that drops the sign of every value: the slots' audit
    (``slot_mismatches``, the check ``rowcache_slot_check`` runs in a server) names them."""

    def signless(planes: Any, experts: Any) -> torch.Tensor:
        decoded = decode_experts(planes, experts)
        return (decoded.view(torch.int16) & 0x7FFF).view(torch.bfloat16)

    p = provider()
    monkeypatch.setattr(kernels, "decode_experts", signless)
    steps(p, [[0, 5]])
    assert sorted(p.slot_mismatches(p.resident_experts())) == [
        "expert 0 slot 0: w13",
        "expert 0 slot 0: w2",
        "expert 5 slot 1: w13",
        "expert 5 slot 1: w2",
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layout": "packed"}, "which take layout='separate', got layout='packed'"),
        ({"compress": "yes"}, "compress must be a bool, got 'yes' (str)"),
    ],
)
def test_settings_the_format_cannot_take_are_refused(change: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"compress": True, **change}
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RowCacheWeightProvider(**weights(), capacity=C, device="cpu", planner="device", **args)


def test_shared_sources_keep_the_scales_and_encode_the_weights() -> None:
    """With ``share_sources`` the scales are the caller's tensors (an in-place write reaches a
    later miss, as for every shared source) and w13 and w2 are planes of their own."""
    w = weights()
    sources = ExpertSources(**w, device="cpu", share=True, compress=True)
    assert sources.tensors()[2] is w["w13_scale"]
    assert set(sources.planes) == {"w13", "w2"}
    w["w13"].zero_()  # the caller's copy no longer matters
    assert not torch.equal(decode_experts(sources.planes["w13"], [0])[0], w["w13"][0])


def test_experts_that_are_not_bf16_are_refused() -> None:
    w = weights()
    w["w2"] = w["w2"].float()
    before = w["w2"].clone()
    with pytest.raises(InvalidInputError, match=r"w2 is torch\.float32"):
        ExpertSources(**w, device="cpu", compress=True)
    assert torch.equal(w["w2"], before)


def test_nothing_copies_from_the_stand_ins() -> None:
    """The compressed sources' ``tensors()`` are ``meta`` stand-ins: shape and dtype for the
    slots, and an error, not silent bytes, for anything that would copy from them."""
    sources = ExpertSources(**weights(), device="cpu", compress=True)
    w13 = sources.tensors()[0]
    assert w13 is not None and w13.device.type == "meta" and w13.shape == (E, 2 * INTER, H)
    assert sources.copied()[:2] == (None, None)
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.empty(2 * INTER, H, dtype=torch.bfloat16).copy_(w13[0])


def test_the_whole_expert_set_as_the_slots_hold_it() -> None:
    """``source_weights``: the planes decoded (every bit of the source), the other sources as
    they are; ``compressed`` names the sources held as planes."""
    given = weights(3)
    p = provider(3)
    assert p.compressed == ("w13", "w2")
    for name, want in given.items():
        got = p.source_weights(name, "cpu")
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    plain = RowCacheWeightProvider(**given, capacity=C, device="cpu", planner="device")
    assert plain.compressed == ()
    assert torch.equal(plain.source_weights("w2", "cpu"), given["w2"])
    with pytest.raises(InvalidInputError, match="unknown source 'w3'; sources: w13, w2"):
        p.source_weights("w3", "cpu")
    with pytest.raises(InvalidInputError, match="these sources hold no w13_bias"):
        p.source_weights("w13_bias", "cpu")
