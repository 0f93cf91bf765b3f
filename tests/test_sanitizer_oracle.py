"""PyTorch's stream sanitizer as an independent oracle over recorded traces.

The conformance machine (tests/test_conformance.py) replays every run's trace through
``sanitizer_oracle`` and requires it clean. Here: the adapter itself, and proof that the
oracle is awake: traces of mutated tables, whose missing or misplaced event is exactly what
lets a copy overwrite a slot under a pending read (or a map write race another), are reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis.stateful import run_state_machine_as_test
from sanitizer_oracle import races
from test_conformance import MUTANT_SETTINGS, Conformance, no_release_wait, schedules_from

from model_check.streams.queues import host_call, initial_state
from model_check.table import Step, Table, load_table
from model_check.table.reference import Bounds
from rowcache import RowCacheWeightProvider
from rowcache import row_provider as row_provider_module
from rowcache.backends import RecordingBackend
from rowcache.backends.base import Plan, Roles
from rowcache.schedules import _generated

TABLE = load_table()

Call = tuple[str, tuple[object, ...], int]


def model_trace(table: Table, capacity: int, calls: list[Call], experts: int = 3) -> list[str]:
    """The device calls of a sequence of host calls, as the model records them."""
    bounds = Bounds(num_experts=experts, capacity=capacity, consumer_streams=2)
    state = initial_state(bounds)
    lines: list[str] = []
    for op, args, stream in calls:
        out = host_call(table, bounds, state, op, args, stream)
        state = out.state
        lines += out.trace
    return lines


def replace_step(table: Table, op: str, match: Callable[[Step], bool], **changes: str) -> Table:
    operation = table.op(op)
    steps = tuple(replace(s, **changes) if match(s) else s for s in operation.steps)
    return table.with_op(replace(operation, steps=steps))


def drop_step(table: Table, op: str, match: Callable[[Step], bool]) -> Table:
    operation = table.op(op)
    return table.with_op(
        replace(operation, steps=tuple(s for s in operation.steps if not match(s)))
    )


# A read is pending on slot 0 when the next prepare refills it (capacity 1).
REFILL_UNDER_READ: list[Call] = [
    ("prepare", ((0,),), 0),
    ("read", (), 0),
    ("prepare", ((1,),), 0),
]
# The same, with the second prepare made on another stream (owner change).
REFILL_AFTER_OWNER_CHANGE: list[Call] = [
    ("prepare", ((0,),), 0),
    ("read", (), 0),
    ("prepare", ((1,),), 1),
    ("read", (), 1),
]
# A map written by invalidate on a stream that is not the owner.
INVALIDATE_FROM_OTHER_STREAM: list[Call] = [
    ("prepare", ((0,),), 0),
    ("read", (), 0),
    ("invalidate", (0,), 1),
    ("prepare", ((1,),), 1),
]
SCENARIOS = [REFILL_UNDER_READ, REFILL_AFTER_OWNER_CHANGE, INVALIDATE_FROM_OTHER_STREAM]


def is_release_wait(s: Step) -> bool:
    return (s.kind, s.stream, s.event) == ("wait_event", "copy", "release")


def is_release_record(s: Step) -> bool:
    return (s.kind, s.event) == ("record_event", "release")


def is_ready_wait(s: Step) -> bool:
    return (s.kind, s.stream, s.event) == ("wait_event", "current", "ready")


def is_invalidate_upload(s: Step) -> bool:
    return s.kind in ("upload_map", "release_staging")


MUTATED: dict[str, tuple[Table, list[Call], str]] = {
    "drop the copy stream's wait on release": (
        drop_step(TABLE, "prepare", is_release_wait),
        REFILL_UNDER_READ,
        "slot 0",
    ),
    "record release on the current stream": (
        replace_step(TABLE, "prepare", is_release_record, stream="current"),
        REFILL_AFTER_OWNER_CHANGE,
        "slot 0",
    ),
    "skip the owner's wait on ready": (
        drop_step(TABLE, "prepare", is_ready_wait),
        REFILL_UNDER_READ[:2],
        "slot 0",
    ),
    "invalidate's map write on the current stream": (
        replace_step(TABLE, "invalidate", is_invalidate_upload, stream="current"),
        INVALIDATE_FROM_OTHER_STREAM,
        "resident map",
    ),
}


@pytest.mark.parametrize("calls", SCENARIOS)
def test_real_table_traces_are_clean(calls: list[Call]) -> None:
    trace = model_trace(TABLE, 1, calls)
    assert any(line.startswith("read") for line in trace)
    assert races(trace) == []


@pytest.mark.parametrize("name", list(MUTATED))
def test_mutated_table_is_reported(name: str) -> None:
    table, calls, pointer = MUTATED[name]
    assert races(model_trace(TABLE, 1, calls)) == []
    found = races(model_trace(table, 1, calls))
    assert found, f"{name}: the sanitizer found nothing"
    assert any(r.pointer == pointer for r in found), [str(r) for r in found]


def test_mutated_provider_trace_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider running schedules generated from a table without the release wait."""

    def trace(backend: RecordingBackend) -> list[str]:
        w13 = torch.arange(3.0).view(3, 1, 1).expand(3, 2, 2).clone()
        p = RowCacheWeightProvider(w13, w13.clone(), capacity=1, device="cpu", backend=backend)
        p.prepare(torch.tensor([[0]]))
        pairs = p.forward_pairs
        assert pairs is not None
        roles = Roles(0, p.owner, backend.copy_stream)
        _generated.run_read(backend, roles, Plan(forward_pairs=pairs))
        p.prepare(torch.tensor([[1]]))
        return backend.take()

    clean = trace(RecordingBackend())
    assert races(clean) == []
    mutant = schedules_from(no_release_wait(TABLE))
    monkeypatch.setattr(row_provider_module, "run_prepare", mutant.run_prepare)
    found = races(trace(RecordingBackend()))
    assert [str(r) for r in found] == [
        "slot 0: `copy expert 1 to slot 0 on 2` is not ordered after `read {0->slot0} on 0`"
    ]


def test_host_sync_orders_everything() -> None:
    lines = [
        "copy expert 0 to slot 0 on 2",
        "host_sync all",
        "read {0->slot0} on 0",
        "copy expert 1 to slot 0 on 2",
    ]
    assert [str(r) for r in races(lines)] == [
        "slot 0: `copy expert 1 to slot 0 on 2` is not ordered after `read {0->slot0} on 0`"
    ]
    assert races(lines[:3]) == []


def test_unknown_lines_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown trace line"):
        races(["launch the missiles"])
    with pytest.raises(ValueError, match="names the role"):
        races(["host_sync copy"])


class AgainstMutatedTable(Conformance):
    """Provider and model both run the table without the release wait, so they agree on
    every trace line; only the sanitizer, replaying the traces, can tell."""

    table = no_release_wait(TABLE)
    model_checks = False


def test_the_machine_s_sanitizer_catches_what_conformance_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mutant = schedules_from(AgainstMutatedTable.table)
    monkeypatch.setattr(row_provider_module, "run_prepare", mutant.run_prepare)
    with pytest.raises(AssertionError, match="sanitizer: "):
        run_state_machine_as_test(AgainstMutatedTable, settings=MUTANT_SETTINGS)


# -- importing the oracle leaves the process unsanitized unless the sanitizer is enabled ---------

_COUNT = """
import os, sys
sys.path[:0] = [{tests!r}]
{first}
import torch.cuda._gpu_trace as gpu_trace
import torch.cuda._sanitizer as csan
handler = csan.cuda_sanitizer.dispatch.event_handler
print(sum(
    getattr(cb, "__self__", None) is handler
    for registry in vars(gpu_trace).values()
    for cb in getattr(registry, "callback_list", ())
))
"""


def _handler_callbacks(first: str, sanitize: bool) -> int:
    """The sanitizer handler's callbacks in the GPU trace of a fresh Python after ``first``."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_SANITIZER"}
    if sanitize:
        env["TORCH_CUDA_SANITIZER"] = "1"
    tests = str(Path(__file__).resolve().parent)
    script = _COUNT.format(tests=tests, first=first)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_importing_the_sanitizer_module_registers_its_handler_for_the_whole_process() -> None:
    # What the oracle undoes: torch's own import-time behaviour (were torch to stop doing it,
    # this fails, and the oracle's detaching can go).
    assert _handler_callbacks("", sanitize=False) == 10


def test_importing_the_oracle_takes_the_handler_off_where_the_sanitizer_is_not_enabled() -> None:
    assert _handler_callbacks("import sanitizer_oracle", sanitize=False) == 0


def test_the_oracle_leaves_an_enabled_sanitizer_its_handler() -> None:
    # TORCH_CUDA_SANITIZER=1: torch enables the sanitizer as it is imported, before the oracle.
    assert _handler_callbacks("import sanitizer_oracle", sanitize=True) == 10


@pytest.mark.parametrize("detached", [False, True])
def test_the_gpu_suite_refuses_a_sanitizer_pass_whose_handler_is_off(
    tmp_path: Path, detached: bool
) -> None:
    """tests/cuda's start under TORCH_CUDA_SANITIZER: it goes on with the handler attached, and
    refuses to run when something took it off (seeded here by a sitecustomize that clears the
    GPU trace's registries before pytest starts)."""
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    if detached:
        (tmp_path / "sitecustomize.py").write_text(
            "import torch.cuda._gpu_trace as gpu_trace\n"
            "for registry in vars(gpu_trace).values():\n"
            "    if hasattr(registry, 'callback_list'):\n"
            "        registry.callback_list.clear()\n"
        )
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/cuda", "-p", "no:cacheprovider", "--co", "-q"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=False,
    )
    said = "TORCH_CUDA_SANITIZER is set but the stream sanitizer gets no GPU events"
    if detached:
        assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout[-2000:]
        assert said in done.stderr
    else:
        assert done.returncode == pytest.ExitCode.OK, done.stdout[-2000:] + done.stderr[-2000:]
