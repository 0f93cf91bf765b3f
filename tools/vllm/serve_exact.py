"""Exact per request under load (issue 35, items 2 and 3): greedy requests to ``vllm serve`` must
return the same tokens alone and among many others, with clients that disconnect mid-stream,
under KV-cache pressure that makes vLLM preempt, and over a soak.

    python3 tools/vllm/serve_exact.py --model DIR --out $OUT [--servers none,row]
        [--requests 64] [--max-tokens 64] [--aborts 0.1] [--kv-blocks N] [--soak S]
        [--no-batch-invariant] [--deadline S]

One server at a time (``serve_check.launch``), started with ``VLLM_BATCH_INVARIANT=1`` unless
``--no-batch-invariant`` (vLLM's batch-invariant kernels; without them vLLM 0.25.0's own
tokens at 32 sequences were not reproducible run to run), the same serving settings as
``serve_bench.py`` (``serve_bench.COMMON_ARGS``, vLLM's verbose JIT monitor among them),
``none`` (no offload: the control) and ``row`` (rowcache, 32 slots). For each:

1. ``alone``: every one of ``--requests`` distinct token-id prompts (16 to 512 tokens, seeded)
   sent by itself, one after the other: each request's reference tokens;
2. ``together``: all of them at once, and beside them ``--aborts`` of their number more
   streamed requests whose client reads a few chunks and closes the connection (vLLM aborts
   them);
3. ``after``: the first eight again, alone: what the aborts left behind must not change them.

Every request is greedy (``temperature`` 0), ``max_tokens`` long (``ignore_eos``), and asks for its
``token_ids`` (vLLM 0.25.0's ``return_token_ids``). ``together`` and ``after`` are compared with
``alone`` request by request (first divergence), and ``row``'s ``alone`` with ``none``'s. Prefix
caching is off (``--no-enable-prefix-caching``): a request sent again must be computed again, its
prompt's experts loaded again, not served from the KV cache of its first sending. A cache server is
Every server is started with the plugin's worker extension (``rowcache.vllm.worker_extension``) and
``VLLM_SERVER_DEV_MODE=1``; a cache server is read through ``POST /collective_rpc`` after ``after``
(and after the soak): every layer's counters must be consistent
(``rowcache.vllm.expert_cache_counter_problems``) and every resident slot's bytes equal to its
expert's host bytes. ``--kv-blocks N`` starts the
servers with ``--num-gpu-blocks-override N`` (a KV cache too small for every request at once: vLLM
preempts and recomputes), and the number of preemptions is read from the server's ``/metrics``
(``vllm:num_preemptions``). ``--soak S`` then keeps 32 requests in flight for S seconds, sampling
every ten seconds the GPU's memory in use (``nvidia-smi``), the worker's pinned host memory as
torch's caching host allocator counts it (``rowcache_pinned``: CUDA's pinned pages show in neither
``VmLck`` nor ``VmPin``) and, recorded but not judged, the server's ``VmRSS``, ``VmLck`` and
``VmPin``. The server log is searched for errors. Writes
``$OUT/serve_exact.json`` (one record), ``$OUT/serve_exact.txt`` (the verdicts) and
``$OUT/serve_exact_logs.tar.gz``, rewritten after each server (a run cut short keeps the servers it
finished); exit status 0 only when every comparison is exact, every cache read back consistent and
exact, and no server logged an error.

The checkpoint needs no tokenizer (prompts are token ids; a server of a checkpoint without one
is started with ``--skip-tokenizer-init``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout on the path for tools.vllm
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from rowcache.vllm import expert_cache_counter_problems
from rowcache.vllm.worker_extension import QUALNAME as WORKER_EXTENSION
from tools.vllm import serve_bench, serve_check

AFTER = 8
"""Requests sent alone again after the concurrent round."""
ABORT_CHUNKS = 3
"""Streamed chunks an aborting client reads before it closes the connection."""
KV_BLOCK_TOKENS = 16
"""vLLM's default KV-cache block size (``--block-size``)."""
SOAK_CONCURRENCY = 32
SAMPLE_EVERY_S = 10.0
ERROR_LINE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|CUDA error|RowcacheError")


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct token-id prompts of 16 to 512 tokens (ids from 3: past the special ones)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 512))] for _ in range(count)]


# -- the client ---------------------------------------------------------------------------------


def complete(port: int, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy completion's token ids (``/v1/completions``, ``return_token_ids``)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        data = json.loads(response.read())
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {str(data)[:300]}")
    ids: list[int] = data["choices"][0]["token_ids"]
    return ids


def abort_midstream(port: int, model: str, prompt: list[int], max_tokens: int) -> int:
    """A streamed request whose client reads ``ABORT_CHUNKS`` chunks and hangs up; the chunks
    read."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    read = 0
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        while read < ABORT_CHUNKS:
            line = response.fp.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                read += 1
    finally:
        connection.close()  # the disconnect: vLLM aborts the request
    return read


def collective_rpc(port: int, method: str) -> Any:
    """The first worker's answer to ``method`` (``POST /collective_rpc``: a server started with
    ``VLLM_SERVER_DEV_MODE=1`` and the worker extension that has the method)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request(
            "POST",
            "/collective_rpc",
            json.dumps({"method": method}),
            {"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        data = json.loads(response.read() or b"null")
    finally:
        connection.close()
    if response.status != 200 or not isinstance(data, dict) or not data.get("results"):
        raise RuntimeError(f"{method}: HTTP {response.status}: {str(data)[:300]}")
    return data["results"][0]


def read_cache(port: int, rpc: Callable[[int, str], Any]) -> dict[str, Any]:
    """The cache's counters and slot check, and what is wrong with them (``problems``; a cache
    that cannot be read is a problem, never a pass)."""
    try:
        stats = rpc(port, "rowcache_stats")
        slots = rpc(port, "rowcache_slot_check")
    except Exception as exc:
        return {"problems": [f"cache unreadable: {type(exc).__name__}: {exc}"[:300]]}
    problems: list[str] = []
    if not isinstance(stats, list) or not stats:
        problems.append(f"no cached layer in rowcache_stats: {str(stats)[:200]}")
    else:
        problems += expert_cache_counter_problems(stats)
    if not isinstance(slots, dict) or not slots.get("slots"):
        problems.append(f"no resident slot checked: {str(slots)[:200]}")
    else:
        problems += [f"slot bytes: {m}" for m in slots.get("mismatches", [])][:20]
    totals = (
        {
            key: sum(int(s.get(key, 0)) for s in stats)
            for key in ("hits", "misses", "evictions", "invalidations")
        }
        if isinstance(stats, list)
        else {}
    )
    return {"stats": stats, "totals": totals, "slots": slots, "problems": problems}


Complete = Callable[[int, str, list[int], int], list[int]]
Abort = Callable[[int, str, list[int], int], int]
Rpc = Callable[[int, str], Any]


def divergence(want: list[int], got: list[int] | None) -> int | None:
    """The first position where ``got`` differs from ``want`` (None: identical)."""
    if got is None:
        return 0
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def compare(want: Sequence[list[int]], got: Sequence[list[int] | None]) -> dict[str, Any]:
    first = [divergence(w, g) for w, g in zip(want, got, strict=False)]
    bad = [i for i, f in enumerate(first) if f is not None]
    return {
        "requests": len(first),
        "identical": len(first) - len(bad),
        "diverging": {str(i): first[i] for i in bad},
        "exact": not bad and len(first) == len(want),
    }


# -- one server -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    model: str
    out: Path
    servers: tuple[serve_bench.BenchServer, ...]
    requests: int = 64
    max_tokens: int = 64
    aborts: float = 0.1
    kv_blocks: int | None = None
    soak_s: float = 0.0
    batch_invariant: bool = True
    deadline_s: float = 3600.0
    start_timeout: float = 300.0
    seed: int = 0
    python: str = sys.executable


@dataclass
class Checked:
    server: str
    status: str = "not started"
    ready_s: float | None = None
    alone: list[list[int]] = field(default_factory=list)
    together: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    aborted: list[int] = field(default_factory=list)
    preemptions: float | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    cache_after_soak: dict[str, Any] = field(default_factory=dict)
    soak: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    plugin: dict[str, Any] = field(default_factory=dict)


def server_args(options: Options, server: serve_bench.BenchServer) -> list[str]:
    # Every server: the pinned-memory read of a soak answers with or without the cache.
    extra = [*server.args, "--no-enable-prefix-caching", "--worker-extension-cls", WORKER_EXTENSION]
    if options.kv_blocks is not None:
        extra += ["--num-gpu-blocks-override", str(options.kv_blocks)]
    if not (Path(options.model) / "tokenizer.json").exists():
        extra.append("--skip-tokenizer-init")
    return extra


def metric(port: int, name: str) -> float | None:
    """The sum of a Prometheus counter on the server's ``/metrics`` (None: not there)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode(errors="replace")
    except OSError:
        return None
    finally:
        connection.close()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if re.match(rf"{re.escape(name)}_total[{{ ]", line)
    ]
    return sum(values) if values else None


def memory_sample(pid: int) -> dict[str, Any]:
    """GPU memory in use (MiB, ``nvidia-smi``) and the server's process group's host memory
    (KiB, ``/proc/PID/status``): resident (``VmRSS``, which holds CUDA's pinned allocations:
    they are resident pages of the process), locked by ``mlock`` (``VmLck``) and pinned by a
    driver (``VmPin``). Which of the last two CUDA's pinned host memory shows in depends on how
    the driver pins it, so all three are kept."""
    sample: dict[str, Any] = {"t": round(time.time(), 1)}
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        sample["gpu_mib"] = int(out.split()[0])
    rss = locked = pinned = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError, ValueError):
            fields = dict(
                line.split(":", 1) for line in status.read_text().splitlines() if ":" in line
            )
            if os.getpgid(int(status.parent.name)) != pid:
                continue
            rss += int(fields.get("VmRSS", "0 kB").split()[0])
            locked += int(fields.get("VmLck", "0 kB").split()[0])
            pinned += int(fields.get("VmPin", "0 kB").split()[0])
    sample["rss_kib"], sample["locked_kib"], sample["pinned_kib"] = rss, locked, pinned
    return sample


PINNED_KEYS = ("torch_host_bytes", "arena_bytes", "transient_bytes")
"""What ``rowcache_pinned`` answers: every pinned byte as torch's host allocator counts it
(judged), and of those the plugin's arenas' slabs (recorded: they tell the cache's own share
from vLLM's and torch's)."""


def pinned_sample(port: int, rpc: Rpc) -> dict[str, int | None]:
    """The worker's pinned host bytes (``rowcache_pinned``); None for each figure that cannot be
    read."""
    found: dict[str, int | None] = dict.fromkeys(PINNED_KEYS)
    with contextlib.suppress(Exception):
        answer = rpc(port, "rowcache_pinned")
        for key in PINNED_KEYS:
            value = answer.get(key)
            found[key] = int(value) if isinstance(value, int) else None
    return found


def soak(
    port: int,
    pid: int,
    options: Options,
    batch: list[list[int]],
    complete_: Complete,
    rpc: Rpc = collective_rpc,
) -> dict[str, Any]:
    """``SOAK_CONCURRENCY`` requests in flight for ``options.soak_s`` seconds; memory sampled
    every ``SAMPLE_EVERY_S``."""
    stop_at = time.monotonic() + options.soak_s
    done = [0]
    failures: list[str] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        while time.monotonic() < stop_at:
            prompt = batch[(index + done[0]) % len(batch)]
            try:
                complete_(port, options.model, prompt, options.max_tokens)
            except Exception as exc:
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])
            with lock:
                done[0] += 1

    def sample() -> dict[str, Any]:
        return {**memory_sample(pid), **pinned_sample(port, rpc)}

    samples = [sample()]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(SOAK_CONCURRENCY)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        time.sleep(min(SAMPLE_EVERY_S, max(0.1, stop_at - time.monotonic())))
        samples.append(sample())
    return {
        "seconds": options.soak_s,
        "requests": done[0],
        "failures": failures[:20],
        "samples": samples,
        "growth": growth(samples),
    }


GROWTH_KEYS = ("gpu_mib", "torch_host_bytes", "rss_kib", "locked_kib", "pinned_kib")


def growth(samples: list[dict[str, Any]]) -> dict[str, float | None]:
    """Last sample over the second (the first is before any load): GPU MiB, the worker's
    pinned host bytes, host KiB; None where either sample lacks the figure."""
    if len(samples) < 3:
        return dict.fromkeys(GROWTH_KEYS)
    first, last = samples[1], samples[-1]

    def grown(key: str) -> float | None:
        if first.get(key) is None or last.get(key) is None:
            return None
        return float(last[key]) - float(first[key])

    return {key: grown(key) for key in GROWTH_KEYS}


SOAK_GPU_GROWTH_MIB = 64
"""GPU memory a soak may add between its first loaded sample and its last (allocator noise)."""
SOAK_PINNED_GROWTH_BYTES = 64 << 20
"""Pinned host memory it may add (torch's host allocator caches blocks in power-of-two sizes:
one new block of a buffer vLLM grows is not a leak; a leak grows without bound)."""


def soak_problems(result: dict[str, Any]) -> list[str]:
    """Why a soak fails (empty: it passed): not run, requests that failed, memory that grew."""
    if "status" in result:
        return [str(result["status"])]
    problems = []
    if result.get("failures"):
        problems.append(f"{len(result['failures'])} requests failed")
    if not result.get("requests"):
        problems.append("no request answered")
    growth = result.get("growth") or {}
    gpu = growth.get("gpu_mib")
    if gpu is None:
        problems.append("GPU memory not sampled")
    elif gpu > SOAK_GPU_GROWTH_MIB:
        problems.append(f"GPU memory grew {gpu:g} MiB (limit {SOAK_GPU_GROWTH_MIB})")
    pinned = growth.get("torch_host_bytes")
    if pinned is None:
        problems.append("pinned host memory not read (rowcache_pinned)")
    elif pinned > SOAK_PINNED_GROWTH_BYTES:
        problems.append(
            f"pinned host memory grew {pinned / 2**20:g} MiB "
            f"(limit {SOAK_PINNED_GROWTH_BYTES >> 20})"
        )
    return problems


def check_server(
    server: serve_bench.BenchServer,
    options: Options,
    work: Path,
    deadline: float,
    complete_: Complete = complete,
    abort: Abort = abort_midstream,
    launcher: serve_check.Launcher = serve_check.launch,
    rpc: Rpc = collective_rpc,
    vocab: int = 4096,
) -> Checked:
    record = Checked(server.name)
    port = serve_check.free_port()
    log = work / f"server-{server.name}.log"
    log.unlink(missing_ok=True)  # an earlier run's log is not this server's
    command = serve_bench.serve_command(options.python, options.model, port, server)
    command += server_args(options, server)
    env = dict(os.environ)
    if options.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /collective_rpc: the cache, pinned memory
    started = time.monotonic()
    process = launcher(command, env, log)
    handle = serve_check.Server(
        serve_check.ServerSpec(server.name), port, log, command, process, started
    )
    batch = prompts(options.requests, vocab, options.seed)
    try:
        serve_check.wait_ready([handle], min(deadline, started + options.start_timeout))
        record.status, record.ready_s = handle.status, handle.ready_s
        if handle.status != "ready":
            return record
        record.alone = [complete_(port, options.model, p, options.max_tokens) for p in batch]
        aborting = prompts(round(options.requests * options.aborts), vocab, options.seed + 1)
        with ThreadPoolExecutor(len(batch) + len(aborting)) as pool:
            together = [
                pool.submit(complete_, port, options.model, p, options.max_tokens) for p in batch
            ]
            aborted = [
                pool.submit(abort, port, options.model, p, options.max_tokens) for p in aborting
            ]
            got = [f.result() for f in together]
            record.aborted = [f.result() for f in aborted]
        record.together = compare(record.alone, got)
        again = [complete_(port, options.model, p, options.max_tokens) for p in batch[:AFTER]]
        record.after = compare(record.alone[:AFTER], again)
        record.preemptions = metric(port, "vllm:num_preemptions")
        if server.caches:
            record.cache = read_cache(port, rpc)
        if options.kv_blocks is not None and not record.preemptions:
            record.errors.append("--kv-blocks set but the server counted no preemption")
        # The soak, then its reads and the server's stop: a minute.
        if options.soak_s > 0 and time.monotonic() + options.soak_s + 60 < deadline:
            record.soak = soak(port, process.pid, options, batch, complete_, rpc)
            if server.caches:
                record.cache_after_soak = read_cache(port, rpc)
        elif options.soak_s > 0:
            record.soak = {"status": "not run: time"}
    except Exception as exc:
        record.status = f"failed: {type(exc).__name__}: {exc}"[:400]
    finally:
        # Errors while serving: the log up to the stop (a stopped server may print its
        # shutdown's own tracebacks, which are not the requests' business).
        served = log.read_bytes() if log.exists() else b""
        serve_check.stop(process)
        text = served.decode(errors="replace")
        record.plugin = serve_check.scan_log(text)
        logged = [line[:300] for line in text.splitlines() if ERROR_LINE.search(line)]
        record.errors = record.errors + logged[:20]
    return record


def verdicts(checked: Sequence[Checked]) -> tuple[list[str], bool]:
    lines: list[str] = []
    ok = True
    by = {c.server: c for c in checked}
    for c in checked:
        if c.status != "ready":
            lines.append(f"{c.server}: {c.status}: MISSED")
            ok = False
            continue
        for what, result in (("together", c.together), ("after the aborts", c.after)):
            exact = bool(result.get("exact"))
            ok &= exact
            where = "" if exact else f", diverging {result.get('diverging')}"
            lines.append(
                f"{c.server}: {what}: {result.get('identical')}/{result.get('requests')} "
                f"identical to alone{where}: {'met' if exact else 'MISSED'}"
            )
        lines.append(f"{c.server}: aborted mid-stream: {len(c.aborted)} clients")
        for what, cache in (("cache", c.cache), ("cache after the soak", c.cache_after_soak)):
            if not cache:
                continue
            problems = cache.get("problems", [])
            ok &= not problems
            slots = cache.get("slots") or {}
            detail = (
                f"{slots.get('slots')} slots in {slots.get('layers')} layers byte-exact, "
                f"counters consistent {json.dumps(cache.get('totals'))}"
                if not problems
                else f"{len(problems)} problems, first: {problems[0]}"
            )
            lines.append(f"{c.server}: {what}: {detail}: {'met' if not problems else 'MISSED'}")
        if c.preemptions is not None:
            lines.append(f"{c.server}: preemptions: {c.preemptions:g}")
        if c.soak:
            shown = {k: c.soak.get(k) for k in ("requests", "failures", "growth", "status")}
            problems = soak_problems(c.soak)
            ok &= not problems
            verdict = "met" if not problems else "MISSED: " + "; ".join(problems)
            lines.append(f"{c.server}: soak: {json.dumps(shown)}: {verdict}")
        if c.errors:
            ok = False
            lines.append(f"{c.server}: errors in the log ({len(c.errors)}): {c.errors[0]}: MISSED")
    if "none" in by and "row" in by and by["none"].alone and by["row"].alone:
        same = compare(by["none"].alone, by["row"].alone)
        ok &= bool(same["exact"])
        lines.append(
            f"row alone against none alone: {same['identical']}/{same['requests']} identical: "
            f"{'met' if same['exact'] else 'MISSED'}"
        )
    return lines, ok


def run(options: Options, **fakes: Any) -> int:
    work = options.out / "serve_exact_work"
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + options.deadline_s
    vocab = int(json.loads((Path(options.model) / "config.json").read_text())["vocab_size"])
    checked: list[Checked] = []
    ok = False
    for server in options.servers:
        checked.append(check_server(server, options, work, deadline, vocab=vocab, **fakes))
        ok = write(options, work, checked)
    return 0 if ok else 1


def write(options: Options, work: Path, checked: Sequence[Checked]) -> bool:
    """The record, the verdicts and the logs of the servers checked so far; whether all
    passed."""
    lines, ok = verdicts(checked)
    record = {
        "model": options.model,
        "batch_invariant": options.batch_invariant,
        "requests": options.requests,
        "max_tokens": options.max_tokens,
        "kv_blocks": options.kv_blocks,
        "servers": [c.__dict__ for c in checked],
        "verdicts": lines,
        "ok": ok,
        "commit": os.environ.get("ROWCACHE_COMMIT", "?"),
    }
    (options.out / "serve_exact.json").write_text(json.dumps(record, indent=1) + "\n")
    (options.out / "serve_exact.txt").write_text("\n".join(lines) + "\n")
    with tarfile.open(options.out / "serve_exact_logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.glob("*.log")):
            tar.add(path, arcname=path.name)
    print("\n".join(lines), flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--servers", default="none,row")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--aborts", type=float, default=0.1)
    ap.add_argument("--kv-blocks", type=int, default=None)
    ap.add_argument("--soak", type=float, default=0.0)
    ap.add_argument("--no-batch-invariant", action="store_true")
    ap.add_argument("--deadline", type=float, default=3600.0)
    ns = ap.parse_args(argv)
    try:
        servers = tuple(serve_bench.parse_servers(ns.servers))
    except ValueError as exc:
        ap.error(str(exc))
    if ns.requests < AFTER:
        ap.error(f"--requests must be at least {AFTER}, got {ns.requests}")
    if not 0 <= ns.aborts <= 1:
        ap.error(f"--aborts is a fraction of --requests in [0, 1], got {ns.aborts}")
    least = -(-serve_bench.MAX_MODEL_LEN // KV_BLOCK_TOKENS)
    if ns.kv_blocks is not None and ns.kv_blocks < least:
        ap.error(
            f"--kv-blocks {ns.kv_blocks}: vLLM refuses to start with fewer than {least} blocks "
            f"of {KV_BLOCK_TOKENS} tokens (one {serve_bench.MAX_MODEL_LEN}-token context)"
        )
    ns.out.mkdir(parents=True, exist_ok=True)
    options = Options(
        ns.model,
        ns.out,
        servers,
        ns.requests,
        ns.max_tokens,
        ns.aborts,
        ns.kv_blocks,
        ns.soak,
        not ns.no_batch_invariant,
        ns.deadline,
    )
    return run(options)


if __name__ == "__main__":
    serve_check.start_tool()
    sys.exit(main())
