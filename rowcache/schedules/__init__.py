"""Device schedules generated from spec/table.toml (see ``_generated.py``)."""

from rowcache.schedules._generated import (
    CONSUMER_OPERATIONS,
    PROVIDER_OPERATIONS,
    run_invalidate,
    run_prepare,
)

__all__ = ["CONSUMER_OPERATIONS", "PROVIDER_OPERATIONS", "run_invalidate", "run_prepare"]
