"""A small synthetic MoE layer run through both providers on the CPU: ``python -m rowcache.demo``.

16 experts, top-4 routing, 6 slots, 64 tokens per batch, three batches: more experts are
routed than fit, so every forward is split (by token chunks or by expert groups) and slots are
evicted and refilled. Each provider's output is compared with the uncached layer: the token
split must match bit for bit (each row runs the same operations on the same bytes), the
expert split within float32 rounding of the partial sums. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rowcache.cached import CachedWeightProvider
from rowcache.forward import RunFn, run_with_expert_cache
from rowcache.row_provider import RowCacheWeightProvider
from rowcache.types import ExpertWeightProvider, ExpertWeightResult, Split

__all__ = ["main"]

EXPERTS, TOP_K, SLOTS, TOKENS, HIDDEN, INTER, BATCHES = 16, 4, 6, 64, 32, 16, 3

Lookup = Callable[[int], "tuple[Tensor, Tensor] | None"]


def _mlp(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def _moe_rows(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, rows: slice, lookup: Lookup
) -> Tensor:
    """One MLP per (token, routed expert), summed in routing order; unmapped experts skipped."""
    out = x.new_zeros((rows.stop - rows.start, x.shape[1]))
    for local, token in enumerate(range(rows.start, rows.stop)):
        row = x[token : token + 1]
        acc = x.new_zeros((1, x.shape[1]))
        for j, expert in enumerate(topk_ids[token].tolist()):
            weights = lookup(expert)
            if weights is not None:
                acc = acc + topk_weights[token, j] * _mlp(row, *weights)
        out[local] = acc[0]
    return out


def _run_fn(x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> RunFn:
    def run(weights: ExpertWeightResult, rows: slice, include_shared: bool) -> Tensor:
        expert_map: list[int] = weights.expert_map.tolist()

        def lookup(expert: int) -> tuple[Tensor, Tensor] | None:
            slot = expert_map[expert]
            return None if slot < 0 else (weights.w1[slot], weights.w2[slot])

        return _moe_rows(x, topk_ids, topk_weights, rows, lookup)

    return run


def _batches(seed: int) -> list[tuple[Tensor, Tensor, Tensor]]:
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


def run_demo(seed: int = 0) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    batches = _batches(seed + 1)
    references = [
        _moe_rows(x, ids, wts, slice(0, TOKENS), lambda e: (w13[e], w2[e]))
        for x, ids, wts in batches
    ]
    rows: list[dict[str, object]] = []
    splits: tuple[Split, ...] = ("token", "expert")
    for name in ("cached", "row"):
        for split in splits:
            provider: ExpertWeightProvider
            if name == "cached":
                provider = CachedWeightProvider(w13, w2, capacity=SLOTS, split=split, device="cpu")
            else:
                provider = RowCacheWeightProvider(
                    w13, w2, capacity=SLOTS, split=split, device="cpu"
                )
            error = 0.0
            scale = 0.0
            for (x, ids, wts), ref in zip(batches, references, strict=True):
                out = run_with_expert_cache(provider, ids, _run_fn(x, ids, wts))
                error = max(error, float((out - ref).abs().max()))
                scale = max(scale, float(ref.abs().max()))
            stats = provider.stats()
            rows.append(
                {
                    "provider": name,
                    "split": split,
                    "prepares": stats["prepare_calls"],
                    "hits": stats["hits"],
                    "misses": stats["misses"],
                    "evictions": stats["evictions"],
                    "max_abs_error": error,
                    "scale": scale,
                }
            )
    return rows


def check(row: dict[str, object]) -> str | None:
    """Why a row fails, or None."""
    error, scale = row["max_abs_error"], row["scale"]
    assert isinstance(error, float) and isinstance(scale, float)
    if row["split"] == "token" and error != 0.0:
        return f"token split differs from the uncached layer by {error:g} (must be 0)"
    # Float32 partial sums regrouped: a few units of rounding (2^-24) of the output's size.
    if row["split"] == "expert" and error > 1e-5 * max(scale, 1.0):
        return f"expert split differs from the uncached layer by {error:g}"
    misses, evictions = row["misses"], row["evictions"]
    assert isinstance(misses, int) and isinstance(evictions, int)
    if misses < SLOTS or evictions != misses - SLOTS:
        return f"{misses} misses and {evictions} evictions do not add up for {SLOTS} slots"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rowcache.demo", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    seed = parser.parse_args(argv).seed
    print(
        f"{EXPERTS} experts, top-{TOP_K}, {SLOTS} slots, {BATCHES} batches of {TOKENS} tokens "
        f"(CPU, seed {seed})"
    )
    header = ("provider", "split", "prepares", "hits", "misses", "evictions", "max abs error")
    print(f"{header[0]:<9}{header[1]:<8}" + "".join(f"{h:>14}" for h in header[2:]))
    failures: list[str] = []
    for row in run_demo(seed):
        print(
            f"{row['provider']!s:<9}{row['split']!s:<8}{row['prepares']:>14}{row['hits']:>14}"
            f"{row['misses']:>14}{row['evictions']:>14}{row['max_abs_error']:>14.3g}"
        )
        problem = check(row)
        if problem is not None:
            failures.append(f"{row['provider']}/{row['split']}: {problem}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    if not failures:
        print("ok: token split exact, expert split within float32 rounding")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
