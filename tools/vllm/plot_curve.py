"""The curve users choose from (issue 21, item 3): batch-1 decode tok/s against GiB of experts on
the GPU, from the e2e phases ``curve`` and ``curve_skew`` (``tools/vllm/e2e.py``).

    python3 tools/vllm/plot_curve.py RECORDS.jsonl [MORE.jsonl | results.json ...] \\
        --out docs/vllm/curve.svg

Reads ``records.jsonl`` (one engine a line) and ``results.json`` files (``e2e.py run`` and
``merge`` write them); a later file's record of an engine replaces an earlier one's. Plots,
on the plain 8-layer checkpoint, vLLM's UVA offload and ``row`` with the device planner as two
lines of points (each ``row`` point labelled with its slots), no offload as a horizontal line,
and the skewed checkpoint's points (``curve.skew.*``; where those are missing, the same engines
of the ``steps_skew`` phase, ``steps.skew.uva675.full`` and ``steps.skew.row32dev.full``, whose
b1 decode is the same measurement) as marked points. The GiB of experts an engine keeps on the
GPU come from its spec (``engines.expert_gib_on_gpu``: 9.0 GiB without offload, 9.0 minus
``cpu_offload_gb``, or ``slots / 128 x 9.0``), not from its memory probe (UVA's offloaded
parameters are device views of host memory and count as GPU tensors there).

Prints the points as a table. Needs matplotlib (a dev dependency of the project,
``pip install -e .[dev]``); without it, it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout on the path for tools.vllm
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from tools.vllm.harness import engines
from tools.vllm.harness.specs import EngineSpec

PLAIN = "curve.plain."
SKEW = "curve.skew."
STEPS_SKEW = "steps.skew."
SKEW_LABELS = ("uva675.full", "row32dev.full")
"""The skewed checkpoint's two plotted engines (labels after the prefix)."""

Record = dict[str, Any]


@dataclass(frozen=True)
class Point:
    """One engine's figure: GiB of experts on the GPU, batch-1 decode tok/s."""

    name: str
    gib: float
    tok_s: float
    label: str
    """What the plot writes beside it (``32``: slots, ``UVA``, ...)."""


@dataclass
class Curve:
    uva: list[Point] = field(default_factory=list)
    row: list[Point] = field(default_factory=list)
    none: Point | None = None
    skew: list[Point] = field(default_factory=list)
    skew_none: Point | None = None
    missing: list[str] = field(default_factory=list)
    """Engines of the phases without a b1 figure (not run, failed), with why."""


def read(paths: list[Path]) -> dict[str, Record]:
    """Every record of ``paths`` by engine name, later files winning."""
    found: dict[str, Record] = {}
    for path in paths:
        text = path.read_text()
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            records = list((data.get("results") or data).values())
        for record in records:
            if isinstance(record, dict) and "name" in record:
                found[str(record["name"])] = record
    return found


def b1(record: Record) -> float | None:
    """The record's batch-1 decode tok/s (a workload's median), or None."""
    decode = ((record.get("steps") or {}).get("decode") or {}).get("1") or {}
    value = decode.get("tok_s")
    return float(value) if isinstance(value, int | float) else None


def point(name: str, record: Record) -> Point:
    spec = EngineSpec.from_json(record["spec"])
    tok_s = b1(record)
    assert tok_s is not None
    if spec.knob is not None and spec.knob.size:
        label = str(spec.knob.size)
    elif spec.offload is not None:
        label = "UVA"
    else:
        label = "no offload"
    return Point(name, round(engines.expert_gib_on_gpu(spec), 4), tok_s, label)


def curve_points(records: dict[str, Record]) -> Curve:
    """The plot's points from the records (see the module docstring)."""
    curve = Curve()
    for name, record in records.items():
        if not (name.startswith(PLAIN) or name.startswith(SKEW)):
            continue
        if b1(record) is None:
            curve.missing.append(f"{name}: {str(record.get('error') or 'no b1 figure')[:120]}")
            continue
        found = point(name, record)
        label = name.split(".", 2)[2]
        if name.startswith(SKEW):
            if label == "none.full":
                curve.skew_none = found
            else:
                curve.skew.append(found)
        elif label == "none.full":
            curve.none = found
        elif label.startswith("uva"):
            curve.uva.append(found)
        elif label.startswith("row"):
            curve.row.append(found)
    have = {p.name.split(".", 2)[2] for p in curve.skew}
    for label in SKEW_LABELS:
        steps = records.get(STEPS_SKEW + label)
        if label not in have and steps is not None and b1(steps) is not None:
            curve.skew.append(point(STEPS_SKEW + label, steps))
    for points in (curve.uva, curve.row, curve.skew):
        points.sort(key=lambda p: (p.gib, p.name))
    return curve


def table(curve: Curve) -> str:
    """The points as text, one a line."""
    lines = [f"{'engine':28} {'expert GiB on GPU':>18} {'b1 tok/s':>9}"]
    everything = [curve.none, *curve.uva, *curve.row, *curve.skew, curve.skew_none]
    for p in everything:
        if p is not None:
            lines.append(f"{p.name:28} {p.gib:>18.2f} {p.tok_s:>9.1f}")
    lines += [f"missing: {m}" for m in curve.missing]
    return "\n".join(lines)


def render(curve: Curve, out: Path, title: str) -> None:
    """Draw ``curve`` into ``out`` (SVG, or what matplotlib makes of the suffix)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(
            "plot_curve.py needs matplotlib (a dev dependency: pip install -e '.[dev]', or "
            f"pip install matplotlib): {exc}"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "rowcache-curve"  # stable ids: diffable SVG
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    if curve.uva:
        ax.plot(
            [p.gib for p in curve.uva],
            [p.tok_s for p in curve.uva],
            "s-",
            color="tab:orange",
            label="vLLM UVA offload (cpu_offload_gb = 9.0 - kept)",
        )
    if curve.row:
        ax.plot(
            [p.gib for p in curve.row],
            [p.tok_s for p in curve.row],
            "o-",
            color="tab:blue",
            label="rowcache row, device planner (slots per layer)",
        )
        for p in curve.row:
            ax.annotate(
                p.label, (p.gib, p.tok_s), textcoords="offset points", xytext=(4, 6), fontsize=8
            )
    if curve.none is not None:
        ax.axhline(
            curve.none.tok_s,
            color="gray",
            linestyle="--",
            label=f"no offload, all {curve.none.gib:g} GiB on the GPU ({curve.none.tok_s:g})",
        )
    for p in curve.skew:
        uva = p.label == "UVA"
        ax.plot(
            [p.gib],
            [p.tok_s],
            marker="*",
            markersize=13,
            linestyle="none",
            markerfacecolor="none",
            markeredgecolor="tab:orange" if uva else "tab:blue",
            label=f"skewed router: {'UVA' if uva else 'row ' + p.label} ({p.tok_s:g})",
        )
    ax.set_xlabel("GiB of experts on the GPU (of 9.0)")
    ax.set_ylabel("decode tok/s, batch 1")
    ax.set_xlim(-0.3, 9.5)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    # Lower right: the one corner no point reaches (the row line climbs to the upper right).
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path, help="records.jsonl / results.json files")
    ap.add_argument("--out", type=Path, default=Path("docs/vllm/curve.svg"))
    ap.add_argument(
        "--title",
        default="8 layers of Qwen3-30B-A3B shapes, bf16, H200, vLLM 0.25.0, full CUDA graphs",
    )
    ns = ap.parse_args(argv)
    curve = curve_points(read(ns.records))
    print(table(curve))
    if not (curve.uva or curve.row or curve.none):
        print("no curve.plain records with a b1 figure: nothing to plot", file=sys.stderr)
        return 1
    render(curve, ns.out, ns.title)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
