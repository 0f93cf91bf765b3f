"""Triton kernels built in this process, counted so that a timed measurement can say whether
one was built inside it.

A kernel that Triton builds inside a timed generation stalls the whole step: under ``vllm
serve`` one build of vLLM's MoE kernel stopped every request in flight for 0.8 to 1.0 s
(docs/records/2026-12-05-serving-batch-invariant.md), and in the e2e engines of 2026-12-05 the
JIT monitor saw vLLM's ``fused_moe_kernel`` and the planner's ``plan_kernel`` built after
start-up (docs/records/2026-12-05-deepseek-v2-lite-uva.md). vLLM's monitor logs each kernel
once, without saying which measurement it fell in; this counter does.

Triton calls ``knobs.runtime.jit_post_compile_hook`` after every kernel it builds in the
process, from source or from its disk cache (``JITFunction._call_hook``). vLLM's monitor,
installed after start-up, chains the hook it finds there (vLLM 0.25.0,
``vllm/utils/jit_monitor.py``), so a counter installed before the engine keeps counting. It
sees only this process: an engine whose core runs in another process
(``VLLM_ENABLE_V1_MULTIPROCESSING`` other than ``0``) is not counted, and its records say so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

KEPT = 32
"""How many builds' descriptions a counter keeps after :meth:`JitCounter.describe_from`:
enough to tell which specializations a run built, bounded for a record."""

DESCRIPTION_CHARS = 600
"""A build's description (:func:`describe`) cut to this many characters."""


class JitCounter:
    """The kernels built since it was installed, in order, and the descriptions of the first
    ``KEPT`` built after a chosen point (start-up builds hundreds; those are not kept)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.descriptions: list[str] = []
        self.failure: str | None = None
        """Why a build could not be counted (the counts are then incomplete: not reported)."""
        self._describe_from: int | None = None

    def record(self, fn: object, describe: Callable[[], str]) -> None:
        name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or "<unknown>"
        self.names.append(str(name))
        start = self._describe_from
        if start is not None and len(self.names) > start and len(self.descriptions) < KEPT:
            self.descriptions.append((describe() or str(name))[:DESCRIPTION_CHARS])

    def mark(self) -> int:
        """A point to count from (:meth:`since`)."""
        return len(self.names)

    def since(self, mark: int) -> list[str]:
        """The kernels built after ``mark``, by name, in order."""
        return self.names[mark:]

    def describe_from(self, mark: int) -> None:
        """Keep the descriptions of the first ``KEPT`` builds after ``mark``."""
        self._describe_from = mark
        self.descriptions = []


def describe(hook_kwargs: dict[str, Any]) -> str:
    """What made a build distinct: its constexprs and specialized values (``constants``) and
    its arguments' attributes (``configs``: divisibility by 16), then Triton's own ``repr``
    (Triton 3.6's stops after the first argument)."""
    build = hook_kwargs.get("compile")
    parts = []
    if isinstance(build, dict):
        parts = [f"{key}={build[key]!r}" for key in ("constants", "configs") if key in build]
    return "; ".join([*parts, str(hook_kwargs.get("repr") or "")])


def install(counter: JitCounter, runtime: Any) -> None:
    """Count every build ``runtime`` (Triton's ``knobs.runtime``) reports, passing each on to
    the hook that was there before."""
    existing: Callable[..., Any] | None = runtime.jit_post_compile_hook

    def on_build(**kwargs: Any) -> Any:
        # Inside Triton's build of a kernel the engine is launching: a failure here must not
        # fail that launch, so it marks the counter (whose counts are then not reported).
        try:
            counter.record(kwargs.get("fn"), lambda: describe(kwargs))
        except Exception as error:
            counter.failure = counter.failure or f"{type(error).__name__}: {error}"[:300]
        return existing(**kwargs) if existing is not None else None

    runtime.jit_post_compile_hook = on_build


def counting() -> JitCounter:
    """A counter of this process's Triton builds, installed (Triton imported)."""
    from triton import knobs  # type: ignore[import-untyped, unused-ignore]

    counter = JitCounter()
    install(counter, knobs.runtime)
    return counter
