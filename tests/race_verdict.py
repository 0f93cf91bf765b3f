"""What one run of a device-path race fixture shows, and when a fixture has decided.

Pure Python (no torch): CPU CI tests it (``tests/test_race_verdict.py``); the GPU fixtures in
``tests/cuda/test_device_planner_cuda.py`` feed it what they observed.

A race fixture holds the racing work behind a kernel that spins on a flag in pinned host
memory, makes the call under test, then polls (bounded) whether the call's racing work
completed while the hold was still in place, and only then releases the flag. Once the device
is idle it compares what readers saw and the device state with the CPU reference. One run
gives an ``Observation``:

* ``wrong_reads`` / ``state_mismatches``: violations seen (a reader or a snapshot saw bytes
  that are not its expert's; the maps, owners, counters or LRU order differ from the
  reference);
* ``released``: the hold ended because the test released it, after the call and the poll
  (False: the spin reached its iteration limit first, so the hold did not last);
* ``raced``: the racing work (the GPU work that must wait, or that a mutant lets run early)
  completed while the hold was in place;
* ``control``: work on the racing stream that nothing orders behind the hold completed while
  the hold was in place (the device ran the streams concurrently, so the racing work could
  have run).

``decide`` turns it into a verdict, for the correct provider or for a mutant (a seeded
ordering bug the fixture must detect):

=========  ==========  ======  =======  ===========================  ============================
violation  hold ended  raced   control  correct provider             mutant
=========  ==========  ======  =======  ===========================  ============================
yes        either      either  either   FAIL (a bug: bytes or state  FAIL (detected)
                                        wrong, whatever the timing)
no         at its      either  either   INCONCLUSIVE: the hold       INCONCLUSIVE: the hold timed
           limit                        timed out before release     out before release
no         released    yes     either   INCONCLUSIVE: it ran while   PASS (a race was staged and
                                        held yet nothing was wrong,  nothing was wrong: the
                                        which proves nothing         mutant went undetected)
no         released    no      yes      PASS (the racing work        INCONCLUSIVE: the racing
                                        waited for the held work)    work did not run while held,
                                                                     no race was staged
no         released    no      no       INCONCLUSIVE: the device     INCONCLUSIVE: the same
                                        ran nothing of the racing
                                        stream while held, so
                                        waiting proves nothing
=========  ==========  ======  =======  ===========================  ============================

A violation decides on its own: the provider promises right bytes and state under any timing,
so a wrong read is a bug of the correct provider and a detection of a mutant, held or not.
Without one, a run decides only when the hold lasted until the release: then, for the correct
provider, racing work that stayed pending while unordered work on its stream ran is the
ordering under test (PASS); for a mutant, racing work that ran while held has staged the race
it must lose (a clean result is then a real miss, not bad luck). The other cases prove nothing
and are retried.

``settle`` runs a fixture until it decides, at most ``attempts`` times: the correct provider
must PASS, a mutant must FAIL (be detected); any other decided verdict, or ``attempts``
inconclusive runs, raises ``FixtureFailure`` naming every run's reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal

__all__ = [
    "ATTEMPTS",
    "FixtureFailure",
    "Observation",
    "Outcome",
    "Role",
    "Verdict",
    "decide",
    "log_outcomes",
    "settle",
]

ATTEMPTS = 3
"""Runs of one fixture before ``settle`` gives up on inconclusive results."""

Role = Literal["correct", "mutant"]


class Verdict(Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Observation:
    """What one run of a race fixture saw (see the module docstring)."""

    released: bool
    raced: bool
    control: bool = True
    wrong_reads: tuple[str, ...] = ()
    state_mismatches: tuple[str, ...] = ()
    spins: int = 0  # iterations of the spinning kernel
    polled_ms: float = 0.0  # host time spent polling for the racing work while held

    @property
    def violations(self) -> tuple[str, ...]:
        return self.wrong_reads + self.state_mismatches


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    reason: str
    observation: Observation = field(repr=False)


HOLD_TIMED_OUT = (
    "the hold timed out before release (the spin reached its iteration limit after {spins} "
    "iterations: the host was held up in the call or the poll)"
)
NOT_STAGED = (
    "the racing work did not run while the hold was in place ({polled_ms:.0f} ms polled): no "
    "race could be staged"
)
SERIALIZED = (
    "work on the racing stream that nothing orders behind the hold did not run while held "
    "({polled_ms:.0f} ms polled): the device serialized the streams, nothing could race"
)
PROVES_NOTHING = (
    "the racing work completed while held, yet every read and the state were right: this "
    "proves nothing"
)


def decide(observation: Observation, role: Role) -> Outcome:
    """The verdict of one run (the table of the module docstring)."""
    o = observation
    if o.violations:
        return Outcome(Verdict.FAIL, "; ".join(o.violations), o)
    if not o.released:
        return Outcome(Verdict.INCONCLUSIVE, HOLD_TIMED_OUT.format(spins=o.spins), o)
    if o.raced:
        if role == "correct":
            return Outcome(Verdict.INCONCLUSIVE, PROVES_NOTHING, o)
        return Outcome(
            Verdict.PASS,
            "the racing work ran while held and every read and the state were right",
            o,
        )
    if not o.control:
        return Outcome(Verdict.INCONCLUSIVE, SERIALIZED.format(polled_ms=o.polled_ms), o)
    if role == "correct":
        return Outcome(
            Verdict.PASS, f"the racing work waited while held ({o.polled_ms:.0f} ms polled)", o
        )
    return Outcome(Verdict.INCONCLUSIVE, NOT_STAGED.format(polled_ms=o.polled_ms), o)


class FixtureFailure(AssertionError):
    """A race fixture decided against what its role requires, or never decided."""


WANTED = {"correct": Verdict.PASS, "mutant": Verdict.FAIL}


def settle(
    name: str,
    observe: Callable[[], Observation],
    role: Role,
    attempts: int = ATTEMPTS,
    record: Callable[[Outcome, int], None] | None = None,
) -> list[Outcome]:
    """Run ``observe`` until a run decides, at most ``attempts`` times; return every outcome
    when the decision is the one ``role`` requires (PASS for the correct provider, FAIL for a
    mutant), else raise ``FixtureFailure`` naming every run's verdict and reason.
    ``record(outcome, attempt)``, when given, sees every run (the conformance logs)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    outcomes: list[Outcome] = []
    for attempt in range(1, attempts + 1):
        outcome = decide(observe(), role)
        outcomes.append(outcome)
        if record is not None:
            record(outcome, attempt)
        if outcome.verdict is Verdict.INCONCLUSIVE:
            continue
        if outcome.verdict is WANTED[role]:
            return outcomes
        what = (
            "the correct provider violated the ordering"
            if role == "correct"
            else "the mutant was not detected"
        )
        raise FixtureFailure(f"{name}: {what}\n{describe(outcomes)}")
    raise FixtureFailure(
        f"{name} ({role}): inconclusive in all {attempts} runs, it decided nothing\n"
        f"{describe(outcomes)}"
    )


def describe(outcomes: Sequence[Outcome]) -> str:
    """One line per run: its verdict and reason."""
    return "\n".join(
        f"  run {n}: {o.verdict.value.upper()}: {o.reason}" for n, o in enumerate(outcomes, 1)
    )


def log_outcomes(
    provider: str,
    fixture: str,
    outcome: Outcome,
    attempt: int,
    folder: str | None = None,
) -> None:
    """Append one run to ``fixtures.jsonl`` under ``folder`` (default:
    ``$ROWCACHE_CONFORMANCE_LOGS``; nothing when neither is set), in the rows of
    ``tests/cuda/race_fixtures.py``: ``provider``, ``fixture``, ``findings`` (``[kind,
    detail]`` pairs, kinds ``wrong_read`` and ``wrong_map``) and ``inconclusive`` (the reason,
    or empty), plus this module's ``verdict``, ``reason``, ``attempt`` and observation."""
    folder = folder if folder is not None else os.environ.get("ROWCACHE_CONFORMANCE_LOGS")
    if not folder:
        return
    o = outcome.observation
    row = {
        "provider": provider,
        "fixture": fixture,
        "findings": [["wrong_read", d] for d in o.wrong_reads]
        + [["wrong_map", d] for d in o.state_mismatches],
        "inconclusive": outcome.reason if outcome.verdict is Verdict.INCONCLUSIVE else "",
        "verdict": outcome.verdict.value,
        "reason": outcome.reason,
        "attempt": attempt,
        "observation": asdict(o),
    }
    path = Path(folder) / "fixtures.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
