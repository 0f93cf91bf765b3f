"""The slot side of gpt-oss's MXFP4 experts after vLLM's swizzle, in plain torch.

vLLM's OpenAI-Triton path keeps each layer's experts as triton_kernels tensors whose storage is
one torch tensor with the expert dimension outermost and every expert one contiguous byte range
of the same size (docs/GPT_OSS.md, section 2). So the cache can hold each source as ``[E,
bytes]`` rows (``expert_rows``), copy rows into ``[C, bytes]`` slot buffers like any other
geometry, and give the kernel a view of the slot buffer with the storage's own strides
(``slot_view``), wrapped as the original wrapper with ``C`` experts (``rewrapped``).

``MaskedSumTap`` is the exact route's hook on the reduction of ``UnfusedOAITritonExperts``: its
``masked_moe_sum(intermediate [M, top_k, K], topk_ids, output)`` adds the entries whose id is at
least 0 in k order into a float32 accumulator and reads no other entry, so the rows of experts a
pass did not map may hold anything. The tap hands a pass's ``[M, top_k, K]`` to the caller
(which merges the entries the pass exposed, by its ``expert_map``) and reduces a step's merged
entries once, with the step's ids, as one kernel call over every expert would.

Nothing here imports vLLM or triton_kernels: the wrappers are handled as dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

from rowcache.errors import InvalidInputError
from rowcache.vllm.reduction_tap import UnreducedTap

__all__ = ["MaskedSumTap", "expert_rows", "rewrapped", "slot_view"]


def _dense_expert_major(t: Tensor) -> bool:
    """Whether ``t``'s elements past its first dimension fill each expert's range exactly
    (strides a permutation of a contiguous layout, the expert stride outermost)."""
    inner = sorted(zip(t.stride()[1:], t.shape[1:], strict=True))
    span = 1
    for stride, size in inner:
        if size != 1 and stride != span:
            return False
        span *= size
    return t.stride(0) == span


def expert_rows(t: Tensor) -> Tensor:
    """``t`` (``[E, ...]``, the expert dimension outermost, each expert one dense range) as an
    ``[E, n]`` view of its elements in storage order: expert ``e``'s row is its byte range.
    Anything else is refused, naming the shape and strides."""
    if t.dim() < 2 or not _dense_expert_major(t):
        raise InvalidInputError(
            f"expert rows need an [E, ...] tensor whose experts are dense ranges of the expert "
            f"stride, got shape {tuple(t.shape)} with strides {t.stride()}"
        )
    per = math.prod(t.shape[1:])
    return t.as_strided((t.shape[0], per), (per, 1))


def slot_view(slots: Tensor, like: Tensor) -> Tensor:
    """The ``[C, n]`` slot buffer ``slots`` seen as ``like`` (``[E, ...]``) is seen: shape
    ``[C, *like.shape[1:]]`` with ``like``'s strides, so that slot ``c`` holds what
    ``expert_rows(like)[e]`` holds for the expert copied into it."""
    per = math.prod(like.shape[1:])
    if slots.dim() != 2 or slots.shape[1] != per or slots.dtype != like.dtype:
        raise InvalidInputError(
            f"a slot view of {like.dtype} experts of {per} elements needs a [C, {per}] "
            f"{like.dtype} buffer, got {slots.dtype} of shape {tuple(slots.shape)}"
        )
    if not slots.is_contiguous() or not _dense_expert_major(like):
        raise InvalidInputError(
            f"a slot view needs a contiguous buffer and dense experts, got strides "
            f"{slots.stride()} and {like.stride()}"
        )
    return slots.as_strided((slots.shape[0], *like.shape[1:]), like.stride())


def rewrapped(wrapper: Any, data: Tensor) -> Any:
    """A copy of the triton_kernels ``Tensor`` dataclass ``wrapper`` over ``data`` (its first
    dimension the slot count): the same layout object and dtype, ``shape`` and ``shape_max``
    with the expert count replaced."""
    storage = wrapper.storage
    experts = int(data.shape[0])
    shape = [experts, *list(wrapper.shape)[1:]]
    shape_max = [experts, *list(wrapper.shape_max)[1:]]
    return dataclasses.replace(
        wrapper,
        storage=dataclasses.replace(storage, data=data),
        shape=shape,
        shape_max=shape_max,
    )


class MaskedSumTap(UnreducedTap):
    """Stands in for ``masked_moe_sum`` in the module that calls it (a module global, so one
    tap serves every layer); outside ``unreduced`` every call goes to the original."""

    reduction = "masked_moe_sum"

    def __init__(self, original: Callable[[Tensor, Tensor, Tensor], None]) -> None:
        super().__init__()
        self.original = original

    def __call__(self, intermediate: Tensor, topk_ids: Tensor, output: Tensor) -> None:
        if not self._took(intermediate):
            self.original(intermediate, topk_ids, output)

    def reduce(self, unreduced: Tensor, output: Tensor, topk_ids: Tensor) -> None:
        """The original reduction over a step's merged entries with the step's ids."""
        self.original(unreduced, topk_ids, output)
