"""`python -m rowcache.demo` runs the three routes the plugin runs, finds each bit-identical
to one call with every expert resident, and fails when a route is not."""

from __future__ import annotations

import pytest

from rowcache import demo


def test_demo_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    for planner, split in (("host", "token"), ("host", "expert"), ("device", "expert")):
        [line] = [line for line in out.splitlines() if line.split()[:2] == [planner, split]]
        assert line.split()[-1] == "0"  # no value differs
    assert "ok: every route bit-identical to one call with every expert resident" in out


def test_a_seeded_inexact_route_fails_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    """The expert split through the reduced route (each group's output reduced, the groups
    summed in float32): the numbers are close, the bits are not, and the demo says so."""
    seeded = [demo.Route("host", "expert", demo.reduced_route)]
    assert demo.main([], routes=seeded) == 1
    captured = capsys.readouterr()
    assert "FAIL host/expert:" in captured.err and "every bit must match" in captured.err
    assert "ok:" not in captured.out


def test_demo_check_flags_counters_that_do_not_add_up() -> None:
    row: dict[str, object] = {
        "planner": "host",
        "split": "token",
        "misses": 10,
        "evictions": 4,
        "differing": 0,
        "max_abs_error": 0.0,
    }
    assert demo.check(row) is None
    assert demo.check({**row, "evictions": 3}) is not None
    assert demo.check({**row, "differing": 1, "max_abs_error": 1e-7}) is not None
