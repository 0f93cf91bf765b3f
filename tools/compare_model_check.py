"""Compare two recorded runs of ``python -m model_check``: a change that should not change what
the model check finds (a re-layout of ``model_check/``) must leave every output the same but
its timings.

    python tools/compare_model_check.py BEFORE_DIR AFTER_DIR

Each folder holds what one checkout printed: ``check.json`` (``python -m model_check --json
check``), ``mutants.json`` (``--json mutants``), ``explain.txt`` (``explain`` of every mutant)
and ``diagram.txt`` (``diagram``). The JSON files are compared with every ``seconds`` key
removed, the text files byte for byte. Prints one line per file and the first differing lines;
exits 1 when any file differs or is missing.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any

JSON_FILES = ("check.json", "mutants.json")
TEXT_FILES = ("explain.txt", "diagram.txt")
TIMING_KEYS = frozenset({"seconds"})
SHOWN = 40  # differing lines shown per file


def untimed(value: Any) -> Any:
    """``value`` without its timings (every ``seconds`` key, at any depth)."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def lines_of(path: Path) -> list[str]:
    if path.suffix == ".json":
        masked = untimed(json.loads(path.read_text()))
        return json.dumps(masked, indent=1, sort_keys=True).splitlines()
    return path.read_text().splitlines()


def compare(before: Path, after: Path) -> tuple[bool, list[str]]:
    """Whether every file is the same; one line per file (``same``, ``DIFFERS`` or
    ``MISSING``), each followed by its first differing lines."""
    report = []
    same = True
    for name in (*JSON_FILES, *TEXT_FILES):
        a, b = before / name, after / name
        missing = [str(p) for p in (a, b) if not p.exists()]
        if missing:
            report.append(f"{name}: MISSING {', '.join(missing)}")
            same = False
            continue
        diff = list(difflib.unified_diff(lines_of(a), lines_of(b), str(a), str(b), lineterm=""))
        report.append(f"{name}: {'DIFFERS' if diff else 'same'}")
        report.extend(diff[:SHOWN])
        same = same and not diff
    return same, report


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    same, report = compare(Path(argv[0]), Path(argv[1]))
    print("\n".join(report))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
