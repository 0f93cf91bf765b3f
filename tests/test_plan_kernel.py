"""The fused planner (``plan_kernel``) run on the CPU by Triton's interpreter, pass by pass
against the torch planner (``tests/plan_kernel_checks.py``), under both victim policies; and
each seeded bug of the kernel caught."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from triton_interpreter import interpreted as run_interpreted

CHECKS = Path(__file__).resolve().parent / "plan_kernel_checks.py"


def interpreted(*args: str) -> subprocess.CompletedProcess[str]:
    return run_interpreted(CHECKS, *args)


@pytest.mark.parametrize(
    "args", [["--policy", "lru"], ["--policy", "lfu"], ["--policy", "lfu", "--count-max", "15"]]
)
def test_the_fused_planner_is_the_torch_planner(args: list[str]) -> None:
    done = interpreted(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("ok: ")


def test_prompt_sized_steps_loop_over_blocks_of_entries() -> None:
    # Steps of up to 400 rows (1,600 routing entries): the kernel's wide block and its loop
    # over more than one block, which decode-sized steps never reach.
    args = ["--experts", "64", "--capacity", "16", "--max-rows", "400", "--steps", "12"]
    done = interpreted(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("ok: ")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_gpt_oss_shapes_at_half_its_experts(policy: str) -> None:
    # gpt-oss-20b's 32 experts at 16 slots (the half, docs/GPT_OSS.md): an 8-token prompt's 32
    # entries in two passes; steps of up to 8 rows.
    args = ["--policy", policy, "--experts", "32", "--capacity", "16", "--max-rows", "8"]
    done = interpreted(*args, "--steps", "100")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("ok: ")


@pytest.mark.parametrize(
    ("mutant", "policy", "symptom"),
    [
        (1, "lru", "resident"),  # a selected expert's slot may be taken
        (4, "lru", "stamps"),  # hits keep their old stamps
        (5, "lru", "resident"),  # the step exposed in id order
        (7, "lfu", "resident"),  # counts kept but never read: victims by recency
        (8, "lfu", "counts"),  # counts never halved, only saturated
    ],
)
def test_each_seeded_bug_of_the_planner_is_caught(mutant: int, policy: str, symptom: str) -> None:
    done = interpreted("--policy", policy, "--mutant", str(mutant))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    assert last.startswith("FAILED:") and f": {symptom}:" in last, last


def test_the_planner_takes_the_step_sizes_unspecialized() -> None:
    # Triton ignores a misspelled name in do_not_specialize; the interpreter cannot tell.
    from rowcache.device_plan.triton_kernels import plan_kernel

    names = [p.name for p in plan_kernel.params if p.do_not_specialize]
    assert names == ["n_ids", "count_max", "pass_index", "num_passes"]
