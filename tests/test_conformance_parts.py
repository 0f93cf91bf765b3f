"""tools/run_cuda_conformance_parts.sh without a GPU: its parts split each step's tests with
nothing dropped and nothing run twice, bad part names leave nothing behind, and the archives
of several calls merge into one summary (a part run again replaces the earlier one; parts of
different commits fail it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "run_cuda_conformance_parts.sh"
MARKERS = {
    "suite": "not gpu_mutant",
    "mutants": "gpu_mutant",
    "sanitizer": "not gpu_mutant and not csan_subprocess",
}
ENVIRONMENT = (
    "commit: {commit}\n"
    "gpu: NVIDIA H200, 580.159.04, 143771 MiB\n"
    "torch: 2.11.0+cu130 (CUDA 13.0)\n"
    "python: 3.12.3; pytest 9.1.1; hypothesis 6.168.3\n"
)


def _parts() -> dict[str, str]:
    listed = subprocess.run(
        ["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True
    ).stdout
    parts = {}
    for line in listed.splitlines():
        name, _, rest = line.partition(": -k ")
        parts[name] = rest.strip('"')
    return parts


def _collected(marker: str) -> list[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/cuda",
            "-p",
            "no:cacheprovider",
            "-q",
            "--collect-only",
            "-m",
            marker,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


def _matches(expression: str, test_id: str) -> bool:
    # pytest -k matches a substring of the item's names, case-insensitively
    name = test_id.lower()

    def matcher(word: str, /, **_kwargs: str | int | bool | None) -> bool:
        return word.lower() in name

    return Expression.compile(expression).evaluate(matcher)


@pytest.mark.parametrize("step", sorted(MARKERS))
def test_every_test_of_a_step_runs_in_exactly_one_of_its_parts(step: str) -> None:
    parts = {n: e for n, e in _parts().items() if n.startswith(f"{step}.")}
    assert parts
    ids = _collected(MARKERS[step])
    assert len(ids) > 5
    for test_id in ids:
        owners = [n for n, e in parts.items() if _matches(e, test_id)]
        assert len(owners) == 1, (test_id, owners)


def test_an_unknown_part_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = subprocess.run(
        ["bash", str(SCRIPT), str(logs), str(tmp_path / "a.tgz"), "suite.rest", "suite.typo"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    known = "known: suite.rest suite.lockstep-bf16 suite.lockstep-bf16_scaled"
    assert f"unknown part 'suite.typo'; {known}" in run.stderr
    assert not logs.exists() and not (tmp_path / "a.tgz").exists()


def test_a_part_longer_than_the_time_left_is_not_started(tmp_path: Path) -> None:
    """A part whose estimate exceeds what is left of the call waits for a later call rather
    than being cut with its time lost; the call says so, fails, and still packs its archive."""
    logs, archive = tmp_path / "logs", tmp_path / "a.tgz"
    env = {**os.environ, "ROWCACHE_CALL_SECONDS": "60"}
    run = subprocess.run(
        ["bash", str(SCRIPT), str(logs), str(archive), "suite.lockstep-nvfp4", "sanitizer.rest"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 1
    # bash's SECONDS may tick before the first part on a loaded machine: 60 s or a little less
    said = re.search(
        r"== part suite\.lockstep-nvfp4: not started \(estimated 75 s, (\d+) s left in the call\)",
        run.stdout,
    )
    assert said is not None, run.stdout
    assert 55 <= int(said.group(1)) <= 60
    assert "== part sanitizer.rest: not started (estimated 450 s," in run.stdout
    made = sorted(p.name for p in logs.iterdir())
    assert made == ["sanitizer-rest.out", "suite-lockstep-nvfp4.out"]
    assert archive.exists()


def test_a_part_is_limited_to_twice_its_estimate(tmp_path: Path) -> None:
    """One part gone wrong (attempt F: a lockstep part that took the whole call) leaves the
    call's other parts their time: a part is cut at twice its estimate, or at what is left of
    the call if that is less. (Without a CUDA torch each part then fails at once.)"""
    env = {**os.environ, "ROWCACHE_CALL_SECONDS": "500", "PYTHON": "false"}
    run = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            str(tmp_path / "logs"),
            str(tmp_path / "a.tgz"),
            "suite.rest",
            "sanitizer.rest",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 1
    # bash's SECONDS may tick before a part on a loaded machine: 500 s or a little less
    first = re.search(r"== part suite\.rest \((\d+) s left, at most 180 s\): -k", run.stdout)
    assert first is not None, run.stdout
    assert 495 <= int(first.group(1)) <= 500
    second = re.search(r"== part sanitizer\.rest \((\d+) s left, at most (\d+) s\): -k", run.stdout)
    assert second is not None, run.stdout
    assert 490 <= int(second.group(1)) <= 500 and second.group(1) == second.group(2)


def _plan_seconds(gpus: str, *parts: str, estimates: str = "") -> dict[str, tuple[int, list[str]]]:
    """Each lane's estimated seconds and parts, as --plan prints them."""
    env = {**os.environ, "ROWCACHE_GPUS": gpus, "ROWCACHE_PART_ESTIMATES": estimates}
    out = subprocess.run(
        ["bash", str(SCRIPT), "--plan", *parts], capture_output=True, text=True, check=True, env=env
    ).stdout
    lanes = {}
    for line in out.splitlines():
        label, _, rest = line.partition(": about ")
        seconds, _, names = rest.partition(" s:")
        lanes[label] = (int(seconds), names.split())
    return lanes


def _plan(gpus: str, *parts: str) -> dict[str, list[str]]:
    return {label: names for label, (_, names) in _plan_seconds(gpus, *parts).items()}


def test_one_gpu_runs_every_part_in_order() -> None:
    assert _plan("") == {"one GPU": list(_parts())}


@pytest.mark.parametrize("gpus", ["0 1", "0 1 2 3", "3 5"])
def test_gpus_share_the_parts_each_part_once(gpus: str) -> None:
    """One lane a GPU; every part in exactly one lane, in the parts' order; the longest part
    (the sanitized suite) on the first GPU; on four GPUs every lane fits one call's 540 s."""
    lanes = _plan(gpus)
    assert list(lanes) == [f"GPU {g}" for g in gpus.split()]
    dealt = [name for names in lanes.values() for name in names]
    assert sorted(dealt) == sorted(_parts())
    order = list(_parts())
    for names in lanes.values():
        assert names == sorted(names, key=order.index)
    assert "sanitizer.rest" in lanes[f"GPU {gpus.split()[0]}"]
    if len(gpus.split()) == 4:
        assert all(seconds <= 540 for seconds, _ in _plan_seconds(gpus).values())


def test_estimates_measured_since_replace_the_scripts() -> None:
    """ROWCACHE_PART_ESTIMATES: what a call starts and how the lanes are dealt follow it."""
    [(seconds, names)] = _plan_seconds("", "suite.rest", "suite.lockstep-nvfp4").values()
    assert (seconds, names) == (90 + 75, ["suite.rest", "suite.lockstep-nvfp4"])
    given = "suite.rest=10,suite.lockstep-nvfp4=500"
    [(seconds, _)] = _plan_seconds(
        "", "suite.rest", "suite.lockstep-nvfp4", estimates=given
    ).values()
    assert seconds == 510


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("suite.typo=10", "ROWCACHE_PART_ESTIMATES: unknown part in 'suite.typo=10'; known:"),
        ("suite.rest", "ROWCACHE_PART_ESTIMATES: unknown part in 'suite.rest'; known:"),
        ("suite.rest=ten", "ROWCACHE_PART_ESTIMATES: 'ten' is not whole seconds"),
    ],
)
def test_bad_estimates_are_refused_before_anything_is_written(
    tmp_path: Path, given: str, said: str
) -> None:
    logs = tmp_path / "logs"
    env = {**os.environ, "ROWCACHE_PART_ESTIMATES": given}
    run = subprocess.run(
        ["bash", str(SCRIPT), str(logs), str(tmp_path / "a.tgz"), "suite.rest"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 2
    assert said in run.stderr
    assert not logs.exists() and not (tmp_path / "a.tgz").exists()


def test_a_bad_gpu_index_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    env = {**os.environ, "ROWCACHE_GPUS": "0 one"}
    run = subprocess.run(
        ["bash", str(SCRIPT), str(logs), str(tmp_path / "a.tgz")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 2 and "ROWCACHE_GPUS: 'one' is not a GPU index" in run.stderr
    assert not logs.exists()


def _xml(cases: list[tuple[str, str, str]]) -> str:
    body = "".join(
        f'<testcase classname="{c}" name="{n}">'
        + ("" if outcome == "passed" else '<failure message="boom">trace</failure>')
        + "</testcase>"
        for c, n, outcome in cases
    )
    return (
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'
    )


# step.part -> its test (classname, name); the mutants need a race and a device-path mutant
TESTS = {
    "suite.rest": ("tests.cuda.test_device_planner_cuda", "test_lockstep[bf16-packed]"),
    "suite.machine": ("tests.cuda.test_cuda_machine", MACHINE := "test_conformance_machine"),
    "sanitizer.machine": ("tests.cuda.test_cuda_machine", MACHINE),
    "sanitizer.rest": ("tests.cuda.test_device_planner_cuda", "test_lockstep[bf16-packed]"),
    "mutants.kills-slow": ("tests.cuda.test_gpu_mutants", "test_cuda_machine_kills[slow]"),
    "mutants.kills-host-sync": ("tests.cuda.test_gpu_mutants", "test_cuda_machine_kills[sync]"),
    "mutants.kills": ("tests.cuda.test_gpu_mutants", "test_gpu_mutant_is_detected[no_wait]"),
    "mutants.fixtures": (
        "tests.cuda.test_device_planner_cuda",
        "test_device_mutant_is_detected[stale_map]",
    ),
}


def _call_archive(
    tmp_path: Path,
    label: str,
    parts: list[str],
    commit: str = "0123456789abcdef",
    outcome: str = "passed",
) -> Path:
    """What one GPU call leaves: LOG_DIR with a folder per part, packed."""
    logs = tmp_path / label / "conf"
    for name in parts:
        step, part = name.split(".")
        folder = logs / f"{step}-{part}"
        folder.mkdir(parents=True)
        classname, test = TESTS[name]
        (folder / f"{name}.xml").write_text(_xml([(classname, test, outcome)]))
        (folder / f"{name}.rc").write_text("0\n" if outcome == "passed" else "1\n")
        env = ENVIRONMENT.format(commit=commit)
        (folder / "environment.txt").write_text(env)
        (folder / f"environment.{name}.txt").write_text(env)
        (logs / f"{step}-{part}.out").write_text(f"== {name}\n")
    archive = tmp_path / f"{label}.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(logs, arcname="conf")
    return archive


def _merge(tmp_path: Path, *archives: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "--merge", str(tmp_path / "merged"), *map(str, archives)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


NAMES = list(TESTS)


def test_calls_merge_into_one_passing_summary(tmp_path: Path) -> None:
    first = _call_archive(tmp_path, "one", NAMES[:3])
    second = _call_archive(tmp_path, "two", NAMES[3:])
    merged = _merge(tmp_path, first, second)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert "cuda-conformance: PASS" in merged.stdout
    assert "in parts machine, rest" in merged.stdout


def test_a_missing_call_fails_the_merge(tmp_path: Path) -> None:
    merged = _merge(tmp_path, _call_archive(tmp_path, "one", NAMES[:3]))
    assert merged.returncode != 0
    assert "problem: step mutants is missing" in merged.stdout


def test_a_part_run_again_replaces_the_earlier_one(tmp_path: Path) -> None:
    failed = _call_archive(tmp_path, "one", NAMES, outcome="failed")
    again = _call_archive(tmp_path, "two", NAMES)
    assert _merge(tmp_path, again, failed).returncode != 0
    merged = _merge(tmp_path, failed, again)
    assert merged.returncode == 0, merged.stdout


def test_parts_of_different_commits_fail_the_merge(tmp_path: Path) -> None:
    first = _call_archive(tmp_path, "one", NAMES[:3])
    second = _call_archive(tmp_path, "two", NAMES[3:], commit="fedcba9876543210")
    merged = _merge(tmp_path, first, second)
    assert merged.returncode != 0
    assert "ran with commit" in merged.stdout


def test_paths_are_the_callers_and_a_missing_archive_is_refused(tmp_path: Path) -> None:
    """The script runs from the repository's root; relative paths are still the caller's."""
    _call_archive(tmp_path, "one", NAMES)
    merged = subprocess.run(
        ["bash", str(SCRIPT), "--merge", "merged", "one.tgz"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert (tmp_path / "merged" / "all" / "summary.txt").exists()
    missing = subprocess.run(
        ["bash", str(SCRIPT), "--merge", "other", "one.tgz", "two.tgz"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no archive two.tgz" in missing.stderr
    assert not (tmp_path / "other").exists()


def test_a_part_writes_its_record_and_the_whole_steps_tests(tmp_path: Path) -> None:
    """One part through tools/run_cuda_conformance.sh, with a Python that says it has CUDA
    (tests/cuda then skips its GPU tests): the part's XML, log and status, and the whole step's
    collected tests (gathered beside the part's own run), every test of the step."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = -c ] && [[ "$2" == *"torch.cuda.is_available()"* ]]; then exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    logs = tmp_path / "logs"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "ROWCACHE_STEPS": "suite",
        "ROWCACHE_PART": "rest",
        "ROWCACHE_PYTEST_K": _parts()["suite.rest"],
    }
    subprocess.run(
        ["bash", str(ROOT / "tools" / "run_cuda_conformance.sh"), str(logs)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    made = {p.name for p in logs.iterdir()}
    assert {"suite.rest.xml", "suite.rest.log", "suite.rest.rc", "suite.collected"} <= made
    assert (logs / "suite.rest.rc").read_text().strip() == "0"
    collected = (logs / "suite.collected").read_text().split()
    assert sorted(collected) == sorted(_collected(MARKERS["suite"]))
