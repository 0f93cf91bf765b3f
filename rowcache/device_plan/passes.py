"""How many passes a step needs, fixed by its shape alone.

A captured graph cannot branch on the number of distinct experts a step routes to, so the
number of passes is decided by what the shape allows: a step of ``n`` routing entries touches
at most ``min(n, E)`` distinct experts, and each pass exposes at most ``capacity`` of them.
One capture per batch size therefore holds for every routing of that size.
"""

from __future__ import annotations

__all__ = ["num_passes"]


def num_passes(num_entries: int, num_experts: int, capacity: int) -> int:
    """Passes for a step of ``num_entries`` routing entries (at least one: an empty step is
    one empty pass)."""
    reachable = min(num_entries, num_experts)
    return max(1, -(-reachable // capacity))
