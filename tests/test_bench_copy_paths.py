"""CPU checks of the copy paths the benchmark compares (``row``: batched, ``row_pt``: per
tensor): the batched path's address arithmetic against tensor views, and its refusal, naming
what is missing, where NVIDIA's ``cuda-bindings`` are not installed. The copies themselves run
in ``tests/cuda`` (the conformance suite uses the batched path by default)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rowcache.backends.batched_copy import BatchedCopyUnavailable, RowLayout, load_runtime
from rowcache.backends.cuda import CudaBackend


def _pairs(capacity: int, experts: int) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    shapes = {
        "w13": ((6, 4), torch.bfloat16),
        "w2": ((4, 3), torch.bfloat16),
        "w13_scale": ((6, 2), torch.uint8),
        "w2_scale_2": ((), torch.float32),
    }
    return [
        (
            torch.empty((capacity, *shape), dtype=dtype),
            torch.empty((experts, *shape), dtype=dtype),
            name,
        )
        for name, (shape, dtype) in shapes.items()
    ]


def test_row_addresses_are_the_row_views() -> None:
    pairs = _pairs(capacity=3, experts=7)
    layout = RowLayout(pairs)
    copies = [(6, 0), (2, 2), (4, 1)]
    dsts, srcs, sizes = layout.addresses(copies)
    expected = [
        (buf[slot].data_ptr(), src[expert].data_ptr(), src[expert].numel() * src.element_size())
        for expert, slot in copies
        for buf, src, _ in pairs
    ]
    assert list(zip(dsts, srcs, sizes, strict=True)) == expected
    assert layout.names == ("w13", "w2", "w13_scale", "w2_scale_2")
    assert layout.expert_bytes == 6 * 4 * 2 + 4 * 3 * 2 + 6 * 2 + 4


def test_empty_rows_are_left_out_of_the_batch() -> None:
    pairs = [*_pairs(2, 3), (torch.empty(2, 0), torch.empty(3, 0), "w2_scale")]
    layout = RowLayout(pairs)
    assert "w2_scale" not in layout.names
    dsts, _, _ = layout.addresses([(1, 1)])
    assert len(dsts) == 4


def test_rows_that_are_not_contiguous_are_refused() -> None:
    buf, src, name = _pairs(2, 3)[0]
    strided = torch.empty(3, 4, 6, dtype=src.dtype).transpose(1, 2)
    with pytest.raises(BatchedCopyUnavailable, match="does not hold each row contiguously"):
        RowLayout([(buf, strided, name)])


def test_copy_option_is_checked_first() -> None:
    with pytest.raises(ValueError, match="copy must be one of"):
        CudaBackend("cuda", copy="gather")  # type: ignore[arg-type]


@pytest.mark.skipif(
    importlib.util.find_spec("cuda") is not None
    and importlib.util.find_spec("cuda.bindings") is not None,
    reason="cuda-bindings is installed here",
)
def test_batched_without_bindings_names_what_is_missing() -> None:
    with pytest.raises(BatchedCopyUnavailable, match="cuda-bindings") as raised:
        load_runtime()
    assert "copy='per_tensor'" in str(raised.value)
    # The backend refuses at construction, before touching CUDA (this machine may have none).
    with pytest.raises(BatchedCopyUnavailable, match=r"cuda\.bindings\.runtime"):
        CudaBackend("cuda:0")


def test_batched_copies_are_reported_to_the_stream_sanitizer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A batched copy is no aten operation, so the backend reports its destination rows to
    PyTorch's stream sanitizer itself: an unordered write after a read on another stream is
    reported, an event-ordered one is not. Runs the sanitizer's analysis half on the CPU."""
    import sys
    import types

    from torch.cuda._sanitizer import CUDASanitizerErrors, EventHandler

    from rowcache.backends import cuda as cuda_backend

    handler = EventHandler()
    fake = types.SimpleNamespace(
        cuda_sanitizer=types.SimpleNamespace(
            enabled=True, dispatch=types.SimpleNamespace(event_handler=handler)
        ),
        CUDASanitizerErrors=CUDASanitizerErrors,
    )
    monkeypatch.setitem(sys.modules, "torch.cuda._sanitizer", fake)
    consumer, copy, row = 0x11, 0x22, 0x1000
    for stream in (consumer, copy):
        handler._handle_stream_creation(stream)
    handler._handle_event_creation(7)
    assert not handler._handle_kernel_launch(consumer, {row}, set(), set(), "read", {row: []})
    handler._handle_event_record(7, consumer)
    handler._handle_event_wait(7, copy)
    cuda_backend._sanitizer_write(copy, lambda: [row])  # ordered after the read: clean
    other = 0x2000
    assert not handler._handle_kernel_launch(consumer, {other}, set(), set(), "read", {other: []})
    with pytest.raises(CUDASanitizerErrors):
        cuda_backend._sanitizer_write(copy, lambda: [other])  # not ordered: reported
    assert "rowcache cudaMemcpyBatchAsync" in capsys.readouterr().err
    fake.cuda_sanitizer.enabled = False
    cuda_backend._sanitizer_write(copy, lambda: [other])  # off: nothing is checked
