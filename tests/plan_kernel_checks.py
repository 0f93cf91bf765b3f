"""The fused planner (``rowcache.device_plan.triton_kernels.plan_kernel``) against the torch
planner, pass by pass, on random steps: run as a script under ``TRITON_INTERPRET=1`` (Triton's
interpreter, on the CPU; ``tests/test_plan_kernel.py``), or on a GPU as it is.

    python tests/plan_kernel_checks.py [--policy lru|lfu] [--count-max N] [--mutant N]

Steps of 1 to 4 rows of up to 4 distinct experts of E, padding among them (with ``--max-rows``
above 4, prompt-sized steps whose later rows route to other experts: ``prompt_rows``), run in
as many passes as they need; after every pass every tensor of the cache state (maps, owners, stamps,
clock, request counts, miss list, counters) must be the torch planner's. Prints ``ok: N
passes`` (exit 0) or ``FAILED: <where>`` (exit 1)."""

from __future__ import annotations

import argparse
import random
import sys

import torch

from rowcache.device_plan.kernels import launch_plan
from rowcache.device_plan.passes import num_passes
from rowcache.device_plan.state import first_difference, new_state
from rowcache.device_plan.torch_planner import plan_pass


def prompt_rows(rng: random.Random, experts: int, count: int) -> list[list[int]]:
    """A prompt's routing: each row picks 4 experts from a window of 6 that moves through the
    experts with the row's position, so a step's later entries route to experts its earlier
    ones did not (the planner must read every block of entries, not only the first)."""
    width = min(6, experts)
    found = []
    for row in range(count):
        base = row * experts // count
        window = [(base + k) % experts for k in range(width)]
        found.append(rng.sample(window, min(4, width)))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", choices=["lru", "lfu"], default="lfu")
    ap.add_argument("--count-max", type=int, default=3)
    ap.add_argument("--mutant", type=int, default=0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=3)
    ap.add_argument(
        "--max-rows", type=int, default=4, help="rows a step has at most (a prompt's: hundreds)"
    )
    ns = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count_max = ns.count_max if ns.policy == "lfu" else 0
    e, c = ns.experts, ns.capacity
    reference = new_state(e, c, device, count_max)
    fused = new_state(e, c, device, count_max)
    rng = random.Random(0)
    done = 0
    for step in range(ns.steps):
        if ns.max_rows <= 4:
            rows = [
                rng.sample(range(e), rng.randint(1, min(4, e)))
                for _ in range(rng.randint(1, ns.max_rows))
            ]
        else:
            rows = prompt_rows(rng, e, rng.randint(1, ns.max_rows))
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [-1] * (width - len(r)) for r in rows], device=device)
        passes = num_passes(ids.numel(), e, c)
        for index in range(passes):
            plan_pass(reference, ids, index, passes)
            launch_plan(fused, ids, index, passes, ns.mutant)
            found = first_difference(reference, fused)
            if found is not None:
                print(f"FAILED: step {step} {ids.tolist()}, pass {index} of {passes}: {found}")
                return 1
            done += 1
    print(f"ok: {done} passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
