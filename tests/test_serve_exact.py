"""tools/vllm/serve_exact.py on the CPU: its HTTP client against a small fake OpenAI server
(completions, streaming, metrics), and the whole check with fake servers and clients: exact,
a client whose tokens change under concurrency (caught), a cache server whose tokens differ
from no offload's (caught), an error in a server's log (caught)."""

from __future__ import annotations

import http.server
import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_serve_check import FAKE_SERVER

from tools.vllm import serve_bench
from tools.vllm import serve_check as sc
from tools.vllm import serve_exact as se


def _tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [(sum(prompt) + i) % 97 for i in range(max_tokens)]


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/collective_rpc":
            known = body["method"] == "rowcache_stats"
            self.send_response(200 if known else 404)
            self.end_headers()
            reply = {"results": [[{"layer": "l0"}]]} if known else {"detail": "Not Found"}
            self.wfile.write(json.dumps(reply).encode())
            return
        ids = _tokens(body["prompt"], body["max_tokens"])
        self.send_response(200)
        self.end_headers()
        if body.get("stream"):
            for token in ids:
                chunk = {"choices": [{"text": f"t{token}"}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self.wfile.write(json.dumps({"choices": [{"token_ids": ids}]}).encode())

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(
            b"# HELP vllm:num_preemptions_total x\n"
            b'vllm:num_preemptions_created{engine="0"} 1.7e9\n'
            b'vllm:num_preemptions_total{engine="0"} 3.0\n'
            b'vllm:num_preemptions_total{engine="1"} 2.0\n'
        )

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def openai_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def test_the_http_client(openai_port: int) -> None:
    assert se.collective_rpc(openai_port, "rowcache_stats") == [{"layer": "l0"}]
    with pytest.raises(RuntimeError, match="nothing: HTTP 404"):
        se.collective_rpc(openai_port, "nothing")
    assert se.complete(openai_port, "/m", [5, 6], 4) == _tokens([5, 6], 4)
    assert se.abort_midstream(openai_port, "/m", [5, 6], 10) == se.ABORT_CHUNKS
    assert se.metric(openai_port, "vllm:num_preemptions") == 5.0
    assert se.metric(openai_port, "vllm:nothing") is None


def test_prompts_and_comparisons() -> None:
    batch = se.prompts(64, 4096, 0)
    assert len({tuple(p) for p in batch}) == 64
    assert all(16 <= len(p) <= 512 and min(p) >= 3 for p in batch)
    assert se.prompts(64, 4096, 0) == batch
    assert se.divergence([1, 2, 3], [1, 2, 3]) is None
    assert se.divergence([1, 2, 3], [1, 5, 3]) == 1
    assert se.divergence([1, 2, 3], [1, 2]) == 2
    assert se.divergence([1, 2], None) == 0
    assert se.compare([[1], [2]], [[1], [3]]) == {
        "requests": 2,
        "identical": 1,
        "diverging": {"1": 0},
        "exact": False,
    }
    samples = [
        {"gpu_mib": 10, "rss_kib": 5},
        {"gpu_mib": 100, "rss_kib": 50},
        {"gpu_mib": 100, "rss_kib": 70},
    ]
    assert se.growth(samples) == {
        "gpu_mib": 0.0,
        "torch_host_bytes": None,
        "rss_kib": 20.0,
        "locked_kib": None,
        "pinned_kib": None,
    }
    here = se.memory_sample(os.getpgid(0))  # this process group: real /proc fields
    assert here["rss_kib"] > 0 and here["locked_kib"] >= 0 and here["pinned_kib"] >= 0


class Fleet:
    """Fake servers (serve_check's, for /health) and fake clients keyed by server."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.ports: dict[int, str] = {}
        self.inflight = 0
        self.lock = threading.Lock()
        self.noisy: set[str] = set()  # servers whose tokens change when others are in flight
        self.shifted: set[str] = set()  # servers whose tokens differ from the others'
        self.error_in_log: set[str] = set()
        self.commands: list[list[str]] = []
        self.envs: list[dict[str, str]] = []
        self.cache_reply: dict[str, Any] = {
            "rowcache_stats": [
                {
                    "layer": "l0",
                    "hits": 9,
                    "misses": 40,
                    "evictions": 8,
                    "invalidations": 0,
                    "resident": 32,
                    "capacity": 32,
                }
            ],
            "rowcache_slot_check": {"layers": 1, "slots": 32, "mismatches": []},
        }
        self.rpcs: list[tuple[str, str]] = []

    def launcher(self, command: list[str], env: dict[str, str], log: Path) -> sc.Process:
        name = log.stem.removeprefix("server-")
        self.ports[int(command[command.index("--port") + 1])] = name
        self.commands.append(command)
        self.envs.append(env)
        if name in self.error_in_log:
            log.write_text("ERROR 12-03 [core.py:1] EngineCore hit an exception\n")
        script = self.tmp / "fake_server.py"
        script.write_text(textwrap.dedent(FAKE_SERVER))
        return sc.launch([sys.executable, str(script), *command[5:]], env, log)

    def complete(self, port: int, model: str, prompt: list[int], max_tokens: int) -> list[int]:
        name = self.ports[port]
        with self.lock:
            self.inflight += 1
            crowded = self.inflight > 1
        try:
            ids = _tokens(prompt, max_tokens)
            if name in self.shifted:
                ids[-1] += 1
            if name in self.noisy and crowded and sum(prompt) % 5 == 0:
                ids[3] += 1
            threading.Event().wait(0.01)
            return ids
        finally:
            with self.lock:
                self.inflight -= 1

    def abort(self, port: int, model: str, prompt: list[int], max_tokens: int) -> int:
        return se.ABORT_CHUNKS

    def rpc(self, port: int, method: str) -> Any:
        self.rpcs.append((self.ports[port], method))
        reply = self.cache_reply[method]
        if isinstance(reply, Exception):
            raise reply
        return reply


def _options(tmp_path: Path, **kw: Any) -> se.Options:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    base: dict[str, Any] = {
        "model": str(model),
        "out": tmp_path / "out",
        "servers": tuple(serve_bench.parse_servers("none,row")),
        "requests": 16,
        "max_tokens": 8,
    }
    return se.Options(**{**base, **kw})


def _run(tmp_path: Path, fleet: Fleet, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> int:
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    options = _options(tmp_path, **kw)
    options.out.mkdir(parents=True, exist_ok=True)
    return se.run(
        options,
        complete_=fleet.complete,
        abort=fleet.abort,
        launcher=fleet.launcher,
        rpc=fleet.rpc,
    )


def test_exact_servers_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = Fleet(tmp_path)
    monkeypatch.setattr(se, "metric", lambda port, name: 0.0)  # no preemption: caught
    assert _run(tmp_path, fleet, monkeypatch, kv_blocks=64) == 1
    assert "counted no preemption" in (tmp_path / "out" / "serve_exact.txt").read_text()
    monkeypatch.setattr(se, "metric", lambda port, name: 3.0)
    assert _run(tmp_path, fleet, monkeypatch, kv_blocks=64) == 0
    record = json.loads((tmp_path / "out" / "serve_exact.json").read_text())
    assert record["ok"] and [s["server"] for s in record["servers"]] == ["none", "row"]
    row = record["servers"][1]
    assert row["together"]["exact"] and row["after"]["requests"] == se.AFTER
    assert row["aborted"] == [se.ABORT_CHUNKS] * 2  # a tenth of 16, rounded
    text = (tmp_path / "out" / "serve_exact.txt").read_text()
    assert "row alone against none alone: 16/16 identical: met" in text
    # Batch-invariant mode, the KV blocks and no tokenizer: on the servers' command lines.
    assert all(env["VLLM_BATCH_INVARIANT"] == "1" for env in fleet.envs)
    for command in fleet.commands:
        assert command[command.index("--num-gpu-blocks-override") + 1] == "64"
        assert "--skip-tokenizer-init" in command
        assert "--no-enable-prefix-caching" in command
    # Every server has the worker extension in dev mode (a soak reads its pinned memory); the
    # cache server alone is read back.
    extension = [
        c[c.index("--worker-extension-cls") + 1]
        for c in fleet.commands[-2:]
        if "--worker-extension-cls" in c
    ]
    assert extension == ["rowcache.vllm.worker_extension.ExpertCacheRpc"] * 2
    assert [env.get("VLLM_SERVER_DEV_MODE") for env in fleet.envs[-2:]] == ["1", "1"]
    assert set(fleet.rpcs) == {("row", "rowcache_stats"), ("row", "rowcache_slot_check")}
    assert "row: cache: 32 slots in 1 layers byte-exact, counters consistent" in text
    assert row["cache"]["totals"]["misses"] == 40


@pytest.mark.parametrize(
    ("method", "reply", "words"),
    [
        (
            "rowcache_slot_check",
            {"layers": 1, "slots": 32, "mismatches": ["l0: slot 3"]},
            "slot bytes: l0: slot 3",
        ),
        (
            "rowcache_slot_check",
            {"layers": 0, "slots": 0, "mismatches": []},
            "no resident slot checked",
        ),
        (
            "rowcache_stats",
            [
                {
                    "layer": "l0",
                    "hits": 9,
                    "misses": 41,
                    "evictions": 8,
                    "invalidations": 0,
                    "resident": 32,
                    "capacity": 32,
                }
            ],
            "l0: resident=32 but misses - evictions - invalidations",
        ),
        ("rowcache_stats", [], "no cached layer"),
        ("rowcache_stats", RuntimeError("rowcache_stats: HTTP 404"), "cache unreadable"),
    ],
)
def test_a_cache_read_back_wrong_or_not_at_all_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, reply: Any, words: str
) -> None:
    fleet = Fleet(tmp_path)
    fleet.cache_reply[method] = reply
    assert _run(tmp_path, fleet, monkeypatch, servers=(serve_bench.SERVERS["row"],)) == 1
    text = (tmp_path / "out" / "serve_exact.txt").read_text()
    assert "row: cache: " in text and words in text and "MISSED" in text


def test_the_record_is_written_after_each_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = Fleet(tmp_path)
    seen: list[list[str]] = []
    real = se.check_server

    def spy(*args: Any, **kw: Any) -> se.Checked:
        path = tmp_path / "out" / "serve_exact.json"
        seen.append(
            [s["server"] for s in json.loads(path.read_text())["servers"]] if path.exists() else []
        )
        return real(*args, **kw)

    monkeypatch.setattr(se, "check_server", spy)
    assert _run(tmp_path, fleet, monkeypatch) == 0
    assert seen == [[], ["none"]]


def test_tokens_that_change_under_concurrency_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = Fleet(tmp_path)
    fleet.noisy.add("row")
    assert _run(tmp_path, fleet, monkeypatch) == 1
    text = (tmp_path / "out" / "serve_exact.txt").read_text()
    assert "none: together: 16/16 identical to alone: met" in text
    assert "row: together:" in text and "diverging {" in text and "MISSED" in text


def test_a_cache_server_unlike_no_offload_and_a_logged_error_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = Fleet(tmp_path)
    fleet.shifted.add("row")
    fleet.error_in_log.add("none")
    assert _run(tmp_path, fleet, monkeypatch, batch_invariant=False) == 1
    assert all("VLLM_BATCH_INVARIANT" not in env for env in fleet.envs)
    text = (tmp_path / "out" / "serve_exact.txt").read_text()
    assert "row alone against none alone: 0/16 identical: MISSED" in text
    assert "none: errors in the log (1): ERROR 12-03" in text


def test_command_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in (
        (["--requests", "4"], "--requests must be at least 8, got 4"),
        (["--aborts", "1.5"], "--aborts is a fraction of --requests in [0, 1], got 1.5"),
        (["--servers", "row,x"], "--servers: unknown ['x']"),
        (["--kv-blocks", "100"], "--kv-blocks 100: vLLM refuses to start with fewer than 160"),
    ):
        with pytest.raises(SystemExit):
            se.main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), *args])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("result", "problems"),
    [
        ({"requests": 500, "failures": [], "growth": {"gpu_mib": 2.0, "torch_host_bytes": 0}}, []),
        # One new block of a buffer vLLM grows: within the limit; VmPin is not judged.
        (
            {"requests": 5, "growth": {"gpu_mib": 0.0, "torch_host_bytes": 2**25, "pinned_kib": 4}},
            [],
        ),
        ({"status": "not run: time"}, ["not run: time"]),
        (
            {
                "requests": 500,
                "failures": ["HTTP 500"],
                "growth": {"gpu_mib": 0.0, "torch_host_bytes": 0.0},
            },
            ["1 requests failed"],
        ),
        (
            {"requests": 500, "growth": {"gpu_mib": 300.0, "torch_host_bytes": 2**30}},
            ["GPU memory grew 300 MiB (limit 64)", "pinned host memory grew 1024 MiB (limit 64)"],
        ),
        (
            {"requests": 0, "failures": [], "growth": {"gpu_mib": None}},
            [
                "no request answered",
                "GPU memory not sampled",
                "pinned host memory not read (rowcache_pinned)",
            ],
        ),
    ],
)
def test_a_soak_passes_only_without_failures_or_growth(
    result: dict[str, Any], problems: list[str]
) -> None:
    assert se.soak_problems(result) == problems


def test_a_failed_soak_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = Fleet(tmp_path)
    monkeypatch.setattr(se, "metric", lambda port, name: 3.0)
    grown = {"requests": 9, "failures": [], "growth": {"gpu_mib": 500.0}, "samples": []}
    monkeypatch.setattr(se, "soak", lambda *args: grown)
    servers = (serve_bench.SERVERS["row"],)
    assert _run(tmp_path, fleet, monkeypatch, servers=servers, soak_s=1.0) == 1
    text = (tmp_path / "out" / "serve_exact.txt").read_text()
    assert "row: soak: " in text and "MISSED: GPU memory grew 500 MiB" in text


def test_the_soak_judges_the_workers_pinned_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak samples the worker's pinned host bytes through ``rowcache_pinned`` with the
    rest: memory that grows past the limit fails it; a worker that cannot be read fails it
    too (never a pass unmeasured)."""
    monkeypatch.setattr(se, "SAMPLE_EVERY_S", 0.05)
    options = se.Options("m", tmp_path, (serve_bench.SERVERS["row"],), soak_s=0.4)
    read: list[int] = []

    def growing(port: int, method: str) -> dict[str, int]:
        assert method == "rowcache_pinned"
        read.append(len(read))
        # 16 MiB more each read, none of it the arenas'
        return {"torch_host_bytes": read[-1] * (16 << 20), "arena_bytes": 7 << 30}

    def unreadable(port: int, method: str) -> dict[str, int]:
        raise OSError("no worker extension")

    def answer_until(count: int) -> Callable[..., list[int]]:
        def answer(*args: Any) -> list[int]:  # a request's wait, the GIL released as a socket's
            time.sleep(0.01)
            # The soak samples while requests run: they last until ``count`` pinned reads
            # were taken, however slow a loaded machine makes each sample (a count, not a
            # time).
            while len(read) < count:
                time.sleep(0.01)
            return [1]

        return answer

    done = se.soak(1, os.getpgid(0), options, [[5, 6]], answer_until(7), growing)
    assert len(done["samples"]) >= 6 and done["growth"]["torch_host_bytes"] >= 64 << 20
    assert any(p.startswith("pinned host memory grew") for p in se.soak_problems(done))
    # The arenas' share is recorded beside it, None where the worker did not say.
    assert {s["arena_bytes"] for s in done["samples"]} == {7 << 30}
    assert {s["transient_bytes"] for s in done["samples"]} == {None}
    done = se.soak(1, os.getpgid(0), options, [[5, 6]], answer_until(0), unreadable)
    assert "pinned host memory not read (rowcache_pinned)" in se.soak_problems(done)
