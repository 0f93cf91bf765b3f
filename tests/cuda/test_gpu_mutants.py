"""GPU mutants: the real CUDA provider running schedules generated from mutated tables.

Every mutant of ``model_check.table.mutants`` that changes a schedule runs through every race
fixture on the GPU, and each must be detected there: a wrong read, a wrong map, or a host
block. These tests pass when the mutant is caught; they show that the race fixtures can fail.

The CUDA hypothesis machine (``host_call_machine``, ``cuda_rig.CudaRig``) kills every one of
them too, with shrinking on: the provider runs the mutant's schedules, the model replays the
mutant's table (so the GPU log must still be that table's trace), and the kill must come from
a property check (the model's verdict over all interleavings, the GPU's own data checks, or
the sanitizer oracle). Its shrunk counterexample must have no more host calls than the one
``python -m model_check explain MUTANT`` prints for the model mutant of the same name.
``ROWCACHE_MUTANT_EXAMPLES`` sets the machine's examples per length (default 200).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cuda_rig import CudaRig
from cuda_support import ExpertData
from host_call_machine import call_text, explain_to_compare, judge, kill
from mutant_provider import NOT_ON_GPU, REQUIRED, host_mutants, install, schedule_mutants
from race_fixtures import FIXTURES, Inconclusive, Report, save

from model_check.table.mutants import MUTANTS
from rowcache import RowCacheWeightProvider

EXPECTED = {
    "no_release_wait": "wrong_read",  # a slot is refilled under a running reader
    "no_ready_wait": "wrong_read",  # the next forward reads slots before their copies land
    "resident_map_on_current_first": "wrong_map",  # an older map upload lands last
}


@pytest.mark.nogpu
def test_the_required_mutants_run_on_the_gpu() -> None:
    gpu = set(schedule_mutants())
    assert set(REQUIRED) <= gpu
    assert set(EXPECTED) == set(REQUIRED)
    # Every catalogued mutant is accounted for: on the GPU, host-only (CPU tests), or excluded
    # with a reason.
    accounted = gpu | set(host_mutants()) | set(NOT_ON_GPU)
    assert accounted == {m.name for m in MUTANTS}


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("name", schedule_mutants())
def test_gpu_mutant_is_detected(name: str) -> None:
    def make(data: ExpertData, capacity: int) -> RowCacheWeightProvider:
        return install(data.provider(capacity), name)

    reports: list[Report] = []
    for fixture_name, fixture in FIXTURES.items():
        try:
            reports.append(fixture(make))
        except Inconclusive as why:  # this fixture proves nothing for this mutant; go on
            torch.cuda.synchronize()
            reports.append(Report(fixture_name, inconclusive=str(why)))
    save(name, reports)
    lines = [
        f"{r.fixture}: {'inconclusive' if r.inconclusive else sorted(r.kinds()) or 'not detected'}"
        for r in reports
    ]
    for r in reports:
        lines += [f"    [{f.kind}] {f.detail}" for f in r.findings[:3]]
    print(f"mutant {name}\n  " + "\n  ".join(lines))
    kinds = set().union(*(r.kinds() for r in reports))
    assert kinds, f"mutant {name} went undetected by every race fixture"
    if name in EXPECTED:
        assert EXPECTED[name] in kinds, f"mutant {name}: expected a {EXPECTED[name]}, got {kinds}"


MUTANT_EXAMPLES = int(os.environ.get("ROWCACHE_MUTANT_EXAMPLES", "200"))


@pytest.mark.gpu_mutant
@pytest.mark.parametrize("name", schedule_mutants())
def test_cuda_machine_kills_gpu_mutant_no_longer_than_explain(name: str) -> None:
    found = kill(CudaRig(), name, MUTANT_EXAMPLES)
    torch.cuda.synchronize()
    shortest = explain_to_compare(name, found)
    problems = judge(name, found, shortest)
    print(f"mutant {name}: " + (found.describe() if found else "not killed"))
    folder = os.environ.get("ROWCACHE_CONFORMANCE_LOGS")
    if folder:  # one record per mutant, rewritten by every run; "explain": explain's
        # counterexample where it may be shorter than the kill (null: none is)
        path = Path(folder) / "machine_kills" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            **(found.as_json() if found else {"mutant": name, "kind": "not killed"}),
            "explain": None if shortest is None else [call_text(c) for c in shortest],
            "problems": problems,
        }
        path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    assert not problems, "\n".join(problems)
