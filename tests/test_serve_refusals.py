"""tools/vllm/serve_refusals.py on the CPU: fake servers that refuse (print the plugin's line
and exit) or, seeded, start anyway; the verdicts and the record."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tools.vllm import serve_check as sc
from tools.vllm import serve_refusals as sr

REFUSER = """
    import http.server, json, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    section = json.loads(args[args.index("--additional-config") + 1])["rowcache"]
    if section.get("moe_expert_cache_provider") == "rows" and "SERVE_ANYWAY" in sys.argv[0]:
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    if section.get("moe_expert_cache_size") == 4:
        print("rowcache.vllm.knob.KnobError: moe_expert_cache_size=4 is smaller than the "
              "model's top_k=8: one token needs 8 experts at once", flush=True)
    elif section.get("moe_expert_cache_provider") == "rows":
        print("KnobError: additional_config['rowcache']['moe_expert_cache_provider']: 'rows' "
              "is not allowed; allowed values: row, cached", flush=True)
    else:
        print("RowcacheError: rowcache: compilation_config.splitting_ops=[] (one full graph) "
              "cannot run the MoE op eagerly, which the expert cache needs", flush=True)
    sys.exit(1)
"""


def _launcher(tmp_path: Path, name: str) -> sc.Launcher:
    script = tmp_path / name
    script.write_text(textwrap.dedent(REFUSER))

    def launch(command: list[str], env: dict[str, str], log: Path) -> sc.Process:
        return sc.launch([sys.executable, str(script), *command[5:]], env, log)

    return launch


def test_every_case_refused(tmp_path: Path) -> None:
    code = sr.run("/m", tmp_path / "out", 60.0, launcher=_launcher(tmp_path, "refuse.py"))
    assert code == 0
    record = json.loads((tmp_path / "out" / "serve_refusals.json").read_text())
    assert [r["case"] for r in record["results"]] == [c.name for c in sr.CASES]
    assert all(r["refused"] and r["status"] == "exited" for r in record["results"])
    text = (tmp_path / "out" / "serve_refusals.txt").read_text()
    assert (
        "slots-below-top-k: exited; rowcache.vllm.knob.KnobError: moe_expert_cache_size=4" in text
    )


def test_a_server_that_starts_anyway_is_caught(tmp_path: Path) -> None:
    code = sr.run("/m", tmp_path / "out", 20.0, launcher=_launcher(tmp_path, "SERVE_ANYWAY.py"))
    assert code == 1
    text = (tmp_path / "out" / "serve_refusals.txt").read_text()
    assert "unknown-provider: ready; no refusal line: MISSED" in text


@pytest.mark.parametrize("status", ["ready", "timeout"])
def test_verdict_needs_an_exit(status: str) -> None:
    case = sr.CASES[0]
    assert not sr.verdict(case, status, case.expect[0])["refused"]
    assert sr.verdict(case, "exited", case.expect[0])["refused"]
    assert not sr.verdict(case, "exited", "something else")["refused"]


def test_a_checkpoint_without_a_tokenizer_is_served_without_one(tmp_path: Path) -> None:
    """Else the server would stop at the missing tokenizer, not at the plugin's refusal."""
    commands: list[list[str]] = []
    inner = _launcher(tmp_path, "refuse.py")

    def launch(command: list[str], env: dict[str, str], log: Path) -> sc.Process:
        commands.append(command)
        return inner(command, env, log)

    with_tokenizer = tmp_path / "tok"
    with_tokenizer.mkdir()
    (with_tokenizer / "tokenizer.json").write_text("{}")
    assert sr.run(str(tmp_path), tmp_path / "a", 60.0, launcher=launch) == 0
    assert sr.run(str(with_tokenizer), tmp_path / "b", 60.0, launcher=launch) == 0
    flags = ["--skip-tokenizer-init" in c for c in commands]
    assert flags == [True] * len(sr.CASES) + [False] * len(sr.CASES)
    assert json.loads((tmp_path / "a" / "serve_refusals.json").read_text())["commit"]
