"""``e2e.py run`` and ``e2e.py merge``: the phases' engines as child processes, and the records.

Engines of one phase start concurrently (memory is fixed per engine with
``kv_cache_memory_bytes``), then wait until all are ready and take turns, under a file lock,
for the timed generations, so no timed section overlaps another engine's start-up or
generation, nor the background checkpoint build. A phase marked ``one_at_a_time`` starts each
engine only after the previous one has exited (the story's ``gpu_memory_utilization`` budgets
need an otherwise idle GPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.vllm.harness import checkpoints, phases
from tools.vllm.harness.child import JOB_SUFFIX, RESULT_SUFFIX
from tools.vllm.harness.phases import Results
from tools.vllm.harness.specs import Checkpoint, EngineSpec, Job
from tools.vllm.harness.summary import summarize

E2E = Path(__file__).resolve().parents[1] / "e2e.py"
"""The command line every child process runs (``child``, ``register-probe``)."""


def env(extra: dict[str, str], cache_root: Path | None = None) -> dict[str, str]:
    """The environment of a child: in-process engine core (unless ``extra`` says otherwise),
    ``apply_model`` allowed, no usage stats, two inductor compile threads."""
    out = dict(os.environ)
    out.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    out.update(extra)
    if cache_root is not None:  # engines of one phase share no vLLM compile cache directory
        out["VLLM_CACHE_ROOT"] = str(cache_root)
    return out


class Run:
    """One ``run`` call: its directories, its deadline and the background checkpoint build."""

    def __init__(
        self, out: Path, work: Path, deadline: float, profile: bool, build_done: Callable[[], bool]
    ) -> None:
        self.out = out
        self.work = work
        self.logs = work / "logs"
        self.deadline = deadline
        self.profile = profile
        self.build_done = build_done

    def job(self, spec: EngineSpec, barrier: Path) -> Job:
        profile_out = None
        if self.profile and spec.profiled:
            profile_out = str((self.out / f"profile_{spec.name}.txt").resolve())
        return Job(
            spec=spec,
            model=str(checkpoints.location(self.work, spec.checkpoint)),
            barrier=str(barrier),
            barrier_timeout=max(30.0, self.deadline - time.time() - 60),
            profile_out=profile_out,
        )

    def launch(self, job: Job) -> subprocess.Popen[bytes]:
        name = job.spec.name
        path = self.logs / f"{name}{JOB_SUFFIX}"
        path.write_text(json.dumps(job.to_json()))
        # An earlier call on the same (warm) machine may have left a result under this name.
        (self.logs / f"{name}{RESULT_SUFFIX}").unlink(missing_ok=True)
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child writes it
        return subprocess.Popen(
            [sys.executable, str(E2E), "child", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env(job.spec.env(), self.work / "vcache" / name),
        )

    def collect(self, spec: EngineSpec, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        out = self.logs / f"{spec.name}{RESULT_SUFFIX}"
        if out.exists():
            res: dict[str, Any] = json.loads(out.read_text())
        else:
            res = {
                "name": spec.name,
                "spec": spec.to_json(),
                "ok": False,
                "error": f"no result (exit {proc.returncode})",
            }
        log = (self.logs / f"{spec.name}.log").read_text(errors="replace")
        for line in log.splitlines():
            if "Model loading took" in line:
                res["model_loading_log"] = line.split("Model loading took", 1)[1].strip()[:120]
            if "Input addresses for cudagraphs are different" in line:
                res["address_assert"] = line.strip()[-300:]
        res["exit"] = proc.returncode
        return res

    def engines(self, specs: list[EngineSpec]) -> list[dict[str, Any]]:
        """Start ``specs`` together, let them take turns for the timed sections, collect."""
        # A fresh barrier per group: a "go" left by an earlier group or call would start the
        # timed sections before every engine is ready.
        barrier = self.logs / f"barrier.{specs[0].name}"
        shutil.rmtree(barrier, ignore_errors=True)
        barrier.mkdir(parents=True)
        procs = [(spec, self.launch(self.job(spec, barrier))) for spec in specs]
        # Timed sections start once every engine is ready (or gone) and the checkpoint build
        # has ended: no timed section overlaps a start-up or a build.
        while time.time() < self.deadline:
            waiting = [
                spec
                for spec, proc in procs
                if proc.poll() is None and not (barrier / f"ready.{spec.name}").exists()
            ]
            if not waiting and self.build_done():
                break
            time.sleep(1)
        (barrier / "go").write_text("1")
        results = []
        for spec, proc in procs:
            try:
                proc.wait(timeout=max(1.0, self.deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            results.append(self.collect(spec, proc))
        return results

    def phase(self, phase: phases.Phase, specs: list[EngineSpec]) -> Results:
        results: Results = {}
        if not phase.one_at_a_time:
            for r in self.engines(specs):
                results[r["name"]] = r
            return results
        for spec in specs:
            if phase.min_left_s is not None and time.time() > self.deadline - phase.min_left_s:
                results[spec.name] = {"name": spec.name, "ok": False, "error": "not run: time"}
                continue
            for r in self.engines([spec]):
                results[r["name"]] = r
        return results


def _register_probes(logs: Path) -> subprocess.Popen[bytes]:
    """register()'s cost, in fresh processes: with vLLM's config imported (as when vLLM loads
    plugins) and its fused-MoE package not yet, and with both imported. Run one after the
    other, so that neither times the other's imports."""
    py, e2e = sys.executable, E2E
    return subprocess.Popen(
        [
            "bash",
            "-c",
            f"{py} {e2e} register-probe {logs / 'register.json'}; "
            f"{py} {e2e} register-probe {logs / 'register_preloaded.json'} --fused-moe-first",
        ],
        stdout=open(logs / "register.log", "wb"),
        stderr=subprocess.STDOUT,
        env=env({}),
    )


def run(out: Path, work: Path, phase_names: list[str], profile: bool, deadline_s: float) -> int:
    start = time.time()
    deadline = start + deadline_s
    out.mkdir(parents=True, exist_ok=True)  # the profiled engines write into it
    work = work.resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    selected = phases.select(phase_names)
    results: Results = {}
    meta: dict[str, Any] = {
        "phases": phase_names,
        "profile": profile,
        "deadline_s": deadline_s,
        "commit": os.environ.get("ROWCACHE_COMMIT", "?"),
    }
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["torch"] = torch.__version__
        from importlib.metadata import version

        meta["vllm"] = version("vllm")
    except Exception as exc:
        meta["env_error"] = repr(exc)

    needed: list[Checkpoint] = []
    for phase in selected:
        needed += [c for c in phase.checkpoints() if c not in needed]
    t = time.time()
    checkpoints.build_foreground(work, needed)
    meta["tiny_ckpt_s"] = round(time.time() - t, 1)
    build = checkpoints.Background(work, needed, logs / "checkpoints.log")
    probe = _register_probes(logs)
    runner = Run(out, work, deadline, profile, build.done)
    for phase in selected:
        specs = phase.engines(results)
        if build.needed_by([s.checkpoint for s in specs]) and not build.wait(
            deadline - time.time()
        ):
            meta["build_unfinished_at"] = phase.name
        results.update(runner.phase(phase, specs))
        meta[f"after_{phase.name}_s"] = round(time.time() - start, 1)
    for key in ("register", "register_preloaded"):
        try:
            probe.wait(timeout=5)
            meta[key] = json.loads((logs / f"{key}.json").read_text())
        except Exception as exc:
            meta[key] = repr(exc)
    meta["wall_s"] = round(time.time() - start, 1)
    summary = _write(out, results, meta)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(logs.glob("*.log")) + sorted(logs.glob("*.json")):
            tar.add(path, arcname=path.name)
    print(summary, flush=True)
    return 0


def merge(paths: list[str], out_dir: str) -> int:
    """One results.json and summary from the results.json of several calls (later ones win)."""
    results: Results = {}
    meta: dict[str, Any] = {"merged_from": []}
    for path in paths:
        data = json.loads(Path(path).read_text())
        part = data.get("meta", {})
        meta["merged_from"].append(
            {"path": path, **{k: part.get(k) for k in ("phases", "profile", "commit", "wall_s")}}
        )
        for key in ("gpu", "torch", "vllm"):
            meta.setdefault(key, part.get(key))
        results.update(data.get("results", {}))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(_write(out, results, meta), flush=True)
    return 0


def _write(out: Path, results: Results, meta: dict[str, Any]) -> str:
    """Write results.json and summary.txt; the summary."""
    summary = summarize(results, meta)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "summary.txt").write_text(summary + "\n")
    return summary
