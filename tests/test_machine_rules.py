"""The CUDA hypothesis machine's rules, preconditions and mutant kills, on the CPU.

``tests/cuda/host_call_machine.py`` is written once for any device; the GPU suite drives it
against the real CUDA provider (``tests/cuda/test_cuda_machine.py``) and kills the GPU mutants
with it (``tests/cuda/test_gpu_mutants.py``). Here the same machine drives ``RecordingBackend``
(``RecordingRig``), so that CPU CI runs every rule on the real provider, the preconditions, a
few mutant kills with shrinking and their comparison with ``python -m model_check explain``.

``ROWCACHE_MACHINE_MUTANTS=all`` kills every GPU mutant here (about ten seconds each): the
rules draw the same examples whatever the rig, so with the same hypothesis version this
previews the GPU mutant run, except for what only a GPU checks (the bytes of the slots).
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from dataclasses import replace
from pathlib import Path

import pytest

CUDA_TESTS = Path(__file__).resolve().parent / "cuda"
if str(CUDA_TESTS) not in sys.path:  # the GPU suite's helpers (they need no GPU)
    sys.path.insert(0, str(CUDA_TESTS))

from host_call_machine import (  # noqa: E402
    PROPERTY_KINDS,
    HostCallMachine,
    Kill,
    ModelViolation,
    Record,
    RecordingRig,
    explain_to_compare,
    judge,
    kill,
    machine,
    machine_settings,
    oracle_lines,
)
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402
from mutant_provider import EXPLAIN_DEPTH, explain_calls, schedule_mutants  # noqa: E402

OPS = ("prepare", "read", "invalidate", "synchronize")
CPU_MUTANTS = (
    "no_ready_wait",  # read: the model finds a stale read (P2)
    "invalidate_map_on_current",  # invalidate: the model finds a map upload out of order (P4)
    "release_on_current",  # two prepares: the sanitizer oracle, in the teardown
)
MUTANTS = schedule_mutants() if os.environ.get("ROWCACHE_MACHINE_MUTANTS") == "all" else CPU_MUTANTS


class Draw:
    """Stands in for hypothesis's ``data`` argument when a test calls a rule itself."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, strategy: object, label: str | None = None) -> object:
        return self.value


def fresh(mutant: str | None = None, capacity: int = 2) -> HostCallMachine:
    m = machine(RecordingRig(), mutant=mutant)()
    m.setup(capacity=capacity)
    return m


def test_every_rule_runs_and_the_real_provider_passes() -> None:
    record = Record()
    run_state_machine_as_test(
        machine(RecordingRig(), record=record), settings=machine_settings(25, shrink=False)
    )
    assert record.examples >= 25
    assert all(record.calls[op] for op in OPS), dict(record.calls)


def test_preconditions_and_the_consumer_stream() -> None:
    m = fresh()
    assert not m.can_read(), "a read before any prepare"
    assert not m.can_synchronize(), "a sync with nothing enqueued"
    result = m.prepare(Draw([1, 0]), stream=1, busy=0.0)
    assert result.values == (1, 0), "the requested experts go into the bundle"
    assert m.can_read() and m.can_synchronize()
    m.read(delay=0.5)
    m.synchronize()
    assert m.can_read() and not m.can_synchronize()
    m.invalidate(expert=0, stream=2, busy=0.0)
    assert m.can_synchronize()
    m.teardown()
    assert m.calls == [
        ("prepare", ((0, 1),), 1),
        ("read", (), 1),  # on the stream of the last prepare
        ("synchronize", (), 0),
        ("invalidate", (0,), 2),
    ], "the teardown's sync is not one of the example's host calls"
    assert m.lines[-1] == "host_sync all" and m.done


def test_a_failed_check_ends_the_example_without_the_teardown_checks() -> None:
    m = fresh("no_ready_wait")
    m.prepare(Draw([0]), stream=0, busy=0.0)
    with pytest.raises(ModelViolation, match="P2_no_stale_read"):
        m.read(delay=0.0)
    assert not m.done and len(m.calls) == 2
    m.teardown()  # no sync, no oracle: the finding stands as it is


def test_oracle_lines_leave_out_only_a_sync_of_one_role() -> None:
    lines = ["host_sync owner", "record release on 0", "host_sync all"]
    assert oracle_lines(lines) == ["record release on 0", "host_sync all"]


def test_judge() -> None:
    calls = (("prepare", ((0,),), 0), ("read", (), 0))
    found = Kill("m", "model", "violates P2", calls)
    assert judge("m", found, None) == []
    assert judge("m", found, calls) == []
    assert judge("m", found, (*calls, ("synchronize", (), 0))) == []
    [longer] = judge("m", found, calls[:1])
    assert "2 host calls" in longer and "explain's has 1" in longer
    assert judge("m", None, None) == ["m: the machine did not kill the mutant"]
    [trace] = judge("m", replace(found, kind="trace"), None)
    assert "not by a property check" in trace
    assert {"model", "device data", "sanitizer oracle"} == PROPERTY_KINDS


def test_explain_calls_is_the_counterexample_explain_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "no_ready_wait"
    monkeypatch.setattr(sys, "argv", ["model_check", "explain", name])
    # run as ``python -m model_check`` runs it: not over a copy an earlier test imported
    monkeypatch.delitem(sys.modules, "model_check.__main__", raising=False)
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("model_check", run_name="__main__", alter_sys=False)
    assert exited.value.code == 0
    printed = [
        (m[1], int(m[2]))
        for line in capsys.readouterr().out.splitlines()
        if (m := re.match(r" *\d+ \| (\w+)\(.*\) on s(\d+)", line))
    ]
    calls = explain_calls(name)
    assert calls is not None
    assert printed == [(op, stream) for op, _, stream in calls] == [("prepare", 0), ("read", 0)]


def test_a_smaller_depth_finds_explains_counterexample_or_none() -> None:
    name = "no_ready_wait"  # prepare, read; then the device runs the read before the copy
    full = explain_calls(name, EXPLAIN_DEPTH)
    assert full is not None and len(full) == 2
    assert explain_calls(name, 2) == full  # found expanding a state reached by 2 host calls
    assert explain_calls(name, 1) is None
    two = Kill(name, "model", "", full)
    three = Kill(name, "model", "", (*full, ("synchronize", (), 0)))
    assert explain_to_compare(name, two) is None and judge(name, two, None) == []
    assert explain_to_compare(name, three) == full and judge(name, three, full) != []


@pytest.mark.parametrize("name", MUTANTS)
def test_the_machine_kills_a_mutant_no_longer_than_explain(name: str) -> None:
    found = kill(RecordingRig(), name, 200)
    assert found is not None, f"{name} survived"
    problems = judge(name, found, explain_to_compare(name, found))
    assert not problems, "\n".join(problems)
