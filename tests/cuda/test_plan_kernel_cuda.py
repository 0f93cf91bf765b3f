"""The fused planner on the GPU, pass by pass against the torch planner on the same device
(``tests/plan_kernel_checks.py``), under both victim policies, and each seeded bug of the
kernel caught (the CPU runs the same checks under Triton's interpreter:
``tests/test_plan_kernel.py``)."""

from __future__ import annotations

import plan_kernel_checks as checks
import pytest


@pytest.mark.parametrize(
    "args", [["--policy", "lru"], ["--policy", "lfu"], ["--policy", "lfu", "--count-max", "15"]]
)
def test_the_fused_planner_is_the_torch_planner(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert checks.main([*args, "--steps", "400", "--experts", "64", "--capacity", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok: ")


@pytest.mark.gpu_mutant
@pytest.mark.parametrize(("mutant", "policy"), [(1, "lru"), (4, "lru"), (7, "lfu"), (8, "lfu")])
def test_each_seeded_bug_of_the_planner_is_caught(
    mutant: int, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert checks.main(["--policy", policy, "--mutant", str(mutant)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAILED:")
