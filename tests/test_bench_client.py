"""One client process for every level of a serving benchmark (``tools/vllm/bench_client.py``
and ``serve_bench.PersistentClient``), run against a stand-in for vLLM's client module; the
names it calls checked against the vLLM 0.25.0 wheel."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import vllm_wheels

from tools.vllm import serve_bench as sb

FAKE_SERVE = """
import os, sys, time
print("client imported", os.getpid(), flush=True)

def add_cli_args(parser):
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--result", default=None)

def main(args):
    print("level", args.seed, flush=True)
    print("to stderr", args.seed, file=sys.stderr, flush=True)
    time.sleep(args.sleep)
    if args.fail:
        raise RuntimeError("the client failed")
    if args.result:
        open(args.result, "w").write(str(args.seed))
    return {}
"""


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``vllm`` is a stand-in: its client prints, sleeps or raises."""
    root = tmp_path / "site"
    for package in ("vllm", "vllm/benchmarks", "vllm/utils"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "vllm/benchmarks/serve.py").write_text(textwrap.dedent(FAKE_SERVE))
    (root / "vllm/utils/argparse_utils.py").write_text(
        "import argparse\nFlexibleArgumentParser = argparse.ArgumentParser\n"
    )
    return {**os.environ, "PYTHONPATH": str(root)}


def command(*args: str) -> list[str]:
    return ["py", "-m", "vllm.entrypoints.cli.main", "bench", "serve", *args]


def test_levels_run_in_one_process_each_into_its_own_log(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    client = sb.PersistentClient(sys.executable)
    try:
        assert not client.warm
        logs = [tmp_path / f"client-{n}.log" for n in (1, 2)]
        result = tmp_path / "r.json"
        assert client(command("--seed", "1"), fake_vllm, logs[0], 30.0) == 0
        assert client.warm
        assert (
            client(command("--seed", "2", "--result", str(result)), fake_vllm, logs[1], 30.0) == 0
        )
    finally:
        client.close()
    first, second = (log.read_text() for log in logs)
    assert "client imported" in first and "client imported" not in second  # imported once
    assert "level 1" in first and "to stderr 1" in first and "level 2" not in first
    assert "level 2" in second and "to stderr 2" in second
    assert result.read_text() == "2"


def test_a_level_past_its_timeout_is_cut_and_the_next_starts_a_new_client(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    client = sb.PersistentClient(sys.executable)
    try:
        started = time.monotonic()
        code = client(command("--seed", "1", "--sleep", "30"), fake_vllm, tmp_path / "a.log", 3.0)
        assert code == 124 and time.monotonic() - started < 20 and not client.warm
        assert client(command("--seed", "2"), fake_vllm, tmp_path / "b.log", 30.0) == 0
        assert "client imported" in (tmp_path / "b.log").read_text()  # a new process
    finally:
        client.close()


def test_a_failing_level_says_why_and_the_client_goes_on(
    tmp_path: Path, fake_vllm: dict[str, str]
) -> None:
    client = sb.PersistentClient(sys.executable)
    try:
        assert client(command("--seed", "1", "--fail"), fake_vllm, tmp_path / "a.log", 30.0) == 1
        assert "RuntimeError: the client failed" in (tmp_path / "a.log").read_text()
        assert client(command("--unknown"), fake_vllm, tmp_path / "b.log", 30.0) == 2
        assert "the following arguments are required: --seed" in (tmp_path / "b.log").read_text()
        assert client(command("--seed", "3"), fake_vllm, tmp_path / "c.log", 30.0) == 0
        assert "client imported" not in (tmp_path / "c.log").read_text()  # the same process
    finally:
        client.close()


def test_a_client_that_cannot_start_is_an_error_not_a_pass(tmp_path: Path) -> None:
    """No vLLM to import: the level fails with the import's traceback in its log."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "nothing")}
    client = sb.PersistentClient(sys.executable)
    try:
        assert client(command("--seed", "1"), env, tmp_path / "a.log", 30.0) == 1
    finally:
        client.close()
    assert "ModuleNotFoundError" in (tmp_path / "a.log").read_text()


def test_the_names_it_calls_are_vllms() -> None:
    """``bench_client.run_level`` calls what ``vllm bench serve`` calls in vLLM 0.25.0."""
    found = vllm_wheels.read(
        "0.25.0",
        "vllm/benchmarks/serve.py",
        "vllm/entrypoints/cli/benchmark/serve.py",
        "vllm/utils/argparse_utils.py",
    )
    assert "def add_cli_args(parser: FlexibleArgumentParser)" in found["vllm/benchmarks/serve.py"]
    assert "def main(args: argparse.Namespace)" in found["vllm/benchmarks/serve.py"]
    subcommand = found["vllm/entrypoints/cli/benchmark/serve.py"]
    assert "from vllm.benchmarks.serve import add_cli_args, main" in subcommand
    assert "add_cli_args(parser)" in subcommand and "main(args)" in subcommand
    assert "class FlexibleArgumentParser" in found["vllm/utils/argparse_utils.py"]
