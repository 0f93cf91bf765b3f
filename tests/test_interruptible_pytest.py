"""tools/interruptible_pytest.py: a pytest started with SIGINT ignored (as a shell starts its
background jobs) is still interrupted by SIGINT and writes the JUnit XML of the tests it ran;
plain ``python -m pytest`` started so is not (the seeded case the launcher exists for)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "tools" / "interruptible_pytest.py"

TESTS = """
import pathlib, time

def test_quick():
    pass

def test_long():
    pathlib.Path({started!r}).write_text("1")
    time.sleep(120)
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(command: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    started = tmp_path / "started"
    test_file = tmp_path / "test_cut.py"
    test_file.write_text(TESTS.format(started=str(started)))
    xml = tmp_path / "cut.xml"
    process = subprocess.Popen(
        [*command, str(test_file), "-p", "no:cacheprovider", "-q", f"--junitxml={xml}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_ignore_sigint,  # what a shell without job control does for `cmd &`
    )
    deadline = time.monotonic() + 60
    while not started.exists():
        assert process.poll() is None, "pytest ended before its long test started"
        assert time.monotonic() < deadline, "the long test never started"
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    return process, xml, started


def test_sigint_cuts_the_run_and_keeps_its_record(tmp_path: Path) -> None:
    process, xml, _ = _start([sys.executable, str(LAUNCHER)], tmp_path)
    try:
        rc = process.wait(timeout=30)
    finally:
        process.kill()
    assert rc == 2  # pytest's "interrupted"
    cases = {c.get("name"): c for c in ET.parse(xml).iter("testcase")}
    assert "test_quick" in cases and not list(cases["test_quick"])  # passed


def test_plain_pytest_started_so_ignores_sigint(tmp_path: Path) -> None:
    process, xml, _ = _start([sys.executable, "-m", "pytest"], tmp_path)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=3)
    finally:
        process.kill()
        process.wait()
    assert not xml.exists()


def test_imports_as_python_m_pytest_does(tmp_path: Path) -> None:
    """The tools folder is not on the path (its ``vllm/`` would shadow vLLM); the working
    directory is, as under ``python -m pytest``."""
    test_file = tmp_path / "test_path.py"
    test_file.write_text(
        "import os, sys\n"
        "def test_path():\n"
        f"    assert {str(LAUNCHER.parent)!r} not in sys.path\n"
        "    assert os.getcwd() in sys.path\n"
    )
    run = subprocess.run(
        [sys.executable, str(LAUNCHER), str(test_file), "-p", "no:cacheprovider", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
