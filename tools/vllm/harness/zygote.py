"""Engines forked from one process that imported vLLM once (``e2e.py zygote``).

Every engine used to start as a fresh Python process that imports torch and vLLM first: 17 to
24 s of each engine's device time on the H200 machine (``import_s`` of the twelve engines of
steps run 6), about a sixth of an engine. The zygote imports them once per call and forks
each engine from there. The forked child sets the environment the engine's own process would
have had, sends its output to the engine's log, takes /dev/null as its input and runs
``child.main`` as before; the zygote waits for it and reports its exit status.

vLLM forks its own workers from a process that has imported it (its default start method
where CUDA is not initialized). The zygote checks three things before it serves: CUDA is not
initialized; no Python thread runs but its own (a fork copies only the calling thread, and a
lock another thread held would hang the engine instead of failing it; native threads, such as
the BLAS pool numpy's import starts, handle a fork themselves and are only recorded); and a
forked canary can initialize CUDA and run one operation. If the import or a check fails, the
zygote says so and ends, and the orchestrator starts every engine as a process of its own, as
before, and records why (``Run.zygote_status``).

Only engines whose start needs no other import-time setting than the zygote's are forked
(``IMPORT_TIME``: torch's inductor reads its worker count when it is imported, vLLM
configures its logging when it is imported); the zygote refuses any other, and that engine
starts as a process of its own. Both sides of that comparison are environments as a process
starts: importing vLLM rewrites some of its own variables (0.25.0's ``env_override`` sets
``TORCHINDUCTOR_COMPILE_THREADS=1`` and ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and sets others
only where they are unset), so the zygote keeps the values it started with, and a forked
engine gets its own environment with the imports' rewrites applied on top, as its own process
would have after the same imports. That holds only where the engine starts with the zygote's
value of each rewritten variable (an import that sets a variable only where it is unset would
have left an engine's own value alone), so an engine with another value of one is refused too.

Protocol, one JSON object a line: the zygote says ``{"ready": true, "import_s": s,
"threads": [names], "import_rewrites": [names]}`` or ``{"ready": false, "error": e}``; the
orchestrator asks ``{"job": path, "log": path, "env": {...}}``; the zygote answers
``{"pid": n}`` (or ``{"pid": null, "error": e}``) and, once the child has ended, ``{"pid": n,
"exit": code}`` (a negative code: the signal that ended it, as ``subprocess.Popen.returncode``
says it). One engine at a time: the next request is read after the last child's exit is
reported. The zygote ends when its input ends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

__all__ = [
    "FORKED_ENV",
    "IMPORT_TIME",
    "ForkedEngine",
    "Zygote",
    "cuda_canary",
    "preload_vllm",
    "serve",
]

IMPORT_TIME = (
    "TORCHINDUCTOR_COMPILE_THREADS",
    "VLLM_LOGGING_LEVEL",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_PREFIX",
    "PYTHONPATH",
)
"""Variables read while torch, vLLM or the harness are imported: a forked engine must have the
zygote's values of them."""

FORKED_ENV = "ROWCACHE_E2E_FORKED"
"""Set in a forked engine's environment: the zygote's import time (JSON), for its record."""


def preload_vllm() -> None:
    """What an engine's process imports before anything else (``child.run``). The harness's
    own engine code (``child``) is imported by ``e2e.py`` before it starts the zygote, which
    hands ``child.main`` in: this module imports nothing of the harness that imports it back."""
    from vllm import LLM, SamplingParams  # noqa: F401

    import rowcache.vllm._config  # noqa: F401


def cuda_canary() -> None:
    """Initialize CUDA and run one operation (in a forked child: what an engine does first)."""
    import torch

    x = torch.ones(4, device="cuda")  # initializes CUDA
    if float(x.sum().item()) != 4.0:
        raise RuntimeError("the canary's sum is wrong")


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _native_threads() -> list[str]:
    """The names of the process's threads, native ones included (Linux; none elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue
    return names


def _say(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _fork(body: Callable[[], None]) -> int:
    """Fork; the child runs ``body`` and leaves through ``os._exit`` (1 if ``body`` returns
    or raises: an engine's ``child.main`` leaves through ``os._exit(0)`` itself)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is its observable effects
        try:
            body()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    return pid


def _canary(canary: Callable[[], None]) -> str:
    """``"ok"`` when ``canary`` passes in a forked child, else what it printed."""
    read, write = os.pipe()

    def body() -> None:
        os.close(read)
        os.dup2(write, 2)
        canary()
        os._exit(0)

    pid = _fork(body)
    os.close(write)
    with os.fdopen(read, "r", errors="replace") as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return "ok" if code == 0 else f"exit {code}: {said.strip()[-1500:]}"


def _import_rewrites(before: dict[str, str], after: dict[str, str]) -> dict[str, str | None]:
    """What importing did to the environment: a value set (or changed), or None: removed."""
    out: dict[str, str | None] = {k: v for k, v in after.items() if before.get(k) != v}
    out.update({k: None for k in before if k not in after})
    return out


def _engine(
    request: dict[str, Any],
    run_child: Callable[[str], None],
    forked: str,
    rewrites: dict[str, str | None],
) -> None:
    """The forked engine: its log as output, no input, its environment with the imports'
    ``rewrites`` applied (what its own process would have after the same imports), then the
    child."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in rewrites.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ[FORKED_ENV] = forked
    run_child(request["job"])


def serve(
    preload: Callable[[], None],
    run_child: Callable[[str], None],
    canary: Callable[[], None],
    requests: IO[str],
    replies: IO[str],
) -> int:
    """The zygote's life (module docstring): import, check, canary, then one engine a request."""
    t0 = time.time()
    started_with = dict(os.environ)  # the comparison's side: as a process starts (docstring)
    try:
        preload()
        if _cuda_initialized():
            raise RuntimeError("CUDA was initialized while importing: forked engines cannot use it")
        threads = threading.active_count()
        if threads > 1:
            # A fork copies only the calling thread: a lock another Python thread holds at
            # that moment stays held in the child forever, and the engine would hang to its
            # deadline instead of failing. (Native pools such as OpenBLAS's, which numpy's
            # import starts, handle a fork themselves, as they do under multiprocessing.)
            raise RuntimeError(f"{threads} Python threads run after the imports; a fork needs one")
        import_s = round(time.time() - t0, 1)
        checked = _canary(canary)
        if checked != "ok":
            raise RuntimeError(f"the CUDA canary failed in a forked child: {checked}")
    except BaseException as exc:
        _say(replies, {"ready": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return 1
    rewrites = _import_rewrites(started_with, dict(os.environ))
    _say(
        replies,
        {
            "ready": True,
            "import_s": import_s,
            "threads": _native_threads(),
            "import_rewrites": sorted(rewrites),
        },
    )
    forked = json.dumps({"import_s": import_s})
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        # The import-time settings, and the variables the imports rewrote (docstring).
        names = sorted({*IMPORT_TIME, *rewrites})
        wrong = [n for n in names if request["env"].get(n) != started_with.get(n)]
        if wrong:
            _say(replies, {"pid": None, "error": f"import-time settings differ: {wrong}"})
            continue
        pid = _fork(functools.partial(_engine, request, run_child, forked, rewrites))
        _say(replies, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _say(replies, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)})
    return 0


class Zygote:
    """The orchestrator's side: start the zygote process, wait until it is ready, fork engines.

    ``command``: the zygote's command line (``e2e.py zygote``); ``env``: its environment (the
    import-time settings of the engines it may fork). ``status`` says how it went, for the
    run's record: ``{"import_s": s, "threads": [...], "import_rewrites": [...]}`` when ready,
    else ``{"error": e}``; engines it refused are added under ``refused``.
    """

    def __init__(self, command: list[str], env: dict[str, str], ready_timeout_s: float) -> None:
        self.status: dict[str, Any] = {}
        self._messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self._proc: subprocess.Popen[str] | None = None
        try:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
        except OSError as exc:
            self.status = {"error": f"not started: {exc}"}
            return
        threading.Thread(target=self._read, daemon=True).start()
        try:
            first = self._messages.get(timeout=ready_timeout_s)
        except queue.Empty:
            first = {"ready": False, "error": f"not ready after {ready_timeout_s:.0f} s"}
        if first.get("ready"):
            self.status = {
                "import_s": first.get("import_s"),
                "threads": first.get("threads"),
                "import_rewrites": first.get("import_rewrites"),
            }
        else:
            self.status = {"error": first.get("error", "ended before it was ready")}
            self.close()

    @property
    def ready(self) -> bool:
        return "error" not in self.status

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self._messages.put(json.loads(line))
            except json.JSONDecodeError:
                continue  # not the protocol: something the zygote's imports printed
        self._messages.put({"eof": True})

    def spawn(self, job: str, log: str, env: dict[str, str]) -> ForkedEngine | None:
        """Fork the engine of ``job`` (None, with ``status["refused"]``, when the zygote
        refuses it or has ended: start that engine as a process of its own)."""
        if not self.ready or self._proc is None or self._proc.stdin is None:
            return None
        try:
            self._proc.stdin.write(json.dumps({"job": job, "log": log, "env": env}) + "\n")
            self._proc.stdin.flush()
        except OSError as exc:
            self.status["error"] = f"its input is closed: {exc}"
            return None
        reply: dict[str, Any] = {"exit": None}
        while "exit" in reply:  # an earlier engine's exit nobody waited for is not the reply
            try:
                reply = self._messages.get(timeout=30)
            except queue.Empty:
                reply = {"eof": True}
        pid = reply.get("pid")
        if not isinstance(pid, int):
            why = reply.get("error") or "ended"
            self.status.setdefault("refused", []).append(f"{job}: {why}")
            if reply.get("eof"):
                self.status["error"] = "ended"
            return None
        return ForkedEngine(pid, self._messages)

    def close(self) -> None:
        """End the zygote (its input closed) and wait for it."""
        if self._proc is None:
            return
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ForkedEngine:
    """A forked engine as ``subprocess.Popen`` is used for one: ``poll``, ``wait``, ``kill``,
    ``returncode``. Its exit comes from the zygote, which is its parent."""

    def __init__(self, pid: int, messages: queue.Queue[dict[str, Any]]) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._messages = messages

    def _take(self, message: dict[str, Any]) -> None:
        if message.get("eof"):
            # The zygote is gone: the child was its child; if it still runs, it is stopped.
            self._signal(signal.SIGKILL)
            self.returncode = -int(signal.SIGKILL)
        elif message.get("pid") == self.pid and "exit" in message:
            self.returncode = int(message["exit"])

    def poll(self) -> int | None:
        while self.returncode is None:
            try:
                self._take(self._messages.get_nowait())
            except queue.Empty:
                break
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.time() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.time()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout or 0.0)
            try:
                self._take(self._messages.get(timeout=left))
            except queue.Empty:
                continue
        return self.returncode

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
