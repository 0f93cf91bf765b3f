"""ExpertSources and SlotBuffers: validation, pinning, allocation."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from rowcache.errors import InvalidInputError
from rowcache.sources import (
    SOURCE_NAMES,
    ExpertSources,
    allocate_slot_buffers,
    validate_capacity,
)

E = 5
CPU = torch.device("cpu")


def every_source(num_experts: int = E) -> dict[str, torch.Tensor]:
    return {
        "w13": torch.randn(num_experts, 6, 4),
        "w2": torch.randn(num_experts, 4, 3),
        "w13_scale": torch.ones(num_experts, 6, 1, dtype=torch.float16),
        "w2_scale": torch.ones(num_experts, 4, 1, dtype=torch.float16),
        "w13_scale_2": torch.ones(num_experts),
        "w2_scale_2": torch.ones(num_experts, 1),
        "w13_bias": torch.zeros(num_experts, 6),
        "w2_bias": torch.zeros(num_experts, 4, dtype=torch.bfloat16),
    }


def build(tensors: dict[str, torch.Tensor], device: torch.device | str = CPU) -> ExpertSources:
    return ExpertSources(**tensors, device=device)


def rejected(match: str) -> pytest.RaisesExc[InvalidInputError]:
    return pytest.raises(InvalidInputError, match=re.escape(match))


def test_every_source_copied_in_order_by_default() -> None:
    given = every_source()
    sources = build(given)
    assert sources.num_experts == E and not sources.shared
    for name, kept in zip(SOURCE_NAMES, sources.tensors(), strict=True):
        assert kept is not None and kept.is_contiguous(), name
        assert kept.untyped_storage().data_ptr() != given[name].untyped_storage().data_ptr()
        assert torch.equal(kept, given[name]), name
    given["w13"].fill_(5.0)  # the caller's write reaches no copy
    assert not torch.equal(sources.w13, given["w13"])
    assert sources.host_bytes == sum(t.nbytes for t in given.values())


def test_a_non_contiguous_source_is_copied_contiguous() -> None:
    given = every_source()
    given["w13"] = torch.randn(4, 6, E).permute(2, 1, 0)
    sources = build(given)
    assert sources.w13.is_contiguous() and torch.equal(sources.w13, given["w13"])


def test_shared_sources_are_the_callers_tensors() -> None:
    given = every_source()
    sources = ExpertSources(**given, device=CPU, share=True)
    assert sources.shared
    assert all(s is given[n] for s, n in zip(sources.tensors(), SOURCE_NAMES, strict=True))


def test_share_is_checked() -> None:
    with rejected("share_sources must be a bool, got 1 (int)"):
        ExpertSources(**every_source(), device=CPU, share=1)  # type: ignore[arg-type]
    with rejected("share_sources=True cannot be combined with layout='packed'"):
        ExpertSources(**every_source(), device=CPU, layout="packed", share=True)


def test_expert_bytes_is_one_row_of_every_source() -> None:
    given = every_source()
    assert build(given).expert_bytes == sum(t[0].nbytes for t in given.values())
    two = ExpertSources(given["w13"], given["w2"], device=CPU)
    assert two.expert_bytes == given["w13"][0].nbytes + given["w2"][0].nbytes
    packed = ExpertSources(**given, device=CPU, layout="packed")
    assert packed.pack is not None and packed.expert_bytes == packed.pack[1]


def test_optional_sources_absent() -> None:
    given = every_source()
    sources = ExpertSources(given["w13"], given["w2"], device=CPU)
    assert sources.tensors()[2:] == (None,) * 6
    assert sources.host_bytes == given["w13"].nbytes + given["w2"].nbytes


def test_host_bytes_counts_every_source() -> None:
    given = every_source()
    assert build(given).host_bytes == sum(t.nbytes for t in given.values())


def test_host_bytes_are_the_sources_own_in_a_shared_slab() -> None:
    # Pinned sources are views of the arena's slabs, which other layers' sources share: each
    # layer counts its own bytes, not the slab's (24 gpt-oss layers reported 65.5 GB of host
    # memory for 10.2 GB of rows on the H200).
    slab = torch.zeros(4096, dtype=torch.float32)
    w13, w2 = slab[: E * 24].view(E, 6, 4), slab[1024 : 1024 + E * 12].view(E, 4, 3)
    sources = ExpertSources(w13, w2, device=CPU, share=True)
    assert sources.host_bytes == w13.nbytes + w2.nbytes
    packed = ExpertSources(**every_source(), device=CPU, layout="packed")
    assert packed.pack is not None and packed.host_bytes == E * packed.pack[1]


@pytest.mark.parametrize(
    ("present", "missing"), [("w13_scale_2", "w2_scale_2"), ("w2_scale_2", "w13_scale_2")]
)
def test_scale_2_must_come_together(present: str, missing: str) -> None:
    given = every_source()
    del given[missing]
    with rejected(f"{present} was given without {missing}"):
        build(given)


def test_expert_counts_must_agree_and_each_is_named() -> None:
    given = every_source()
    given["w2_scale"] = torch.ones(E + 1, 4, 1)
    given["w13_scale_2"] = torch.ones(E - 1)
    with rejected(
        f"w13 has E={E}, w2 has E={E}, w13_scale has E={E}, w2_scale has E={E + 1}, "
        f"w13_scale_2 has E={E - 1}, w2_scale_2 has E={E}"
    ):
        build(given)


def test_sources_must_be_on_cpu_and_the_device_is_named() -> None:
    given = every_source()
    given["w2_scale"] = torch.empty(E, 4, 1, device="meta")
    with rejected("expert sources must be on the CPU (host memory): w2_scale is on meta"):
        build(given)


def test_zero_dim_and_non_tensor_rejected() -> None:
    given = every_source()
    given["w13_scale_2"] = torch.tensor(1.0)
    with rejected("w13_scale_2 must be expert-major [E, ...], got a 0-dim tensor"):
        build(given)
    with rejected("w2 must be a torch.Tensor, got list"):
        ExpertSources(torch.ones(E, 1), [[1.0]] * E, device=CPU)  # type: ignore[arg-type]
    with rejected("w13 is required, got None"):
        ExpertSources(None, torch.ones(E, 1), device=CPU)  # type: ignore[arg-type]


def test_no_experts_rejected() -> None:
    with rejected("expert sources hold no experts (E=0)"):
        build(every_source(0))


class FakePinning:
    """Stands in for pinned memory on a CPU-only build: records what was pinned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import rowcache.pinned

        self.pinned: set[int] = set()
        self.ranges: list[tuple[int, int]] = []
        """Blocks allocated pinned (start, end): a view into one is pinned too."""
        self.pin_calls = 0
        fake = self
        monkeypatch.setattr(rowcache.pinned, "_ARENA", None)  # a fresh arena, over fakes

        def is_pinned(t: torch.Tensor) -> bool:
            ptr = t.data_ptr()
            return ptr in fake.pinned or any(a <= ptr < b for a, b in fake.ranges)

        def pin_memory(t: torch.Tensor) -> torch.Tensor:
            fake.pin_calls += 1
            copy = t.clone()
            fake.pinned.add(copy.data_ptr())
            return copy

        real_empty = torch.empty

        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            t = real_empty(*args, **kwargs)
            if pin_memory:
                fake.pin_calls += 1
                fake.pinned.add(t.data_ptr())
                fake.ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
            return t

        monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch, "empty", empty)


def test_cuda_target_copies_every_source_into_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakePinning(monkeypatch)
    given = every_source()
    fake.pinned.add(given["w13"].data_ptr())  # already pinned: copied all the same
    sources = build(given, device="cuda")
    assert fake.pin_calls == 1  # one slab of the arena holds them all (rowcache.pinned)
    for name, kept in zip(SOURCE_NAMES, sources.tensors(), strict=True):
        assert kept is not None and kept.is_pinned(), name
        assert kept.data_ptr() != given[name].data_ptr(), name
        assert torch.equal(kept, given[name])


def test_cuda_target_shares_pinned_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePinning(monkeypatch)
    given = every_source()
    fake.pinned.update(t.data_ptr() for t in given.values())
    sources = ExpertSources(**given, device="cuda", share=True)
    assert fake.pin_calls == 0
    assert all(s is given[n] for s, n in zip(sources.tensors(), SOURCE_NAMES, strict=True))


def test_cuda_target_does_not_share_unpinned_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePinning(monkeypatch)
    given = every_source()
    fake.pinned.update(t.data_ptr() for n, t in given.items() if n not in ("w2", "w2_scale_2"))
    with rejected("share_sources=True on cuda needs pinned sources, and w2, w2_scale_2 are not"):
        ExpertSources(**given, device="cuda", share=True)
    assert fake.pin_calls == 0


def test_cpu_target_never_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePinning(monkeypatch)
    given = every_source()
    build(given)
    assert fake.pin_calls == 0


def test_rejected_sources_are_never_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePinning(monkeypatch)
    given = every_source()
    given["w2"] = torch.ones(E + 1, 1)
    with rejected("disagree on the number of experts"):
        build(given, device="cuda")
    assert fake.pin_calls == 0


# -- slot buffers ----------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_slot_buffers_shape_dtype_device(device: str) -> None:
    given = every_source()
    # Sources stay on the CPU whatever the target; only the buffers go there.
    sources = build(given, device=device)
    buffers = allocate_slot_buffers(sources, 3, device)
    for name, buf in zip(SOURCE_NAMES, buffers.tensors(), strict=True):
        src = given[name]
        assert buf is not None
        assert buf.shape == (3, *src.shape[1:]), name
        assert buf.dtype == src.dtype and buf.device.type == device
    assert buffers.capacity == 3
    assert buffers.slot_bytes == sum(3 * t[0].nbytes for t in given.values())


def test_absent_sources_have_no_buffers() -> None:
    given = every_source()
    buffers = allocate_slot_buffers(ExpertSources(given["w13"], given["w2"], device=CPU), 2, CPU)
    assert buffers.tensors()[2:] == (None,) * 6
    assert buffers.slot_bytes == 2 * (given["w13"][0].nbytes + given["w2"][0].nbytes)


@pytest.mark.parametrize("capacity", [0, -1, E + 1])
def test_capacity_out_of_range_names_both_values(capacity: int) -> None:
    with rejected(f"got capacity={capacity} with num_experts={E}"):
        allocate_slot_buffers(build(every_source()), capacity, CPU)


@pytest.mark.parametrize("capacity", [True, 2.0, "2", None])
def test_capacity_must_be_an_int(capacity: object) -> None:
    with rejected("capacity must be an int"):
        validate_capacity(capacity, E)


def test_capacity_equal_to_num_experts_allowed() -> None:
    assert validate_capacity(E, E) == E


def test_slots_must_be_on_the_device_the_sources_were_prepared_for() -> None:
    with rejected("slot buffers requested on meta but the sources were prepared for cpu"):
        allocate_slot_buffers(build(every_source()), 2, "meta")
