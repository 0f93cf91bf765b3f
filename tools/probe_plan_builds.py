"""Probe: which builds of the fused planner (``plan_kernel``) each routing shape makes, in the
order an engine meets them, and the planner against its torch reference on the same shapes.

An engine builds the planner's kernels for the steps it meets first in vLLM's profile run (the
largest step) and its graph captures (decode steps); any other kernel it builds while serving
stalls that step (``harness/jit_count.py``). This replays that order on one layer's cache
(DeepSeek-V2-Lite's 64 experts, top-6, 16 slots by default): the profile step, the captured
batch sizes, prompts of assorted lengths, decode again, and records every build by the shape
that made it (Triton's ``jit_post_compile_hook``), then checks the fused planner pass by pass
against ``torch_planner.plan_pass`` on random steps of those lengths whose later rows route to
other experts (so every block of entries matters), under both policies.
Writes ``plan_builds.json`` to ``--out``.

    python -m tools.probe_plan_builds --out OUTDIR
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from rowcache.device_plan.kernels import launch_plan
from rowcache.device_plan.passes import num_passes
from rowcache.device_plan.state import DeviceCacheState, first_difference, new_state
from rowcache.device_plan.torch_planner import plan_pass
from tools.vllm.harness.jit_count import JitCounter, counting

PROFILE_ROWS = 2048
CAPTURED_ROWS = (1, 2, 4, 8)
PROMPT_ROWS = (8, 64, 9, 17, 100, 301, 511, 512, 2048, 1000, 333)
LOCKSTEP_ROWS = (1, 2, 3, 8, 9, 17, 40, 100, 301, 700)


def step(
    state: DeviceCacheState, counter: JitCounter, label: str, rows: int, top_k: int
) -> dict[str, Any]:
    """One step of ``rows`` rows, every pass, and the builds it made."""
    mark, start = counter.mark(), time.perf_counter()
    experts, capacity = state.num_experts, state.capacity
    ids = torch.randint(0, experts, (rows, top_k), device=state.resident.device)
    ids = ids.to(torch.int32)
    passes = num_passes(ids.numel(), experts, capacity)
    for index in range(passes):
        launch_plan(state, ids, index, passes)
    torch.cuda.synchronize()
    seconds = round(time.perf_counter() - start, 3)
    built = counter.since(mark)
    return {"label": label, "rows": rows, "passes": passes, "built": built, "s": seconds}


def drifting_ids(rows: int, experts: int, top_k: int, device: torch.device) -> torch.Tensor:
    """A step's routing whose experts move with the row: row r routes to top_k distinct
    experts (as vLLM's rows do, where experts >= 2 x top_k) among the 2 x top_k from
    r x experts / rows on."""
    base = torch.arange(rows, device=device)[:, None] * experts // rows
    offsets = torch.rand(rows, 2 * top_k, device=device).argsort(dim=1)[:, :top_k]
    return ((base + offsets) % experts).to(torch.int32)


def lockstep(experts: int, capacity: int, top_k: int, steps: int) -> dict[str, Any]:
    rng = random.Random(0)
    device = torch.device("cuda")
    checked, first = 0, None
    for policy, count_max in (("lru", 0), ("lfu", 3)):
        reference = new_state(experts, capacity, device, count_max)
        fused = new_state(experts, capacity, device, count_max)
        for index in range(steps):
            rows = rng.choice(LOCKSTEP_ROWS)
            ids = drifting_ids(rows, experts, top_k, device)
            passes = num_passes(ids.numel(), experts, capacity)
            for p in range(passes):
                plan_pass(reference, ids, p, passes)
                launch_plan(fused, ids, p, passes)
                checked += 1
                found = first_difference(reference, fused)
                if found is not None and first is None:
                    first = f"{policy} step {index} ({rows} rows) pass {p}: {found}"
    return {"passes_checked": checked, "first_difference": first}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--lockstep-steps", type=int, default=60)
    ns = ap.parse_args(argv)
    torch.manual_seed(0)
    counter = counting()
    counter.describe_from(0)
    state = new_state(ns.experts, ns.capacity, torch.device("cuda"))
    steps = [step(state, counter, "profile", PROFILE_ROWS, ns.top_k)]
    steps += [step(state, counter, "capture", r, ns.top_k) for r in CAPTURED_ROWS]
    steps += [step(state, counter, "prompt", r, ns.top_k) for r in PROMPT_ROWS]
    steps += [step(state, counter, "decode", r, ns.top_k) for r in (1, 8)]
    after_start = sum(len(s["built"]) for s in steps if s["label"] in ("prompt", "decode"))
    import triton  # type: ignore[import-untyped, unused-ignore]

    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"experts": ns.experts, "capacity": ns.capacity, "top_k": ns.top_k},
        "steps": steps,
        "builds_after_profile_and_captures": after_start,
        "lockstep": lockstep(ns.experts, ns.capacity, ns.top_k, ns.lockstep_steps),
        "described": counter.descriptions,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "plan_builds.json").write_text(json.dumps(out, indent=1))
    for s in steps:
        print(s)
    print("builds after the profile step and the captures:", after_start)
    print("lockstep:", out["lockstep"])
    return 1 if out["lockstep"]["first_difference"] is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
