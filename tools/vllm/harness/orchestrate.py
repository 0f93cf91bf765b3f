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
import secrets
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.vllm.harness import checkpoints, phases
from tools.vllm.harness.child import JOB_SUFFIX, RESULT_SUFFIX
from tools.vllm.harness.measure import cut_short
from tools.vllm.harness.phases import Results
from tools.vllm.harness.specs import Checkpoint, EngineSpec, Job
from tools.vllm.harness.summary import summarize
from tools.vllm.harness.zygote import ForkedEngine, Zygote

E2E = Path(__file__).resolve().parents[1] / "e2e.py"
"""The command line every child process runs (``child``, ``register-probe``)."""
RECORDS = "records.jsonl"
"""One JSON record per engine of a budgeted phase, one a line, in the order they ended."""
RUN_ID = "run_id"
"""WORK's file naming the run its records belong to: kept by ``--resume`` (one run over
consecutive calls on one machine), new otherwise."""
KILL_GRACE_S = 20.0
"""An engine still running this long after its deadline is stopped (it saved what it
measured after every generation)."""

ZYGOTE_READY_S = 120.0
"""How long the zygote may take to import vLLM and pass its canary (about 20 s on the H200
machine) before the call's engines start as processes of their own."""

EngineProcess = subprocess.Popen[bytes] | ForkedEngine
"""An engine's process: started by itself, or forked from the zygote."""


def engine_deadline(
    now: float, end: float, once: float, full: float, later_once: list[float]
) -> float | None:
    """When an engine of a budgeted phase must end its measurements; None: not started.

    It starts only with at least ``once`` (its estimate to start and measure everything once)
    left before ``end``; it may take up to 1.5 times ``full`` (everything with every repeat),
    but leaves the engines after it their ``once`` where it can (never less than its own)."""
    left = end - now
    if left < once:
        return None
    share = max(once, left - sum(later_once))
    return now + min(left, share, 1.5 * full if full else left)


FIRST_ENGINE_S = 25.0
"""What the first engine a call starts takes beyond its estimate: it builds the call's shared
model-info cache (20 s in steps run 6, 0 s in every later engine). The zygote's own start is
not in it: a budgeted phase starts the zygote before it sets the first engine's deadline. In
the curve run of 2026-12-02 the first engine, given only its own estimate while the zygote
started inside it, used it all before its first measurement, and ran again in the next call."""


COLD_START_S = 45.0
"""What the first engine on a fresh machine takes beyond ``FIRST_ENGINE_S``: torch.compile,
Inductor and Triton start from empty caches. On the H100 of 2026-12-06 gpt-oss-20b's first
engine came up in 114.1 s and measured nothing within its 125 s; the same engine came up in
52.3 s in the next call on that machine (records/2026-12-06-gpt-oss-half-uva.md)."""


def cold_machine(work: Path) -> bool:
    """Whether no engine has run under ``work`` yet (no engine cache root, ``vcache``): a
    call's first engine then compiles from empty caches (``COLD_START_S``)."""
    return not (work / "vcache").exists()


def zygote_command() -> list[str]:
    """The zygote's command line (``harness/zygote.py``)."""
    return [sys.executable, str(E2E), "zygote"]


def with_repeats(spec: EngineSpec, repeats: int | None) -> EngineSpec:
    """``spec`` measuring each of its workload's measurements ``repeats`` times (``run
    --repeats``; None: as the spec says). A call short of device time measures everything
    once: its record is complete at one repeat, so ``--resume`` does not run it again, and its
    medians are marked as of one. Its estimate with every repeat becomes its estimate once."""
    if repeats is None or spec.workload is None:
        return spec
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    full = spec.time_once_s if repeats == 1 else spec.time_full_s
    return replace(
        spec,
        repeats=repeats,
        workload=replace(spec.workload, repeats=repeats),
        time_full_s=full,
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``records.jsonl`` (none when there is no file)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(records: list[dict[str, Any]]) -> Results:
    """The last record of each engine, by name, in the order the engines first appear."""
    last: Results = {}
    for record in records:
        last[record["name"]] = record
    return last


def resumable(records: list[dict[str, Any]]) -> Results:
    """The engines that ended complete in earlier calls (``run --resume`` does not run them
    again), by name: the last complete record of each. A record the deadline cut short (a
    batch size or the TTFT not measured, or fewer repeats) is not complete: its engine runs
    again."""
    done: Results = {}
    for record in records:
        complete = not record.get("partial") and not cut_short(record.get("steps") or {})
        if record.get("ok") and complete:
            done[record["name"]] = record
    return done


COMPILE_THREADS_TOGETHER = 2
"""Inductor's compile workers of each engine when a phase's engines start together."""
COMPILE_THREADS_ALONE = 8
"""Inductor's compile workers of an engine that starts alone (the budgeted and one-at-a-time
phases: the GPU machine's 16 cores are its own). The workers compile the same code either way,
and compiled engines choose no kernel by timing, so this changes an engine's start-up time,
not its kernels. vLLM 0.25.0 overrules both when it is imported (its ``env_override`` sets
``TORCHINDUCTOR_COMPILE_THREADS=1``): the zygote found it in the curve run of 2026-12-02, and
FP8 run 2's ``meta.zygote.import_rewrites`` lists the variable."""


def env(
    extra: dict[str, str],
    cache_root: Path | None = None,
    compile_threads: int = COMPILE_THREADS_TOGETHER,
) -> dict[str, str]:
    """The environment of a child: in-process engine core (unless ``extra`` says otherwise),
    ``apply_model`` allowed, no usage stats, ``compile_threads`` inductor compile workers.
    (Compiled engines choose no kernel by timing through their ``compilation_config``:
    ``child.deterministic_inductor``.)"""
    out = dict(os.environ)
    out.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads),
            "PYTHONUNBUFFERED": "1",
        }
    )
    out.update(extra)
    if cache_root is not None:  # engines of one phase share no vLLM compile cache directory
        out["VLLM_CACHE_ROOT"] = str(cache_root)
    return out


MODELINFOS = "modelinfos"
"""vLLM's cache of model-class facts under ``VLLM_CACHE_ROOT`` (0.25.0:
``_LazyRegisteredModel.inspect_model_cls``), keyed by the model's Python file and its hash.
Without it an engine learns them by importing torch and vLLM again in a subprocess: 21 to 25 s
of every engine's start in steps run 5."""
DEEP_GEMM = "deep_gemm"
"""DeepGEMM's JIT cache under ``VLLM_CACHE_ROOT`` (0.25.0: ``vllm/utils/deep_gemm.py`` sets
``DG_JIT_CACHE_DIR`` there unless it is set). vLLM picks DeepGEMM for the dense layers of a
block-scaled FP8 checkpoint and compiles its kernels for every token count at start-up: 46 to
59 s of each FP8 engine's start in FP8 runs 1 and 2 of 2026-12-02, the same 76 kernels every
time."""
SHARED_CACHES = (MODELINFOS, DEEP_GEMM)
"""The caches under ``VLLM_CACHE_ROOT`` that every engine of a run shares."""


def engine_cache_root(work: Path, name: str) -> Path:
    """Engine ``name``'s ``VLLM_CACHE_ROOT``: its own (its compile cache is its own), with the
    run's one copy of each of ``SHARED_CACHES`` linked in, so that only the first engine
    inspects its model class or compiles DeepGEMM's kernels. What they hold depends on vLLM's
    files and the kernels' shapes alone, never on the engine's settings or on rowcache. vLLM
    writes model infos atomically; DeepGEMM's kernels are compiled only by FP8 engines, which
    start one at a time (the budgeted phases)."""
    root = work / "vcache" / name
    root.mkdir(parents=True, exist_ok=True)
    for cache in SHARED_CACHES:
        shared = work / "vcache-shared" / cache
        shared.mkdir(parents=True, exist_ok=True)
        link = root / cache
        if not link.is_symlink():
            if link.exists():  # a directory of its own, from a call before the link
                shutil.rmtree(link)
            link.symlink_to(shared.resolve(), target_is_directory=True)
    return root


class Run:
    """One ``run`` call: its directories, its deadline and the background checkpoint build."""

    def __init__(
        self,
        out: Path,
        work: Path,
        deadline: float,
        profile: bool,
        build_done: Callable[[], bool],
        only: tuple[str, ...] = (),
        done: Results | None = None,
        run_id: str = "",
        repeats: int | None = None,
        zygote: bool = False,
        checkpoint_ready: Callable[[Checkpoint], bool] | None = None,
        earlier: Results | None = None,
        shadow: bool = False,
        cold: bool = False,
        trace: bool = False,
    ) -> None:
        self.out = out
        self.shadow = shadow
        """``run --shadow``: every cache engine of this call that measures a workload (the
        budgeted phases') under the shadow check."""
        self.trace = trace
        """``run --trace``: every engine of this call that measures a workload traces its MoE
        layers over its first generation."""
        self.cold = cold
        """The machine's caches are empty (:func:`cold_machine`): the first engine the call
        starts gets ``COLD_START_S`` beyond ``FIRST_ENGINE_S``."""
        self.run_id = run_id
        """Written into every record: ratios are taken only between records of one run."""
        self.work = work
        self.logs = work / "logs"
        self.deadline = deadline
        self.profile = profile
        self.build_done = build_done
        self.checkpoint_ready = checkpoint_ready or (lambda _checkpoint: build_done())
        """Whether an engine of a checkpoint can start (a budgeted engine waits for its own
        checkpoint only; timed sections still wait for the whole build, ``build_done``)."""
        self.only = only
        self.repeats = repeats
        """``run --repeats``: every budgeted engine's repeats (None: its own)."""
        self.use_zygote = zygote
        """Fork the engines that start alone from one process that imported vLLM
        (``harness/zygote.py``); started at the first such engine."""
        self.zygote: Zygote | None = None
        self.forked = 0
        self.started_any = False
        """Whether this call has started an engine of a budgeted phase (``FIRST_ENGINE_S``; an
        earlier phase's engines only make the first budgeted one's extra time unneeded)."""
        self.zygote_disabled: str | None = None
        self.done: Results = done or {}
        """Complete records of earlier calls (``--resume``): not run again."""
        self.records: list[dict[str, Any]] = list({**(earlier or {}), **self.done}.values())
        """What OUT/records.jsonl holds: the last record of every engine of the run, earlier
        calls' (``earlier``, with ``--resume``: complete or not, so that a call's records hold
        the whole run, an engine the deadline cut short until it runs again) and this call's."""

    def job(self, spec: EngineSpec, barrier: Path, deadline: float | None = None) -> Job:
        profile_out = None
        if self.profile and spec.profiled:
            profile_out = str((self.out / f"profile_{spec.name}.txt").resolve())
        return Job(
            spec=spec,
            model=str(checkpoints.location(self.work, spec.checkpoint)),
            barrier=str(barrier),
            barrier_timeout=max(30.0, (deadline or self.deadline) - time.time() - 60),
            profile_out=profile_out,
            deadline=deadline,
            # Where its counters are read: a cache engine measuring a workload.
            shadow=self.shadow and spec.caches and spec.workload is not None,
            # Every engine measuring a workload: the cache's and its references alike.
            trace=self.trace and spec.workload is not None,
        )

    def launch(self, job: Job, alone: bool = False) -> EngineProcess:
        """Start ``job``'s engine; ``alone``: no other engine starts beside it."""
        name = job.spec.name
        if job.spec.caches:
            require_plugin()
        path = self.logs / f"{name}{JOB_SUFFIX}"
        path.write_text(json.dumps(job.to_json()))
        # An earlier call on the same (warm) machine may have left a result under this name.
        (self.logs / f"{name}{RESULT_SUFFIX}").unlink(missing_ok=True)
        environ = env(
            job.spec.env(),
            engine_cache_root(self.work, name),
            COMPILE_THREADS_ALONE if alone else COMPILE_THREADS_TOGETHER,
        )
        if alone and self.use_zygote:
            zygote = self.start_zygote()
            forked = zygote.spawn(str(path), str(self.logs / f"{name}.log"), environ)
            if forked is not None:
                self.forked += 1
                return forked
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child writes it
        return subprocess.Popen(
            [sys.executable, str(E2E), "child", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environ,
        )

    def start_zygote(self) -> Zygote:
        """The call's zygote, started (imports and canary, up to ``ZYGOTE_READY_S``) at the
        first call, with the environment of an engine that starts alone."""
        if self.zygote is None:
            self.zygote = Zygote(
                zygote_command(), env({}, None, COMPILE_THREADS_ALONE), ZYGOTE_READY_S
            )
        return self.zygote

    @property
    def zygote_status(self) -> dict[str, Any]:
        """For the run's record: whether a zygote was started, what it said (its import time,
        native threads and the variables its imports rewrote, or why it could not serve,
        engines it refused), engines forked, and why it was turned off."""
        if self.zygote is None:
            return {"used": False}
        status: dict[str, Any] = {"used": True, **self.zygote.status, "forked": self.forked}
        if self.zygote_disabled is not None:
            status["disabled"] = self.zygote_disabled
        return status

    def close(self) -> None:
        """End the zygote, if one was started."""
        if self.zygote is not None:
            self.zygote.close()

    def collect(self, spec: EngineSpec, proc: EngineProcess) -> dict[str, Any]:
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
        res.update(log_facts(log))
        res["exit"] = proc.returncode
        res["run_id"] = self.run_id
        if res.get("partial") and not res.get("error"):
            res["error"] = f"stopped before its measurements ended (exit {proc.returncode})"
        return res

    def engines(
        self, specs: list[EngineSpec], deadline: float | None = None
    ) -> list[dict[str, Any]]:
        """Start ``specs`` together, let them take turns for the timed sections, collect.
        ``deadline``: the engines' own (workloads end their measurements by it; an engine
        still running ``KILL_GRACE_S`` after it is stopped)."""
        # A fresh barrier per group: a "go" left by an earlier group or call would start the
        # timed sections before every engine is ready.
        barrier = self.logs / f"barrier.{specs[0].name}"
        shutil.rmtree(barrier, ignore_errors=True)
        barrier.mkdir(parents=True)
        alone = len(specs) == 1
        procs = [(spec, self.launch(self.job(spec, barrier, deadline), alone)) for spec in specs]
        stop = self.deadline if deadline is None else min(self.deadline, deadline + KILL_GRACE_S)
        # Timed sections start once every engine is ready (or gone) and the checkpoint build
        # has ended: no timed section overlaps a start-up or a build.
        while time.time() < stop:
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
                proc.wait(timeout=max(1.0, stop - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            results.append(self.collect(spec, proc))
            if isinstance(proc, ForkedEngine) and not results[-1].get("ok"):
                # A forked engine that failed may have failed for being forked: the call's
                # later engines start as processes of their own, at the cost of their imports.
                self.use_zygote = False
                why = results[-1].get("error") or f"exit {proc.returncode}"
                self.zygote_disabled = f"after {spec.name}: {why}"[:400]
        return results

    def picked(self, specs: list[EngineSpec]) -> list[EngineSpec]:
        """The engines of ``specs`` that ``--only`` names (without it all but those run on
        demand, ``EngineSpec.on_demand``), with ``--repeats``."""
        if self.only:
            picked = [s for s in specs if _label(s) in self.only]
        else:
            picked = [s for s in specs if not s.on_demand]
        return [with_repeats(s, self.repeats) for s in picked]

    def to_run(self, specs: list[EngineSpec]) -> list[EngineSpec]:
        """The engines of ``specs`` this call would start: those ``--only`` names, less those
        an earlier call completed (``--resume``)."""
        return [s for s in self.picked(specs) if s.name not in self.done]

    def budgeted(self, specs: list[EngineSpec]) -> Results:
        """One engine at a time, each by its :func:`engine_deadline`; every record appended to
        WORK/records.jsonl and OUT/records.jsonl, and the logs packed, as soon as it ends.

        The results hold, besides the engines ``--only`` names, every engine of the phase an
        earlier call completed (``--resume``): the summary judges this call's engines against
        their references and controls wherever those ran."""
        # Earlier calls' engines first, in the phase's order, as one call would have run them.
        results: Results = {s.name: self.done[s.name] for s in specs if s.name in self.done}
        specs = self.picked(specs)
        for i, spec in enumerate(specs):
            if spec.name in self.done:
                continue
            later = [s.time_once_s for s in specs[i + 1 :] if s.name not in self.done]
            extra = 0.0
            if not self.started_any:
                extra = FIRST_ENGINE_S + (COLD_START_S if self.cold else 0.0)
            once = spec.time_once_s + extra
            full = spec.time_full_s + extra if spec.time_full_s else 0.0  # 0: no estimate
            if self.use_zygote and self.deadline - time.time() >= once:
                # Its start (about 20 s) is no engine's: before the engine's deadline is set,
                # and while the engine's checkpoint may still be building.
                self.start_zygote()
            # Its own checkpoint, not the whole build (FP8 run 2 of 2026-12-02: the first
            # engine waited 29 s for the online engines' bf16 checkpoint, then 20 s for the
            # zygote).
            asked = time.time()
            while not self.checkpoint_ready(spec.checkpoint) and time.time() < self.deadline:
                time.sleep(1)
            now = time.time()
            deadline = engine_deadline(now, self.deadline, once, full, later)
            if deadline is None:
                results[spec.name] = {
                    "name": spec.name,
                    "spec": spec.to_json(),
                    "ok": False,
                    "error": f"not run: time ({self.deadline - now:.0f} s left, needs about "
                    f"{once:.0f} s; run again with --resume)",
                }
                continue
            self.started_any = True
            for r in self.engines([spec], deadline):
                r["engine_deadline_s"] = round(deadline - now, 1)
                r["checkpoint_wait_s"] = round(now - asked, 1)
                results[r["name"]] = r
                self.records = [x for x in self.records if x["name"] != r["name"]] + [r]
                with open(self.work / RECORDS, "a") as f:
                    f.write(json.dumps(r) + "\n")
                (self.out / RECORDS).write_text("".join(json.dumps(x) + "\n" for x in self.records))
                pack_logs(self.out, self.logs)
        return results

    def phase(self, phase: phases.Phase, specs: list[EngineSpec]) -> Results:
        # Before the phase's first engine, not only before its first engine with the cache on:
        # a call that would be refused there should not first spend minutes on the baselines.
        if any(s.caches for s in self.to_run(specs)):
            require_plugin()
        if any(s.quantized for s in self.to_run(specs)):
            require_quantization_packages()
        results: Results = {}
        if phase.budgeted:
            return self.budgeted(specs)
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


def run_identity(work: Path, resume: bool) -> str:
    """The run's id: WORK's with ``--resume`` (the calls of one run on one machine), else a
    new one (the time and a random suffix), written for the calls that resume it."""
    path = work / RUN_ID
    if resume and path.exists():
        return path.read_text().strip()
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)
    path.write_text(run_id + "\n")
    return run_id


PLUGIN_GROUP = "vllm.general_plugins"


def require_plugin() -> None:
    """Stop before an engine with the cache on starts without the plugin: vLLM loads rowcache
    only through its entry point, so a checkout on PYTHONPATH alone gives an engine that
    ignores ``additional_config`` and measures vLLM without the cache under the cache's name.
    Install the wheel of the commit under test where vLLM finds it (see
    ../shared/gpu/VLLM_ON_DEVICE.md: ``pip install --no-deps --target /tmp/site``)."""
    from importlib.metadata import entry_points

    found = [e.value for e in entry_points(group=PLUGIN_GROUP) if e.value.startswith("rowcache")]
    if not found:
        raise SystemExit(
            f"rowcache e2e: no rowcache entry point in {PLUGIN_GROUP!r}: an engine with the "
            "cache on would run without it. Install the rowcache wheel of the commit under "
            "test (pip install --no-deps --target DIR rowcache-*.whl, DIR on PYTHONPATH)."
        )


QUANTIZATION_PACKAGES = ("compressed_tensors", "loguru")
"""What vLLM imports to build any quantization config (0.25.0: ``get_quantization_config``
imports every method's module, ``auto_awq`` among them, whose MoE oracle imports
``compressed_tensors``, which imports ``loguru``). vLLM requires ``compressed-tensors`` and
it requires ``loguru``, so ``pip install vllm`` brings both; a vLLM unpacked without them
starts no quantized engine."""


def require_quantization_packages() -> None:
    """Stop before a phase with quantized engines whose every engine would fail while its
    config is built: in FP8 run 1 of 2026-12-02 six engines failed that way one by one
    (``No module named 'compressed_tensors'``), four minutes of device time."""
    from importlib.util import find_spec

    missing = [name for name in QUANTIZATION_PACKAGES if find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"rowcache e2e: {', '.join(missing)} not found: vLLM imports it to build any "
            "quantization config, so every quantized engine would fail. Install "
            "compressed-tensors (the version vLLM's metadata names) and loguru, which it "
            "needs (pip install --no-deps --target DIR, DIR on PYTHONPATH)."
        )


def _label(spec: EngineSpec) -> str:
    """A budgeted engine's label: its name after ``<phase>.<checkpoint>.`` (``steps.plain.``,
    ``curve.skew.``, ``fp8.plain.``, ...)."""
    return spec.name.split(".", 2)[-1]


def log_facts(log: str) -> dict[str, Any]:
    """What an engine's log says beyond its result: vLLM's model loading line, its replay
    address check, the plugin's lines (settings, lowered graphs, an inexact route), the
    offloader's and the MoE backend vLLM chose (``Using TRITON Fp8 MoE backend out of
    potential backends: [...]``, ``oracle/fp8.py`` and ``oracle/unquantized.py``)."""
    facts: dict[str, Any] = {}
    plugin: list[str] = []
    for line in log.splitlines():
        if "Model loading took" in line:
            facts["model_loading_log"] = line.split("Model loading took", 1)[1].strip()[:120]
        if "Input addresses for cudagraphs are different" in line:
            facts["address_assert"] = line.strip()[-300:]
        if "rowcache" in line and len(plugin) < 12 and line.strip()[-300:] not in plugin:
            plugin.append(line.strip()[-300:])
        if "Offloader set to" in line or "Total GPU memory saved" in line:
            facts.setdefault("offload_log", []).append(line.strip()[-300:])
        if "MoE backend out of potential backends" in line:  # vLLM's backend choice
            found = facts.setdefault("moe_backend_log", [])
            if line.strip()[-300:] not in found:
                found.append(line.strip()[-300:])
    if plugin:
        facts["plugin_log"] = plugin
    return facts


def pack_logs(out: Path, logs: Path) -> None:
    """OUT/logs.tar.gz: every log and job/result file of the work directory's logs."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(logs.glob("*.log")) + sorted(logs.glob("*.json")):
            tar.add(path, arcname=path.name)


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


def run(
    out: Path,
    work: Path,
    phase_names: list[str],
    profile: bool,
    deadline_s: float,
    only: tuple[str, ...] = (),
    resume: bool = False,
    repeats: int | None = None,
    zygote: bool = False,
    shadow: bool = False,
    trace: bool = False,
) -> int:
    start = time.time()
    deadline = start + deadline_s
    out.mkdir(parents=True, exist_ok=True)  # the profiled engines write into it
    work = work.resolve()
    cold = cold_machine(work)  # before any engine makes its cache root
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    selected = phases.select(phase_names)
    results: Results = {}
    meta: dict[str, Any] = {
        "phases": phase_names,
        "profile": profile,
        "deadline_s": deadline_s,
        "commit": os.environ.get("ROWCACHE_COMMIT", "?"),
        "only": list(only),
        "resume": resume,
        "repeats": repeats,
        "shadow": shadow,
        "trace": trace,
        "cold_start": cold,
    }
    earlier = read_records(work / RECORDS) if resume else []
    done = resumable(earlier)
    if not resume:
        (work / RECORDS).unlink(missing_ok=True)
    meta["resumed"] = sorted(done)
    meta["run_id"] = run_id = run_identity(work, resume)
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
    known = [c for phase in phases.PHASES for c in phase.checkpoints()]
    needed = checkpoints.with_sources(needed, known)
    t = time.time()
    checkpoints.build_foreground(work, needed)
    meta["tiny_ckpt_s"] = round(time.time() - t, 1)
    build = checkpoints.Background(work, needed, logs / "checkpoints.log")
    probe = _register_probes(logs)
    runner = Run(
        out,
        work,
        deadline,
        profile,
        build.done,
        only,
        done,
        run_id,
        repeats,
        zygote,
        checkpoint_ready=build.ready,
        earlier=latest(earlier),
        shadow=shadow,
        cold=cold,
        trace=trace,
    )
    try:
        for phase in selected:
            specs = phase.engines(results)
            # A budgeted phase's engines each wait for their own checkpoint (Run.budgeted).
            wait = build.needed_by([s.checkpoint for s in specs]) and not phase.budgeted
            if wait and not build.wait(deadline - time.time()):
                meta["build_unfinished_at"] = phase.name
            results.update(runner.phase(phase, specs))
            meta[f"after_{phase.name}_s"] = round(time.time() - start, 1)
    finally:
        runner.close()
    meta["zygote"] = runner.zygote_status
    for key in ("register", "register_preloaded"):
        try:
            probe.wait(timeout=5)
            meta[key] = json.loads((logs / f"{key}.json").read_text())
        except Exception as exc:
            meta[key] = repr(exc)
    meta["wall_s"] = round(time.time() - start, 1)
    summary = _write(out, results, meta)
    pack_logs(out, logs)
    print(summary, flush=True)
    return 0


def merge(paths: list[str], out_dir: str) -> int:
    """One results.json and summary from the results.json of several calls (later ones win)."""
    results: Results = {}
    meta: dict[str, Any] = {"merged_from": []}
    for path in paths:
        if path.endswith(".jsonl"):  # a budgeted phase's records.jsonl
            found = read_records(Path(path))
            meta["merged_from"].append({"path": path, "records": len(found)})
            results.update({r["name"]: r for r in found})
            continue
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
