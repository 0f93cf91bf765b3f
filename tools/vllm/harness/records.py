"""The token references of engines recorded before results carried their spec's
``compare_with`` (the runs of 2026-11-29 and 2026-11-30), so that ``merge`` still compares
them as their summaries did. An engine recorded since then carries its own.
"""

from __future__ import annotations

from tools.vllm.harness.engines import (
    MP_REF,
    QWEN_B,
    QWEN_B_IDMAP,
    STORY_NONE,
    TINY_EAGER_NONE,
    TINY_PIECEWISE_NONE,
    TINY_PIECEWISE_REFS,
)

_BY_PREFIX = (
    ("tiny.eager.", (TINY_EAGER_NONE,)),
    ("tiny.piecewise.", TINY_PIECEWISE_REFS),
    ("tiny.debug.", (TINY_PIECEWISE_NONE,)),
    ("mp.", (TINY_EAGER_NONE, MP_REF)),
    ("qwen8seq.", ("qwen8seq.b.eager_moe",)),
    (f"{QWEN_B}.", (QWEN_B, "qwen8.ref.eager")),
    ("qwen8.", ("qwen8.ref.eager",)),
    ("story.", (STORY_NONE,)),
)


def compare_with(name: str) -> tuple[str, ...]:
    """What an engine recorded without ``compare_with`` is compared with, by its name."""
    if name.startswith("qwen8.") and ("row" in name or "cached" in name):
        return (QWEN_B_IDMAP, QWEN_B)
    for prefix, refs in _BY_PREFIX:
        if name.startswith(prefix):
            return refs
    return ()
