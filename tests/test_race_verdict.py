"""The device-path race fixtures' verdicts and retries (``tests/race_verdict.py``), on the CPU:
every row of the verdict table for both roles, a violation failing the correct provider and
detecting a mutant, a retry deciding after an inconclusive run, and inconclusive runs that
exhaust the retries failing with every reason named."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from race_verdict import (
    ATTEMPTS,
    FixtureFailure,
    Observation,
    Outcome,
    Role,
    Verdict,
    decide,
    log_outcomes,
    settle,
)

CLEAN_WAIT = Observation(released=True, raced=False, polled_ms=300.0)
"""The correct provider's good run: held for the whole poll, the racing work waited."""
CLEAN_RACE = Observation(released=True, raced=True, polled_ms=1.0)
"""A staged race (the racing work ran while held) with nothing wrong."""
WRONG_READ = Observation(
    released=True, raced=True, wrong_reads=("pending reader saw slot 0 overwritten (expert 0)",)
)
WRONG_STATE = Observation(
    released=True, raced=True, state_mismatches=("resident: [-1, 0] != [1, -1]",)
)
TIMED_OUT = Observation(released=False, raced=False, spins=4_000_000)


def expected(o: Observation, role: Role) -> Verdict:
    """The table of ``race_verdict``'s docstring, written out again row by row."""
    if o.wrong_reads or o.state_mismatches:
        return Verdict.FAIL
    if not o.released:
        return Verdict.INCONCLUSIVE
    if o.raced:
        return Verdict.INCONCLUSIVE if role == "correct" else Verdict.PASS
    if not o.control:
        return Verdict.INCONCLUSIVE
    return Verdict.PASS if role == "correct" else Verdict.INCONCLUSIVE


@pytest.mark.parametrize(
    ("violation", "released", "raced", "control", "role"),
    list(
        itertools.product(
            ("none", "read", "state"),
            (True, False),
            (True, False),
            (True, False),
            ("correct", "mutant"),
        )
    ),
)
def test_every_row_of_the_table(
    violation: str, released: bool, raced: bool, control: bool, role: Role
) -> None:
    o = Observation(
        released=released,
        raced=raced,
        control=control,
        wrong_reads=("wrong bytes",) if violation == "read" else (),
        state_mismatches=("state differs",) if violation == "state" else (),
    )
    outcome = decide(o, role)
    assert outcome.verdict is expected(o, role)
    assert outcome.reason
    if violation != "none":
        assert ("wrong bytes" if violation == "read" else "state differs") in outcome.reason


def test_inconclusive_reasons_say_why() -> None:
    assert "timed out before release" in decide(TIMED_OUT, "correct").reason
    assert "4000000 iterations" in decide(TIMED_OUT, "mutant").reason
    assert "no race could be staged" in decide(CLEAN_WAIT, "mutant").reason
    assert "proves nothing" in decide(CLEAN_RACE, "correct").reason
    serialized = Observation(released=True, raced=False, control=False)
    for role in ("correct", "mutant"):
        assert "serialized the streams" in decide(serialized, role).reason  # type: ignore[arg-type]


def runs(*observations: Observation) -> tuple[list[int], Callable[[], Observation]]:
    """An ``observe`` that returns the given observations in turn, counting its calls."""
    calls: list[int] = []
    it = iter(observations)

    def observe() -> Observation:
        calls.append(1)
        return next(it)

    return calls, observe


def test_correct_provider_passes() -> None:
    calls, observe = runs(CLEAN_WAIT)
    outcomes = settle("race", observe, "correct")
    assert [o.verdict for o in outcomes] == [Verdict.PASS] and len(calls) == 1


@pytest.mark.parametrize("seeded", [WRONG_READ, WRONG_STATE], ids=["wrong_read", "wrong_state"])
def test_a_violation_fails_the_correct_provider_at_once(seeded: Observation) -> None:
    """A seeded bug's observation is a failure, not retried away."""
    calls, observe = runs(seeded, CLEAN_WAIT)
    with pytest.raises(FixtureFailure, match="the correct provider violated the ordering") as info:
        settle("race", observe, "correct")
    assert seeded.violations[0] in str(info.value)
    assert len(calls) == 1


@pytest.mark.parametrize("seeded", [WRONG_READ, WRONG_STATE], ids=["wrong_read", "wrong_state"])
def test_a_violation_detects_the_mutant(seeded: Observation) -> None:
    calls, observe = runs(seeded)
    outcomes = settle("race", observe, "mutant")
    assert [o.verdict for o in outcomes] == [Verdict.FAIL] and len(calls) == 1


def test_a_staged_race_without_violation_fails_the_mutant_test_at_once() -> None:
    calls, observe = runs(CLEAN_RACE, WRONG_READ)
    with pytest.raises(FixtureFailure, match="the mutant was not detected"):
        settle("race", observe, "mutant")
    assert len(calls) == 1


def test_a_retry_decides_after_inconclusive_runs() -> None:
    calls, observe = runs(TIMED_OUT, CLEAN_RACE, CLEAN_WAIT)
    outcomes = settle("race", observe, "correct")
    assert [o.verdict for o in outcomes] == [
        Verdict.INCONCLUSIVE,
        Verdict.INCONCLUSIVE,
        Verdict.PASS,
    ]
    assert len(calls) == 3
    calls, observe = runs(CLEAN_WAIT, WRONG_READ)
    outcomes = settle("race", observe, "mutant")
    assert [o.verdict for o in outcomes] == [Verdict.INCONCLUSIVE, Verdict.FAIL]
    assert len(calls) == 2


def test_exhausted_retries_fail_naming_every_reason() -> None:
    calls, observe = runs(TIMED_OUT, CLEAN_RACE, TIMED_OUT, CLEAN_WAIT)
    with pytest.raises(FixtureFailure) as info:
        settle("invalidate_during_replay", observe, "correct")
    message = str(info.value)
    assert len(calls) == ATTEMPTS == 3
    assert f"inconclusive in all {ATTEMPTS} runs" in message
    assert "invalidate_during_replay" in message
    assert message.count("timed out before release") == 2
    assert "proves nothing" in message
    assert "run 3: INCONCLUSIVE" in message

    calls, observe = runs(CLEAN_WAIT, TIMED_OUT)
    with pytest.raises(FixtureFailure, match="inconclusive in all 2 runs") as info:
        settle("race", observe, "mutant", attempts=2)
    assert "no race could be staged" in str(info.value)
    assert "timed out before release" in str(info.value)


def test_every_run_is_recorded_and_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROWCACHE_CONFORMANCE_LOGS", str(tmp_path))
    seen: list[tuple[Outcome, int]] = []

    def record(outcome: Outcome, attempt: int) -> None:
        seen.append((outcome, attempt))
        log_outcomes("device: mutant", "device_replay_after_pending_reader", outcome, attempt)

    _, observe = runs(TIMED_OUT, WRONG_READ)
    settle("race", observe, "mutant", record=record)
    assert [a for _, a in seen] == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "fixtures.jsonl").read_text().splitlines()]
    assert [r["verdict"] for r in rows] == ["inconclusive", "fail"]
    assert "timed out" in rows[0]["inconclusive"] and rows[0]["findings"] == []
    assert rows[1]["inconclusive"] == ""
    assert rows[1]["findings"] == [["wrong_read", WRONG_READ.wrong_reads[0]]]
    assert rows[1]["provider"] == "device: mutant" and rows[1]["attempt"] == 2
    # The conformance summary's finding kinds (tools/run_cuda_conformance.sh).
    assert {f[0] for r in rows for f in r["findings"]} <= {"wrong_read", "wrong_map", "host_block"}


def test_nothing_is_logged_without_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ROWCACHE_CONFORMANCE_LOGS", raising=False)
    monkeypatch.chdir(tmp_path)
    log_outcomes("device: real", "f", decide(CLEAN_WAIT, "correct"), 1)
    assert list(tmp_path.iterdir()) == []


def test_attempts_must_be_positive() -> None:
    _, observe = runs(CLEAN_WAIT)
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        settle("race", observe, "correct", attempts=0)
