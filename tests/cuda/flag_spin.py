"""Holding GPU work until the host lets it go: a kernel that spins on a flag in pinned host
memory, for the device-path race fixtures (``test_device_planner_cuda.py``).

A fixed-length sleep cannot say whether the call under test landed while the racing work was
held: on a fast machine the sleep may be over before the call is even made. Here the hold lasts
until the test writes the flag, which it does only after the call under test has returned and
after polling whether the call's racing work completed meanwhile; the spin's output says
whether it ended by that release or by its iteration limit (which bounds it when a call blocks
the host, so nothing hangs).

* ``spin_kernel``: one program reads the flag through unified addressing (a pinned CPU
  tensor's address is valid on the device) with a volatile load on every iteration, so the
  loop cannot be folded into one load, until the flag is non-zero or ``limit`` iterations have
  passed; it writes the flag it saw last (0: the limit ended it) and the iteration count.
* ``peek_kernel``: copies a small int64 device tensor into pinned host memory, so the host can
  look at device state on a stream of its own, without waiting for the held streams.
* ``FlagHold``: one hold (pinned flag, spin output, an event behind the spin); ``Peek``: one
  device tensor watched through ``peek_kernel``.

Triton is imported here at module level: import this module lazily, inside GPU tests (CPU CI
collects ``tests/cuda`` without Triton).

Every kernel that runs while a hold is in place must have been launched once before: with
CUDA's lazy module loading, the first launch of a kernel may load its module, which can wait
for the kernels running on the device, the spin among them, until its limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from cuda_support import sanitizer_enabled
from torch import Tensor

SLOWDOWN = 4.0 if sanitizer_enabled() else 1.0  # the stream sanitizer slows every host op
HOLD_LIMIT_MS = 3000.0 * SLOWDOWN
"""How long a hold lasts at most (the spin's iteration limit, calibrated): well past the call
under test and the poll, short enough that a call blocking the host costs seconds, not a hang."""
POLL_MS = 300.0
"""How long the host polls for the racing work while the hold is in place."""
CALIBRATION_SPINS = 20_000
MAX_SPINS = 2**31 - 1  # the limit stays an int32 argument: one compiled variant


@triton.jit(do_not_specialize=["flag_addr", "limit"])
def spin_kernel(flag_addr, out_ptr, limit):
    flag = flag_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    seen = tl.load(flag, volatile=True)
    count = tl.zeros([], dtype=tl.int64)
    while (seen == 0) & (count < limit):
        seen = tl.load(flag, volatile=True)
        count += 1
    tl.store(out_ptr, seen.to(tl.int64))
    tl.store(out_ptr + 1, count)


@triton.jit(do_not_specialize=["dst_addr"])
def peek_kernel(src_ptr, dst_addr, n, BLOCK: tl.constexpr):
    at = tl.arange(0, BLOCK)
    inside = at < n
    values = tl.load(src_ptr + at, mask=inside, other=0, volatile=True)
    dst = dst_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    tl.store(dst + at, values.to(tl.int64), mask=inside)


def launch_spin(flag: Tensor, out: Tensor, limit: int) -> None:
    """Enqueue the spin on the current stream: ``flag`` a pinned int32 CPU tensor, ``out`` an
    int64 ``[2]`` device tensor (flag seen last, iterations)."""
    assert flag.is_pinned() and flag.dtype == torch.int32, "the flag lives in pinned memory"
    assert out.is_cuda and out.dtype == torch.int64 and out.numel() >= 2
    spin_kernel[(1,)](flag.data_ptr(), out, min(int(limit), MAX_SPINS), num_warps=1)


def launch_peek(src: Tensor, dst: Tensor) -> None:
    """Enqueue ``dst[:] = src`` on the current stream: ``src`` an int64 device tensor, ``dst``
    a pinned int64 CPU tensor of the same size."""
    assert src.is_cuda and src.dtype == torch.int64 and src.is_contiguous()
    assert dst.is_pinned() and dst.dtype == torch.int64 and dst.numel() == src.numel()
    n = src.numel()
    block = max(16, 1 << (n - 1).bit_length())
    peek_kernel[(1,)](src, dst.data_ptr(), n, BLOCK=block, num_warps=1)


_SPINS_PER_MS: list[float] = []


def spins_per_ms() -> float:
    """Spin iterations per millisecond on this device, measured once (the first launch also
    compiles and loads the kernel)."""
    if not _SPINS_PER_MS:
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        out = torch.zeros(2, dtype=torch.int64, device="cuda")
        launch_spin(flag, out, 1000)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        launch_spin(flag, out, CALIBRATION_SPINS)
        end.record()
        end.synchronize()
        code, spins = out.tolist()
        assert code == 0 and spins == CALIBRATION_SPINS, (code, spins)
        _SPINS_PER_MS.append(spins / max(start.elapsed_time(end), 1e-3))
    return _SPINS_PER_MS[0]


def spins_for_ms(ms: float) -> int:
    return max(1000, min(MAX_SPINS, int(ms * spins_per_ms())))


@dataclass(frozen=True)
class SpinResult:
    released: bool  # the spin ended because the flag was set (False: its limit ended it)
    spins: int


class FlagHold:
    """One hold. Build it before anything is enqueued for the race (it allocates), then:
    ``launch()`` on the stream to hold, the racing commands and the call under test,
    ``hold_then_release(raced)``, synchronize, ``result()``."""

    def __init__(self, limit_ms: float = HOLD_LIMIT_MS) -> None:
        self.limit = spins_for_ms(limit_ms)
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.out = torch.full((2,), -1, dtype=torch.int64, device="cuda")
        self.ended = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.polled_ms = 0.0
        self.launched = False

    def launch(self) -> None:
        """Enqueue the spin on the current stream, and an event behind it."""
        assert not self.launched, "a FlagHold holds once"
        self.flag.zero_()
        launch_spin(self.flag, self.out, self.limit)
        self.ended.record()
        self.launched = True

    def hold_then_release(
        self,
        raced: Callable[[], bool],
        control: Callable[[], bool] = lambda: True,
        poll_ms: float = POLL_MS,
    ) -> tuple[bool, bool]:
        """Poll ``raced()`` while the hold is in place, up to ``poll_ms`` (stopping early when
        it is true or when the spin ended on its own), then release the flag. ``control()``
        (work that nothing orders behind the hold) is polled alongside. Returns whether each
        was seen true while held (meaningful only when ``result().released``)."""
        assert self.launched, "launch() first"
        start = time.perf_counter()
        seen = ran = False
        try:
            while True:
                seen = raced()
                ran = ran or control()  # after raced(): what raced, ran after the control
                if seen or self.ended.query():
                    break
                if (time.perf_counter() - start) * 1e3 >= poll_ms:
                    break
                time.sleep(200e-6)
        finally:
            self.polled_ms = (time.perf_counter() - start) * 1e3
            self.release()
        return seen, ran

    def release(self) -> None:
        self.flag.fill_(1)

    def result(self) -> SpinResult:
        """How the spin ended (once the device is idle)."""
        code, spins = self.out.tolist()
        assert code >= 0, "the spin has not run (synchronize before reading its result)"
        return SpinResult(released=code != 0, spins=int(spins))


class Peek:
    """A small int64 device tensor, read on a stream of its own into pinned memory: the host
    sees its value without waiting for held streams. Built (and its kernel loaded) before the
    hold."""

    def __init__(self, src: Tensor) -> None:
        self.src = src
        self.dst = torch.zeros(src.numel(), dtype=torch.int64, pin_memory=True)
        # The high-priority pool: never one of the default-priority streams a test holds.
        self.stream = torch.cuda.Stream(priority=-1)  # type: ignore[no-untyped-call]
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        assert self.read() is not None, "the first peek did not complete"

    def read(self, wait_ms: float = 50.0) -> list[int] | None:
        """The tensor's values now, or None when the peek did not complete in ``wait_ms``."""
        with torch.cuda.stream(self.stream):
            launch_peek(self.src, self.dst)
            self.done.record()
        start = time.perf_counter()
        while not self.done.query():
            if (time.perf_counter() - start) * 1e3 >= wait_ms:
                return None
            time.sleep(50e-6)
        return [int(v) for v in self.dst.tolist()]
