"""The steps comparison's part of the summary: one table per checkpoint, tokens against the
same-mode no-offload engine sequence by sequence, and issue 18's targets marked met or missed.

Runs on the host from the records (``results.json`` or ``records.jsonl``; ``e2e.py merge``
combines several calls'), never on the GPU machine's engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.vllm.harness import engines, kernel_profile, model_engines, probe_lines
from tools.vllm.harness.phases import Results

Sequences = list[list[int]]

ROW = "row32dev.full"
UVA = "uva675.full"
PREFETCH = "prefetch.full"
DEVICE_EAGER = "row32dev.eager"
HOST_EAGER = "row32host.eager"
HOST_PLANES = "row32hostplanes.eager"
DEVICE_PIECEWISE = "row32dev.piecewise"
PLANES = "row32planes.full"
MEASURES = ("b1", "b8", "b32", "ttft")


def divergence(ref: Sequences, got: Sequences) -> list[int | None]:
    """Per sequence, the first position where ``got`` differs from ``ref`` (None: identical);
    a shorter sequence differs where it ends, a missing one at 0."""
    out: list[int | None] = []
    for i, want in enumerate(ref):
        have = got[i] if i < len(got) else []
        first = next((p for p, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), None)
        if first is None and len(want) != len(have):
            first = min(len(want), len(have))
        out.append(first)
    return out


def describe(div: list[int | None] | None) -> str:
    """``div`` in a few characters: ``=`` identical, else how many sequences diverge and the
    first positions."""
    if div is None:
        return "n/a"
    bad = [p for p in div if p is not None]
    if not bad:
        return f"= ({len(div)})"
    if len(bad) == 1:
        return f"1/{len(div)} at {bad[0]}"
    return f"{len(bad)}/{len(div)} at {min(bad)}-{max(bad)}"


def steps_of(record: dict[str, Any]) -> dict[str, Any] | None:
    steps: dict[str, Any] | None = record.get("steps")
    return steps


def sequences(record: dict[str, Any], measure: str) -> Sequences | None:
    """The token ids of ``measure`` (b<N>: every sequence's decode; ttft: each prompt's first
    token, as one-token sequences)."""
    steps = steps_of(record)
    if not steps:
        return None
    if measure == "ttft":
        firsts = steps["ttft"].get("first_tokens") or []
        return [[t] for t in firsts] if firsts else None
    entry = steps["decode"].get(measure[1:]) or {}
    found: Sequences | None = entry.get("tokens")
    return found


def compare(results: Results, name: str, ref: str) -> dict[str, list[int | None] | None]:
    """Per measurement, :func:`divergence` of ``name``'s tokens from ``ref``'s."""
    out: dict[str, list[int | None] | None] = {}
    for measure in MEASURES:
        want = sequences(results.get(ref, {}), measure)
        have = sequences(results.get(name, {}), measure)
        out[measure] = None if want is None or have is None else divergence(want, have)
    return out


def speed(record: dict[str, Any], measure: str) -> float | None:
    """tok/s of a decode measurement, or the time to first token in ms."""
    steps = steps_of(record)
    if not steps:
        return None
    if measure == "ttft":
        ms: float | None = steps["ttft"].get("ms")
        return ms
    value: float | None = (steps["decode"].get(measure[1:]) or {}).get("tok_s")
    return value


def _cell(record: dict[str, Any], measure: str) -> str:
    steps = steps_of(record)
    value = speed(record, measure)
    if not steps or value is None:
        return "-"
    entry = steps["ttft"] if measure == "ttft" else steps["decode"].get(measure[1:]) or {}
    runs = len(entry.get("ms_runs") or []) if measure == "ttft" else entry.get("repeats_run", 0)
    return f"{value:g}" + ("" if runs >= 3 else f"({runs})")


def _hits(record: dict[str, Any]) -> str:
    steps = steps_of(record)
    if not steps or not record.get("spec", {}).get("knob"):
        return "-"
    cells = []
    for measure in MEASURES:
        entry = steps["ttft"] if measure == "ttft" else steps["decode"].get(measure[1:]) or {}
        rate = (entry.get("cache") or {}).get("hit_rate")
        cells.append("-" if rate is None else f"{rate:.2f}")
    return "/".join(cells)


def _route(record: dict[str, Any]) -> str:
    routes = (record.get("route") or {}).get("routes") or {}
    backend = backend_of(record)
    found = "; ".join(f"{route} ({n} layers)" for route, n in routes.items())
    if backend is not None and backend != "TRITON/TritonExperts":  # only the unusual ones
        found = f"{found}; " if found else ""
        found += f"MoE backend {backend}"
    return found or "-"


def backend_of(record: dict[str, Any]) -> str | None:
    """The MoE backend and experts class of an engine's MoE layers (``probes.moe_backends``),
    e.g. ``TRITON/TritonExperts``; several joined by ``+``; None where not recorded."""
    found = ((record.get("probe") or {}).get("moe_backend")) or {}
    return "+".join(sorted(found)) if found else None


def prefixes(results: Results) -> list[str]:
    """The checkpoints' name prefixes (``steps.plain``, ``steps.skew``) in first-seen order."""
    found: list[str] = []
    for name, record in results.items():
        if steps_of(record) is not None or name.startswith(("steps.", "models.")):
            prefix = ".".join(name.split(".")[:2])
            if prefix not in found:
                found.append(prefix)
    return found


def reference(results: Results, name: str) -> str:
    spec = results.get(name, {}).get("spec") or {}
    refs = spec.get("compare_with") or []
    return str(refs[0]) if refs else ""


def _title(prefix: str) -> str:
    phase = prefix.split(".")[0]
    titles = {
        "steps": "steps comparison",
        "curve": "the curve",
        "fp8": "FP8 experts",
        "models": "the models people offload",
    }
    return titles.get(phase, phase)


def report(results: Results) -> list[str]:
    lines: list[str] = []
    for prefix in prefixes(results):
        lines += [
            "",
            f"{_title(prefix)}, {prefix} (tok/s; TTFT ms of a 2,048-token prompt; "
            "(n): medians of n < 3; tokens against the same-mode no-offload engine: "
            "'=' identical sequences, else sequences diverging and first positions):",
        ]
        lines.append(
            f"{'engine':16} {'graphs':18} {'b1':>8} {'b8':>8} {'b32':>8} {'TTFT':>8}  "
            f"{'hit b1/b8/b32/ttft':20} {'tokens b1 | b8 | b32 | ttft':40} route"
        )
        for name, record in results.items():
            if not name.startswith(prefix + "."):
                continue
            label = name[len(prefix) + 1 :]
            if not record.get("ok") and not steps_of(record):
                lines.append(f"{label:16} FAILED: {str(record.get('error', '?'))[:160]}")
                continue
            ref = reference(results, name)
            if ref == name:
                tokens = "reference"
            else:
                div = compare(results, name, ref)
                tokens = " | ".join(describe(div[m]) for m in MEASURES)
            lines.append(
                f"{label:16} {record.get('cudagraph_mode', '?')!s:18} "
                + " ".join(f"{_cell(record, m):>8}" for m in MEASURES)
                + f"  {_hits(record):20} {tokens:40} {_route(record)}"
            )
            if not record.get("ok"):
                lines.append(f"{'':16} PARTIAL: {str(record.get('error', '?'))[:160]}")
        lines += kernel_lines(results, prefix)
        lines += targets(results, prefix)
        lines += jit_lines(results, prefix)
    return lines


def jit_lines(results: Results, prefix: str) -> list[str]:
    """The timed measurements that had a Triton kernel built inside one of their runs (a build
    stalls the step it falls in; the figure is a median, so one slow run of three may not move
    it), engine by engine, from each measurement's ``jit_compiles`` (``harness/jit_count``);
    the engines that measured without counting are named; nothing where no record counted
    (records made before the count)."""
    counted = 0
    found: list[str] = []
    uncounted: list[str] = []
    for name, record in results.items():
        steps = steps_of(record) if name.startswith(prefix + ".") else None
        if not steps:
            continue
        label = name[len(prefix) + 1 :]
        measured = [(f"b{b}", e) for b, e in steps.get("decode", {}).items()]
        for measure, entry in [*measured, ("ttft", steps.get("ttft") or {})]:
            built = entry.get("jit_compiles")
            if built is None:
                if entry.get("tok_s") is not None or entry.get("ms") is not None:
                    uncounted.append(f"{label} {measure}")
                continue
            counted += 1
            if built:
                kernels = ", ".join(f"{k} x{built.count(k)}" for k in sorted(set(built)))
                found.append(f"    {label} {measure}: {kernels}")
    if not counted:
        return []
    lines = [f"  Triton builds inside timed runs: none (in {counted} measurements)"]
    if found:
        head = "  Triton builds inside timed runs (each stalls the run it falls in):"
        lines = [head, *found]
    if uncounted:
        lines.append(f"  Triton builds not counted: {', '.join(uncounted)}")
    return lines


KERNEL_COLUMNS = (
    "rowcache gather",
    "rowcache planner",
    "MoE GEMM",
    "MoE align and sort",
    "MoE sum",
    "attention",
    "dense GEMM",
    "copy",
    "elementwise",
)
"""The categories of ``harness/kernel_profile.py`` shown as columns; the rest sum to 'rest'."""


def kernel_lines(results: Results, prefix: str) -> list[str]:
    """One profiled 2,048-token prompt step per engine (``Workload.ttft_kernel_profile``): its
    GPU span, busy time (the union of its activities) and the time of each category, in ms;
    then a b1 decode token's share of them (``Workload.decode_kernel_profile``)."""
    prompt = _kernel_rows(
        _profiles(results, prefix, lambda steps: steps.get("ttft_kernels")), ".2f"
    )
    tokens = _profiles(results, prefix, _decode_token)
    counted = any("misses" in found for _, found in tokens)
    decode = _kernel_rows(tokens, ".3f", misses=counted)
    lines = []
    if prompt:
        lines += [
            "one 2,048-token prompt step on the GPU, by kernel category (ms; busy: the union "
            "of the activities, less than their sum where some ran at once):",
            KERNEL_HEADER,
            *prompt,
        ]
    if decode:
        lines += [
            "a b1 decode token on the GPU, by kernel category (ms: two profiles of the decode "
            "prompt, with its first token and with more, their difference over the tokens more"
            + ("; misses: the cache's, a token):" if counted else "):"),
            f"{KERNEL_HEADER} {'misses':>8}" if counted else KERNEL_HEADER,
            *decode,
        ]
    return lines


KERNEL_HEADINGS = (
    "span",
    "busy",
    "gather",
    "planner",
    "moe_gemm",
    "align",
    "moe_sum",
    "attn",
    "dense",
    "copy",
    "elemwise",
    "rest",
)
"""The kernel tables' columns: the span and busy time, then ``KERNEL_COLUMNS`` and the rest."""
KERNEL_HEADER = f"{'engine':16} " + " ".join(f"{h:>8}" for h in KERNEL_HEADINGS)


def _decode_token(steps: dict[str, Any]) -> dict[str, Any] | None:
    found = steps.get("decode_kernels")
    if not found or "whole" not in found:
        return found  # skipped or failed: said as it is
    return kernel_profile.per_token(found["first"], found["whole"], int(found["tokens"]))


def _profiles(
    results: Results,
    prefix: str,
    profile_of: Callable[[dict[str, Any]], dict[str, Any] | None],
) -> list[tuple[str, dict[str, Any]]]:
    """(label, profile) of every engine of ``prefix`` whose record has one."""
    out = []
    for name, record in results.items():
        if name.startswith(prefix + "."):
            found = profile_of(steps_of(record) or {})
            if found:
                out.append((name[len(prefix) + 1 :], found))
    return out


def _kernel_rows(
    profiles: list[tuple[str, dict[str, Any]]], fmt: str, misses: bool = False
) -> list[str]:
    """One row an engine; ``misses``: then a token's misses where the profile has them."""
    rows = []
    for label, found in profiles:
        if "by_category" not in found:
            why = found.get("skipped") or found.get("error") or "no device activity"
            rows.append(f"{label:16} {str(why)[:120]}")
            continue
        cats = found["by_category"]
        shown = [cats.get(c, {}).get("ms", 0.0) for c in KERNEL_COLUMNS]
        rest = sum(v["ms"] for c, v in cats.items() if c not in KERNEL_COLUMNS)
        row = f"{label:16} {found['span_ms']:>8{fmt}} {found['busy_ms']:>8{fmt}} "
        row += " ".join(f"{v:>8{fmt}}" for v in (*shown, rest))
        if misses and "misses" in found:
            row += f" {found['misses']:>8.1f}"
        rows.append(row)
    return rows


def _ratio(
    results: Results,
    prefix: str,
    measure: str,
    other: str,
    factor: float,
    higher: bool,
    label: str = ROW,
    *,
    verdict: bool = True,
) -> str | None:
    """``label``'s ``measure`` against ``factor`` x ``other``'s: a target line; none where
    either is not measured, and no ratio between records of two runs (``run_id``: the machine,
    its load and vLLM's compilation differ from run to run; records without one are of runs
    made before ids, each merged file one run). ``verdict`` False: the ratio alone, no target
    (``factor`` unused)."""
    mine_record = results.get(f"{prefix}.{label}", {})
    their_record = results.get(f"{prefix}.{other}", {})
    mine, theirs = speed(mine_record, measure), speed(their_record, measure)
    if mine is None or theirs is None or not theirs:
        return None
    runs = (mine_record.get("run_id"), their_record.get("run_id"))
    if runs[0] != runs[1]:
        return (
            f"  {measure} {label} vs {other}: measured in two runs ({runs[0] or 'unnamed'}, "
            f"{runs[1] or 'unnamed'}): no ratio"
        )
    ratio = mine / theirs
    met = ratio >= factor if higher else ratio <= factor
    sign = ">=" if higher else "<="
    unit = "ms" if measure == "ttft" else "tok/s"
    if not verdict:
        return f"  {measure} {label} / {other}: {mine:g} / {theirs:g} {unit} = {ratio:.3f}"
    return (
        f"  {measure} {label} {sign} {factor:g} x {other}: {mine:g} / {theirs:g} {unit} = "
        f"{ratio:.3f} ({'met' if met else 'MISSED'})"
    )


def _token_verdict(results: Results, name: str, measures: tuple[str, ...] = MEASURES) -> str | None:
    """Whether engine ``name``'s tokens are identical to its reference's in ``measures``: met,
    MISSED, or incomplete with what was not measured (None where the engine has no record)."""
    if name not in results or not steps_of(results[name]):
        return None
    compared = compare(results, name, reference(results, name))
    div = {m: d for m, d in compared.items() if m in measures}
    same = all(p is None for d in div.values() if d is not None for p in d)
    missing = [m for m, d in div.items() if d is None]
    verdict = "met" if same and not missing else "MISSED" if not same else "incomplete"
    return verdict + (f" (not measured: {', '.join(missing)})" if missing else "")


def _tokens(
    results: Results,
    prefix: str,
    label: str,
    measures: tuple[str, ...],
    controls: ControlCheck | None = None,
) -> str | None:
    """Whether ``label``'s tokens are identical to its reference's in ``measures``: a target
    line (None where the engine has no record). With ``controls`` (:func:`control_check`) a
    measure is not judged where a control showed the reference differing from itself, nor at
    a batch of 8 or more without a control of the reference's run (no offload itself is not
    reproducible there without one), and the line says which and why."""
    name = f"{prefix}.{label}"
    if name not in results or not steps_of(results[name]):
        return None
    ref = reference(results, name)
    unjudged = controls.unjudged(ref, measures) if controls is not None else {}
    judged = tuple(m for m in measures if m not in unjudged)
    verdict = _token_verdict(results, name, judged) if judged else None
    line = f"  tokens {label} identical to {ref[len(prefix) + 1 :]}"
    line += f" ({', '.join(judged)}): {verdict}" if judged else ": not judged"
    for measure in (m for m in measures if m in unjudged):
        line += f"; {measure} not judged: {unjudged[measure]}"
    return line


BATCHED = ("b8", "b32")
"""The measures whose token comparison needs a control: vLLM without offload is not
reproducible from run to run at b32 (and is not known to be at b8) outside its
batch-invariant mode."""


@dataclass(frozen=True)
class ControlCheck:
    """What the controls (a reference engine run again) say of each reference: the measures
    where one gave other tokens (with its label), and those a control of the reference's own
    run measured at all."""

    differs: dict[str, dict[str, str]]
    measured: dict[str, set[str]]

    def unjudged(self, ref: str, measures: tuple[str, ...]) -> dict[str, str]:
        """The measures of ``measures`` not to judge against ``ref``, each with why."""
        out: dict[str, str] = {}
        for measure in measures:
            control = self.differs.get(ref, {}).get(measure)
            if control is not None:
                out[measure] = f"the control {control} differs from its reference there"
            elif measure in BATCHED and measure not in self.measured.get(ref, set()):
                out[measure] = "no control of its reference in this run"
        return out


def control_check(results: Results, prefix: str, controls: tuple[str, ...]) -> ControlCheck:
    """:class:`ControlCheck` of ``controls`` (labels): a control counts only where it ran in
    its reference's run (``run_id``: merged results hold several)."""
    differs: dict[str, dict[str, str]] = {}
    measured: dict[str, set[str]] = {}
    for label in controls:
        name = f"{prefix}.{label}"
        if name not in results or not steps_of(results[name]):
            continue
        ref = reference(results, name)
        if results[name].get("run_id") != results.get(ref, {}).get("run_id"):
            continue
        for measure, found in compare(results, name, ref).items():
            if found is None:
                continue
            measured.setdefault(ref, set()).add(measure)
            if any(p is not None for p in found):
                differs.setdefault(ref, {})[measure] = label
    return ControlCheck(differs, measured)


FP8_UVA = engines.FP8_UVA_LABEL
FP8_ROW128 = engines.row_label(128)
FP8_DEFAULT = engines.FP8_DEFAULT_LABEL


def fp8_targets(results: Results, prefix: str) -> list[str]:
    """Issue 22's targets for an FP8 checkpoint: 128 slots >= 0.9 x no offload; 32 slots >=
    1.3 x UVA at the same expert memory (plain), >= 3 x (skewed); tokens identical to no
    offload (block scales at b1 and b8, online per-tensor at b1); the planner the plugin chose
    where only the slot count was set; the MoE backend of each engine."""
    factor = 3.0 if prefix.endswith("skew") else 1.3
    wanted = []
    for measure in ("b1", "b8"):
        wanted += [
            (measure, "none.full", 0.9, True, FP8_ROW128),
            (measure, FP8_UVA, factor, True, ROW),
        ]
    lines = [line for w in wanted if (line := _ratio(results, prefix, *w)) is not None]
    for label in (ROW, FP8_ROW128, FP8_UVA, FP8_DEFAULT):
        line = _tokens(results, prefix, label, ("b1", "b8"))
        lines += [line] if line is not None else []
    line = _tokens(results, prefix, "online." + ROW, ("b1",))
    lines += [line] if line is not None else []
    line = _default_planner(results, prefix)
    lines += [line] if line is not None else []
    for name, record in results.items():
        if name.startswith(prefix + "."):
            logged = "; ".join(record.get("moe_backend_log") or []) or "no log line"
            lines.append(
                f"  MoE backend {name[len(prefix) + 1 :]}: {backend_of(record) or '?'} "
                f"(vLLM: {logged[:200]})"
            )
    return [f"targets ({prefix}, issue 22):", *lines] if lines else []


def _default_planner(results: Results, prefix: str) -> str | None:
    """Which planner the plugin chose for the engine that set the slot count alone
    (``FP8_DEFAULT``): block-scaled FP8 in full graphs defaults to the device planner."""
    record = results.get(f"{prefix}.{FP8_DEFAULT}")
    if record is None or record.get("error"):
        return None
    planners = (record.get("route") or {}).get("planners") or {}
    layers = sum(planners.values())
    device = planners.get("device", 0)
    verdict = "met" if layers and device == layers else "MISSED"
    found = ", ".join(f"{name} {n}" for name, n in sorted(planners.items())) or "none recorded"
    return f"  default planner of {FP8_DEFAULT}: device in every layer ({found}): {verdict}"


def models_targets(results: Results, prefix: str) -> list[str]:
    """Issue 34's targets for one model: ``row`` at about a quarter of the experts on the GPU
    decodes b1 at >= 1.3 x UVA at the same memory (>= 3 x on the skewed router), its time to
    first token <= 0.8 x UVA's; the half budget's ratios beside them (no target); tokens of
    every engine identical to no offload at b1, b8 and on the prompts; every cache engine's
    slots exact."""
    checkpoint = next(c for c, p in model_engines.MODELS_PREFIX.items() if p == prefix)
    budget = model_engines.MODEL_BUDGETS[checkpoint]
    row_q, uva_q, row_h, uva_h = model_engines.model_roles(budget)
    factor = 3.0 if checkpoint.router_skew else 1.3
    wanted = [
        ("b1", uva_q, factor, True, row_q),
        ("ttft", uva_q, 0.8, False, row_q),
        ("b8", uva_q, 1.0, True, row_q),
        ("b1", uva_h, 1.0, True, row_h),
        ("b8", uva_h, 1.0, True, row_h),
        ("ttft", uva_h, 1.0, False, row_h),
    ]
    lines = [line for w in wanted if (line := _ratio(results, prefix, *w)) is not None]
    if lines:
        lines.insert(0, "  (the quarter's b1 and TTFT are issue 34's targets; the rest parity)")
    baseline = budget.baseline
    if baseline is not None and any(
        name.startswith(prefix + ".")
        and (record.get("spec") or {}).get("moe_backend") == baseline.backend
        for name, record in results.items()
    ):
        lines.insert(
            0,
            f"  (UVA on vLLM's {baseline.backend} MoE backend, where it offloads this "
            "model's experts; the cache and its reference on the backend it serves)",
        )
    quarter = budget.slots(model_engines.QUARTER)
    lfu, raw = engines.lfu_label(quarter), engines.lfu_raw_label(quarter)
    if budget.planes:
        versus = [("b1", lfu, 1.0, True, raw), ("b1", uva_q, 1.0, True, raw)]
        found = [
            line for w in versus if (line := _ratio(results, prefix, *w, verdict=False)) is not None
        ]
        if found:
            lines += ["  (the quarter's lfu on raw bytes: against its planes and UVA, no target)"]
            lines += found
    lines += offloaded_lines(results, prefix, budget)
    lines += link_lines(results, prefix, budget)
    eager = model_engines.eager_label(budget.slots(model_engines.HALF))  # on demand only
    cached = (row_q, row_h, lfu, *((raw,) if budget.planes else ()), eager)
    controls = model_engines.controls(budget)
    checked = control_check(results, prefix, controls)
    for label in controls:
        line = _tokens(results, prefix, label, ("b1", "b8", "ttft"))
        lines += [line] if line is not None else []
    bare = (model_engines.BARE_REFERENCE,) if budget.scale_guard else ()  # on demand only
    for label in (uva_q, uva_h, *cached, *bare):
        line = _tokens(results, prefix, label, ("b1", "b8", "ttft"), checked)
        lines += [line] if line is not None else []
    for label in cached:
        lines += probe_lines.of_record(
            results.get(f"{prefix}.{label}"),
            label,
            probe_lines.slots_line,
            probe_lines.exactness_line,
            probe_lines.placement_line,
            probe_lines.shadow_line,
        )
    for label in (*controls, uva_q, uva_h, *cached):
        lines += probe_lines.of_results(results, prefix, label, probe_lines.trace_line)
    for label in cached:
        lines += probe_lines.of_results(
            results,
            prefix,
            label,
            probe_lines.replay_line,
            probe_lines.slot_watch_line,
            probe_lines.expert_bytes_line,
        )
    references = ("none.full", *bare, *controls, model_engines.EAGER_REFERENCE)
    for label in (*references, *cached):
        lines += probe_lines.of_record(
            results.get(f"{prefix}.{label}"),
            label,
            probe_lines.scale_guard_line,
            probe_lines.scale_tails_line,
        )
    return [f"targets ({prefix}, issue 34):", *lines] if lines else []


def link_lines(results: Results, prefix: str, budget: model_engines.ModelBudget) -> list[str]:
    """Where each engine's b1 token goes over the link (no target), measured against its
    no-offload reference of the same run: a cache engine's misses a token (the decode prompt's
    prefill included) times the host bytes of one expert (the probe's expert host bytes over its
    layers and ``budget.experts``: planes where it holds planes, so the bytes the link moves); a
    UVA engine's offloaded layers times ``budget.top_k`` routed experts of its backend's size
    (vLLM's MoE kernels read only the routed experts; its prompt's prefill reads not counted);
    each moved in the time its token takes beyond the reference's. Then every cache engine's
    bytes a token against those of UVA at its budget: where the cache moves as many, only a
    faster rate than UVA's would make it faster."""
    lines, moved = [], {}
    for name, record in results.items():
        if not name.startswith(prefix + "."):
            continue
        found = _b1_link(results, prefix, name, record, budget)
        if found is not None:
            moved[name[len(prefix) + 1 :]], line = found
            lines.append(line)
    row_q, uva_q, row_h, uva_h = model_engines.model_roles(budget)
    quarter = budget.slots(model_engines.QUARTER)
    pairs = [(row_q, uva_q), (row_h, uva_h), (engines.lfu_label(quarter), uva_q)]
    pairs += [(engines.lfu_raw_label(quarter), uva_q)] if budget.planes else []
    for cache, uva in pairs:
        if moved.get(cache) and moved.get(uva):
            lines.append(
                f"  b1 {cache} moves {moved[cache] / moved[uva]:.2f} x the bytes {uva} reads a "
                "token (the cache's prefill misses included; no target)"
            )
    return lines


def _b1_link(
    results: Results,
    prefix: str,
    name: str,
    record: dict[str, Any],
    budget: model_engines.ModelBudget,
) -> tuple[float, str] | None:
    """The bytes an engine's b1 decode token moves over the link and its line
    (:func:`link_lines`); None for an engine that moves none, or without the figures, or whose
    reference ran in another run."""
    spec = record.get("spec") or {}
    other = (spec.get("compare_with") or [""])[0]
    reference_record = results.get(other) or {}
    entry = ((steps_of(record) or {}).get("decode") or {}).get("1") or {}
    mine, theirs = speed(record, "b1"), speed(reference_record, "b1")
    if not (mine and theirs) or record.get("run_id") != reference_record.get("run_id"):
        return None  # no figure between two runs
    offload = spec.get("offload") or {}
    if "cache" in record:
        probe = record.get("probe") or {}
        counts = entry.get("cache") or {}
        layers, host = probe.get("cached_layers"), probe.get("expert_host_bytes")
        decode_tokens = (spec.get("workload") or {}).get("decode_tokens")
        tokens = (entry.get("batch") or 0) * (decode_tokens or 0) * (entry.get("repeats_run") or 0)
        if not (layers and host and tokens and "misses" in counts):
            return None
        per_token = counts["misses"] / tokens
        miss_bytes = host / (layers * budget.experts)
        moved = per_token * miss_bytes
        what = f"{per_token:.1f} misses a token (its prefill included) x {miss_bytes / 1e6:.2f} MB"
    elif offload.get("backend") == "uva":
        backend = spec.get("moe_backend")
        asked = float(offload["cpu_offload_gb"])
        if _kept_beyond_offload(record, budget) is not False:
            return None  # not probed, or vLLM offloaded less than asked (offloaded_lines)
        layers = budget.uva_offloaded_layers(asked, backend)
        expert = budget.expert_bytes(backend)
        moved = layers * budget.top_k * expert
        what = (
            f"reads {layers} offloaded layers x {budget.top_k} routed experts x "
            f"{expert / 1e6:.2f} MB a decode token (its prefill's reads not counted)"
        )
    else:
        return None
    token_ms, reference_ms = 1000 / mine, 1000 / theirs
    line = (
        f"  b1 {name.removeprefix(prefix + '.')}: {what} = {moved / 1e9:.3f} GB, in "
        f"{token_ms:.2f} ms against {other.removeprefix(prefix + '.')}'s {reference_ms:.2f} ms"
    )
    if moved > 0 and token_ms > reference_ms:
        line += f": {moved / (token_ms - reference_ms) / 1e6:.1f} GB/s beside its work"
    return moved, line + " (no target)"


def _kept_beyond_offload(record: dict[str, Any], budget: model_engines.ModelBudget) -> bool | None:
    """For a UVA engine whose experts the probe counted: whether it kept more of them on the
    GPU than its ``cpu_offload_gb`` leaves (vLLM offloaded less than asked); None for any other
    engine, or one not probed."""
    spec = record.get("spec") or {}
    offload = spec.get("offload") or {}
    kept = (record.get("probe") or {}).get("expert_gpu_bytes")
    if kept is None or offload.get("backend") != "uva":
        return None
    asked = float(offload["cpu_offload_gb"])
    allowed = budget.uva_kept_gib(asked, spec.get("moe_backend")) * 2**30
    return bool(kept > allowed * 1.01)


def offloaded_lines(results: Results, prefix: str, budget: model_engines.ModelBudget) -> list[str]:
    """A line for every UVA engine of ``prefix`` that kept more of the experts on the GPU than
    its ``cpu_offload_gb`` leaves (vLLM offloaded less than asked, or nothing: on gpt-oss's
    triton_unfused backend the swizzled experts are new GPU tensors that nothing offloads
    again): its ratios compare with an engine that holds the experts on the GPU."""
    lines = []
    for name, record in results.items():
        if not name.startswith(prefix + ".") or not _kept_beyond_offload(record, budget):
            continue
        spec = record["spec"]
        kept = record["probe"]["expert_gpu_bytes"] / 2**30
        asked = float(spec["offload"]["cpu_offload_gb"])
        allowed = budget.uva_kept_gib(asked, spec.get("moe_backend"))
        lines.append(
            f"  {name[len(prefix) + 1 :]} kept {kept:.2f} GiB of experts on the GPU "
            f"against the {allowed:.2f} GiB its offload leaves: vLLM did not "
            "offload them, and its ratios compare with an engine that holds them on the GPU"
        )
    return lines


def targets(results: Results, prefix: str) -> list[str]:
    """The targets for this checkpoint, where both engines have the figure: issue 18's for the
    steps comparison, issue 22's for FP8 (:func:`fp8_targets`), issue 34's for the models
    (:func:`models_targets`); the curve has none (its plot is ``tools/vllm/plot_curve.py``)."""
    if prefix.startswith("fp8."):
        return fp8_targets(results, prefix)
    if prefix.startswith("models."):
        return models_targets(results, prefix)
    if not prefix.startswith("steps."):
        return []
    if prefix.endswith("skew"):
        wanted = [("b8", UVA, 2.0, True), ("b32", UVA, 2.0, True), ("b1", UVA, 4.0, True)]
    else:
        wanted = [
            ("b8", UVA, 0.95, True),
            ("b32", UVA, 0.95, True),
            ("ttft", UVA, 0.8, False),
            ("ttft", PREFETCH, 1.0, False),
            ("b1", UVA, 1.3, True),
        ]
    # The eager default's speed claim (rowcache.vllm.defaults.EAGER_NOT_SLOWER): the device
    # planner at batch 1 at least as fast as the host planner, same slots, same run.
    lines = [line for w in wanted if (line := _ratio(results, prefix, *w)) is not None]
    eager = _ratio(results, prefix, "b1", HOST_EAGER, 1.0, True, DEVICE_EAGER)
    lines += [eager] if eager is not None else []
    for label in ("none2.full", ROW, DEVICE_EAGER, HOST_EAGER, DEVICE_PIECEWISE):
        verdict = _token_verdict(results, f"{prefix}.{label}")
        if verdict is None:
            continue
        what = " (the control: a second no-offload engine)" if label == "none2.full" else ""
        lines.append(f"  tokens {label} identical to no offload{what}: {verdict}")
    for label in (ROW, DEVICE_EAGER, HOST_EAGER, DEVICE_PIECEWISE):
        lines += probe_lines.of_record(
            results.get(f"{prefix}.{label}"),
            label,
            probe_lines.exactness_line,
            probe_lines.shadow_line,
        )
    issue_18 = [f"targets ({prefix}, issue 18):", *lines] if lines else []
    return issue_18 + planes_targets(results, prefix)


def planes_targets(results: Results, prefix: str) -> list[str]:
    """Issue 36's targets for the experts held as bf16 planes (``row32planes.full``), against
    UVA at the same expert memory: plain b1 >= 1.7 x, b8 >= 1.25 x, b32 >= 1.2 x, the
    2,048-token prompt in <= 0.6 x UVA's time and <= 0.85 x the prefetch offloader's; skewed
    b32 >= 2 x. Beside them the planes against the same cache copying raw bytes
    (``row32dev.full``: no target, the gain of the format alone), the tokens, the slot audit and
    the in-engine exactness."""
    host = host_planes_lines(results, prefix)
    if f"{prefix}.{PLANES}" not in results:
        if not host:
            return []
        return [f"targets ({prefix}, issue 36):", *host, *host_memory_lines(results, prefix)]
    if prefix.endswith("skew"):
        wanted = [("b32", UVA, 2.0, True)]
    else:
        wanted = [
            ("b1", UVA, 1.7, True),
            ("b8", UVA, 1.25, True),
            ("b32", UVA, 1.2, True),
            ("ttft", UVA, 0.6, False),
            ("ttft", PREFETCH, 0.85, False),
        ]
    lines = [line for w in wanted if (line := _ratio(results, prefix, *w, PLANES)) is not None]
    gains = [(m, ROW, 1.0, m != "ttft") for m in MEASURES]
    found = [line for w in gains if (line := _ratio(results, prefix, *w, PLANES)) is not None]
    if found:
        lines += ["  (against the raw-byte cache: no target)", *found]
    verdict = _token_verdict(results, f"{prefix}.{PLANES}")
    if verdict is not None:
        lines.append(f"  tokens {PLANES} identical to no offload: {verdict}")
    lines += probe_lines.of_record(
        results.get(f"{prefix}.{PLANES}"),
        PLANES,
        probe_lines.slots_line,
        probe_lines.exactness_line,
    )
    lines += host_memory_lines(results, prefix)
    lines += host
    return [f"targets ({prefix}, issue 36):", *lines] if lines else []


def host_planes_lines(results: Results, prefix: str) -> list[str]:
    """The host planner's planes (``row32hostplanes.eager``: decoded in its copy step) against
    its raw bytes in eager mode (``row32host.eager``; no target: what a default for the host
    planner would need at every measure), its tokens against no offload in eager mode, the slot
    audit and the in-engine exactness."""
    name = f"{prefix}.{HOST_PLANES}"
    if name not in results:
        return []
    gains = [(m, HOST_EAGER, 1.0, m != "ttft") for m in MEASURES]
    found = [line for w in gains if (line := _ratio(results, prefix, *w, HOST_PLANES)) is not None]
    lines = ["  (the host planner's planes against its raw bytes, eager: no target)", *found]
    verdict = _token_verdict(results, name)
    if verdict is not None:
        lines.append(f"  tokens {HOST_PLANES} identical to no offload: {verdict}")
    lines += probe_lines.of_record(
        results.get(name), HOST_PLANES, probe_lines.slots_line, probe_lines.exactness_line
    )
    return lines


def host_memory_lines(results: Results, prefix: str) -> list[str]:
    """What the cache engines pin (no target): the providers' host bytes, and where the probe
    recorded them, the caching host allocator's pinned bytes and the layers whose w13/w2 were
    released (``probes.pinned_host_memory``)."""
    out = []
    for label in (ROW, PLANES, HOST_PLANES):
        probe = (results.get(f"{prefix}.{label}") or {}).get("probe") or {}
        if "expert_host_bytes" not in probe:
            continue
        line = f"  host memory of {label}: experts {probe['expert_host_bytes'] / 1e9:.2f} GB"
        if probe.get("host_pinned_bytes") is not None:
            line += f", pinned in all {probe['host_pinned_bytes'] / 1e9:.2f} GB"
            arena, transient = (
                probe.get("host_pinned_arena_bytes"),
                probe.get("host_pinned_transient_bytes"),
            )
            if arena is not None and transient is not None:
                line += (
                    f" (arena slabs {arena / 1e9:.2f} GB, transient slabs "
                    f"{transient / 1e9:.2f} GB, other "
                    f"{(probe['host_pinned_bytes'] - arena - transient) / 1e9:.2f} GB)"
                )
        if "released_layers" in probe:
            line += f", layers released {probe['released_layers']}"
        out.append(line + " (no target)")
    return out
