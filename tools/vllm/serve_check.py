"""``vllm serve`` with the rowcache plugin, queried by the OpenAI client (issue 21, item 2).

    python3 tools/vllm/serve_check.py --model DIR --out $OUT [--size 32] [--mode graphs|eager]
        [--planner host|device] [--max-tokens 32] [--prompts 4] [--deadline S]
        [--build "--qwen3-30b-a3b --layers 8"] [--concurrent]

Starts one server per configuration as ``python3 -m vllm.entrypoints.cli.main serve DIR``
(the bundle carries no ``vllm`` console script), each in a process group of its own with its
log in a file, one at a time, and waits for ``GET /health`` under one deadline:

* ``ref``: no cache. Where the cache servers run the host planner in graphs (``--planner
  host``) it is the same graph cut (``{"rowcache": {"moe_eager_between_graphs": true}}``: the
  MoE op eager between captured pieces), so that tokens compare exactly; with the device
  planner (the user's graph modes kept: ``--planner device``, or the plugin's default in full
  graphs, ``rowcache.vllm.defaults``) and in eager mode it is vLLM as is;
* ``cfg``: the cache through ``--additional-config '{"rowcache": {...}}'``;
* ``env``: the same through ``ROWCACHE_MOE_EXPERT_CACHE_*`` environment variables.

Each is queried with the OpenAI Python client: ``completions.create`` of token-id prompts
(the random checkpoints have no tokenizer: ``--skip-tokenizer-init``), ``temperature=0``,
``max_tokens`` fixed, ``extra_body={"return_token_ids": True, "ignore_eos": True}``. vLLM
0.25.0's OpenAI server supports both: ``CompletionRequest.return_token_ids`` and
``CompletionResponseChoice.token_ids`` in ``vllm/entrypoints/openai/completion/protocol.py``
(``return_tokens_as_token_ids`` there only changes how ``logprobs`` name tokens, and logprobs
need a tokenizer). The cache servers' token ids and texts are compared with ``ref`` prompt by
prompt (first divergence), and each server's log is searched for the plugin's start-up lines:
``rowcache: N slots per MoE layer, provider ..., split ...`` and ``rowcache: planner P
(reason)``. Writes ``$OUT/serve_check.json`` (one record), ``$OUT/serve_check.txt`` (summary)
and ``$OUT/serve_logs.tar.gz`` (every server log): three files of the eight a device call
returns. Exit status 0 only when every server answered, the plugin's lines name the settings
asked for, and the tokens are identical.

Packages. The GPU bundle (``../shared/gpu/vllm025-deps.txt``) already carries ``openai`` (with
``jiter``, ``sniffio``, ``distro``; ``httpx``, ``anyio``, ``tqdm`` and ``pydantic`` are in the
image), ``fastapi`` and ``starlette``. ``vllm serve`` of vLLM 0.25.0 also imports, at start-up,
``uvicorn`` (``vllm/entrypoints/launcher.py``), ``watchfiles`` (``serve/utils/ssl.py``, imported
by the launcher), ``prometheus_fastapi_instrumentator`` (``serve/instrumentator/metrics.py``)
and ``model_hosting_container_standards`` (``serve/sagemaker/api_router.py``, imported by
``openai/api_server.py``), which needs ``jmespath`` and ``supervisor``; ``python-multipart``
serves the form routes of ``fastapi[standard]``. ``click``, ``h11``, ``anyio``, ``uvloop`` and
``prometheus-client`` are in the image. Seven wheels, 1.0 MiB (docs/RUNNING.md, "vllm serve"):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        --platform manylinux1_x86_64 -d .whl uvicorn==0.54.0 watchfiles==1.3.0 \\
        prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 \\
        jmespath==1.1.0 supervisor==4.3.0 python-multipart==0.0.34

A server that exits because a module is missing is recorded with the module's name.

``--build ARGS`` first builds the random-weight checkpoint ``DIR`` with
``make_moe_checkpoint.py ARGS`` unless a whole one is there (its ``.rowcache-built`` marker,
as the e2e harness writes it); a ``DIR`` with a ``config.json`` and no marker stops the check
with an error and is left as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

if __package__ in (None, ""):  # run as a script: the checkout on the path for tools.vllm
    sys.path.append(str(Path(__file__).resolve().parents[2]))

ENV_KEYS = {
    "moe_expert_cache_size": "ROWCACHE_MOE_EXPERT_CACHE_SIZE",
    "moe_expert_cache_provider": "ROWCACHE_MOE_EXPERT_CACHE_PROVIDER",
    "moe_expert_cache_split": "ROWCACHE_MOE_EXPERT_CACHE_SPLIT",
    "moe_expert_cache_planner": "ROWCACHE_MOE_EXPERT_CACHE_PLANNER",
    "moe_eager_between_graphs": "ROWCACHE_MOE_EAGER_BETWEEN_GRAPHS",
}
"""The knob's environment variables (rowcache.vllm.knob.ENV; literal here so that this script
needs no rowcache import to start servers)."""

SETTINGS_LINE = re.compile(
    r"rowcache: (?P<size>\d+) slots per MoE layer, provider '(?P<provider>\w+)'"
    r"(?:, split '(?P<split>\w+)')?(?:, planned on the (?P<where>host|device))?"
)
EAGER_LINE = re.compile(r"rowcache: expert cache off, MoE op eager between graph pieces")
PLANNER_LINE = re.compile(r"rowcache: planner (?P<planner>host|device) \((?P<reason>[^\n]*)\)")
NOT_INSTALLED = re.compile(r"rowcache: vLLM plugin not installed[^\n]*")
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '(?P<name>[\w.]+)'")


# -- what runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """One server: its label, the knob through ``--additional-config`` or the environment."""

    label: str
    config: dict[str, object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    expects_cache: bool = False


def knob(size: int, planner: str | None) -> dict[str, object]:
    section: dict[str, object] = {"moe_expert_cache_size": size}
    if planner is not None:
        section["moe_expert_cache_planner"] = planner
    return section


def expected_planner(mode: str, planner: str | None) -> str:
    """The planner the cache servers serve: the one set, else the plugin's default for the
    mode (the checkpoints here are unquantized; ``graphs``: vLLM's default full graphs)."""
    if planner is not None:
        return planner
    # Here, not at the top: the script starts servers without importing rowcache, and run as
    # a script it finds the checkout only once the path above is set.
    from rowcache.vllm.defaults import default_planner

    return default_planner("eager" if mode == "eager" else "full")[0]


def specs(size: int, mode: str, planner: str | None) -> list[ServerSpec]:
    """``ref``, ``cfg`` and ``env`` (module docstring)."""
    section = knob(size, planner)
    same_cut = mode == "graphs" and expected_planner(mode, planner) == "host"
    ref = ServerSpec("ref", {"moe_eager_between_graphs": True} if same_cut else {})
    env = {ENV_KEYS[key]: str(value) for key, value in section.items()}
    return [
        ref,
        ServerSpec("cfg", section, expects_cache=True),
        ServerSpec("env", {}, env, expects_cache=True),
    ]


def server_command(
    python: str, model: str, port: int, spec: ServerSpec, mode: str, extra: Sequence[str] = ()
) -> list[str]:
    command = [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--seed",
        "0",
        *extra,
    ]
    if mode == "eager":
        command.append("--enforce-eager")
    if spec.config:
        command += ["--additional-config", json.dumps({"rowcache": spec.config})]
    return command


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts, the same for every server (ids 3.. to skip bos/eos/pad)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + i)] for i in range(count)]


# -- servers --------------------------------------------------------------------------------


class Process(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Launcher = Callable[[list[str], dict[str, str], Path], Process]
Probe = Callable[[int], bool]


PR_SET_PDEATHSIG = 1
"""``prctl``'s option: the signal a process gets when its parent exits (Linux)."""


def _interruptible() -> None:
    """In the child before it runs the server: SIGINT back to its default action (a shell runs
    background jobs with SIGINT ignored, and a Python started with it ignored never installs
    its handler, so the server would sit out ``stop``'s graceful SIGINT and be killed), and
    SIGKILL when this tool exits, however it exits (a device call cut at its limit kills the
    tool; a server left running would hold the GPU's memory and fail the next call's)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


GROUPS_ENV = "ROWCACHE_SERVE_GROUPS"
"""Where the servers' process groups are listed while they run (default below)."""
GROUPS_FILE = "/tmp/rowcache-serve-groups.json"


def _groups_path() -> Path:
    return Path(os.environ.get(GROUPS_ENV, GROUPS_FILE))


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat``, field 22):
    with the pid it names one process, never a later one that got the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


Groups = dict[str, list[str]]
"""A server's process group (its leader's pid) -> its leader's start time, the pid and the
start time of the tool that started it."""


def _groups() -> Groups:
    try:
        found = json.loads(_groups_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {
        str(k): [str(x) for x in v] for k, v in found.items() if isinstance(v, list) and len(v) == 3
    }


def _write_groups(groups: Groups) -> None:
    path = _groups_path()
    if groups:
        path.write_text(json.dumps(groups))
    else:
        path.unlink(missing_ok=True)


def _alive(pid: str, started: str) -> bool:
    """Whether process ``pid`` is the one that started at ``started`` (not a reused pid)."""
    return _started_at(int(pid)) == started


def reap_leftovers() -> list[int]:
    """Kill the process groups of servers whose tool has ended without stopping them (a call
    cut at its limit before its ``finally`` ran; the server's engine core outlives the server
    itself), each only if its leader is still the process that was listed; a running tool's
    servers are left alone. Returns the groups killed."""
    killed, kept = [], {}
    for pid, (started, owner, owner_started) in _groups().items():
        if not _alive(pid, started):
            continue
        if _alive(owner, owner_started):
            kept[pid] = [started, owner, owner_started]
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGKILL)
            killed.append(int(pid))
    _write_groups(kept)
    return killed


def start_tool() -> None:
    """What each serving tool does first when run as a script: kill the servers an earlier
    call left running (``reap_leftovers``, which says so), and let SIGTERM (a device call's
    time limit) exit through the ``finally`` blocks that stop this tool's servers, instead of
    ending the process where it stands."""
    killed = reap_leftovers()
    if killed:
        print(f"killed the process groups of servers left running: {killed}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def launch(command: list[str], env: dict[str, str], log: Path) -> Process:
    """A server in a new session (its own process group: stopped as a whole), SIGINT
    deliverable whatever this process inherited, killed when this process exits; stdout and
    stderr into ``log``. Its group is listed (``reap_leftovers``) until ``stop``."""
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_interruptible,  # the server process only; no threads run here
        )
    started, me = _started_at(process.pid), _started_at(os.getpid())
    if started is not None and me is not None:
        _write_groups({**_groups(), str(process.pid): [started, str(os.getpid()), me]})
    return process


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def stop(process: Process, grace: float = 15.0) -> int | None:
    """SIGINT to the server's process group, SIGKILL after ``grace`` seconds; what is left of
    the group once the server has exited (vLLM's engine core after a failed start) is killed."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 5.0)):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    groups = _groups()
    if groups.pop(str(process.pid), None) is not None:
        _write_groups(groups)
    return process.poll()


@dataclass
class Server:
    spec: ServerSpec
    port: int
    log: Path
    command: list[str]
    process: Process
    started: float
    ready_s: float | None = None
    status: str = "starting"
    returncode: int | None = None


def wait_ready(
    servers: list[Server],
    deadline: float,
    probe: Probe = healthy,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    interval: float = 1.0,
) -> None:
    """Until every server is ``ready`` or ``exited``, or the deadline (``timeout``)."""
    while True:
        waiting = [s for s in servers if s.status == "starting"]
        for server in waiting:
            code = server.process.poll()
            if code is not None:
                server.status, server.returncode = "exited", code
            elif probe(server.port):
                server.status, server.ready_s = "ready", round(clock() - server.started, 1)
        if not any(s.status == "starting" for s in servers):
            return
        if clock() >= deadline:
            for server in servers:
                if server.status == "starting":
                    server.status = "timeout"
            return
        sleep(interval)


# -- the client -----------------------------------------------------------------------------


Complete = Callable[[int, str, list[list[int]], int], list[dict[str, Any]]]
"""(port, model, prompts, max_tokens) -> one choice per prompt: ``token_ids`` and ``text``."""


def openai_complete(
    port: int, model: str, batch: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """Greedy completions through the OpenAI Python client, one request per prompt (the
    server batches them as it likes; each sequence is its own)."""
    import importlib

    openai: Any = importlib.import_module("openai")  # on the device, from the bundle
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", timeout=300)
    choices: list[dict[str, Any]] = []
    for prompt in batch:
        response = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        [choice] = response.model_dump()["choices"]
        choices.append(
            {
                "token_ids": list(choice.get("token_ids") or []),
                "text": choice.get("text") or "",
                "finish_reason": choice.get("finish_reason"),
            }
        )
    return choices


def compare(reference: list[dict[str, Any]], got: list[dict[str, Any]]) -> dict[str, Any]:
    """Token ids and texts prompt by prompt; the first divergence of each."""
    divergences: list[dict[str, Any]] = []
    identical_tokens = total_tokens = 0
    for index, (ref, out) in enumerate(zip(reference, got, strict=True)):
        a, b = ref["token_ids"], out["token_ids"]
        total_tokens += max(len(a), len(b))
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        identical_tokens += len(a) if first is None else first
        if first is not None or ref["text"] != out["text"]:
            divergences.append(
                {
                    "prompt": index,
                    "token": first,
                    "reference": a[first] if first is not None and first < len(a) else None,
                    "got": b[first] if first is not None and first < len(b) else None,
                    "text_differs": ref["text"] != out["text"],
                }
            )
    return {
        "identical": not divergences,
        "tokens_identical_before_divergence": identical_tokens,
        "tokens": total_tokens,
        "divergences": divergences,
    }


def scan_log(text: str) -> dict[str, Any]:
    """The plugin's start-up lines in a server log (every process that logged them)."""
    settings = [m.groupdict() for m in SETTINGS_LINE.finditer(text)]
    planners = [m.groupdict() for m in PLANNER_LINE.finditer(text)]
    missing = MISSING_MODULE.search(text)
    return {
        "settings": settings,
        "planner": planners,
        "eager_baseline": bool(EAGER_LINE.search(text)),
        "not_installed": [m.group(0) for m in NOT_INSTALLED.finditer(text)],
        "missing_module": missing.group("name") if missing else None,
    }


def plugin_verdict(
    spec: ServerSpec, scan: dict[str, Any], size: int, planner: str | None, mode: str = "graphs"
) -> str:
    """``ok``, or what the log lacks, against what the spec asked for."""
    if scan["not_installed"]:
        return "plugin not installed"
    if not spec.expects_cache:
        if spec.config.get("moe_eager_between_graphs") and not scan["eager_baseline"]:
            return "no eager-baseline line"
        return "ok" if not scan["settings"] else "cache line in the reference"
    if not scan["settings"]:
        return "no settings line"
    if any(int(s["size"]) != size for s in scan["settings"]):
        return f"settings line with another size than {size}"
    if not scan["planner"]:
        return "no planner line"
    chosen = {p["planner"] for p in scan["planner"]}
    if planner is not None and chosen != {planner}:
        return f"planner {sorted(chosen)} where {planner} was set"
    if planner is not None and not all(p["reason"].startswith("set by") for p in scan["planner"]):
        return "planner line does not say it was set"
    if planner is None:
        default = expected_planner(mode, None)
        if chosen != {default}:
            return f"planner {sorted(chosen)} where the default is {default}"
        if not all(p["reason"].startswith("default") for p in scan["planner"]):
            return "planner line does not say it is the default"
    return "ok"


# -- the run --------------------------------------------------------------------------------


@dataclass
class Options:
    model: str
    out: Path
    size: int = 32
    mode: str = "graphs"
    planner: str | None = None
    max_tokens: int = 32
    prompt_count: int = 4
    prompt_len: int = 16
    deadline: float = 540.0
    concurrent: bool = False
    """All servers at once. Faster, but vLLM 0.25.0 sizes a server's KV cache from the GPU
    memory its start-up profile sees taken, other servers' allocations included: on the H200
    (2026-12-02) the third of three servers started together found no memory for its KV cache
    and exited. One at a time is the default."""
    gpu_memory_utilization: float = 0.25
    max_model_len: int = 512
    extra: tuple[str, ...] = ()


@contextlib.contextmanager
def running(
    options: Options, batch: Sequence[ServerSpec], launcher: Launcher, base_env: dict[str, str]
) -> Iterator[list[Server]]:
    """Start ``batch``; stop every one of them on the way out, whatever happens."""
    servers: list[Server] = []
    extra = [
        "--gpu-memory-utilization",
        str(options.gpu_memory_utilization),
        "--max-model-len",
        str(options.max_model_len),
        *options.extra,
    ]
    try:
        for spec in batch:
            port = free_port()
            log = options.out / f"server_{spec.label}.log"
            command = server_command(sys.executable, options.model, port, spec, options.mode, extra)
            env = {k: v for k, v in base_env.items() if k not in ENV_KEYS.values()}
            env.update(spec.env)
            process = launcher(command, env, log)
            servers.append(Server(spec, port, log, command, process, time.monotonic()))
        yield servers
    finally:
        for server in servers:
            server.returncode = stop(server.process)


def run(
    options: Options,
    launcher: Launcher = launch,
    complete: Complete = openai_complete,
    probe: Probe = healthy,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    vocab: int | None = None,
) -> dict[str, Any]:
    """Every server, queried and compared; the record (also written to ``options.out``)."""
    started = clock()
    deadline = started + options.deadline
    options.out.mkdir(parents=True, exist_ok=True)
    vocab = vocab or _vocab(options.model)
    batch = prompts(options.prompt_count, options.prompt_len, vocab, seed=0)
    all_specs = specs(options.size, options.mode, options.planner)
    groups = [all_specs] if options.concurrent else [[s] for s in all_specs]
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        if clock() >= deadline:
            for spec in group:
                results[spec.label] = {"status": "not started (deadline)"}
            continue
        with running(options, group, launcher, dict(os.environ)) as servers:
            wait_ready(servers, deadline, probe, clock, sleep)
            for server in servers:
                entry: dict[str, Any] = {
                    "command": server.command,
                    "env": server.spec.env,
                    "status": server.status,
                    "ready_s": server.ready_s,
                }
                if server.status == "ready":
                    try:
                        t0 = clock()
                        outputs[server.spec.label] = complete(
                            server.port, options.model, batch, options.max_tokens
                        )
                        entry["client_s"] = round(clock() - t0, 2)
                    except Exception as exc:  # the server's fault or the client's: recorded
                        entry["status"] = f"client failed: {type(exc).__name__}: {exc}"
                results[server.spec.label] = entry
        for server in servers:  # stopped: the logs are complete
            entry = results[server.spec.label]
            entry["returncode"] = server.returncode
            text = server.log.read_text(errors="replace") if server.log.exists() else ""
            scan = scan_log(text)
            entry["log"] = scan
            entry["plugin"] = plugin_verdict(
                server.spec, scan, options.size, options.planner, options.mode
            )
            if server.status != "ready":
                entry["log_tail"] = text[-3000:]
    comparisons: dict[str, Any] = {}
    for label in ("cfg", "env"):
        if "ref" in outputs and label in outputs:
            comparisons[label] = compare(outputs["ref"], outputs[label])
            comparisons[label]["tokens_per_prompt"] = [c["token_ids"] for c in outputs[label]]
    if "ref" in outputs:
        comparisons["ref_tokens_per_prompt"] = [c["token_ids"] for c in outputs["ref"]]
    verdict = verdict_of(results, comparisons)
    record: dict[str, Any] = {
        "tool": "serve_check",
        "commit": os.environ.get("ROWCACHE_COMMIT", "?"),
        "versions": versions(),
        "model": options.model,
        "mode": options.mode,
        "size": options.size,
        "planner_setting": options.planner,
        "max_tokens": options.max_tokens,
        "prompts": batch,
        "servers": results,
        "comparisons": comparisons,
        "verdict": verdict,
        "wall_s": round(clock() - started, 1),
    }
    write(options.out, record)
    return record


def verdict_of(results: dict[str, dict[str, Any]], comparisons: dict[str, Any]) -> str:
    if any(r.get("status") != "ready" for r in results.values()):
        return "incomplete"
    if any(r.get("plugin") != "ok" for r in results.values()):
        return "fail"
    if any(not comparisons.get(label, {}).get("identical") for label in ("cfg", "env")):
        return "fail"
    return "pass"


def summary(record: dict[str, Any]) -> str:
    lines = [
        f"serve_check {record['verdict']}: {record['model']} mode {record['mode']} size "
        f"{record['size']} planner setting {record['planner_setting']} ({record['wall_s']} s)"
    ]
    for label, entry in record["servers"].items():
        log = entry.get("log", {})
        planner = "; ".join(f"{p['planner']} ({p['reason']})" for p in log.get("planner", []))
        lines.append(
            f"  {label}: {entry.get('status')} ready {entry.get('ready_s')} s, plugin "
            f"{entry.get('plugin')}, planner {planner or '-'}"
            + (f", missing module {log['missing_module']}" if log.get("missing_module") else "")
        )
    for label in ("cfg", "env"):
        comparison = record["comparisons"].get(label)
        if comparison:
            lines.append(
                f"  {label} against ref: {comparison['tokens_identical_before_divergence']}/"
                f"{comparison['tokens']} tokens before divergence; "
                f"divergences {comparison['divergences'] or 'none'}"
            )
    return "\n".join(lines) + "\n"


def write(out: Path, record: dict[str, Any]) -> None:
    (out / "serve_check.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "serve_check.txt").write_text(summary(record))
    logs = sorted(out.glob("server_*.log"))
    with tarfile.open(out / "serve_logs.tar.gz", "w:gz") as tar:
        for log in logs:
            tar.add(log, arcname=log.name)
    for log in logs:  # in the archive: the call returns at most eight files
        log.unlink()


def _vocab(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    return int(config["vocab_size"])


def versions() -> dict[str, str]:
    from importlib import metadata

    found: dict[str, str] = {}
    for name in ("vllm", "rowcache", "torch", "openai", "uvicorn"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def build_checkpoint(model: Path, build_args: str) -> None:
    """Build the random-weight checkpoint ``model`` (``make_moe_checkpoint.py`` with
    ``build_args``) unless a whole one is there: its ``BUILT`` marker, written once the builder
    has returned. A ``config.json`` without the marker is a build that stopped halfway
    (``save_pretrained`` writes it first) or a model built elsewhere; either is left as it is,
    with an error, rather than served half-built or overwritten."""
    from tools.vllm.harness.checkpoints import BUILDER_VERSION, BUILT, is_built, mark_built

    if is_built(model):
        return
    if (model / "config.json").exists():
        raise SystemExit(
            f"serve_check.py: --build: {model} has a config.json but no {BUILT} marker of "
            f"builder version {BUILDER_VERSION} (a build that stopped before its end, one by "
            "an older builder, or a model not built by --build); remove the directory to "
            "build it again, or leave out --build to serve it as it is"
        )
    tool = Path(__file__).resolve().parent / "make_moe_checkpoint.py"
    subprocess.run([sys.executable, str(tool), str(model), *build_args.split()], check=True)
    mark_built(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--mode", choices=("graphs", "eager"), default="graphs")
    parser.add_argument("--planner", choices=("host", "device"), default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds for everything")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="every server at once (default: one at a time; see Options.concurrent)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--build", default=None, metavar="ARGS", help="make_moe_checkpoint args")
    parser.add_argument("extra", nargs="*", help="more `vllm serve` arguments (after --)")
    args = parser.parse_args(argv)
    if args.build is not None:
        build_checkpoint(args.model, args.build)
    options = Options(
        model=str(args.model),
        out=args.out,
        size=args.size,
        mode=args.mode,
        planner=args.planner,
        max_tokens=args.max_tokens,
        prompt_count=args.prompts,
        deadline=args.deadline,
        concurrent=args.concurrent,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        extra=tuple(args.extra),
    )
    record = run(options)
    print(summary(record), end="")
    return 0 if record["verdict"] == "pass" else 1


if __name__ == "__main__":
    start_tool()
    raise SystemExit(main())
