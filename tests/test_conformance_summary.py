"""tools/conformance_summary.py on synthetic log folders (no GPU): the verdict of a complete
run, a failed test, a missing step, an undetected mutant, and the script's summary-only mode."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.conformance_summary import main, read_step, summarize

ROOT = Path(__file__).resolve().parents[1]
ENVIRONMENT = (
    "commit: 0123456789abcdef\n"
    "gpu: NVIDIA H200, 580.159.04, 143771 MiB\n"
    "torch: 2.11.0+cu130 (CUDA 13.0)\n"
    "triton: 3.6.0\n"
    "python: 3.12.3; pytest 9.1.1; hypothesis 6.168.3\n"
)
MUTANTS = (
    ("tests.cuda.test_gpu_mutants", "test_gpu_mutant_is_detected[no_wait]"),
    ("tests.cuda.test_gpu_mutants", "test_gpu_mutant_is_detected[early_record]"),
    ("tests.cuda.test_device_planner_cuda", "test_device_mutant_is_detected[stale_map]"),
    (
        "tests.cuda.test_device_planner_cuda",
        "test_device_mutant_replay_without_handoff_is_detected",
    ),
)


def _xml(cases: list[tuple[str, str, str]]) -> str:
    body = []
    for classname, name, outcome in cases:
        inner = {
            "passed": "",
            "failed": '<failure message="boom">trace</failure>',
            "skipped": '<skipped message="no GPU"/>',
        }[outcome]
        body.append(f'<testcase classname="{classname}" name="{name}">{inner}</testcase>')
    return (
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        + "".join(body)
        + "</testsuite></testsuites>"
    )


def _write_step(logs: Path, name: str, cases: list[tuple[str, str, str]], rc: int = 0) -> None:
    (logs / f"{name}.xml").write_text(_xml(cases))
    (logs / f"{name}.rc").write_text(f"{rc}\n")
    (logs / f"environment.{name}.txt").write_text(ENVIRONMENT)


def _complete(logs: Path, *, mutant_outcome: str = "passed", suite_outcome: str = "passed") -> None:
    (logs / "environment.txt").write_text(ENVIRONMENT)
    suite = [
        ("tests.cuda.test_cuda_machine", "test_machine", "passed"),
        ("tests.cuda.test_device_planner_cuda", "test_lockstep[bf16-separate]", suite_outcome),
    ]
    _write_step(logs, "suite", suite, rc=0 if suite_outcome == "passed" else 1)
    mutants = [(c, n, "passed") for c, n in MUTANTS]
    mutants[-1] = (*mutants[-1][:2], mutant_outcome)
    _write_step(logs, "mutants", mutants, rc=0 if mutant_outcome == "passed" else 1)
    _write_step(logs, "sanitizer", [("tests.cuda.test_cuda_machine", "test_machine", "passed")])
    (logs / "mutants.fixtures.jsonl").write_text(
        '{"fixture": "replay_after_reader", "provider": "correct", "findings": []}\n'
        '{"fixture": "replay_after_reader", "provider": "no_handoff", '
        '"findings": [["wrong_read", "slot 3"]]}\n'
    )


def test_a_complete_clean_run_passes(tmp_path: Path) -> None:
    _complete(tmp_path)
    ok, lines = summarize(tmp_path)
    assert ok, "\n".join(lines)
    assert lines[-1].startswith("cuda-conformance: PASS")
    assert "suite 2 passed, 0 failed, 0 skipped" in lines[-1]
    assert "GPU mutants 2/2 detected, device path 2/2" in lines[-1]
    assert "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130" in lines[-1]
    assert "commit 0123456789ab" in lines[-1]
    assert any(line.startswith("correct") for line in lines)


def test_a_failed_test_fails_the_run(tmp_path: Path) -> None:
    _complete(tmp_path, suite_outcome="failed")
    ok, lines = summarize(tmp_path)
    assert not ok
    assert "suite 1 passed, 1 failed, 0 skipped" in lines[-1]
    assert lines[-1].startswith("cuda-conformance: FAIL")


def test_a_skipped_test_fails_the_run(tmp_path: Path) -> None:
    _complete(tmp_path)
    _write_step(
        tmp_path, "sanitizer", [("tests.cuda.test_cuda_machine", "test_machine", "skipped")]
    )
    assert not summarize(tmp_path)[0]


@pytest.mark.parametrize("step", ["suite", "mutants", "sanitizer"])
def test_a_missing_step_is_reported_missing_never_passed(tmp_path: Path, step: str) -> None:
    _complete(tmp_path)
    (tmp_path / f"{step}.xml").unlink()
    ok, lines = summarize(tmp_path)
    assert not ok
    assert f"problem: step {step} is missing" in lines
    assert "MISSING" in lines[-1] or "sanitizer missing" in lines[-1]
    assert read_step(tmp_path, step).ran is False


def test_a_step_without_its_exit_status_is_missing(tmp_path: Path) -> None:
    _complete(tmp_path)
    (tmp_path / "suite.rc").unlink()
    ok, lines = summarize(tmp_path)
    assert not ok
    assert "problem: step suite is missing" in lines


def test_an_undetected_mutant_fails_the_run(tmp_path: Path) -> None:
    _complete(tmp_path, mutant_outcome="failed")
    ok, lines = summarize(tmp_path)
    assert not ok
    assert "device path 1/2" in lines[-1]
    assert any("undetected:" in line and "without_handoff" in line for line in lines)


def _split_suite(logs: Path, *, second: str = "passed", collected: tuple[str, ...] = ()) -> None:
    """The suite as two parts (``machine`` and ``rest``) with the whole step's test ids."""
    (logs / "suite.xml").unlink()
    (logs / "suite.rc").unlink()
    _write_step(logs, "suite.machine", [("tests.cuda.test_cuda_machine", "test_machine", "passed")])
    rest = [("tests.cuda.test_device_planner_cuda", "test_lockstep[bf16-separate]", second)]
    _write_step(logs, "suite.rest", rest, rc=0 if second == "passed" else 1)
    ids = (
        "tests/cuda/test_cuda_machine.py::test_machine",
        "tests/cuda/test_device_planner_cuda.py::test_lockstep[bf16-separate]",
        *collected,
    )
    (logs / "suite.collected").write_text("\n".join(ids) + "\n")


def test_a_step_split_into_parts_is_merged(tmp_path: Path) -> None:
    _complete(tmp_path)
    _split_suite(tmp_path)
    ok, lines = summarize(tmp_path)
    assert ok, "\n".join(lines)
    assert "suite:     2 passed, 0 failed, 0 skipped in parts machine, rest" in lines


def test_a_failure_in_one_part_fails_the_step(tmp_path: Path) -> None:
    _complete(tmp_path)
    _split_suite(tmp_path, second="failed")
    step = read_step(tmp_path, "suite")
    assert step.rc == 1 and step.count("failed") == 1 and not step.clean
    assert not summarize(tmp_path)[0]


def test_a_test_no_part_ran_fails_the_run(tmp_path: Path) -> None:
    _complete(tmp_path)
    _split_suite(tmp_path, collected=("tests/cuda/test_sanitizer_cuda.py::test_forgotten[a]",))
    ok, lines = summarize(tmp_path)
    assert not ok
    assert (
        "problem: step suite: tests.cuda.test_sanitizer_cuda::test_forgotten[a] ran in no part"
        in lines
    )
    assert "1 run in no part" in lines[-1]


def test_a_part_without_its_status_makes_the_step_missing(tmp_path: Path) -> None:
    _complete(tmp_path)
    _split_suite(tmp_path)
    (tmp_path / "suite.rest.rc").unlink()
    assert read_step(tmp_path, "suite").ran is False
    assert "problem: step suite is missing" in summarize(tmp_path)[1]


def test_missing_environment_and_mixed_commits_fail(tmp_path: Path) -> None:
    _complete(tmp_path)
    (tmp_path / "environment.mutants.txt").write_text(
        ENVIRONMENT.replace("0123456789abcdef", "fedcba9876543210")
    )
    ok, lines = summarize(tmp_path)
    assert not ok
    assert any("step mutants ran with commit" in line for line in lines)
    (tmp_path / "environment.txt").unlink()
    ok, lines = summarize(tmp_path)
    assert not ok
    assert any("environment.txt is missing" in line for line in lines)


def test_a_step_with_another_triton_fails_and_the_version_is_reported(tmp_path: Path) -> None:
    """The kernels are Triton's: a part compiled by another Triton is another run."""
    _complete(tmp_path)
    ok, lines = summarize(tmp_path)
    assert ok
    assert lines[0].endswith("; Triton 3.6.0")
    (tmp_path / "environment.suite.txt").write_text(ENVIRONMENT.replace("3.6.0", "3.7.0"))
    ok, lines = summarize(tmp_path)
    assert not ok
    assert "problem: step suite ran with triton '3.7.0', environment.txt says '3.6.0'" in lines


def test_main_writes_the_summary_and_sets_the_status(tmp_path: Path) -> None:
    _complete(tmp_path)
    assert main([str(tmp_path)]) == 0
    assert "cuda-conformance: PASS" in (tmp_path / "summary.txt").read_text()
    (tmp_path / "sanitizer.rc").unlink()
    assert main([str(tmp_path)]) == 1
    assert main([]) == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize(
    ("args", "env"),
    [(["--summary-only"], {}), ([], {"ROWCACHE_STEPS": "summary"})],
    ids=["flag", "env"],
)
def test_the_script_summarizes_a_folder_without_cuda(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    _complete(tmp_path)
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "run_cuda_conformance.sh"), *args, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, **env},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cuda-conformance: PASS" in result.stdout
    (tmp_path / "mutants.xml").unlink()
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "run_cuda_conformance.sh"), *args, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, **env},
        check=False,
    )
    assert result.returncode == 1
    assert "cuda-conformance: FAIL" in result.stdout


def test_the_script_refuses_an_unknown_step(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "run_cuda_conformance.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "ROWCACHE_STEPS": "suite nonsense"},
        check=False,
    )
    assert result.returncode == 2
    assert "unknown step 'nonsense'" in result.stderr


def test_the_script_refuses_a_part_name_that_is_not_a_file_name(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "run_cuda_conformance.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "ROWCACHE_PART": "a/b c"},
        check=False,
    )
    assert result.returncode == 2
    assert "ROWCACHE_PART='a/b c'" in result.stderr
    assert list(tmp_path.iterdir()) == []
