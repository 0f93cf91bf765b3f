"""The zygote of tools/vllm/e2e.py (``harness/zygote.py``) without vLLM or a GPU: a fake zygote
process serves fake engines through the real protocol, the orchestrator's side forks, waits
for, kills and collects them, refuses what it must, and falls back to processes of their own
when the zygote cannot start (its import or its CUDA canary failing)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.vllm.harness import engines, orchestrate, zygote
from tools.vllm.harness.child import JOB_SUFFIX, RESULT_SUFFIX

ROOT = Path(__file__).resolve().parents[1]

FAKE = f"""
import json, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from tools.vllm.harness import zygote
mode = os.environ.get("FAKE_ZYGOTE", "ok")

def preload():
    if mode == "preload":
        raise ImportError("No module named 'vllm'")
    if mode == "torch":  # as the real zygote: torch (and numpy's native threads) imported
        import torch
    if mode == "thread":
        import threading
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    if mode == "rewrite":  # as vLLM's env_override does when it is imported
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        os.environ["SET_BY_IMPORT"] = "yes"
        del os.environ["REMOVED_BY_IMPORT"]
    print("a line an import printed", flush=True)  # not the protocol: ignored

def canary():
    if mode == "canary":
        raise RuntimeError("CUDA error: initialization error")

def child(job):
    given = json.load(open(job))
    spec = given.get("fake", {{}})
    print("child", job, os.environ.get("ENGINE_VAR"), os.environ.get(zygote.FORKED_ENV),
          flush=True)
    print("env", *(os.environ.get(k) for k in
          ("TORCHINDUCTOR_COMPILE_THREADS", "SET_BY_IMPORT", "REMOVED_BY_IMPORT")), flush=True)
    if "spec" in given and os.environ.get("FAKE_CHILD_FAILS"):
        os._exit(1)  # no result: a failed engine
    if "spec" in given:  # an orchestrator's job: write its result as an engine would
        out = job.replace({JOB_SUFFIX!r}, {RESULT_SUFFIX!r})
        json.dump({{"name": given["spec"]["name"], "ok": True}}, open(out, "w"))
    time.sleep(spec.get("sleep", 0))
    if spec.get("raise"):
        raise ValueError("boom")
    if spec.get("matmul"):
        import torch
        print("matmul", float((torch.ones(64, 64) @ torch.ones(64, 64)).sum()), flush=True)
    os._exit(spec.get("exit", 0))

sys.exit(zygote.serve(preload, child, canary, sys.stdin, sys.stdout))
"""


def _command() -> list[str]:
    return [sys.executable, "-c", FAKE]


def _env(mode: str = "ok", **extra: str) -> dict[str, str]:
    out = dict(os.environ, FAKE_ZYGOTE=mode, TORCHINDUCTOR_COMPILE_THREADS="8")
    out.update(extra)
    return out


def _job(tmp_path: Path, name: str, **fake: Any) -> tuple[str, str]:
    job = tmp_path / f"{name}{JOB_SUFFIX}"
    job.write_text(json.dumps({"fake": fake}))
    return str(job), str(tmp_path / f"{name}.log")


def test_engines_are_forked_waited_for_and_killed(tmp_path: Path) -> None:
    z = zygote.Zygote(_command(), _env(), 60)
    try:
        assert z.ready and isinstance(z.status["import_s"], float)
        assert "python" in z.status["threads"]  # the native threads, recorded
        job, log = _job(tmp_path, "a", exit=0)
        z._messages.put({"pid": 1, "exit": 0})  # an earlier engine's exit, never waited for
        engine = z.spawn(job, log, _env(ENGINE_VAR="seen"))
        assert engine is not None and engine.wait(30) == 0 and engine.poll() == 0
        said = Path(log).read_text()
        # the engine's own environment, its log as output, and the zygote's import time
        assert f"child {job} seen " in said and '"import_s"' in said
        job, log = _job(tmp_path, "b", exit=3)
        engine = z.spawn(job, log, _env())
        assert engine is not None and engine.wait(30) == 3
        job, log = _job(tmp_path, "c", **{"raise": True})
        engine = z.spawn(job, log, _env())
        assert engine is not None and engine.wait(30) == 1
        assert "ValueError: boom" in Path(log).read_text()
        job, log = _job(tmp_path, "d", sleep=60)
        engine = z.spawn(job, log, _env())
        assert engine is not None and engine.poll() is None
        with pytest.raises(zygote.subprocess.TimeoutExpired):
            engine.wait(0.5)
        engine.kill()
        assert engine.wait(30) == -9
    finally:
        z.close()
    assert z._proc is not None and z._proc.returncode == 0  # its input closed, it ended


def test_a_forked_engine_computes_with_the_torch_its_zygote_imported(tmp_path: Path) -> None:
    z = zygote.Zygote(_command(), _env("torch"), 120)
    try:
        assert z.ready, z.status
        job, log = _job(tmp_path, "a", matmul=True)
        engine = z.spawn(job, log, _env())
        assert engine is not None and engine.wait(60) == 0
        assert "matmul 262144.0" in Path(log).read_text()
    finally:
        z.close()


def test_an_engine_with_other_import_time_settings_is_refused(tmp_path: Path) -> None:
    z = zygote.Zygote(_command(), _env(), 60)
    try:
        job, log = _job(tmp_path, "a")
        assert z.spawn(job, log, _env(TORCHINDUCTOR_COMPILE_THREADS="2")) is None
        assert "TORCHINDUCTOR_COMPILE_THREADS" in z.status["refused"][0]
        assert z.ready  # the next engine is still forked
        engine = z.spawn(job, log, _env())
        assert engine is not None and engine.wait(30) == 0
    finally:
        z.close()


def test_what_importing_rewrote_is_no_refusal_and_reaches_the_engine(tmp_path: Path) -> None:
    # vLLM's import sets TORCHINDUCTOR_COMPILE_THREADS=1 in its own process: the engine asked
    # for the 8 the zygote started with, and gets what its own process would have had.
    z = zygote.Zygote(_command(), _env("rewrite", REMOVED_BY_IMPORT="x"), 60)
    try:
        assert z.ready, z.status
        assert z.status["import_rewrites"] == [
            "REMOVED_BY_IMPORT",
            "SET_BY_IMPORT",
            "TORCHINDUCTOR_COMPILE_THREADS",
        ]
        job, log = _job(tmp_path, "a")
        engine = z.spawn(job, log, _env(REMOVED_BY_IMPORT="x"))
        assert engine is not None, z.status
        assert engine.wait(30) == 0
        assert "env 1 yes None" in Path(log).read_text()
        assert z.spawn(job, log, _env(TORCHINDUCTOR_COMPILE_THREADS="1")) is None
        assert "TORCHINDUCTOR_COMPILE_THREADS" in z.status["refused"][0]
        # A variable the imports set, which this engine sets to its own value: its own
        # process would have kept it if the import only sets it where unset; refused.
        assert z.spawn(job, log, _env(REMOVED_BY_IMPORT="x", SET_BY_IMPORT="mine")) is None
        assert "import-time settings differ: ['SET_BY_IMPORT']" in z.status["refused"][1]
    finally:
        z.close()


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("preload", "ImportError: No module named 'vllm'"),
        ("canary", "the CUDA canary failed in a forked child: exit 1"),
        ("thread", "2 Python threads run after the imports; a fork needs one"),
    ],
)
def test_a_zygote_that_cannot_start_says_why(tmp_path: Path, mode: str, said: str) -> None:
    z = zygote.Zygote(_command(), _env(mode), 60)
    assert not z.ready and said in z.status["error"]
    if mode == "canary":
        assert "initialization error" in z.status["error"]
    job, log = _job(tmp_path, "a")
    assert z.spawn(job, log, _env()) is None
    assert z._proc is not None and z._proc.returncode == 1


def test_a_zygote_that_cannot_be_started_says_why() -> None:
    z = zygote.Zygote(["/nonexistent/python"], _env(), 5)
    assert not z.ready and z.status["error"].startswith("not started:")
    z.close()


def test_cuda_initialized_by_the_imports_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Cuda:
        @staticmethod
        def is_initialized() -> bool:
            return True

    class Torch:
        cuda = Cuda

    replies: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            replies.append(text)

        def flush(self) -> None:
            pass

    def preload() -> None:
        # undone after the test, also where torch was not imported before (later tests
        # import the real one)
        monkeypatch.setitem(sys.modules, "torch", Torch)

    code = zygote.serve(
        preload,
        lambda job: None,
        lambda: None,
        iter([]),  # type: ignore[arg-type]
        Out(),  # type: ignore[arg-type]
    )
    assert code == 1 and "CUDA was initialized while importing" in replies[0]


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> orchestrate.Run:
    monkeypatch.setattr(orchestrate, "zygote_command", _command)
    monkeypatch.setenv("FAKE_ZYGOTE", mode)
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    end = orchestrate.time.time() + 120
    return orchestrate.Run(out, work, end, False, lambda: True, zygote=True)


def test_the_orchestrator_forks_engines_that_start_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(tmp_path, monkeypatch, "ok")
    spec = engines.steps(only=("none.full",))[0]
    try:
        (record,) = run.engines([spec], orchestrate.time.time() + 60)
    finally:
        run.close()
    assert record["ok"] is True and record["exit"] == 0
    assert run.zygote_status["used"] is True and run.zygote_status["forked"] == 1
    assert isinstance(run.zygote_status["import_s"], float)
    log = (run.logs / f"{spec.name}.log").read_text()
    assert log.startswith("child ")  # forked: the fake zygote's child wrote it


def test_without_a_zygote_engines_start_as_processes_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(tmp_path, monkeypatch, "preload")
    spec = engines.steps(only=("none.full",))[0]
    started: list[list[str]] = []

    class Popen:
        def __init__(self, args: list[str], **kwargs: Any) -> None:
            started.append(args)
            self.returncode: int | None = 0

        def poll(self) -> int | None:
            return self.returncode

        def wait(self, timeout: float | None = None) -> int:
            return 0

    try:
        # The zygote fails to start (its import), before Popen is patched for the engine.
        run.zygote = zygote.Zygote(_command(), _env("preload"), 60)
        monkeypatch.setattr(orchestrate.subprocess, "Popen", Popen)
        job = run.job(spec, tmp_path)
        proc = run.launch(job, alone=True)
    finally:
        run.close()
    assert isinstance(proc, Popen) and started and started[0][-2] == "child"
    assert run.zygote_status["used"] is True
    assert "ImportError" in run.zygote_status["error"]


def test_a_failed_forked_engine_turns_the_zygote_off_for_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It may have failed for being forked: the later engines start as before."""
    run = _run(tmp_path, monkeypatch, "ok")
    monkeypatch.setenv("FAKE_CHILD_FAILS", "1")
    first, second = engines.steps(only=("none.full", "row32dev.full"))
    monkeypatch.setattr(orchestrate, "require_plugin", lambda: None)
    try:
        (record,) = run.engines([first], orchestrate.time.time() + 60)
        assert record["ok"] is False and record["exit"] == 1
        assert run.use_zygote is False
        assert run.zygote_status["disabled"] == f"after {first.name}: no result (exit 1)"
        started: list[list[str]] = []

        class Popen:
            def __init__(self, args: list[str], **kwargs: Any) -> None:
                started.append(args)

        monkeypatch.setattr(orchestrate.subprocess, "Popen", Popen)
        run.launch(run.job(second, tmp_path), alone=True)
        assert started and started[0][-2] == "child"
    finally:
        run.close()
