"""`python -m rowcache.demo` runs both providers and both splits, and its checks pass."""

from __future__ import annotations

import pytest

from rowcache import demo


def test_demo_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    for provider in ("cached", "row"):
        for split in ("token", "expert"):
            assert any(line.split()[:2] == [provider, split] for line in out.splitlines())
    assert "ok: token split exact" in out


def test_demo_check_flags_an_inexact_token_split() -> None:
    row: dict[str, object] = {
        "provider": "row",
        "split": "token",
        "misses": 10,
        "evictions": 4,
        "max_abs_error": 1e-7,
        "scale": 1.0,
    }
    assert demo.check(row) is not None
    assert demo.check({**row, "max_abs_error": 0.0}) is None
