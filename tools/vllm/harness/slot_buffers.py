"""The slot buffers a provider holds, named by source: ``buf_<name>`` for each name of
``rowcache.sources.SOURCE_NAMES`` the provider has (a geometry without scales or biases has
fewer).

The slot watch (``slot_watch``) digests them and the first state (``first_state``) copies them;
both are imported by the trace, so the names live here, in a module that imports neither.
"""

from __future__ import annotations

from typing import Any

__all__ = ["slot_buffers", "slot_keys"]


def slot_keys(provider: Any) -> tuple[str, ...]:
    """The source names whose slot buffer ``provider`` has, in ``SOURCE_NAMES`` order."""
    from rowcache.sources import SOURCE_NAMES

    return tuple(k for k in SOURCE_NAMES if getattr(provider, f"buf_{k}", None) is not None)


def slot_buffers(provider: Any) -> dict[str, Any]:
    """``provider``'s slot buffers by source name (the live tensors, not copies)."""
    return {key: getattr(provider, f"buf_{key}") for key in slot_keys(provider)}
