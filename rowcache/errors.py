"""Exceptions raised by rowcache.

Every rejection of caller input is an ``InvalidInputError``, which is also a
``ValueError`` so that callers written against plain Python conventions (or
against vLLM's providers, which raise ``ValueError``) keep working.
"""

from __future__ import annotations

__all__ = ["ConcurrentCallError", "InvalidInputError", "RowCacheError"]


class RowCacheError(Exception):
    """Base class: catch this to handle every error rowcache raises on purpose."""


class InvalidInputError(RowCacheError, ValueError):
    """Caller input was rejected before any state changed.

    The message names the offending value and the limit it broke, so a log line
    alone is enough to find the bad call.
    """


class ConcurrentCallError(RowCacheError, RuntimeError):
    """A second host thread entered a provider while another call was running.

    Providers assume sequential host calls (their stream ordering depends on
    it); failing loudly is preferable to a silent race on slots and maps.
    """
