"""The committed inductive invariant, spec/invariant.toml: reading it and writing it.

The file pins what the induction (`z3.induction`) proves: the abstraction's bounds, the
ordering properties proved for any number of host calls (and which of them hold vacuously),
and the minimized invariant, one clause a line in the words of the template. The checks fail
when the induction finds anything else; re-pin on purpose with
`python -m model_check.z3.check --write-invariant`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from model_check.z3.induction import InductionResult

INVARIANT_PATH = Path(__file__).resolve().parents[2] / "spec" / "invariant.toml"
WRITE_COMMAND = "python -m model_check.z3.check --write-invariant"


@dataclass(frozen=True)
class Committed:
    consumer_streams: int
    staging_buffers: int
    proves: tuple[str, ...]
    vacuous: tuple[str, ...]
    invariant: tuple[str, ...]


def load_invariant(path: Path = INVARIANT_PATH) -> Committed | None:
    if not path.exists():
        return None
    with path.open("rb") as f:
        data = tomllib.load(f)
    abstraction = data["abstraction"]
    return Committed(
        consumer_streams=int(abstraction["consumer_streams"]),
        staging_buffers=int(abstraction["staging_buffers"]),
        proves=tuple(str(p) for p in data["proves"]),
        vacuous=tuple(str(p) for p in data["vacuous"]),
        invariant=tuple(str(c) for c in data["invariant"]),
    )


def differences(
    committed: Committed, result: InductionResult, streams: int, buffers: int
) -> list[str]:
    """What the induction's result says that the committed file does not (empty: the same)."""
    out = []
    if (committed.consumer_streams, committed.staging_buffers) != (streams, buffers):
        out.append(
            f"the file pins {committed.consumer_streams} consumer streams and "
            f"{committed.staging_buffers} staging buffers, the check ran with {streams} and "
            f"{buffers}"
        )
    proved = tuple(p for p, ok in result.proved.items() if ok)
    if sorted(proved) != sorted(committed.proves):
        out.append(f"proves {list(proved)}, the file pins {list(committed.proves)}")
    if sorted(result.vacuous) != sorted(committed.vacuous):
        out.append(f"vacuous {result.vacuous}, the file pins {list(committed.vacuous)}")
    found, pinned = set(result.invariant), set(committed.invariant)
    for clause in sorted(found - pinned):
        out.append(f"the search finds a clause the file lacks: {clause}")
    for clause in sorted(pinned - found):
        out.append(f"the file has a clause the search does not find: {clause}")
    return out


def invariant_text(result: InductionResult, streams: int, buffers: int) -> str:
    def strings(items: list[str] | tuple[str, ...]) -> str:
        return "[\n" + "".join(f'    "{item}",\n' for item in items) + "]"

    proved = [p for p, ok in result.proved.items() if ok]
    lines = [
        "# The inductive invariant of the z3 induction (model_check/z3/induction.py), committed as",
        "# data as TLA+ proofs commit Inv. The checks (`python -m model_check`, the tests) prove",
        "# these clauses inductive for every operation of spec/table.toml and that they exclude",
        "# the violations of the properties in `proves`, under the abstraction below, for any",
        "# number of host calls, experts and slots; and they fail when Houdini's search over the",
        "# template finds a different minimized invariant. spec/README.md says what this covers.",
        f"# Written by `{WRITE_COMMAND}`.",
        "",
        "# Ordering properties proved; `vacuous`: those no step of the table can violate at all.",
        f"proves = {strings(proved)}",
        f"vacuous = {strings(result.vacuous)}",
        "",
        "# One clause a line, in the words of the template of z3/induction.py.",
        f"invariant = {strings(result.invariant)}",
        "",
        "[abstraction]",
        "# The happens-before summary with one followed operation per kind (z3/streams.py) and",
        "# an abstract host (the owner stream, whether a prepare was accepted).",
        f"consumer_streams = {streams}",
        f"staging_buffers = {buffers}",
        "",
    ]
    return "\n".join(lines)
