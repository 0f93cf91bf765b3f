"""The GPU conformance's log check (``tests/cuda/trace_check.render``) on synthetic logs, without
a GPU: a miss's copies render as one model line only when every present source's copy is on one
stream, in source order. A decode of planes logged on another stream than the copies (the CUDA
backend logs each decode on the stream its launches went to) is rejected: the seeded bug the
machine's planes cell must catch on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda"))

from trace_check import LogError, render

from rowcache.backends.cuda import CudaCall
from rowcache.sources import SOURCE_NAMES

SIX = SOURCE_NAMES[:6]
COPY, CONSUMER = 0xC0, 0xA0
STREAMS = {CONSUMER: 0, COPY: 2}


def miss(streams: dict[str, int], names: tuple[str, ...] = SIX) -> list[CudaCall]:
    return [CudaCall("copy", streams.get(n, COPY), n, 3, 1) for n in names]


def test_a_miss_on_the_copy_stream_renders_as_one_copy() -> None:
    log = [CudaCall("wait", COPY, "release"), *miss({}), CudaCall("record", COPY, "ready")]
    assert render(log, STREAMS, SIX) == [
        "wait release on 2",
        "copy expert 3 to slot 1 on 2",
        "record ready on 2",
    ]


@pytest.mark.parametrize("decoded", ["w13", "w2"])
def test_a_decode_on_another_stream_is_rejected(decoded: str) -> None:
    with pytest.raises(LogError, match="expected one copy of each of"):
        render(miss({decoded: CONSUMER}), STREAMS, SIX)


def test_a_miss_missing_a_source_or_out_of_order_is_rejected() -> None:
    with pytest.raises(LogError):
        render(miss({}, SIX[1:]) + miss({}, SIX[:1]), STREAMS, SIX)
    with pytest.raises(LogError):
        render(miss({}, (SIX[1], SIX[0], *SIX[2:])), STREAMS, SIX)
