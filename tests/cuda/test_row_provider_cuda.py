"""RowCacheWeightProvider on a CUDA device: data, ordering under slow readers, no host block,
and PyTorch's stream sanitizer (CSAN) on real runs. Skipped without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rowcache import RowCacheWeightProvider
from rowcache.backends.cuda import CudaBackend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

E = 8
ROOT = Path(__file__).resolve().parents[2]
FP8 = torch.float8_e4m3fn


def sources() -> dict[str, torch.Tensor]:
    e = torch.arange(E, dtype=torch.float32)
    pow2 = 2.0 ** torch.arange(4, dtype=torch.float32)
    return {
        "w13": e.view(-1, 1, 1) * 100 + torch.arange(8.0).view(1, 4, 2),
        "w2": (e.view(-1, 1, 1) + torch.arange(8.0).view(1, 2, 4) / 16).to(torch.bfloat16),
        "w13_scale": ((e.view(-1, 1) + 1) / 4 * pow2.view(1, 4)).view(-1, 4, 1).to(FP8),
        "w2_scale": ((e.view(-1, 1) + 1) / 4 * pow2[:2].view(1, 2)).view(-1, 2, 1).to(FP8),
        "w13_scale_2": e * 3 + 0.125,
        "w2_scale_2": e * 7 + 0.25,
    }


def new_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def gpu_sleep(cycles: int) -> None:
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def make(capacity: int) -> RowCacheWeightProvider:
    return RowCacheWeightProvider(capacity=capacity, device="cuda", **sources())  # type: ignore[arg-type]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def check_slots(p: RowCacheWeightProvider, expert_map: torch.Tensor, requested: set[int]) -> None:
    torch.cuda.synchronize()
    src = sources()
    bufs = [p.buf_w13, p.buf_w2, p.buf_w13_scale, p.buf_w2_scale, p.buf_w13_scale_2,
            p.buf_w2_scale_2]  # fmt: skip
    for e, slot in enumerate(expert_map.tolist()):
        if e not in requested:
            assert slot == -1
            continue
        for name, buf in zip(src, bufs, strict=True):
            assert buf is not None
            assert torch.equal(raw(buf[slot]), raw(src[name][e])), (name, e, slot)


def test_picks_the_cuda_backend_and_pins_sources() -> None:
    p = make(3)
    assert isinstance(p.backend, CudaBackend)
    assert p.buf_w13.is_cuda and p.backend.forward_map.is_cuda


def test_data_across_streams_owner_changes_and_invalidate() -> None:
    p = make(3)
    streams = [new_stream(), new_stream()]
    calls = [[0, 1], [1, 2], [3], [4, 5, 0], [6], [2, 7], [0], [5, 6, 7], [1, 2, 3]]
    for i, call in enumerate(calls):
        with torch.cuda.stream(streams[i % 2]):
            result = p.prepare(torch.tensor([call], device="cuda"))
            if i % 3 == 2:
                p.invalidate(call[0])
                p.prepare(torch.tensor([call], device="cuda"))
        check_slots(p, result.expert_map, set(call))
    stats = p.stats()
    assert stats["owner_changes"] >= len(calls) - 1
    assert stats["evictions"] > 0 and stats["invalidations"] == 3


def slow_reader_rounds() -> list[bool]:
    """A read held back on stream A, then a prepare on stream B that evicts its slot: for
    each round, whether the read still saw the old expert."""
    p = make(1)
    a, b = new_stream(), new_stream()
    seen = []
    for round_ in range(5):
        with torch.cuda.stream(a):
            result = p.prepare(torch.tensor([[round_ % E]]))
            gpu_sleep(50_000_000)  # tens of ms of GPU time before the read
            # Indexed on the device: a host-side index (.item()) would wait for the sleep. The
            # clamp keeps a broken schedule (a map already rewritten to -1) from asserting.
            slot = result.expert_map[round_ % E : round_ % E + 1].to(torch.int64).clamp(min=0)
            seen.append(result.w1.index_select(0, slot)[0])
        with torch.cuda.stream(b):
            p.prepare(torch.tensor([[(round_ + 1) % E]]))
    torch.cuda.synchronize()
    src = sources()["w13"]
    return [torch.equal(got.cpu(), src[round_ % E]) for round_, got in enumerate(seen)]


def test_a_slow_reader_is_never_overwritten() -> None:
    assert all(slow_reader_rounds())


def test_without_the_release_wait_the_slow_reader_is_overwritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types
    from dataclasses import replace

    from model_check import codegen
    from model_check.table import load_table
    from rowcache import row_provider

    table = load_table()
    op = table.op("prepare")
    steps = tuple(s for s in op.steps if (s.kind, s.stream) != ("wait_event", "copy"))
    module = types.ModuleType("mutant")
    exec(codegen.generate(table.with_op(replace(op, steps=steps))), module.__dict__)
    monkeypatch.setattr(row_provider, "run_prepare", module.run_prepare)
    assert not any(slow_reader_rounds())


def test_prepare_and_invalidate_never_block_on_consumer_work() -> None:
    """With topk_ids on the host (a GPU topk_ids costs a device-to-host read of its experts,
    on the current stream, before anything else: that is validation, not the schedule)."""
    p = make(2)
    p.prepare(torch.tensor([[0, 1]]))
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    gpu_sleep(2_000_000_000)  # about a second of GPU time queued on the owner
    start = time.perf_counter()
    for e in range(2, 8):
        p.prepare(torch.tensor([[e]]))
        p.invalidate(e)
    host = time.perf_counter() - start
    assert not stream.query(), "the sleep finished already: the test proves nothing"
    torch.cuda.synchronize()
    print(f"6 prepares and 6 invalidates behind a 1 s GPU sleep: {host * 1e3:.2f} ms of host time")
    assert host < 0.2, f"host blocked for {host:.3f} s"


SANITIZED = """
import sys, torch
import torch.cuda._sanitizer as csan
csan.enable_cuda_sanitizer()
from rowcache import RowCacheWeightProvider
import rowcache.row_provider as rp
if sys.argv[1] == "mutant":
    import types
    from model_check import codegen
    from model_check.table import load_table
    from dataclasses import replace
    t = load_table(); op = t.op("prepare")
    steps = tuple(s for s in op.steps if not (s.kind == "wait_event" and s.stream == "copy"))
    mod = types.ModuleType("m")
    exec(codegen.generate(t.with_op(replace(op, steps=steps))), mod.__dict__)
    rp.run_prepare = mod.run_prepare
w = torch.arange(8.0).view(8, 1, 1).expand(8, 64, 64).contiguous()
p = RowCacheWeightProvider(w, w.clone(), capacity=2, device="cuda")
a, b = torch.cuda.Stream(), torch.cuda.Stream()
out = []
for i in range(6):
    with torch.cuda.stream(a if i % 2 else b):
        r = p.prepare(torch.tensor([[i, i + 1]]))
        # The consumer reads the map and each slot (CSAN tracks a view by its address).
        out.append(r.expert_map.sum() + sum(r.w1[s].sum() for s in range(2)))
        if i == 3:
            p.invalidate(i)
torch.cuda.synchronize()
print("clean")
"""


def _sanitized(mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-c", SANITIZED, mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def test_stream_sanitizer_finds_no_race_in_a_real_run() -> None:
    done = _sanitized("real")
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-4000:]


def test_stream_sanitizer_reports_the_mutant() -> None:
    done = _sanitized("mutant")
    assert "CSAN detected a possible data race" in done.stderr, (done.stdout, done.stderr[-4000:])
