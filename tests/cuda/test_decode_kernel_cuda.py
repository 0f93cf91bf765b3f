"""The Triton decode of bf16 planes into slots on the GPU: the cases of
``tests/decode_kernel_checks.py`` (exact against the reference decode, nothing written outside
the listed slots or past the miss count), with the planes in device memory and in pinned host
memory read through unified addressing (as the device planner's gather reads its sources),
and each seeded bug of the kernel caught."""

from __future__ import annotations

import decode_kernel_checks as checks
import pytest
import torch


@pytest.mark.parametrize("one_miss", [False, True], ids=["miss_list", "one_miss"])
@pytest.mark.parametrize("where", ["device", "pinned_host"])
def test_the_kernel_decodes_every_case_exactly(where: str, one_miss: bool) -> None:
    # One miss a launch, from pinned host memory: the host planner's path.
    failures = []
    for case in checks.cases():
        pinned = where == "pinned_host"
        failures += checks.run_case(case, torch.device("cuda"), 0, pinned, one_miss)
    assert failures == []


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("mutant", [1, 2, 3, 4, 5])
def test_each_seeded_bug_of_the_kernel_is_caught(mutant: int) -> None:
    failures = []
    for case in checks.cases():
        failures += checks.run_case(case, torch.device("cuda"), mutant)
    assert failures


def test_an_encode_on_the_gpu_gives_the_planes_of_an_encode_on_the_host() -> None:
    # The provider encodes on its CUDA device (rowcache.sources); the planes must be the
    # host's, plane by plane, on every case, or a slot would decode to other bits.
    from rowcache.compress import encode
    from rowcache.sources import HELD_CODE_BITS, ExpertSources

    planes_fields = ("codebook", "sign_mantissa", "codes", "escape_starts", "escapes")
    for case in checks.cases():
        host = encode(case.weights, case.code_bits)
        gpu = encode(case.weights.to("cuda"), case.code_bits)
        assert gpu.code_bits == host.code_bits, case.name  # the same choice of width
        # A host tensor encoded on the GPU a group of experts at a time, into pinned planes.
        staged = encode(
            case.weights, case.code_bits, chunk_values=4096, work_device="cuda", pin_memory=True
        )
        assert staged.code_bits == host.code_bits, case.name
        for field in planes_fields:
            plane = getattr(staged, field)
            # An empty plane (no escapes) owns no memory, and torch reports no memory as not
            # pinned; nothing ever reads it.
            assert plane.numel() == 0 or plane.is_pinned(), (case.name, field)
            assert torch.equal(plane, getattr(host, field)), (case.name, field)
        for field in planes_fields:
            assert torch.equal(getattr(gpu, field).cpu(), getattr(host, field)), (case.name, field)
    w13 = next(c.weights for c in checks.cases() if c.name == "3-d experts")
    w2 = w13.flip(0).transpose(1, 2).contiguous()
    sources = ExpertSources(w13, w2, device="cuda", compress=True)
    for name, source in (("w13", w13), ("w2", w2)):
        held = sources.planes[name]
        want = encode(source, HELD_CODE_BITS)
        assert held.code_bits == want.code_bits
        for field in planes_fields:
            plane = getattr(held, field)
            assert plane.device.type == "cpu", (name, field)
            assert plane.numel() == 0 or plane.is_pinned(), (name, field)
            assert torch.equal(plane, getattr(want, field)), (name, field)
