"""tools/vllm/serve_check.py on the CPU: fake server processes (a small HTTP server that logs
what the plugin would) and a fake client, for the sequencing, the deadline, the comparison, the
log scan and the record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tools.vllm import serve_check as sc

FAKE_SERVER = """
    import http.server, json, os, subprocess, sys, time

    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    section = {}
    if "--additional-config" in args:
        section = json.loads(args[args.index("--additional-config") + 1])["rowcache"]
    size = int(section.get("moe_expert_cache_size", os.environ.get(
        "ROWCACHE_MOE_EXPERT_CACHE_SIZE", 0)))
    planner = section.get("moe_expert_cache_planner", os.environ.get(
        "ROWCACHE_MOE_EXPERT_CACHE_PLANNER"))
    behaviour = os.environ.get("FAKE_" + str(port), "")
    # A child in the same process group, as vLLM's engine core: stopped with the server.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.environ["FAKE_PIDS"], "a") as pids:
        pids.write(f"{os.getpid()} {child.pid}\\n")
    print("INFO 12-01 10:00:00 [api_server.py:1] vLLM API server starting", flush=True)
    if behaviour == "missing":
        print("ModuleNotFoundError: No module named 'uvicorn'", flush=True)
        sys.exit(1)
    if section.get("moe_eager_between_graphs"):
        print("INFO rowcache: expert cache off, MoE op eager between graph pieces", flush=True)
    if size:
        eager = "--enforce-eager" in args
        chosen = planner or ("host" if eager else "device")
        where = "split 'token', planned on the host"
        if chosen == "device":
            where = "planned on the device"
        print(f"INFO rowcache: {size} slots per MoE layer, provider 'row', {where}", flush=True)
        mode = "eager mode" if eager else "full graphs"
        reason = "set by moe_expert_cache_planner" if planner else f"default in {mode}: x"
        print(f"INFO rowcache: planner {chosen} ({reason})", flush=True)
    if behaviour == "hang":
        time.sleep(120)
    time.sleep(float(os.environ.get("FAKE_DELAY", "0.2")))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class Fakes:
    """A launcher of fake servers and a fake client keyed by each server's label."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.script = tmp_path / "fake_server.py"
        self.script.write_text(textwrap.dedent(FAKE_SERVER))
        self.pids = tmp_path / "pids.txt"
        monkeypatch.setenv("FAKE_PIDS", str(self.pids))
        self.behaviour: dict[str, str] = {}  # label -> missing | hang
        self.tokens: dict[str, list[list[int]]] = {}  # label -> choices' token ids
        self.ports: dict[int, str] = {}
        self.launched: list[tuple[list[str], dict[str, str]]] = []
        self.calls: list[str] = []

    def launcher(self, command: list[str], env: dict[str, str], log: Path) -> sc.Process:
        label = log.stem.removeprefix("server_")
        port = int(command[command.index("--port") + 1])
        self.ports[port] = label
        self.launched.append((command, env))
        env = dict(env)
        if label in self.behaviour:
            env[f"FAKE_{port}"] = self.behaviour[label]
        # The fake takes vLLM's arguments after the script (python -m ... serve MODEL ...).
        return sc.launch([sys.executable, str(self.script), *command[5:]], env, log)

    def complete(
        self, port: int, model: str, batch: list[list[int]], max_tokens: int
    ) -> list[dict[str, Any]]:
        label = self.ports[port]
        self.calls.append(label)
        default = [[(sum(p) + i) % 97 for i in range(max_tokens)] for p in batch]
        ids = self.tokens.get(label, default)
        return [{"token_ids": t, "text": "", "finish_reason": "length"} for t in ids]

    def alive(self, settle: float = 3.0) -> list[int]:
        """The fake servers' processes still running (a signal takes a moment to land)."""
        until = time.monotonic() + settle
        while (found := self._alive()) and time.monotonic() < until:
            time.sleep(0.05)
        return found

    def _alive(self) -> list[int]:
        found = []
        for line in self.pids.read_text().split() if self.pids.exists() else []:
            pid = int(line)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            # A zombie (not yet reaped by its parent) is gone for our purpose.
            stat = Path(f"/proc/{pid}/stat")
            if stat.exists() and stat.read_text().split(") ")[1].startswith("Z"):
                continue
            found.append(pid)
        return found


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fakes:
    for name in sc.ENV_KEYS.values():
        monkeypatch.delenv(name, raising=False)
    return Fakes(tmp_path, monkeypatch)


def _options(tmp_path: Path, **kw: Any) -> sc.Options:
    return sc.Options(model="/models/tiny", out=tmp_path / "out", max_tokens=8, **kw)


def _run(options: sc.Options, fakes: Fakes) -> dict[str, Any]:
    return sc.run(
        options, launcher=fakes.launcher, complete=fakes.complete, vocab=512, sleep=time.sleep
    )


def test_pass_writes_one_record_and_one_log_archive(tmp_path: Path, fakes: Fakes) -> None:
    record = _run(_options(tmp_path, deadline=60), fakes)
    assert record["verdict"] == "pass", sc.summary(record)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "serve_check.json",
        "serve_check.txt",
        "serve_logs.tar.gz",
    ]
    assert json.loads((out / "serve_check.json").read_text())["verdict"] == "pass"
    with tarfile.open(out / "serve_logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["server_cfg.log", "server_env.log", "server_ref.log"]
    assert sorted(fakes.calls) == ["cfg", "env", "ref"]
    servers = record["servers"]
    assert servers["cfg"]["log"]["planner"] == [
        {"planner": "device", "reason": "default in full graphs: x"}
    ]
    assert servers["env"]["log"]["settings"][0]["size"] == "32"
    # the device planner keeps vLLM's graphs: the reference is vLLM as is
    assert not servers["ref"]["log"]["eager_baseline"]
    assert record["comparisons"]["cfg"]["identical"]
    # Every server and its child are stopped.
    assert fakes.alive() == []


def test_the_knob_travels_by_config_and_by_environment(tmp_path: Path, fakes: Fakes) -> None:
    _run(_options(tmp_path, deadline=60, planner="device", size=16), fakes)
    by_label = {cmd[cmd.index("--port") + 1]: (cmd, env) for cmd, env in fakes.launched}
    labels = {fakes.ports[int(port)]: value for port, value in by_label.items()}
    cfg_cmd, cfg_env = labels["cfg"]
    knob = json.loads(cfg_cmd[cfg_cmd.index("--additional-config") + 1])
    assert knob == {"rowcache": {"moe_expert_cache_size": 16, "moe_expert_cache_planner": "device"}}
    assert "ROWCACHE_MOE_EXPERT_CACHE_SIZE" not in cfg_env
    env_cmd, env_env = labels["env"]
    assert "--additional-config" not in env_cmd
    assert env_env["ROWCACHE_MOE_EXPERT_CACHE_SIZE"] == "16"
    assert env_env["ROWCACHE_MOE_EXPERT_CACHE_PLANNER"] == "device"
    # The device planner keeps the user's graphs: the reference is vLLM as is.
    ref_cmd, _ = labels["ref"]
    assert "--additional-config" not in ref_cmd
    assert cfg_cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/models/tiny"]
    assert "--skip-tokenizer-init" in cfg_cmd and "--enforce-eager" not in cfg_cmd


def test_planner_set_must_be_logged_as_set(tmp_path: Path, fakes: Fakes) -> None:
    record = _run(_options(tmp_path, deadline=60, planner="device"), fakes)
    assert record["verdict"] == "pass", sc.summary(record)
    assert record["servers"]["cfg"]["log"]["planner"][0]["reason"].startswith("set by")


def test_divergence_fails_with_the_first_divergent_token(tmp_path: Path, fakes: Fakes) -> None:
    ref = [[5, 6, 7, 8], [1, 2, 3, 4]]
    fakes.tokens = {"ref": ref, "cfg": [[5, 6, 7, 8], [1, 2, 9, 4]], "env": ref}
    record = _run(_options(tmp_path, deadline=60, prompt_count=2), fakes)
    assert record["verdict"] == "fail"
    cfg = record["comparisons"]["cfg"]
    assert cfg["divergences"] == [
        {"prompt": 1, "token": 2, "reference": 3, "got": 9, "text_differs": False}
    ]
    assert cfg["tokens_identical_before_divergence"] == 6 and cfg["tokens"] == 8
    assert record["comparisons"]["env"]["identical"]


def test_a_server_that_exits_is_recorded_with_the_missing_module(
    tmp_path: Path, fakes: Fakes
) -> None:
    fakes.behaviour = {"env": "missing"}
    record = _run(_options(tmp_path, deadline=60), fakes)
    assert record["verdict"] == "incomplete"
    env = record["servers"]["env"]
    assert env["status"] == "exited" and env["log"]["missing_module"] == "uvicorn"
    assert "No module named" in env["log_tail"]
    assert "env" not in fakes.calls and "cfg" in fakes.calls
    assert "missing module uvicorn" in sc.summary(record)
    assert fakes.alive() == []


def test_deadline_stops_a_server_that_never_answers(tmp_path: Path, fakes: Fakes) -> None:
    fakes.behaviour = {"cfg": "hang"}
    t0 = time.monotonic()
    record = _run(_options(tmp_path, deadline=4), fakes)
    assert time.monotonic() - t0 < 30
    assert record["servers"]["cfg"]["status"] == "timeout"
    assert record["servers"]["ref"]["status"] == "ready"
    assert record["verdict"] == "incomplete"
    assert fakes.alive() == []


def test_servers_one_at_a_time_and_the_deadline_between_them(tmp_path: Path, fakes: Fakes) -> None:
    now = [0.0]
    complete = fakes.complete

    def slow_complete(*args: Any) -> list[dict[str, Any]]:
        now[0] += 100.0  # the first server's queries use up the deadline
        return complete(*args)

    def sleep(seconds: float) -> None:
        time.sleep(seconds)
        now[0] += seconds

    record = sc.run(
        _options(tmp_path, deadline=50),  # one at a time is the default
        launcher=fakes.launcher,
        complete=slow_complete,
        clock=lambda: now[0],
        sleep=sleep,
        vocab=512,
    )
    statuses = {label: entry["status"] for label, entry in record["servers"].items()}
    assert statuses == {
        "ref": "ready",
        "cfg": "not started (deadline)",
        "env": "not started (deadline)",
    }
    assert record["verdict"] == "incomplete"
    assert len(fakes.launched) == 1
    assert fakes.alive() == []


def test_concurrent_servers_all_start_before_the_first_query(tmp_path: Path, fakes: Fakes) -> None:
    launched_at_first_query: list[int] = []
    complete = fakes.complete

    def counting_complete(*args: Any) -> list[dict[str, Any]]:
        launched_at_first_query.append(len(fakes.launched))
        return complete(*args)

    record = sc.run(
        _options(tmp_path, deadline=60, concurrent=True),
        launcher=fakes.launcher,
        complete=counting_complete,
        vocab=512,
        sleep=time.sleep,
    )
    assert record["verdict"] == "pass", sc.summary(record)
    assert launched_at_first_query[0] == 3
    assert fakes.alive() == []


@pytest.mark.parametrize(("flags", "concurrent"), [([], False), (["--concurrent"], True)])
def test_the_command_line_starts_one_at_a_time_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], concurrent: bool
) -> None:
    seen: list[sc.Options] = []

    def run(options: sc.Options) -> dict[str, Any]:
        seen.append(options)
        return {"verdict": "pass"}

    monkeypatch.setattr(sc, "run", run)
    monkeypatch.setattr(sc, "summary", lambda record: "")
    assert sc.main(["--model", "/models/tiny", "--out", str(tmp_path), *flags]) == 0
    assert seen[0].concurrent is concurrent


def test_wait_ready_with_a_fake_clock() -> None:
    class Proc:
        pid = 1

        def __init__(self, code: int | None) -> None:
            self.code = code

        def poll(self) -> int | None:
            return self.code

        def wait(self, timeout: float | None = None) -> int:
            return 0

    now = [0.0]
    servers = [
        sc.Server(sc.ServerSpec(label), port, Path(label), [], Proc(code), 0.0)
        for label, port, code in (("a", 1, None), ("b", 2, 3), ("c", 3, None))
    ]
    ready_at = {1: 5.0}  # port 3 never answers

    def sleep(s: float) -> None:
        now[0] += s

    sc.wait_ready(servers, 10.0, lambda p: now[0] >= ready_at.get(p, 1e9), lambda: now[0], sleep)
    assert [(s.status, s.ready_s, s.returncode) for s in servers] == [
        ("ready", 5.0, None),
        ("exited", None, 3),
        ("timeout", None, None),
    ]
    assert now[0] == 10.0


def test_compare_lengths_and_texts() -> None:
    a = [{"token_ids": [1, 2, 3], "text": "x"}]
    assert sc.compare(a, a)["identical"]
    short = sc.compare(a, [{"token_ids": [1, 2], "text": "x"}])
    assert short["divergences"][0]["token"] == 2 and short["divergences"][0]["got"] is None
    text = sc.compare(a, [{"token_ids": [1, 2, 3], "text": "y"}])
    assert text["divergences"] == [
        {"prompt": 0, "token": None, "reference": None, "got": None, "text_differs": True}
    ]


def test_scan_log_and_plugin_verdict() -> None:
    log = textwrap.dedent(
        """
        INFO 12-01 [_config.py:91] rowcache: 32 slots per MoE layer, provider 'row', split 'token', planned on the host
        INFO 12-01 [_config.py:91] rowcache: planner device (default in full graphs: tokens_exact in vLLM 0.25.0 on H200, 2026-12-01 at 25f83b1)
        (EngineCore pid=2) INFO rowcache: 32 slots per MoE layer, provider 'row', planned on the device
        """  # noqa: E501
    )
    scan = sc.scan_log(log)
    assert [s["where"] for s in scan["settings"]] == ["host", "device"]
    assert scan["planner"][0]["reason"].startswith("default in full graphs")
    cache = sc.ServerSpec("cfg", expects_cache=True)
    assert sc.plugin_verdict(cache, scan, 32, None) == "ok"
    # Without a setting the planner must be the plugin's default for the mode, and say so.
    host_default = sc.scan_log(
        "rowcache: 32 slots per MoE layer, provider 'row', planned on the host\n"
        "rowcache: planner host (default in full graphs: x)\n"
    )
    assert sc.plugin_verdict(cache, host_default, 32, None) == (
        "planner ['host'] where the default is device"
    )
    assert sc.plugin_verdict(cache, host_default, 32, None, "eager") == "ok"
    unsaid = sc.scan_log(
        "rowcache: 32 slots per MoE layer, provider 'row', planned on the device\n"
        "rowcache: planner device (set by moe_expert_cache_planner)\n"
    )
    assert sc.plugin_verdict(cache, unsaid, 32, None) == (
        "planner line does not say it is the default"
    )
    assert "another size" in sc.plugin_verdict(cache, scan, 16, None)
    assert "where host was set" in sc.plugin_verdict(cache, scan, 32, "host")
    assert sc.plugin_verdict(cache, sc.scan_log(""), 32, None) == "no settings line"
    missing = sc.scan_log("rowcache: vLLM plugin not installed, vLLM runs without (X: y)")
    assert sc.plugin_verdict(cache, missing, 32, None) == "plugin not installed"
    ref = sc.ServerSpec("ref", {"moe_eager_between_graphs": True})
    assert sc.plugin_verdict(ref, sc.scan_log(""), 32, None) == "no eager-baseline line"


def test_specs_reference_follows_the_graph_cut() -> None:
    host = {s.label: s for s in sc.specs(32, "graphs", "host")}
    assert host["ref"].config == {"moe_eager_between_graphs": True}
    assert sc.specs(32, "eager", None)[0].config == {}
    assert sc.specs(32, "graphs", "device")[0].config == {}
    # unset: the plugin's default in full graphs is the device planner, graphs kept
    assert sc.expected_planner("graphs", None) == "device"
    assert sc.specs(32, "graphs", None)[0].config == {}
    eager_cmd = sc.server_command("py", "m", 1, host["cfg"], "eager")
    assert "--enforce-eager" in eager_cmd


def test_prompts_are_deterministic_and_inside_the_vocabulary() -> None:
    a = sc.prompts(4, 16, 512, seed=0)
    assert a == sc.prompts(4, 16, 512, seed=0)
    assert [len(p) for p in a] == [16, 17, 18, 19]
    assert all(3 <= t < 512 for p in a for t in p)


def test_a_server_stops_on_sigint_even_when_launched_with_sigint_ignored(tmp_path: Path) -> None:
    """Background jobs of a shell start with SIGINT ignored; the launched server must still
    take stop()'s SIGINT (here: within its grace, not by the SIGKILL after it)."""
    import signal

    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process = sc.launch([sys.executable, str(script)], dict(os.environ), tmp_path / "log")
    finally:
        signal.signal(signal.SIGINT, before)
    time.sleep(1.0)  # the interpreter is up and sleeping
    t0 = time.monotonic()
    code = sc.stop(process, grace=20.0)
    assert code is not None and code != -signal.SIGKILL, code
    assert time.monotonic() - t0 < 20.0


def test_build_checkpoint_marks_a_whole_build_and_leaves_a_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--build`` builds once and marks the checkpoint whole; a directory with a
    ``config.json`` and no marker (a stopped build, or a model built elsewhere) is neither
    served as built nor overwritten: an error names it, and nothing in it changes."""
    from tools.vllm.harness.checkpoints import BUILT

    runs: list[list[str]] = []

    def fake_run(cmd: list[str], check: bool) -> None:
        runs.append(cmd)
        model = Path(cmd[2])
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text("{}")

    monkeypatch.setattr(sc.subprocess, "run", fake_run)
    model = tmp_path / "qwen8"
    sc.build_checkpoint(model, "--qwen3-30b-a3b --layers 8")
    assert [c[3:] for c in runs] == [["--qwen3-30b-a3b", "--layers", "8"]]
    assert (model / BUILT).exists()
    sc.build_checkpoint(model, "--qwen3-30b-a3b --layers 8")  # whole: not built again
    assert len(runs) == 1

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text('{"half": true}')
    with pytest.raises(SystemExit, match=rf"{partial} has a config.json but no {BUILT}"):
        sc.build_checkpoint(partial, "")
    assert len(runs) == 1
    assert sorted(p.name for p in partial.iterdir()) == ["config.json"]
    assert (partial / "config.json").read_text() == '{"half": true}'


def test_a_server_left_running_is_reaped_by_the_next_tool(tmp_path: Path) -> None:
    """A tool killed before its ``finally`` leaves its server's group listed: the next tool
    kills it; a server whose tool still runs, and a listed group whose leader is another
    process now (a pid reused), are left alone; a stopped server is no longer listed."""
    script = tmp_path / "server.py"
    script.write_text("import time\ntime.sleep(120)\n")
    left = sc.launch([sys.executable, str(script)], dict(os.environ), tmp_path / "a.log")
    stopped = sc.launch([sys.executable, str(script)], dict(os.environ), tmp_path / "b.log")
    sc.stop(stopped, grace=1.0)
    path = Path(os.environ[sc.GROUPS_ENV])
    groups = json.loads(path.read_text())
    assert list(groups) == [str(left.pid)]
    assert sc.reap_leftovers() == [] and left.poll() is None  # its tool (this test) runs
    assert json.loads(path.read_text()) == groups
    # Its tool gone (another start time listed for it); a stale entry (a pid reused).
    groups[str(left.pid)][2] = "0"
    path.write_text(json.dumps({**groups, str(os.getpid()): ["0", "1", "0"]}))
    assert sc.reap_leftovers() == [left.pid]
    assert left.wait(timeout=10) == -signal.SIGKILL
    assert not path.exists()


def test_a_server_dies_with_the_tool_that_started_it(tmp_path: Path) -> None:
    """Killed however it ends (here SIGKILL, as a device call's limit may), the tool takes
    its server with it: the server's parent-death signal."""
    server = tmp_path / "server.py"
    server.write_text("import time\ntime.sleep(120)\n")
    tool = tmp_path / "tool.py"
    tool.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from tools.vllm import serve_check as sc\n"
        f"p = sc.launch([sys.executable, {str(server)!r}], dict(os.environ), "
        f"__import__('pathlib').Path({str(tmp_path / 's.log')!r}))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, str(tool)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    assert _running(pid)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (killed, waiting for its new parent to reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
