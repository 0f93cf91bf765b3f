"""The real CUDA provider under the race fixtures: every read sees the bytes its forward map
names, every later forward sees the new bytes, the idle device map equals the host mirror,
and no provider call blocks the host on a pending reader."""

from __future__ import annotations

import pytest
from race_fixtures import (
    BLOCK_MS,
    FIXTURES,
    Report,
    every_call_behind_a_reader,
    real_provider,
    save,
)

pytestmark = pytest.mark.cuda


def describe(report: Report) -> str:
    calls = ", ".join(f"{call}: {ms:.2f} ms" for call, ms in report.calls)
    readers = ", ".join(f"{label}: {ms:.1f} ms" for label, ms in report.readers)
    found = "\n  ".join(f"[{f.kind}] {f.detail}" for f in report.findings) or "none"
    return (
        f"{report.fixture}\n  host time of each call: {calls}\n  GPU time of each reader: "
        f"{readers}\n  findings:\n  {found}"
    )


@pytest.mark.parametrize("name", [n for n in FIXTURES if n != "every_call_behind_a_reader"])
def test_race_fixture_on_the_real_provider(name: str) -> None:
    report = FIXTURES[name](real_provider)
    save("real", [report])
    print(describe(report))
    assert not report.findings, describe(report)


def test_no_provider_call_blocks_the_host_on_a_pending_reader() -> None:
    """prepare (all hits, misses, evictions, owner changes) and invalidate (resident or not,
    from the owner or another stream), each issued while one 400 ms reader runs: each returns
    with the reader still running, in well under BLOCK_MS of host time."""
    report = every_call_behind_a_reader(real_provider)
    save("real", [report])
    print(describe(report))
    assert not report.findings, describe(report)
    assert len(report.calls) == 10
    slowest = max(ms for _, ms in report.calls[1:])  # the calls made behind the reader
    assert slowest < BLOCK_MS, describe(report)
