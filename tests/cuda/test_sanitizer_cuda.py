"""PyTorch's CUDA stream sanitizer (CSAN) on real runs of the provider: clean for the real
schedules, and awake: it reports deliberately unsynchronized variants (mutant schedules).

Each run is a subprocess that enables CSAN itself, reads every slot it was given on the
consumer stream (CSAN tracks a view by its start address, so slot by slot), and alternates
streams. The whole suite is also run with ``TORCH_CUDA_SANITIZER=1`` by
``tools/run_cuda_conformance.sh``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.csan_subprocess]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch
import torch.cuda._sanitizer as csan
csan.enable_cuda_sanitizer()
from rowcache import RowCacheWeightProvider
from mutant_provider import install
w = torch.arange(8.0).view(8, 1, 1).expand(8, 64, 64).contiguous()
p = RowCacheWeightProvider(w, w.clone(), capacity=2, device="cuda")
if sys.argv[1] != "real":
    install(p, sys.argv[1])
a, b = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)
out = []
for i in range(6):
    with torch.cuda.stream(a if i % 2 else b):
        r = p.prepare(torch.tensor([[i, i + 1]]))
        out.append(r.expert_map.sum() + sum(r.w1[s].sum() for s in range(2)))
        if i == 3:
            p.invalidate(i)
torch.cuda.synchronize()
print("clean")
"""


def sanitized(mode: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests" / "cuda"), os.environ.get("PYTHONPATH", "")]
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_SANITIZER"}
    env["PYTHONPATH"] = path
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def test_stream_sanitizer_finds_no_race_in_a_real_run() -> None:
    done = sanitized("real")
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-4000:]


@pytest.mark.parametrize("mutant", ["no_release_wait", "no_ready_wait"])
def test_stream_sanitizer_reports_an_unsynchronized_variant(mutant: str) -> None:
    done = sanitized(mutant)
    assert done.returncode != 0, done.stdout
    assert "CSAN detected a possible data race" in done.stderr, done.stderr[-4000:]
