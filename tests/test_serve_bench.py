"""tools/vllm/serve_bench.py on the CPU: fake servers (serve_check's, answering /health) and a
fake ``vllm bench serve`` that writes vLLM's result file, for the commands, the sequencing, the
deadline, the record and its targets; the flags checked against the vLLM 0.25.0 wheel."""

from __future__ import annotations

import json
import math
import re
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import vllm_wheels
from test_serve_check import FAKE_SERVER

from tools.vllm import serve_bench as sb
from tools.vllm import serve_check as sc


def test_levels_and_servers_parse_and_reject_unknown_names() -> None:
    assert [lv.name for lv in sb.parse_levels("c1,r2")] == ["c1", "r2"]
    with pytest.raises(ValueError, match=r"--levels: unknown \['c3'\]; known: c1, c8"):
        sb.parse_levels("c1,c3")
    with pytest.raises(ValueError, match=r"--servers: unknown \['rows'\]"):
        sb.parse_servers("none,rows")
    assert [s.name for s in sb.parse_servers(sb.DEFAULT_SERVERS)] == ["none", "uva", "row"]


def test_the_dataset_spans_the_issues_lengths() -> None:
    low, high = sb.INPUT_LEN * (1 - sb.INPUT_RATIO), sb.INPUT_LEN * (1 + sb.INPUT_RATIO)
    assert math.floor(low) == 128 and math.ceil(high) == 2048  # vLLM's floor and ceil
    low, high = sb.OUTPUT_LEN * (1 - sb.OUTPUT_RATIO), sb.OUTPUT_LEN * (1 + sb.OUTPUT_RATIO)
    assert round(low) == 64 and round(high) == 256
    assert {lv.concurrency for lv in sb.LEVELS.values() if lv.rate is None} == {1, 8, 32, 64}
    assert all(lv.concurrency <= 64 for lv in sb.LEVELS.values())  # --max-num-seqs 64


def test_commands() -> None:
    row = sb.SERVERS["row"]
    command = sb.serve_command("py", "/m", 8000, row)
    assert command[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    config = json.loads(command[command.index("--additional-config") + 1])
    assert config == {"rowcache": {"moe_expert_cache_size": 32}}
    assert "--skip-tokenizer-init" not in command  # the client sends text
    uva = sb.serve_command("py", "/m", 8000, sb.SERVERS["uva"])
    assert uva[uva.index("--cpu-offload-gb") + 1] == "6.75"
    bench = sb.bench_command("py", "/m", 8000, sb.LEVELS["r2"], Path("/r"), "x.json")
    flag = {bench[i]: bench[i + 1] for i in range(5, len(bench) - 1) if bench[i].startswith("--")}
    assert flag["--request-rate"] == "2.0" and flag["--max-concurrency"] == "64"
    assert json.loads(flag["--random-range-ratio"]) == {"input": 0.8823, "output": 0.6}
    assert flag["--tokenizer"] == "/m" and flag["--temperature"] == "0"
    assert "--ignore-eos" in bench and "--save-detailed" in bench
    assert (
        sb.bench_command("py", "/m", 1, sb.LEVELS["c8"], Path("/r"), "x")[
            sb.bench_command("py", "/m", 1, sb.LEVELS["c8"], Path("/r"), "x").index(
                "--request-rate"
            )
            + 1
        ]
        == "inf"
    )


class FakeBench:
    """``vllm bench serve`` faked: writes a result file with throughput by server (the port's
    server, from the launched commands) and records what ran."""

    def __init__(self, tok_s: dict[str, float], ttft: dict[str, float]) -> None:
        self.tok_s, self.ttft = tok_s, ttft
        self.ports: dict[int, str] = {}
        self.ran: list[tuple[str, str]] = []
        self.failed: dict[tuple[str, str], int] = {}

    def launcher(self, command: list[str], env: dict[str, str], log: Path) -> sc.Process:
        name = log.stem.removeprefix("server-")
        self.ports[int(command[command.index("--port") + 1])] = name
        script = log.parent / "fake_server.py"
        script.write_text(textwrap.dedent(FAKE_SERVER))
        return sc.launch([sys.executable, str(script), *command[5:]], env, log)

    def client(self, command: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
        port = int(command[command.index("--base-url") + 1].rsplit(":", 1)[1])
        server = self.ports[port]
        level = log.stem.rsplit("-", 1)[1]
        self.ran.append((server, level))
        out = Path(command[command.index("--result-dir") + 1])
        name = command[command.index("--result-filename") + 1]
        result = {
            "completed": int(command[command.index("--num-prompts") + 1]),
            "failed": self.failed.get((server, level), 0),
            "output_throughput": self.tok_s[server],
            "request_throughput": self.tok_s[server] / 160,
            "p99_ttft_ms": self.ttft[server],
            "median_ttft_ms": self.ttft[server] / 2,
            "ttfts": [0.1, 0.2],  # per-request lists stay in the raw file only
        }
        (out / name).write_text(json.dumps(result))
        log.write_text("ok\n")
        return 0


def _options(tmp_path: Path, **kw: Any) -> sb.Options:
    base: dict[str, Any] = {
        "model": "/models/qwen8",
        "out": tmp_path / "out",
        "servers": tuple(sb.parse_servers("none,uva,row")),
        "levels": tuple(sb.parse_levels("c1,c32")),
    }
    return sb.Options(**{**base, **kw})


def test_every_server_every_level_one_record_and_the_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench(
        {"none": 3000.0, "uva": 250.0, "row": 300.0}, {"none": 50, "uva": 900, "row": 700}
    )
    record = sb.run(_options(tmp_path), client=fake.client, launcher=fake.launcher)
    assert fake.ran == [
        (server, level)
        for server in ("none", "uva", "row")
        for level in ("warmup", "warmup1", "warmup2", "c1", "c32")
    ]
    servers = {s["name"]: s for s in record["servers"]}
    assert all(s["status"] == "ready" for s in servers.values())
    c32 = servers["row"]["levels"]["c32"]
    assert c32["figures"]["output_throughput"] == 300.0
    assert "ttfts" not in c32["result"] and c32["raw_file"] == "plain-row-c32.json"
    text = (tmp_path / "out" / "serve_bench.txt").read_text()
    assert (
        "plain  c32  row / UVA output tok/s 1.200 (met: >= 1.0), TTFT p99 700.0 / 900.0 ms "
        "(met: row <= UVA)"
    ) in text
    assert "plain  c1   row / UVA output tok/s 1.200, TTFT p99 700.0 / 900.0 ms (met" in text
    assert servers["row"]["plugin_verdict"] == "ok" and servers["uva"]["plugin_verdict"] == "ok"
    with tarfile.open(tmp_path / "out" / "serve_bench_logs.tar.gz") as tar:
        names = tar.getnames()
    assert "plain-row-c32.json" in names and "server-uva.log" in names
    written = json.loads((tmp_path / "out" / "serve_bench.json").read_text())
    assert written["label"] == "plain"
    assert [w["name"] for w in written["warmups"]] == ["warmup", "warmup1", "warmup2"]


def test_a_missed_target_and_the_batch_invariant_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench(
        {"none": 3000.0, "uva": 250.0, "row": 200.0}, {"none": 50, "uva": 500, "row": 700}
    )
    options = _options(tmp_path, batch_invariant=True)
    assert sb.server_env(options)["VLLM_BATCH_INVARIANT"] == "1"
    assert "VLLM_BATCH_INVARIANT" not in sb.server_env(_options(tmp_path))
    sb.run(options, client=fake.client, launcher=fake.launcher)
    text = (tmp_path / "out" / "serve_bench.txt").read_text()
    assert (
        "plain  c32  row / UVA output tok/s 0.800 (MISSED: >= 1.0), TTFT p99 700.0 / 500.0 ms "
        "(MISSED: row <= UVA)"
    ) in text


def test_levels_past_the_deadline_are_recorded_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench({"none": 100.0, "uva": 100.0, "row": 100.0}, {"none": 1, "uva": 1, "row": 1})
    clock = [0.0]

    def client(command: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
        clock[0] += 100.0  # each level takes 100 s on the fake clock
        return fake.client(command, env, log, timeout)

    options = _options(tmp_path, servers=(sb.SERVERS["row"],), deadline_s=500.0)
    record = sb.run(options, clock=lambda: clock[0], client=client, launcher=fake.launcher)
    levels = record["servers"][0]["levels"]
    # The three warm-ups and c1 fit; c32 (96 x 160 tokens at the 100 tok/s seen) does not with
    # 100 s left.
    names = ("warmup", "warmup1", "warmup2", "c1")
    assert [levels[name]["status"] for name in names] == ["ok"] * 4
    assert levels["c32"]["status"].startswith("not run: time (100 s left)")


def test_a_client_with_vllm_imported_is_estimated_without_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A level's estimate counts a client's start (``CLIENT_START_S``) only where the client is
    not already running with vLLM imported (``PersistentClient.warm``)."""
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench({"none": 100.0, "uva": 100.0, "row": 100.0}, {"none": 1, "uva": 1, "row": 1})

    class Client:
        def __init__(self, warm: bool) -> None:
            self.warm = warm

        def __call__(self, command: list[str], env: dict[str, str], log: Path, t: float) -> int:
            return fake.client(command, env, log, t)

    # The warm-up: 16 x 160 tokens at 100 tok/s before any figure, 25.6 s, of 40 s left.
    levels = {}
    for warm in (True, False):
        options = _options(tmp_path / str(warm), servers=(sb.SERVERS["none"],), deadline_s=40.0)
        record = sb.run(options, clock=lambda: 0.0, client=Client(warm), launcher=fake.launcher)
        levels[warm] = record["servers"][0]["levels"]
    assert levels[True]["warmup"]["status"] == "ok" and levels[True]["c1"]["status"] == "ok"
    assert levels[True]["c32"]["status"].startswith("not run: time")
    assert levels[False]["warmup"]["status"].startswith("not run: time")


def test_a_checkpoint_without_a_tokenizer_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(SystemExit):
        sb.main(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")])
    assert "has no tokenizer.json: vllm bench serve needs a tokenizer" in capsys.readouterr().err


def test_flags_against_the_wheel() -> None:
    paths = (
        "vllm/benchmarks/serve.py",
        "vllm/benchmarks/datasets/datasets.py",
        "vllm/engine/arg_utils.py",
    )
    source = "\n".join(vllm_wheels.read("0.25.0", *paths).values())
    command = sb.bench_command("py", "/m", 1, sb.LEVELS["r1"], Path("/r"), "x")
    command += sb.serve_command("py", "/m", 1, sb.SERVERS["uva"])
    command += list(sb.COMMON_ARGS)
    for flag in {c for c in command if c.startswith("--")} - {"--host", "--port", "--model"}:
        found = re.search(rf'"{flag}"|{flag.removeprefix("--").replace("-", "_")}:', source)
        assert found, flag
    assert "gen_prompt_decode_to_target_len" in source  # prompts are text (a tokenizer needed)


def test_plot_from_a_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tools.vllm import plot_serve

    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench({"none": 3000.0, "uva": 250.0, "row": 300.0}, {"none": 5, "uva": 9, "row": 7})
    options = _options(tmp_path, levels=tuple(sb.parse_levels("c1,r1")))
    record = sb.run(options, client=fake.client, launcher=fake.launcher)
    for server in record["servers"]:  # the fake writes no TPOT
        for entry in server["levels"].values():
            entry["figures"]["median_tpot_ms"] = 10.0
    found = plot_serve.points(record)
    assert [p[0] for p in found["row"]] == ["c1", "r1"]  # no warm-up
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    assert plot_serve.main([str(path), "--out", str(tmp_path / "s.svg")]) == 0
    assert (tmp_path / "s.svg").read_text().startswith("<?xml")


def test_every_level_draws_its_own_prompts() -> None:
    """One seed per level (the prefix cache would answer a repeated prompt), the same on every
    server (each answers the same requests)."""
    levels = [*sb.WARMUPS, *sb.LEVELS.values()]
    assert len({level.seed for level in levels}) == len(levels)
    for level in levels:
        command = sb.bench_command("py", "/m", 1, level, Path("/r"), "f.json")
        assert command[command.index("--seed") + 1] == str(level.seed)


RECORDED = Path(__file__).resolve().parents[1] / "docs" / "vllm" / "2026-12-05-serving-bi-h100"


def test_the_prompt_lengths_drawn_are_the_ones_vllm_drew_on_the_gpu() -> None:
    """``drawn_prompt_lengths`` against the lengths in vLLM's own result files of the H100 run
    (2026-12-05, both warm-ups and both levels, in the order sent)."""
    with tarfile.open(RECORDED / "plain-row" / "serve_bench_logs.tar.gz") as tar:
        for level in (*sb.WARMUPS[:2], sb.LEVELS["c8"], sb.LEVELS["c32"]):
            member = tar.extractfile(f"plain-row-{level.name}.json")
            assert member is not None
            assert sb.drawn_prompt_lengths(level) == json.load(member)["input_lens"]


def test_the_short_warm_up_meets_the_small_tile_at_odd_and_even_rows() -> None:
    """``warmup2``: lone prompts of 129 to 512 tokens (steps past the 128 rows of the captured
    CUDA graphs, below the 512 where vLLM's MoE kernel takes its next tile), both odd and even
    (Triton compiles the kernel apart for rows x top-k a multiple of 16 or not), with 8 tokens
    out; every other level draws the benchmark's lengths."""
    short = sb.WARMUPS[-1]
    lengths = sb.drawn_prompt_lengths(short)
    assert all(129 <= n <= 512 for n in lengths)
    assert {n % 2 for n in lengths} == {0, 1}
    command = sb.bench_command("py", "/m", 1, short, Path("/r"), "f.json")
    assert command[command.index("--random-input-len") + 1] == str(short.input_len)
    ratios = json.loads(command[command.index("--random-range-ratio") + 1])
    assert ratios == {"input": short.input_ratio, "output": 0.0}
    assert command[command.index("--random-output-len") + 1] == "8"
    assert short.concurrency == 1 and short.name.startswith("warmup")  # plots leave it out
    assert sb.estimate_s(short, 100.0, 0.0) == pytest.approx(16 * 8 / 100.0)
    for level in [*sb.WARMUPS[:-1], *sb.LEVELS.values()]:
        command = sb.bench_command("py", "/m", 1, level, Path("/r"), "f.json")
        assert command[command.index("--random-input-len") + 1] == str(sb.INPUT_LEN)
        assert command[command.index("--random-output-len") + 1] == str(sb.OUTPUT_LEN)
        assert json.loads(command[command.index("--random-range-ratio") + 1]) == {
            "input": sb.INPUT_RATIO,
            "output": sb.OUTPUT_RATIO,
        }


def test_the_context_fits_the_position_limit_the_servers_are_given() -> None:
    """A server of the builder's Qwen3 shapes (2,048 positions) refused ``--max-model-len
    2560`` on the H200 until the override."""
    from tools.vllm import make_moe_checkpoint as mk

    args = list(sb.COMMON_ARGS)
    overrides = json.loads(args[args.index("--hf-overrides") + 1])
    assert int(args[args.index("--max-model-len") + 1]) == sb.MAX_MODEL_LEN
    assert mk.QWEN3_30B_A3B["max_position_embeddings"] < sb.MAX_MODEL_LEN
    assert overrides["max_position_embeddings"] >= sb.MAX_MODEL_LEN


def test_records_of_one_label_merge_and_a_server_keeps_the_levels_it_ran() -> None:
    """On 2026-12-03 UVA ran in one call and ``row`` (left no time there) in the next: one
    panel, ``row`` from the call where it ran, and the ratios of the levels both have."""
    from tools.vllm import plot_serve

    def level(tok_s: float, ttft: float) -> dict[str, Any]:
        return {"figures": {"output_throughput": tok_s, "median_tpot_ms": 9.0, "p99_ttft_ms": ttft}}

    first = {
        "label": "plain",
        "servers": [
            {"name": "uva", "levels": {"c1": level(70.0, 2100.0), "c8": level(116.0, 2000.0)}},
            {"name": "row", "levels": {"c1": {"status": "not run: time (21 s left)"}}},
        ],
    }
    second = {"label": "plain", "servers": [{"name": "row", "levels": {"c1": level(77.0, 1900.0)}}]}
    skew = {"label": "skew", "servers": [{"name": "row", "levels": {"c1": level(200.0, 900.0)}}]}
    merged = plot_serve.merge([first, second, skew])
    assert [r["label"] for r in merged] == ["plain", "skew"]
    assert [s["name"] for s in merged[0]["servers"]] == ["uva", "row"]
    assert merged[0]["servers"][1]["levels"] == second["servers"][0]["levels"]
    assert plot_serve.targets(merged[0]) == [
        "plain  c1   row / UVA output tok/s 1.100, TTFT p99 1900.0 / 2100.0 ms (met: row <= UVA)"
    ]
    assert plot_serve.targets(merged[1]) == []


def test_a_server_run_for_the_levels_and_again_for_the_rates_has_both() -> None:
    """On the H100 (2026-12-05) the skewed router's c1 to c64 ran one server a call and the
    rate sweep both servers in a later call: the panel has each server's every level, a level
    answered in full wins over one cut short, and one run without the cache's lines
    disqualifies the server."""
    from tools.vllm import plot_serve

    def record(*servers: dict[str, Any]) -> dict[str, Any]:
        return {"label": "skew", "model": "/m", "servers": list(servers)}

    cut = {"status": "not run: time (9 s left)"}
    levels_row = {"name": "row", "levels": {"c32": _level(855.0, 700.0), "r2": cut}}
    levels_uva = {"name": "uva", "levels": {"c32": _level(382.0, 2900.0)}}
    rates = record(
        {"name": "uva", "levels": {"r2": _level(241.0, 1071.0)}},
        {"name": "row", "levels": {"r2": _level(314.0, 206.0), "c32": _level(1.0, 1.0, "FAILED")}},
    )
    merged = plot_serve.merge([record(levels_row), record(levels_uva), rates])
    assert len(merged) == 1
    servers = {s["name"]: s for s in merged[0]["servers"]}
    assert servers["row"]["levels"] == {"c32": _level(855.0, 700.0), "r2": _level(314.0, 206.0)}
    assert set(servers["uva"]["levels"]) == {"c32", "r2"}
    assert plot_serve.targets(merged[0]) == [
        "skew   c32  row / UVA output tok/s 2.238 (met: >= 1.5), TTFT p99 700.0 / 2900.0 ms "
        "(met: row <= UVA)",
        "skew   r2   row / UVA output tok/s 1.303, TTFT p99 206.0 / 1071.0 ms (met: row <= UVA)",
    ]
    assert levels_row["levels"]["r2"] is cut  # the records read are left as they were
    # A run that gave no figure (it never started, or every level was cut) judges nothing,
    # before or after the runs that did; a run whose figures are kept does.
    never = {"name": "row", "levels": {"c32": cut}, "plugin_verdict": "no cache line"}
    for order in ([record(never), record(levels_row)], [record(levels_row), record(never)]):
        merged = plot_serve.merge([*order, record(levels_uva)])
        assert merged[0]["servers"][0]["plugin_verdict"] == "ok"
        assert "(met: >= 1.5)" in plot_serve.targets(merged[0])[0]
    rates["servers"][1]["plugin_verdict"] = "no cache line"
    merged = plot_serve.merge([record(levels_row), record(levels_uva), rates])
    assert plot_serve.targets(merged[0]) == [
        "skew   row compared with nothing: its log did not show the cache (no cache line)"
    ]
    alone = plot_serve.merge([record(never)])[0]["servers"][0]
    assert alone["plugin_verdict"] == "no cache line"


def test_a_level_with_failed_requests_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the H200 (2026-12-03) vLLM refused 4 of 128 long prompts with HTTP 400; the level's
    figures then cover fewer requests, which its status must say."""
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench({"uva": 250.0}, {"uva": 9})
    fake.failed[("uva", "c32")] = 4
    options = _options(tmp_path, servers=(sb.SERVERS["uva"],))
    record = sb.run(options, client=fake.client, launcher=fake.launcher)
    levels = record["servers"][0]["levels"]
    assert levels["c1"]["status"] == "ok"
    assert levels["c32"]["status"] == "4 of 96 requests FAILED (errors in plain-uva-c32.json)"
    assert "4 of 96 requests FAILED" in (tmp_path / "out" / "serve_bench.txt").read_text()


def _level(tok_s: float, ttft: float, status: str = "ok") -> dict[str, Any]:
    return {
        "status": status,
        "figures": {"output_throughput": tok_s, "median_tpot_ms": 9.0, "p99_ttft_ms": ttft},
    }


def test_only_runs_of_one_kind_share_a_panel_and_a_skewed_label_has_its_own_target() -> None:
    """A skewed model or a batch-invariant run under the default label never joins the plain
    panel; ``skew`` labels are judged at 1.5 x, others at 1.0 x; a level with failed requests
    is compared with nothing."""
    from tools.vllm import plot_serve

    def record(label: str, model: str, invariant: bool, row: float) -> dict[str, Any]:
        return {
            "label": label,
            "model": model,
            "batch_invariant": invariant,
            "servers": [
                {"name": "uva", "levels": {"c32": _level(200.0, 900.0), "c8": _level(1, 1)}},
                {
                    "name": "row",
                    "levels": {"c32": _level(row, 800.0), "c8": _level(1, 1, "2 of 32 FAILED")},
                },
            ],
        }

    merged = plot_serve.merge(
        [
            record("plain", "/m", False, 260.0),
            record("plain", "/m-skew", False, 999.0),
            record("plain", "/m", True, 999.0),
            record("skew", "/m-skew", False, 260.0),
        ]
    )
    assert [(r["label"], r["model"], r["batch_invariant"]) for r in merged] == [
        ("plain", "/m", False),
        ("plain", "/m-skew", False),
        ("plain", "/m", True),
        ("skew", "/m-skew", False),
    ]
    assert plot_serve.targets(merged[0]) == [
        "plain  c32  row / UVA output tok/s 1.300 (met: >= 1.0), TTFT p99 800.0 / 900.0 ms "
        "(met: row <= UVA)"
    ]
    assert "(MISSED: >= 1.5)" in plot_serve.targets(merged[3])[0]


def test_a_levels_verdicts_name_the_compilations_during_it() -> None:
    """One request waiting for a compilation dominates c1's TTFT p99: a level's line names the
    compilations each server logged during it where either logged any (``?`` where a record
    has no count), and says nothing where neither did; other servers' counts do not count."""
    from tools.vllm import plot_serve

    def level(tok_s: float, ttft: float, jit: int | None) -> dict[str, Any]:
        entry = _level(tok_s, ttft)
        if jit is not None:
            entry["jit_compiles"] = jit
        return entry

    record = {
        "label": "skew",
        "servers": [
            {"name": "uva", "levels": {"c1": level(85.0, 690.0, 0), "c8": level(170, 900, 0)}},
            {"name": "row", "levels": {"c1": level(250.0, 950.0, 2), "c8": level(510, 700, 0)}},
            {"name": "none", "levels": {"c1": level(280.0, 880.0, 2)}},
        ],
    }
    c1, c8 = plot_serve.targets(record)
    assert c1.endswith("(MISSED: row <= UVA); compilations during the level: row 2, UVA 0")
    assert c8.endswith("(met: row <= UVA)")
    del record["servers"][0]["levels"]["c1"]["jit_compiles"]
    assert plot_serve.targets(record)[0].endswith("during the level: row 2, UVA ?")
    record["servers"][0]["levels"]["c8"]["jit_compiles"] = 3
    del record["servers"][1]["levels"]["c8"]["jit_compiles"]
    assert plot_serve.targets(record)[1].endswith("during the level: row ?, UVA 3")
    record["servers"][1]["levels"]["c1"]["jit_compiles"] = 0
    assert plot_serve.targets(record)[0].endswith("(MISSED: row <= UVA)")


def test_a_row_server_without_the_caches_lines_is_compared_with_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine without the rowcache wheel serves ``row`` as plain vLLM with every expert on
    the GPU: far ahead of UVA, a false pass unless the log is read."""
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench({"uva": 250.0, "row": 3000.0}, {"uva": 900, "row": 50})

    def without_plugin(command: list[str], env: dict[str, str], log: Path) -> sc.Process:
        if "--additional-config" in command:  # the fake then logs no cache line, as vLLM
            at = command.index("--additional-config")
            command = command[:at] + command[at + 2 :]
        return fake.launcher(command, env, log)

    options = _options(tmp_path, servers=tuple(sb.parse_servers("uva,row")))
    record = sb.run(options, client=fake.client, launcher=without_plugin)
    assert record["servers"][1]["plugin_verdict"] == "no settings line"
    text = (tmp_path / "out" / "serve_bench.txt").read_text()
    assert "row    server log: no settings line (MISSED)" in text
    assert "plain  row compared with nothing: its log did not show the cache" in text
    assert "output tok/s 12.000" not in text


def test_levels_after_the_server_exits_are_recorded_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench({"row": 300.0}, {"row": 7})
    launched: list[sc.Process] = []

    def launcher(command: list[str], env: dict[str, str], log: Path) -> sc.Process:
        launched.append(fake.launcher(command, env, log))
        return launched[-1]

    def client(command: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
        code = fake.client(command, env, log, timeout)
        if log.stem.endswith("-c1"):  # the server dies during c1
            sc.stop(launched[-1], grace=1.0)
        return code

    options = _options(tmp_path, servers=(sb.SERVERS["row"],))
    record = sb.run(options, client=client, launcher=launcher)
    levels = record["servers"][0]["levels"]
    assert levels["c1"]["status"] == "ok"
    assert levels["c32"]["status"].startswith("not run: the server exited (")
    assert [level for _, level in fake.ran] == ["warmup", "warmup1", "warmup2", "c1"]


def test_each_level_counts_the_kernels_the_server_compiled_while_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the H100 (2026-12-05) one c1 prompt waited 1.02 s on ``row`` and 0.73 s on UVA, and
    vLLM's monitor had logged each kernel's first compilation only, in the warm-up: whether a
    compilation slowed a level is read from the lines its server wrote while the level ran."""
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    fake = FakeBench({"row": 300.0}, {"row": 700})
    line = "(EngineCore pid=1) WARNING [jit_monitor.py:129] Triton kernel {} during inference: k.\n"

    def client(command: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
        level = log.stem.rsplit("-", 1)[1]
        with open(log.parent / "server-row.log", "a") as server_log:
            server_log.write(line.format("JIT compilation") * {"warmup": 3, "c1": 1}.get(level, 0))
            server_log.write(line.format("JIT compile"))  # not the monitor's words
        return fake.client(command, env, log, timeout)

    assert "--jit-monitor-verbose" in sb.COMMON_ARGS  # every compilation, not each kernel's first
    options = _options(tmp_path, servers=(sb.SERVERS["row"],))
    record = sb.run(options, client=client, launcher=fake.launcher)
    levels = record["servers"][0]["levels"]
    counts = {name: levels[name]["jit_compiles"] for name in ("warmup", "warmup1", "c1", "c32")}
    assert counts == {"warmup": 3, "warmup1": 0, "c1": 1, "c32": 0}
    table = (tmp_path / "out" / "serve_bench.txt").read_text().splitlines()
    c1 = next(row for row in table if row.startswith("row    c1 "))
    assert c1.split()[-2:] == ["1", "ok"]


def test_no_warm_up_is_drawn_or_compared() -> None:
    from tools.vllm import plot_serve

    server = {"levels": {name: _level(1.0, 1.0) for name in ("warmup", "warmup1", "c1")}}
    assert list(plot_serve.complete(server, ("output_throughput",))) == ["c1"]
