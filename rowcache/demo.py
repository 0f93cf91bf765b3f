"""A small synthetic MoE layer run through the providers' routes on the CPU:
``python -m rowcache.demo``.

16 experts, top-4 routing, 6 slots, 64 tokens per batch, three batches: more experts are
routed than fit, so every forward is cut (by token chunks, by expert groups, or into device
passes) and slots are evicted and refilled. Three routes, the ones the vLLM plugin runs:

* ``host``/``token``: the host planner cuts a step by rows; each chunk's rows are computed
  whole (``run_with_expert_cache``).
* ``host``/``expert``: the host planner cuts a step by expert groups; every group's per-entry
  outputs are merged into one step buffer and reduced once (``run_unreduced_with_expert_cache``).
* ``device``/``expert``: the device planner (here on the CPU) cuts a step into passes, merged
  and reduced once the same way.

Each route's output must equal, bit for bit, one call of the layer with every expert
resident (each entry computed by the same operations on the same bytes, each token's entries
reduced once), and each provider's counters must add up. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rowcache.forward import run_unreduced_with_expert_cache, run_with_expert_cache
from rowcache.provider_base import Planner, RowCacheWeightProvider
from rowcache.types import ExpertWeightResult, Split

__all__ = ["ROUTES", "Route", "check", "main", "run_demo"]

EXPERTS, TOP_K, SLOTS, TOKENS, HIDDEN, INTER, BATCHES = 16, 4, 6, 64, 32, 16, 3

Lookup = Callable[[int], "tuple[Tensor, Tensor] | None"]
Batch = tuple[Tensor, Tensor, Tensor]  # x [M, H], topk_ids [M, K], topk_weights [M, K]


def _mlp(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def _entries(batch: Batch, rows: slice, lookup: Lookup) -> Tensor:
    """``[rows, top_k, H]``: each (token, routed expert) output, router weight applied; an
    entry whose expert ``lookup`` does not find stays 0 (the routes never read it)."""
    x, ids, weights = batch
    out = x.new_zeros((rows.stop - rows.start, ids.shape[1], x.shape[1]))
    for local, token in enumerate(range(rows.start, rows.stop)):
        for j, expert in enumerate(ids[token].tolist()):
            found = lookup(expert)
            if found is not None:
                out[local, j] = (weights[token, j] * _mlp(x[token : token + 1], *found))[0]
    return out


def _reduce(unreduced: Tensor, output: Tensor) -> None:
    """Each token's top-k entries summed once, in routing order (the layer's reduction)."""
    torch.sum(unreduced, dim=1, out=output)


def _slots(weights: ExpertWeightResult) -> Lookup:
    expert_map: list[int] = weights.expert_map.tolist()

    def lookup(expert: int) -> tuple[Tensor, Tensor] | None:
        slot = expert_map[expert]
        return None if slot < 0 else (weights.w1[slot], weights.w2[slot])

    return lookup


def reduced_route(provider: RowCacheWeightProvider, batch: Batch) -> Tensor:
    """A step through ``run_with_expert_cache``: each call returns its rows reduced."""

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
        output = batch[0].new_empty((rows.stop - rows.start, batch[0].shape[1]))
        _reduce(_entries(batch, rows, _slots(weights)), output)
        return output

    return run_with_expert_cache(provider, batch[1], run)


def unreduced_route(provider: RowCacheWeightProvider, batch: Batch) -> Tensor:
    """A step through ``run_unreduced_with_expert_cache``: calls return per-entry outputs,
    merged and reduced once."""

    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
        return _entries(batch, rows, _slots(weights))

    return run_unreduced_with_expert_cache(provider, batch[1], run, _reduce)


@dataclass(frozen=True)
class Route:
    planner: Planner
    split: Split
    step: Callable[[RowCacheWeightProvider, Batch], Tensor]


ROUTES = (
    Route("host", "token", reduced_route),
    Route("host", "expert", unreduced_route),
    Route("device", "expert", unreduced_route),
)


def _batches(seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(BATCHES):
        x = torch.randn(TOKENS, HIDDEN, generator=gen)
        # A skewed router, so some experts are hot and the cache has something to keep.
        bias = torch.linspace(2.0, 0.0, EXPERTS)
        logits = torch.randn(TOKENS, EXPERTS, generator=gen) + bias
        values, ids = logits.topk(TOP_K, dim=-1)
        out.append((x, ids, values.softmax(dim=-1)))
    return out


def _one_call(batch: Batch, w13: Tensor, w2: Tensor) -> Tensor:
    """The layer with every expert resident: one call, each token reduced once."""
    output = batch[0].new_empty(batch[0].shape)
    _reduce(_entries(batch, slice(0, TOKENS), lambda e: (w13[e], w2[e])), output)
    return output


def run_demo(seed: int = 0, routes: Sequence[Route] = ROUTES) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    batches = _batches(seed + 1)
    references = [_one_call(batch, w13, w2) for batch in batches]
    rows: list[dict[str, object]] = []
    for route in routes:
        chosen: dict[str, Any] = {"split": route.split, "planner": route.planner}
        provider = RowCacheWeightProvider(w13, w2, capacity=SLOTS, device="cpu", **chosen)
        error, differing = 0.0, 0
        for batch, reference in zip(batches, references, strict=True):
            out = route.step(provider, batch)
            error = max(error, float((out - reference).abs().max()))
            differing += int((out.view(torch.int32) != reference.view(torch.int32)).sum())
        stats = provider.stats()
        rows.append(
            {
                "planner": route.planner,
                "split": route.split,
                "prepares": stats["prepare_calls"],
                "hits": stats["hits"],
                "misses": stats["misses"],
                "evictions": stats["evictions"],
                "differing": differing,
                "max_abs_error": error,
            }
        )
    return rows


def check(row: dict[str, object]) -> str | None:
    """Why a row fails, or None."""
    differing, error = row["differing"], row["max_abs_error"]
    if differing != 0:
        return (
            f"{differing} output values differ from one call with every expert resident"
            f" (largest by {error:g}); every bit must match"
        )
    misses, evictions = row["misses"], row["evictions"]
    assert isinstance(misses, int) and isinstance(evictions, int)
    if misses < SLOTS or evictions != misses - SLOTS:
        return f"{misses} misses and {evictions} evictions do not add up for {SLOTS} slots"
    return None


def main(argv: Sequence[str] | None = None, routes: Sequence[Route] = ROUTES) -> int:
    parser = argparse.ArgumentParser(prog="python -m rowcache.demo", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    seed = parser.parse_args(argv).seed
    print(
        f"{EXPERTS} experts, top-{TOP_K}, {SLOTS} slots, {BATCHES} batches of {TOKENS} tokens "
        f"(CPU, seed {seed}); each route against one call with every expert resident"
    )
    header = ("planner", "split", "prepares", "hits", "misses", "evictions", "values differ")
    print(f"{header[0]:<9}{header[1]:<8}" + "".join(f"{h:>15}" for h in header[2:]))
    failures: list[str] = []
    for row in run_demo(seed, routes):
        print(
            f"{row['planner']!s:<9}{row['split']!s:<8}{row['prepares']:>15}{row['hits']:>15}"
            f"{row['misses']:>15}{row['evictions']:>15}{row['differing']:>15}"
        )
        problem = check(row)
        if problem is not None:
            failures.append(f"{row['planner']}/{row['split']}: {problem}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    if not failures:
        print(
            "ok: every route bit-identical to one call with every expert resident"
            " (token split, exact expert split, device passes)"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
