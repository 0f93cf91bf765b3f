"""Serving under load (issue 35, item 1): ``vllm serve`` without offload, with vLLM's UVA offload
and with rowcache, each driven by vLLM's own client, ``vllm bench serve``.

    python3 tools/vllm/serve_bench.py --model DIR --out $OUT [--servers none,uva,row]
        [--levels c1,c8,c32,c64,r1,r2,r4] [--deadline S] [--batch-invariant]
        [--build "--qwen3-30b-a3b --layers 8 --tokenizer"] [--label plain]

One server at a time (``serve_check.launch``: its own process group, its log in a file,
``GET /health`` before any request), each with the same serving settings (``COMMON_ARGS``):

* ``none``: vLLM as is, every expert on the GPU;
* ``uva``: vLLM's UVA offload of 6.75 GiB of experts (``--offload-backend uva --cpu-offload-gb
  6.75 --cpu-offload-params experts``: the 2.25 GiB left on the GPU are the memory of 32 slots
  of the 8-layer checkpoint);
* ``row``: rowcache with 32 slots per MoE layer, everything else the plugin's defaults
  (``--additional-config '{"rowcache": {"moe_expert_cache_size": 32}}'``).

Each server first serves three warm-ups (``WARMUPS``: they compile the kernels of new batch
shapes; each level counts the kernels compiled while it ran, ``JIT_MARK``), then
every level in turn: ``cN``, at most N requests in flight, as fast as they are answered
(``--max-concurrency N --request-rate inf``); ``rX``, X requests a second, Poisson arrivals, at most
64 in flight. The requests are vLLM's random dataset (``--dataset-name random``): prompts of 128 to
2,048 tokens and outputs of 64 to 256 (``--random-input-len 1088 --random-output-len 160`` with
range ratios 0.882 and 0.6), ``--ignore-eos``, greedy, one seed per level, the same on every server,
so each server answers the same requests and no level repeats another's prompts (which vLLM's prefix
cache would answer without their prefill). The client needs a tokenizer (the builder's
``--tokenizer``, ``word_tokenizer.py``). vLLM writes one JSON per level (``--save-result
--save-detailed``); this keeps its figures in ``$OUT/serve_bench.json`` (one record: the servers,
each level's figures and the scalars of its result, the plugin's start-up lines, how long each
server took to start) beside ``$OUT/serve_bench.txt`` (a table) and ``$OUT/serve_bench_logs.tar.gz``
(the servers' and clients' logs and vLLM's whole result files, per-request lists included). The
table ends with issue 35's targets, each met or missed (``plot_serve.targets``: ``--label``
naming ``skew`` judges the skewed router's; beside a level's verdict, the compilations each
server logged during it, where either logged any), compared only where ``row``'s log shows the cache
serving with its slots (``plugin_verdict``; a machine without the rowcache wheel would serve it as
plain vLLM) and only over levels whose every request was answered; a level the server did not
live to run is recorded as such. ``tools/vllm/plot_serve.py`` draws latency against throughput
from the records and judges the targets over records of several calls.

The client runs in one process for the whole run (``bench_client.py``, ``PersistentClient``):
vLLM's client module imported once instead of once a level (about 30 s each on the H200);
``--client-per-level`` starts ``vllm bench serve`` anew for every level instead.

``--batch-invariant`` starts every server with ``VLLM_BATCH_INVARIANT=1`` (vLLM's
batch-invariant kernels: a request's tokens do not depend on what it is batched with), to
measure what the mode costs. ``--deadline``: levels that would not end before it are recorded
as not run (an estimate from the level's requests and the server's figures so far).

Packages: the server wheels of ``serve_check.py`` (``vllm bench serve`` imports vLLM's server
modules too); nothing more for the random dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout on the path for tools.vllm
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from tools.vllm import plot_serve, serve_check

UVA_OFFLOAD_GIB = 6.75
ROW_SLOTS = 32
MAX_MODEL_LEN = 2560
COMMON_ARGS = (
    "--seed",
    "0",
    "--max-num-seqs",
    "64",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--hf-overrides",
    json.dumps({"max_position_embeddings": 4096}),
    "--jit-monitor-verbose",
)
"""Every server: 64 sequences at once (the highest level), contexts of a 2,048-token prompt and
256 outputs. The builder's Qwen3 shapes say ``max_position_embeddings`` 2048, below which vLLM
refuses such a context (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``), hence the override, as the offline
harness's (``EngineSpec.max_position_embeddings``); the real model's card says 40,960. vLLM's
JIT monitor logs every kernel compiled after start-up (by default only a kernel's first), so
that each level counts the compilations inside it (``JIT_MARK``)."""
JIT_MARK = "JIT compilation during inference"
"""vLLM 0.25.0's JIT monitor's words (``vllm/utils/jit_monitor.py``): a kernel compiled while
serving, whose request waits for it."""
INPUT_LEN, INPUT_RATIO = 1088, 0.8823
"""Prompts of ``1088 x (1 -+ 0.8823)`` (vLLM takes floor and ceil): 128 to 2,048 tokens, uniform."""
OUTPUT_LEN, OUTPUT_RATIO = 160, 0.6
"""Outputs of 64 to 256 tokens, uniform."""
PERCENTILES = "50,90,99"
METRICS = "ttft,tpot,itl,e2el"


@dataclass(frozen=True)
class BenchServer:
    """One server of the benchmark: its label, its ``vllm serve`` arguments beyond
    ``COMMON_ARGS``, and whether the cache serves its experts."""

    name: str
    label: str
    args: tuple[str, ...] = ()
    caches: bool = False


SERVERS = {
    "none": BenchServer("none", "no offload"),
    "uva": BenchServer(
        "uva",
        f"vLLM UVA offload, {UVA_OFFLOAD_GIB} GiB of experts offloaded",
        (
            "--offload-backend",
            "uva",
            "--cpu-offload-gb",
            str(UVA_OFFLOAD_GIB),
            "--cpu-offload-params",
            "experts",
        ),
    ),
    "row": BenchServer(
        "row",
        f"rowcache, {ROW_SLOTS} slots",
        ("--additional-config", json.dumps({"rowcache": {"moe_expert_cache_size": ROW_SLOTS}})),
        caches=True,
    ),
}


@dataclass(frozen=True)
class Level:
    """One load level: ``concurrency`` requests in flight at most, arriving at ``rate`` a
    second (None: all at once), ``prompts`` requests in all, drawn with ``seed``, their prompt
    and output lengths ``len x (1 -+ ratio)``: ``INPUT_LEN`` and ``OUTPUT_LEN`` for every level
    but ``warmup2``.

    Every level has its own seed, the same on every server: with one seed every level would
    send the first prompts of the level before it again, and vLLM's prefix cache (on by
    default) would answer them from the KV cache, without their prefill."""

    name: str
    prompts: int
    concurrency: int
    rate: float | None = None
    seed: int = 0
    input_len: int = INPUT_LEN
    input_ratio: float = INPUT_RATIO
    output_len: int = OUTPUT_LEN
    output_ratio: float = OUTPUT_RATIO


LEVELS = {
    "c1": Level("c1", 8, 1, seed=1),
    "c8": Level("c8", 32, 8, seed=2),
    "c32": Level("c32", 96, 32, seed=3),
    "c64": Level("c64", 128, 64, seed=4),
    "r1": Level("r1", 32, 64, 1.0, seed=5),
    "r2": Level("r2", 48, 64, 2.0, seed=6),
    "r4": Level("r4", 64, 64, 4.0, seed=7),
}
WARMUPS = (
    Level("warmup", 16, 16, seed=0),
    Level("warmup1", 16, 1, seed=8),
    Level(
        "warmup2", 16, 1, seed=9, input_len=320, input_ratio=0.59, output_len=8, output_ratio=0.0
    ),
)
"""Served before the levels and left out of every comparison: 16 requests at once (batched
decodes and prefills), 16 one at a time (single prompts' prefills, 128 to 2,048 tokens), and 16
short prompts one at a time (131 to 509 tokens, 8 tokens out). vLLM compiles its MoE kernel
(``fused_moe_kernel``) for each tile it picks by the rows of a step, and runs a step of more
rows than its CUDA graphs were captured for (128 here) outside them; a compilation stalls the
whole server for most of a second, and the request that met it waits that long for its first
token. On the H100 (2026-12-05, ``docs/records/2026-12-05-serving-batch-invariant.md``),
``warmup1``'s 466-token prompt compiled the kernel's tile for 129 to 512 rows, its 220-token
prompt found it compiled, and during c8, as a 488-token prompt was prefilled beside requests
decoding, both servers compiled the same tile again, with the same constants. Both prompts of
``warmup1`` were even. vLLM 0.25.0 passes the kernel the step's rows times top-k (8 here) as an
integer Triton compiles apart by whether it is a multiple of 16, so most likely an odd row count
did it (read from the sources, not yet shown by a run): ``warmup2``'s prompts are 9 odd and 7
even lengths (``drawn_prompt_lengths``). After the first warm-up alone (no ``warmup1``), a
194-token prompt of c1 waited 0.7 to 1.0 s on every server, no offload included.
``jit_compiles`` says whether a level still compiled. On the H100 the first two took 1.8 and
5.9 s without offload, 20.0 and 19.0 s for ``row``; ``warmup2``, 16 x 8 tokens out, a few."""
DEFAULT_LEVELS = "c1,c8,c32,c64,r1,r2,r4"
DEFAULT_SERVERS = "none,uva,row"


def parse_levels(text: str) -> list[Level]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in LEVELS]
    if unknown or not names:
        raise ValueError(f"--levels: unknown {unknown or text!r}; known: {', '.join(LEVELS)}")
    return [LEVELS[n] for n in names]


def parse_servers(text: str) -> list[BenchServer]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        raise ValueError(f"--servers: unknown {unknown or text!r}; known: {', '.join(SERVERS)}")
    return [SERVERS[n] for n in names]


def serve_command(python: str, model: str, port: int, server: BenchServer) -> list[str]:
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *COMMON_ARGS,
        *server.args,
    ]


def bench_command(
    python: str, model: str, port: int, level: Level, result_dir: Path, filename: str
) -> list[str]:
    """``vllm bench serve`` of one level against the server on ``port`` (module docstring)."""
    ratios = json.dumps({"input": level.input_ratio, "output": level.output_ratio})
    command = [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(level.input_len),
        "--random-output-len",
        str(level.output_len),
        "--random-range-ratio",
        ratios,
        "--num-prompts",
        str(level.prompts),
        "--max-concurrency",
        str(level.concurrency),
        "--request-rate",
        "inf" if level.rate is None else str(level.rate),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(level.seed),
        "--percentile-metrics",
        METRICS,
        "--metric-percentiles",
        PERCENTILES,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
    ]
    return command


FIGURES = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)
"""What the table shows of a level (vLLM's result keys)."""


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    return {key: raw.get(key) for key in FIGURES}


CLIENT_START_S = 30.0
"""A client's start (its imports) and end: 22 to 27 s on the H200 (2026-12-03)."""
WARM_CLIENT_S = 5.0
"""A level's overhead in a client that has imported vLLM already (``PersistentClient``)."""


def drawn_prompt_lengths(level: Level) -> list[int]:
    """The prompt lengths vLLM 0.25.0's random dataset draws for ``level``: uniform integers
    from ``floor(len x (1 - ratio))`` to ``ceil(len x (1 + ratio))``, both included, from
    numpy's generator seeded with the level's seed (``RandomDataset.sample``; the word
    tokenizer adds no special tokens to subtract). The benchmark's records hold the lengths vLLM
    drew, and the tests check these against them."""
    import numpy as np

    low = math.floor(level.input_len * (1 - level.input_ratio))
    high = math.ceil(level.input_len * (1 + level.input_ratio))
    drawn = np.random.default_rng(level.seed).integers(low, high + 1, size=level.prompts)
    return [int(n) for n in drawn]


def estimate_s(level: Level, tok_s: float | None, client_s: float = CLIENT_START_S) -> float:
    """How long ``level`` should take at ``tok_s`` output tokens a second (the server's best
    so far; 100 before any), plus the client's own time ``client_s``.

    Not padded: a level that starts anyway is cut at the deadline by its client's timeout and
    recorded as such, while a padded estimate skipped levels that would have fitted (on the
    H200, ``row``'s c32 with 195 s left: estimated 225 s at c8's rate, UVA's took 73 s), since
    more requests in flight answer more tokens a second."""
    tokens = level.prompts * level.output_len
    seconds = tokens / max(tok_s or 100.0, 1.0)
    if level.rate is not None:
        seconds = max(seconds, level.prompts / level.rate)
    return seconds + client_s


Runner = Callable[[list[str], dict[str, str], Path, float], int]
"""(command, env, log, timeout seconds) -> exit status (124 on timeout)."""


def run_client(command: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    import subprocess

    with open(log, "ab") as out:
        try:
            done = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return 124
    return done.returncode


class PersistentClient:
    """A ``Runner`` that keeps vLLM's client in one process (``bench_client.py``) and hands it
    each level's arguments, so that vLLM is imported once a run rather than once a level. A
    level past its timeout kills the process (its process group) and returns 124, as a client
    process of its own would; the next level starts a new one. ``warm``: a process is running
    with vLLM imported (its next level costs ``WARM_CLIENT_S``, not ``CLIENT_START_S``)."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self._process: Any = None
        self._env: dict[str, str] | None = None
        self.warm = False

    def __call__(self, command: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
        import select
        import subprocess

        argv = command[command.index("serve", command.index("bench")) + 1 :]
        if self._process is None or self._process.poll() is not None or env != self._env:
            self.close()
            driver = Path(__file__).with_name("bench_client.py")
            with open(log, "ab") as err:  # the driver's own errors, before it redirects
                self._process = subprocess.Popen(
                    [self.python, str(driver)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                    # Killed with this tool however it exits, as the servers are.
                    preexec_fn=serve_check._interruptible,
                )
            self._env, self.warm = dict(env), False
        process = self._process
        process.stdin.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], max(timeout, 0.0))
        if not ready:
            self.close()
            return 124
        line = process.stdout.readline()
        if not line:  # the driver died: its exit status, its traceback in the log
            code = process.wait()
            self._process = None
            with open(log, "a") as out:
                out.write(f"\nbench_client.py exited ({code}) before it answered\n")
            return code or 1
        self.warm = True
        return int(json.loads(line)["rc"])

    def close(self) -> None:
        """Stop the driver (its whole process group)."""
        import signal

        process, self._process, self.warm = self._process, None, False
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


@dataclass(frozen=True)
class Options:
    model: str
    out: Path
    servers: tuple[BenchServer, ...]
    levels: tuple[Level, ...]
    label: str = "plain"
    batch_invariant: bool = False
    deadline_s: float = 3600.0
    start_timeout: float = 300.0
    python: str = sys.executable


@dataclass
class ServerRun:
    server: BenchServer
    ready_s: float | None = None
    status: str = "not started"
    plugin: dict[str, Any] = field(default_factory=dict)
    plugin_verdict: str = "not read"
    """``ok`` where the log shows what the server was asked for: the cache's start-up lines
    (``ROW_SLOTS`` slots, the default planner) on a cache server, none on the others."""
    levels: dict[str, dict[str, Any]] = field(default_factory=dict)


def plugin_verdict(server: BenchServer, scan: dict[str, Any]) -> str:
    """``ok``, or why the server's log does not show what it was asked for (a machine without
    the rowcache wheel would serve ``row`` as vLLM with every expert on the GPU)."""
    spec = serve_check.ServerSpec(server.name, expects_cache=server.caches)
    if not server.caches:
        return "ok" if not scan["settings"] else "the cache's lines in a server without it"
    return serve_check.plugin_verdict(spec, scan, ROW_SLOTS, None)


def bench_server(
    server: BenchServer,
    options: Options,
    env: dict[str, str],
    work: Path,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    run: Runner = run_client,
    launcher: serve_check.Launcher = serve_check.launch,
) -> ServerRun:
    """Start ``server``, serve the warm-ups and every level before ``deadline``, stop it."""
    record = ServerRun(server)
    port = serve_check.free_port()
    log = work / f"server-{server.name}.log"
    command = serve_command(options.python, options.model, port, server)
    started = clock()
    process = launcher(command, env, log)
    handle = serve_check.Server(
        serve_check.ServerSpec(server.name), port, log, command, process, started
    )
    try:
        serve_check.wait_ready(
            [handle], min(deadline, started + options.start_timeout), clock=clock
        )
        record.status, record.ready_s = handle.status, handle.ready_s
        if handle.status != "ready":
            return record
        best: float | None = None
        for level in (*WARMUPS, *options.levels):
            left = deadline - clock()
            code = process.poll()
            if code is not None:
                record.levels[level.name] = {"status": f"not run: the server exited ({code})"}
                continue
            warm = bool(getattr(run, "warm", False))
            if left < estimate_s(level, best, WARM_CLIENT_S if warm else CLIENT_START_S):
                record.levels[level.name] = {"status": f"not run: time ({left:.0f} s left)"}
                continue
            name = f"{options.label}-{server.name}-{level.name}.json"
            (work / name).unlink(missing_ok=True)  # never an earlier run's figures
            mark = log.stat().st_size if log.exists() else 0
            code = run(
                bench_command(options.python, options.model, port, level, work, name),
                env,
                work / f"client-{server.name}-{level.name}.log",
                left,
            )
            entry: dict[str, Any] = {"status": "ok" if code == 0 else f"exit {code}"}
            entry["jit_compiles"] = compiles_since(log, mark)
            result = work / name
            if result.exists():
                raw = json.loads(result.read_text())
                entry["figures"] = figures(raw)
                entry["result"] = {k: v for k, v in raw.items() if not isinstance(v, list)}
                entry["raw_file"] = name
                tok_s = raw.get("output_throughput")
                if isinstance(tok_s, int | float) and code == 0:
                    best = max(best or 0.0, float(tok_s))
                failed = raw.get("failed") or 0
                if failed:
                    # Figures of fewer requests than asked: never a clean level.
                    entry["status"] = (
                        f"{failed} of {level.prompts} requests FAILED (errors in {name})"
                    )
            record.levels[level.name] = entry
    finally:
        handle.returncode = serve_check.stop(process)
        text = log.read_text(errors="replace") if log.exists() else ""
        record.plugin = serve_check.scan_log(text)
        record.plugin_verdict = plugin_verdict(server, record.plugin)
    return record


def compiles_since(log: Path, mark: int) -> int:
    """Kernels the server logged compiling (``JIT_MARK``) past byte ``mark`` of its log: those
    of the level that just ran (a line still in the server's buffers counts for the next)."""
    if not log.exists():
        return 0
    with open(log, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace").count(JIT_MARK)


def server_env(options: Options) -> dict[str, str]:
    env = dict(os.environ)
    if options.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def table(runs: Sequence[ServerRun], levels: Sequence[Level]) -> str:
    """One line per server and level: output and request throughput, TTFT and TPOT p50/p99,
    ITL p99, the kernels compiled while it ran (``JIT``)."""
    head = (
        f"{'server':6} {'level':7} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>8} {'JIT':>4}  status"
    )
    lines = [head]
    for record in runs:
        if record.status != "ready":
            lines.append(f"{record.server.name:6} server {record.status}")
            continue
        if record.plugin_verdict != "ok":
            lines.append(f"{record.server.name:6} server log: {record.plugin_verdict} (MISSED)")
        for level in levels:
            entry = record.levels.get(level.name, {})
            fig = entry.get("figures") or {}

            def cell(key: str, width: int, fig: dict[str, Any] = fig) -> str:
                value = fig.get(key)
                return (
                    f"{value:{width}.1f}" if isinstance(value, int | float) else f"{'-':>{width}}"
                )

            lines.append(
                f"{record.server.name:6} {level.name:7} {cell('output_throughput', 10)} "
                f"{cell('request_throughput', 7)} {cell('median_ttft_ms', 9)} "
                f"{cell('p99_ttft_ms', 9)} {cell('median_tpot_ms', 9)} "
                f"{cell('p99_tpot_ms', 9)} {cell('p99_itl_ms', 8)} "
                f"{entry.get('jit_compiles', '-'):>4}  {entry.get('status', '-')}"
            )
    return "\n".join(lines)


def run(
    options: Options,
    clock: Callable[[], float] = time.monotonic,
    client: Runner = run_client,
    launcher: serve_check.Launcher = serve_check.launch,
) -> dict[str, Any]:
    work = options.out / "serve_bench_work"
    work.mkdir(parents=True, exist_ok=True)
    deadline = clock() + options.deadline_s
    env = server_env(options)
    runs: list[ServerRun] = []
    record: dict[str, Any] = {}
    for server in options.servers:
        runs.append(bench_server(server, options, env, work, deadline, clock, client, launcher))
        record = write(options, work, runs)  # a run cut short keeps the servers it finished
    return record


def write(options: Options, work: Path, runs: Sequence[ServerRun]) -> dict[str, Any]:
    """The record, the table and the logs of the servers run so far."""
    record: dict[str, Any] = {
        "label": options.label,
        "model": options.model,
        "batch_invariant": options.batch_invariant,
        "common_args": list(COMMON_ARGS),
        "dataset": {
            "input_len": INPUT_LEN,
            "input_ratio": INPUT_RATIO,
            "output_len": OUTPUT_LEN,
            "output_ratio": OUTPUT_RATIO,
        },
        "warmups": [dataclasses.asdict(level) for level in WARMUPS],
        "levels": [dataclasses.asdict(level) for level in options.levels],
        "servers": [
            {
                "name": r.server.name,
                "label": r.server.label,
                "args": list(r.server.args),
                "status": r.status,
                "ready_s": r.ready_s,
                "plugin": r.plugin,
                "plugin_verdict": r.plugin_verdict,
                "levels": r.levels,
            }
            for r in runs
        ],
        "versions": serve_check.versions(),
        "commit": os.environ.get("ROWCACHE_COMMIT", "?"),
    }
    targets = plot_serve.targets(record)
    text = table(runs, (*WARMUPS, *options.levels)) + "\n" + "\n".join(targets) + "\n"
    (options.out / "serve_bench.json").write_text(json.dumps(record, indent=1) + "\n")
    (options.out / "serve_bench.txt").write_text(text)
    with tarfile.open(options.out / "serve_bench_logs.tar.gz", "w:gz") as tar:
        for path in sorted([*work.glob("*.log"), *work.glob("*.json")]):
            tar.add(path, arcname=path.name)
    print(text, flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--servers", default=DEFAULT_SERVERS)
    ap.add_argument("--levels", default=DEFAULT_LEVELS)
    ap.add_argument(
        "--label",
        default="plain",
        help="names the record (plain, skew, ...); one naming skew is judged by the skewed "
        "router's target",
    )
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--deadline", type=float, default=3600.0)
    ap.add_argument("--build", default=None, help="make_moe_checkpoint.py arguments")
    ap.add_argument(
        "--client-per-level",
        action="store_true",
        help="start vllm bench serve anew for every level (about 30 s of imports each) "
        "instead of one client process for the run (bench_client.py)",
    )
    ns = ap.parse_args(argv)
    try:
        servers = tuple(parse_servers(ns.servers))
        levels = tuple(parse_levels(ns.levels))
    except ValueError as exc:
        ap.error(str(exc))
    started = time.monotonic()
    if ns.build is not None:
        serve_check.build_checkpoint(Path(ns.model), ns.build)
    if not (Path(ns.model) / "tokenizer.json").exists():
        ap.error(
            f"{ns.model} has no tokenizer.json: vllm bench serve needs a tokenizer (build the "
            "checkpoint with make_moe_checkpoint.py --tokenizer)"
        )
    ns.out.mkdir(parents=True, exist_ok=True)
    # --deadline counts from here: the build's time is the servers' no longer.
    deadline_s = ns.deadline - (time.monotonic() - started)
    options = Options(ns.model, ns.out, servers, levels, ns.label, ns.batch_invariant, deadline_s)
    if ns.client_per_level:
        run(options)
        return 0
    client = PersistentClient(options.python)
    try:
        run(options, client=client)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    serve_check.start_tool()
    sys.exit(main())
