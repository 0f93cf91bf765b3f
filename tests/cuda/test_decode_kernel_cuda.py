"""The Triton decode of bf16 planes into slots on the GPU: the cases of
``tests/decode_kernel_checks.py`` (exact against the reference decode, nothing written outside
the listed slots or past the miss count), with the planes in device memory and in pinned host
memory read through unified addressing (as the device planner's gather reads its sources),
and each seeded bug of the kernel caught."""

from __future__ import annotations

import decode_kernel_checks as checks
import pytest
import torch


@pytest.mark.parametrize("where", ["device", "pinned_host"])
def test_the_kernel_decodes_every_case_exactly(where: str) -> None:
    failures = []
    for case in checks.cases():
        failures += checks.run_case(case, torch.device("cuda"), 0, pinned=where == "pinned_host")
    assert failures == []


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("mutant", [1, 2, 3, 4])
def test_each_seeded_bug_of_the_kernel_is_caught(mutant: int) -> None:
    failures = []
    for case in checks.cases():
        failures += checks.run_case(case, torch.device("cuda"), mutant)
    assert failures
