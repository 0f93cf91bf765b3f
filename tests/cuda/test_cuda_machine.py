"""The hypothesis conformance machine against the real CUDA provider.

Random host calls on three consumer streams, one rule per call (``host_call_machine``):
``prepare`` and ``invalidate`` issued behind 0 to 3 ms of unrelated GPU work on their stream,
``read`` (a consumer read on the stream of the last prepare that spins 0 to 3 ms before it
snapshots the slots and maps; once a prepare was accepted) and ``synchronize`` (once a call
was made since the last). After every call the machine compares the CUDA backend's call log
with the trace the table prescribes (``trace_check.render`` against the happens-before model,
which also checks every ordering property for all interleavings), and the provider's host state
with the model's (LRU order, slots, forward map, owner, counters). At every synchronization and
at the end of each example: every read saw exactly its forward map's experts in all six tensors
and the maps as they were when it was enqueued, the idle device map equals the host mirror,
every mapped slot holds its expert, and the whole trace replays clean through the stream
sanitizer oracle.

The device side is ``cuda_rig.CudaRig``; CPU CI runs the same rules on the recording backend
(``tests/test_machine_rules.py``). The same machine kills the GPU mutants, with shrinking on
(``tests/cuda/test_gpu_mutants.py``); here, on the real provider, shrinking is off: a failure
prints its steps as they ran on the GPU.

``ROWCACHE_CUDA_EXAMPLES`` sets the number of examples (default 200).
"""

from __future__ import annotations

import os

import pytest
from cuda_rig import CudaRig
from host_call_machine import Record, machine, machine_settings
from hypothesis.stateful import run_state_machine_as_test

pytestmark = pytest.mark.cuda

EXAMPLES = int(os.environ.get("ROWCACHE_CUDA_EXAMPLES", "200"))


@pytest.mark.parametrize("compress", [False, True], ids=["bytes", "planes"])
def test_conformance_machine_on_the_real_cuda_provider(compress: bool) -> None:
    # Planes: a quarter of the examples (the decode launches join the copy step; the ordering
    # is the table's either way, and the log names each decode's real stream).
    examples = EXAMPLES if not compress else max(1, EXAMPLES // 4)
    record = Record()
    run_state_machine_as_test(
        machine(CudaRig(compress), record=record),
        settings=machine_settings(examples, shrink=False),
    )
    print(f"{record.examples} examples; host calls {dict(record.calls)}")
    assert record.examples >= examples, f"only {record.examples} examples ran"
    assert all(record.calls[op] for op in ("prepare", "read", "invalidate", "synchronize")), (
        f"a rule never ran: {dict(record.calls)}"
    )
