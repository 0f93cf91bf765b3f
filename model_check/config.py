"""The bounds every run checks, and the manifest that pins their state counts."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from model_check.table.reference import Bounds

MANIFEST_PATH = Path(__file__).resolve().parent.parent / "spec" / "manifest.toml"
WRITE_COMMAND = "python -m model_check check --write-manifest"


@dataclass(frozen=True)
class Check:
    """One exhaustive exploration: a device model at a configuration and host-call depth, of
    the host path's operations (`path` "host") or of the device-planned path's ("device",
    the table's `[device]` section)."""

    model: str  # "hb" (happens-before summary) or "interleavings" (explicit FIFO model)
    bounds: Bounds
    depth: int
    path: str = "host"

    @property
    def key(self) -> str:
        b = self.bounds
        prefix = "" if self.path == "host" else f"{self.path}/"
        policy = "" if b.policy == "lru" else f"-{b.policy}{b.count_max}"
        return f"{prefix}{self.model}/{b.num_experts}e{b.capacity}c{policy}/d{self.depth}"


B32 = Bounds(num_experts=3, capacity=2)
B43 = Bounds(num_experts=4, capacity=3)
# Victims by request count, counts halved past 2: within these depths a count saturates and
# every count is halved, and a victim other than the least recently used is taken.
B32_LFU = Bounds(num_experts=3, capacity=2, policy="lfu", count_max=2)

CHECKS: tuple[Check, ...] = (
    # Every host-call sequence to the full bounds, all interleavings decided by happens-before.
    Check("hb", B32, 6),
    Check("hb", B43, 4),
    # Every interleaving enumerated step by step, to a smaller depth: the cross-check of the
    # summary, and the checker for P7.
    Check("interleavings", B32, 3),
    Check("interleavings", B43, 2),
    # The victim policy by request counts (the orderings are the same; P3 to P5 and the
    # counts' convergence are the policy's).
    Check("hb", B32_LFU, 6),
    Check("interleavings", B32_LFU, 3),
)

# Mutants are searched at these bounds: every one is killed well within them.
MUTANT_CHECKS: tuple[Check, ...] = (
    Check("hb", B32, 6),
    Check("interleavings", B32, 4),
)

# The kill matrix's `intended` column: one exhaustive search for the property a mutant was
# seeded against, alone (`only`), in the first of these models that expresses it. On the host
# path the happens-before summary finds every mutant's in under a second, where the explicit
# model took up to 105 s (hit_path_ignores_handoff's P1; tests/test_model.py runs that search
# in both models); only the explicit model expresses P7 (deadlock). On the device-planned path
# the summary misses three mutants' seeded property at its bounds (each after a whole search of
# 13 to 105 s), so the explicit model decides there.
INTENDED_CHECKS: tuple[Check, ...] = (Check("hb", B32, 6), Check("interleavings", B32, 4))

# The device-planned path's operations, at the same bounds.
DEVICE_CHECKS: tuple[Check, ...] = tuple(replace(c, path="device") for c in CHECKS)
DEVICE_MUTANT_CHECKS: tuple[Check, ...] = (
    Check("hb", B32, 6, "device"),
    Check("interleavings", B32, 3, "device"),
)
DEVICE_INTENDED_CHECKS: tuple[Check, ...] = (Check("interleavings", B32, 3, "device"),)


@dataclass(frozen=True)
class Pinned:
    states: int
    transitions: int
    max_depth: int


def load_manifest(path: Path = MANIFEST_PATH) -> dict[str, Pinned]:
    if not path.exists():
        return {}
    with path.open("rb") as f:
        data = tomllib.load(f)
    return {
        entry["key"]: Pinned(entry["states"], entry["transitions"], entry["max_depth"])
        for entry in data.get("check", [])
    }


def manifest_text(rows: list[tuple[Check, Pinned]]) -> str:
    lines = [
        "# Distinct states, transitions and depth of every exhaustive check of the real table.",
        f"# Written by `{WRITE_COMMAND}`; a change to the table that",
        "# changes the state space must update this file on purpose: `python -m model_check` and",
        "# tests/test_model.py::test_real_table_holds_and_matches_the_manifest fail until it does.",
        "",
    ]
    for check, pinned in rows:
        lines += [
            "[[check]]",
            f'key = "{check.key}"',
            f'model = "{check.model}"',
            f'path = "{check.path}"',
            f"num_experts = {check.bounds.num_experts}",
            f"capacity = {check.bounds.capacity}",
            f"depth = {check.depth}",
            f"states = {pinned.states}",
            f"transitions = {pinned.transitions}",
            f"max_depth = {pinned.max_depth}",
            'expected = "pass"',
            "",
        ]
    return "\n".join(lines)
