"""What a tap on a MoE kernel's reduction does alike for every kernel, in plain torch.

The exact route of a step cut by experts needs each kernel call's unreduced ``[M, top_k, H]``
entries: a tap stands in for the kernel's reduction, and while ``unreduced(call)`` runs one
call it keeps the entries the call hands over instead of reducing them. Outside that it passes
every call through. ``rowcache.vllm._method`` taps ``TritonExperts.moe_sum`` (an instance
attribute), ``rowcache.vllm.mxfp4_slots`` the module global ``masked_moe_sum`` of vLLM's
OpenAI-Triton experts.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

__all__ = ["UnreducedTap"]


class UnreducedTap:
    """Keeps what one kernel call hands its reduction while ``unreduced`` runs it."""

    reduction = "its reduction"
    """What the kernel calls to reduce, as the error names it."""

    def __init__(self) -> None:
        self._take = False
        self._taken: Tensor | None = None

    def _took(self, entries: Tensor) -> bool:
        """Keep ``entries`` (True) when ``unreduced`` is running a call, else False (the caller
        reduces as the kernel asked). They live in the kernel's workspace, which its next call
        reuses: the caller merges them before that call (stream order)."""
        if not self._take:
            return False
        self._taken = entries
        return True

    def unreduced(self, call: Callable[[], object]) -> Tensor:
        """Run ``call`` (one kernel call) and return the entries it handed to the reduction."""
        self._take, self._taken = True, None
        try:
            call()
        finally:
            self._take = False
        taken, self._taken = self._taken, None
        if taken is None:
            raise RuntimeError(
                f"rowcache: the MoE kernel returned without calling {self.reduction}; the "
                "exact route of a step cut by experts needs its unreduced output"
            )
        return taken
