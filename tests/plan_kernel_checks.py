"""The fused planner (``rowcache.device_plan.triton_kernels.plan_kernel``) against the torch
planner, pass by pass, on random steps: run as a script under ``TRITON_INTERPRET=1`` (Triton's
interpreter, on the CPU; ``tests/test_plan_kernel.py``), or on a GPU as it is.

    python tests/plan_kernel_checks.py [--policy lru|lfu] [--count-max N] [--mutant N]

Steps of 1 to 4 rows of up to 4 distinct experts of E, padding among them, run in as many
passes as they need; after every pass every tensor of the cache state (maps, owners, stamps,
clock, request counts, miss list, counters) must be the torch planner's. Prints ``ok: N
passes`` (exit 0) or ``FAILED: <where>`` (exit 1)."""

from __future__ import annotations

import argparse
import random
import sys

import torch

from rowcache.device_plan.kernels import launch_plan
from rowcache.device_plan.passes import num_passes
from rowcache.device_plan.state import DeviceCacheState, new_state
from rowcache.device_plan.torch_planner import plan_pass

COMPARED = (
    "resident",
    "owners",
    "stamps",
    "clock",
    "counts",
    "forward",
    "miss_experts",
    "miss_slots",
    "miss_count",
    "counters",
)


def first_difference(a: DeviceCacheState, b: DeviceCacheState) -> str | None:
    for name in COMPARED:
        x, y = getattr(a, name), getattr(b, name)
        if name in ("miss_experts", "miss_slots"):  # entries past the count are stale
            n = int(a.miss_count.item())
            x, y = x[:n], y[:n]
        if not torch.equal(x.to(torch.int64).cpu(), y.to(torch.int64).cpu()):
            return f"{name}: torch {x.tolist()}, fused {y.tolist()}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", choices=["lru", "lfu"], default="lfu")
    ap.add_argument("--count-max", type=int, default=3)
    ap.add_argument("--mutant", type=int, default=0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=3)
    ns = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count_max = ns.count_max if ns.policy == "lfu" else 0
    e, c = ns.experts, ns.capacity
    reference = new_state(e, c, device, count_max)
    fused = new_state(e, c, device, count_max)
    rng = random.Random(0)
    done = 0
    for step in range(ns.steps):
        rows = [rng.sample(range(e), rng.randint(1, min(4, e))) for _ in range(rng.randint(1, 4))]
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
