"""The GPU conformance run's summary, from its log folder alone (no torch, no GPU).

    python3 tools/conformance_summary.py LOG_DIR

Reads what ``tools/run_cuda_conformance.sh`` leaves in ``LOG_DIR``: ``environment.txt`` (the
commit, GPU and torch of the run; each step also leaves ``environment.<step>.txt``), each
step's ``<step>.xml`` (JUnit) and ``<step>.rc`` (pytest's exit status), and the race fixtures'
records (``<step>.fixtures.jsonl``, or ``fixtures.jsonl`` of an older run). The steps may have
run in separate calls, even on separate machines, and been copied into one folder: a step
whose XML or exit status is absent is reported as missing, and the run as FAIL. A step may
also be split into parts (``ROWCACHE_PART``): ``<step>.<part>.xml`` and ``<step>.<part>.rc``
per part, merged here, and ``<step>.collected``, the test ids of the whole step; a collected
test that no part ran fails the run, so a split cannot drop a test unnoticed. Writes
``summary.txt`` and prints it; exit status 0 only when every step ran and passed with nothing
skipped, every GPU mutant was detected, and the steps ran at one commit on one kind of GPU
with one torch and one Triton.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "STEPS",
    "StepResult",
    "collected_key",
    "main",
    "read_environment",
    "read_step",
    "summarize",
]

STEPS = ("suite", "mutants", "sanitizer")
SHORT = {"wrong_read": "R", "wrong_map": "M", "host_block": "H"}
MUTANT_TEST = "test_gpu_mutant_is_detected["
DEVICE_MUTANT_TEST = "test_device_mutant"
ENVIRONMENT_KEYS = ("commit", "gpu", "torch", "triton")


@dataclass
class StepResult:
    """One pytest step: its exit status (None: no ``.rc``) and every test case's outcome
    (``passed``, ``failed`` or ``skipped``); ``ran`` is False when the XML or the status is
    absent."""

    name: str
    rc: int | None
    cases: dict[str, str] = field(default_factory=dict)
    ran: bool = True
    parts: list[str] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(v == outcome for v in self.cases.values())

    def text(self) -> str:
        if not self.ran:
            return "MISSING (did not run, or its XML or exit status is not in the folder)"
        parts = f" in parts {', '.join(self.parts)}" if self.parts else ""
        uncovered = f", {len(self.uncovered)} run in no part" if self.uncovered else ""
        return (
            f"{self.count('passed')} passed, {self.count('failed')} failed, "
            f"{self.count('skipped')} skipped{uncovered}{parts}"
        )

    @property
    def clean(self) -> bool:
        return (
            self.ran
            and self.rc == 0
            and self.count("failed") == 0
            and self.count("skipped") == 0
            and self.count("passed") > 0
            and not self.uncovered
        )


def read_environment(path: Path) -> dict[str, str]:
    """``key: value`` lines (empty when the file is absent)."""
    if not path.exists():
        return {}
    pairs = (line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)
    return {key: value for key, value in pairs}


def _rc(path: Path) -> int | None:
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        return 1  # an unreadable status is a failure, never a pass


def _cases(path: Path) -> dict[str, str] | None:
    """Every test case's outcome in a JUnit file (None when it cannot be parsed)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    cases: dict[str, str] = {}
    for case in root.iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            cases[key] = "failed"
        elif case.find("skipped") is not None:
            cases[key] = "skipped"
        else:
            cases[key] = "passed"
    return cases


def collected_key(test_id: str) -> str:
    """A ``pytest --collect-only -q`` id (``tests/cuda/test_x.py::test_y[p]``) as the JUnit
    key this summary uses (``tests.cuda.test_x::test_y[p]``)."""
    path, _, name = test_id.partition("::")
    return f"{path.removesuffix('.py').replace('/', '.')}::{name}"


def read_step(logs: Path, name: str) -> StepResult:
    """The step's whole record (``<step>.xml``) and its parts (``<step>.<part>.xml``), merged:
    a test failed in any part failed; the status is the first non-zero one; a part without
    its XML or status makes the step missing."""
    parts = sorted(p.name[len(name) + 1 : -len(".xml")] for p in logs.glob(f"{name}.*.xml"))
    stems = ([name] if (logs / f"{name}.xml").exists() or not parts else []) + [
        f"{name}.{part}" for part in parts
    ]
    cases: dict[str, str] = {}
    status = 0
    for stem in stems:
        rc = _rc(logs / f"{stem}.rc")
        found = _cases(logs / f"{stem}.xml") if (logs / f"{stem}.xml").exists() else None
        if rc is None or found is None:
            return StepResult(name, rc, ran=False, parts=parts)
        status = status or rc
        for key, outcome in found.items():
            if cases.get(key) != "failed":
                cases[key] = outcome
    uncovered: list[str] = []
    collected = logs / f"{name}.collected"
    if collected.exists():
        every = [collected_key(line.strip()) for line in collected.read_text().splitlines()]
        uncovered = [key for key in every if "::" in key and key not in cases]
    return StepResult(name, status, cases, parts=parts, uncovered=uncovered)


def _fixture_rows(logs: Path) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    paths = sorted(logs.glob("*.fixtures.jsonl"))
    if (logs / "fixtures.jsonl").exists():
        paths.append(logs / "fixtures.jsonl")
    for path in paths:
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def _fixture_matrix(rows: list[dict[str, object]]) -> list[str]:
    matrix: dict[str, dict[str, str]] = defaultdict(dict)
    fixtures: list[str] = []
    for row in rows:
        fixture, provider = str(row["fixture"]), str(row["provider"])
        if fixture not in fixtures:
            fixtures.append(fixture)
        findings = row.get("findings") or []
        assert isinstance(findings, list)
        kinds = sorted({SHORT.get(str(f[0]), "?") for f in findings})
        cell = "inconclusive" if row.get("inconclusive") else "".join(kinds) or "-"
        matrix[provider][fixture] = cell
    if not matrix:
        return []
    width = max(len(p) for p in matrix)
    out = [
        "",
        "race fixtures: findings per provider (R wrong read, M wrong map, H host block,",
        "- none, ? inconclusive); columns:",
    ]
    out += [f"  F{number} {fixture}" for number, fixture in enumerate(fixtures, 1)]
    out.append(" " * width + " | " + " | ".join(f"F{n:<2}" for n in range(1, len(fixtures) + 1)))
    for provider, cells in matrix.items():
        shown = [cells.get(f, " ").replace("inconclusive", "?").ljust(3) for f in fixtures]
        out.append(provider.ljust(width) + " | " + " | ".join(shown))
    return out


def _mutant_ids(step: StepResult, marker: str) -> tuple[list[str], list[str]]:
    """(all, detected) test ids of ``step`` whose id contains ``marker``."""
    every = sorted(k for k in step.cases if marker in k)
    return every, [k for k in every if step.cases[k] == "passed"]


def summarize(logs: Path) -> tuple[bool, list[str]]:
    """(pass, the summary's lines) of the run in ``logs``."""
    env = read_environment(logs / "environment.txt")
    steps = {name: read_step(logs, name) for name in STEPS}
    suite, mutants, sanitizer = steps["suite"], steps["mutants"], steps["sanitizer"]
    race, race_detected = _mutant_ids(mutants, MUTANT_TEST)
    device, device_detected = _mutant_ids(mutants, DEVICE_MUTANT_TEST)
    problems: list[str] = []
    if not env:
        problems.append("environment.txt is missing: the run's commit, GPU and torch are unknown")
    for name, step in steps.items():
        if not step.ran:
            problems.append(f"step {name} is missing")
        for stem in [name] + [f"{name}.{part}" for part in step.parts]:
            other = read_environment(logs / f"environment.{stem}.txt")
            for key in ENVIRONMENT_KEYS:
                if other and env and other.get(key) != env.get(key):
                    problems.append(
                        f"step {stem} ran with {key} {other.get(key)!r}, environment.txt says "
                        f"{env.get(key)!r}"
                    )
        problems += [f"step {name}: {key} ran in no part" for key in step.uncovered]
    if mutants.ran and not race:
        problems.append("no race-fixture mutant test in the mutants step")
    if mutants.ran and not device:
        problems.append("no device-path mutant test in the mutants step")
    ok = (
        not problems
        and all(step.clean for step in steps.values())
        and race_detected == race
        and device_detected == device
    )
    out = [
        f"commit {env.get('commit')}; GPU {env.get('gpu')}; torch {env.get('torch')}; "
        f"Triton {env.get('triton', 'not recorded')}"
    ]
    out.append(f"suite:     {suite.text()}")
    if mutants.ran:
        out.append(
            f"mutants:   {mutants.text()}; race-fixture detection {len(race_detected)}/"
            f"{len(race)}; device-path mutants detected {len(device_detected)}/{len(device)}"
        )
        out += [f"  undetected: {k}" for k in race + device if mutants.cases[k] != "passed"]
    else:
        out.append(f"mutants:   {mutants.text()}")
    out.append(f"sanitizer: {sanitizer.text()} (TORCH_CUDA_SANITIZER=1)")
    out += [f"problem: {p}" for p in problems]
    out += _fixture_matrix(_fixture_rows(logs))
    gpu = env.get("gpu", "?").split(",")
    sanitizer_state = (
        "missing"
        if not sanitizer.ran
        else "clean"
        if sanitizer.rc == 0 and sanitizer.count("failed") == 0
        else "NOT clean"
    )
    mutant_text = (
        f"{len(race_detected)}/{len(race)} detected, device path {len(device_detected)}/"
        f"{len(device)} ({mutants.text()})"
        if mutants.ran
        else "MISSING"
    )
    out.append("")
    suite_text = suite.text() if suite.ran else "MISSING"
    out.append(
        f"cuda-conformance: {'PASS' if ok else 'FAIL'} | suite {suite_text}"
        f" | GPU mutants {mutant_text} | sanitizer {sanitizer_state}"
        f"{f' ({sanitizer.text()})' if sanitizer.ran else ''} | {gpu[0].strip()}, driver "
        f"{gpu[1].strip() if len(gpu) > 1 else '?'}, torch {env.get('torch', '?').split()[0]} "
        f"| commit {env.get('commit', '?')[:12]}"
    )
    return ok, out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 tools/conformance_summary.py LOG_DIR", file=sys.stderr)
        return 2
    logs = Path(args[0])
    if not logs.is_dir():
        print(f"conformance summary: no folder {logs}", file=sys.stderr)
        return 2
    ok, lines = summarize(logs)
    (logs / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
