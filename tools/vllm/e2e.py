"""End-to-end run of the rowcache vLLM plugin on a GPU machine (issue 5, section 5).

    python3 tools/vllm/e2e.py run --out OUTDIR [--phases tiny,mp,qwen8,story] [--profile]
        [--deadline S] [--work DIR] [--only LABEL,...] [--resume] [--repeats N]
    python3 tools/vllm/e2e.py merge --out OUTDIR A/results.json B/records.jsonl ...

(or ``python3 -m tools.vllm.e2e ...`` from the repository root). One device call is limited to
about 9.5 minutes, so the phases run in several calls (each after the bundle's assemble step
and ``export`` line, see docs/RUNNING.md), each under its own deadline and writing its own $OUT:

    # call A: tiny model, the multi-process engine, the 24-layer user story
    python3 tools/vllm/e2e.py run --out $OUT --phases tiny,mp,story --deadline $((540 - SECONDS))
    # call B: the 8-layer Qwen3-30B-A3B-shaped engines, with profiles of (b) and (c)
    python3 tools/vllm/e2e.py run --out $OUT --phases qwen8 --profile --deadline $((540 - SECONDS))
    # budgeted phases (steps, curve, fp8, ...): the same command again on the warm machine
    # runs only the engines not yet complete
    python3 tools/vllm/e2e.py run --out $OUT --phases curve --resume --deadline $((540 - SECONDS))

and, here, one summary of both: ``python3 tools/vllm/e2e.py merge --out merged
A/results.json B/results.json`` (``merge`` needs no GPU and no vLLM).

Phases (``--help`` lists them; ``harness/phases.py`` defines them, ``harness/engines.py``,
``harness/model_engines.py`` and ``harness/reruns.py`` their engines):

* ``tiny``: a 2-layer, 16-expert, top-4 Qwen3-MoE with random weights; 4 token-id prompts x 32
  greedy tokens; eager and piecewise-graph modes; no cache, ``cached`` and ``row`` with the
  token split and 6 slots (fewer than the experts a step uses), ``row`` with the expert split;
  two more engines under VLLM_LOGGING_LEVEL=DEBUG, where vLLM asserts that every captured piece
  is replayed with its capture-time input addresses: vLLM's MoE op made a splitting op as is,
  and the same with the plugin's capture-stable output.
* ``split``: the tiny model's piecewise cache engines (``cached``/``row`` token, ``row`` expert)
  again, next to their same-mode reference ``tiny.piecewise.eager_moe`` (no cache, the MoE op
  eager between captured pieces), which they are compared with.
* ``qwen8seq``: (b) and (c) ``row`` 128 of the ``qwen8`` phase again, each engine started and
  run alone.
* ``mp``: the tiny model in vLLM's default multi-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=1:
  the engine core, and with it the plugin and the model, in a process of its own), eager,
  ``row`` with the token split and 6 slots; its tokens are compared with the tiny phase's eager
  no-cache engine (or, without the tiny phase, an in-process eager no-cache engine started in
  this phase), its provider stats come back through ``llm.apply_model(expert_cache_stats)``
  across the process boundary (a failure there is recorded, the tokens still are).
* ``qwen8``: 8 layers with Qwen3-30B-A3B layer shapes, batch 1, 256 greedy tokens, medians of
  three: (a) no cache, full graphs; (b) no cache, MoE op eager between captured pieces (the
  plugin's baseline mode), with eager and vLLM's own piecewise-with-MoE-split as references;
  (c) ``cached``/``row`` with 128 slots (every expert stays resident); (d) ``cached``/``row``
  with 32 slots. With ``--profile``, (b), (c) ``row`` and (c) ``cached`` then generate 64 more
  greedy tokens twice, still holding the timing lock: once with only the MoE path's functions
  wrapped in ``perf_counter`` timers (little overhead), once under cProfile. Each writes
  OUTDIR/profile_<engine>.txt (per-forward breakdown from both, callees of the MoE functions,
  top 40 functions by cumulative and by self time) and OUTDIR/profile_<engine>.pstats.
* ``rerun``: the 2026-11-29 second run: ``tiny.piecewise.eager_moe`` with and without an identity
  ``expert_map``, and the ``qwen8`` engines (b) (also with an identity ``expert_map``), (c)
  ``row`` and (d) in one phase.
* ``steps``, ``steps_skew``: the steps comparison (issue 18, item 4) on the 8-layer
  checkpoint, plain and built with ``--router-skew 1.0``: one engine at a time, each measuring
  b1, b8 and b32 decode of 256 greedy tokens (medians of three) and the time to first token of
  three distinct 2,048-token prompts (``harness/measure.py``) before a deadline of its own
  (``orchestrate.engine_deadline``); engines ``none.full``, ``none2.full`` (the control),
  ``row32dev.full``, ``uva675.full``, ``none.eager``, ``row32dev.eager``, ``row32host.eager``,
  ``prefetch.full``, ``none.piecewise``, ``row32dev.piecewise`` (``engines.STEPS_LABELS``, in
  that order; ``--only`` picks some, ``--resume`` skips those an earlier call on the
  same machine completed; with ``--profile`` the eager engines are profiled as ``qwen8``'s
  are, after their measurements). Each engine's record goes to OUTDIR/records.jsonl as it ends; the
  summary compares tokens sequence by sequence and marks issue 18's targets
  (``harness/steps_report.py``).
* ``curve``, ``curve_skew``: the curve users choose from (issue 21, item 3) on the 8-layer
  checkpoint, plain and skewed: one engine at a time (budgeted as ``steps``), each measuring
  b1 decode of 256 greedy tokens (medians of three) in full graphs: no offload; vLLM's UVA
  offload keeping 0, 2.25, 4.5 and 6.75 of the 9.0 GiB of experts on the GPU
  (``cpu_offload_gb`` 9.0, 6.75, 4.5, 2.25); ``row`` with the device planner at 8, 16, 32, 64
  and 128 slots (``engines.curve``, most important first: no offload, row 32, UVA 6.75, then
  the ends). The skewed checkpoint runs its two plotted points (row 32, UVA 6.75) and its no
  offload. ``tools/vllm/plot_curve.py`` draws the records.
* ``fp8``, ``fp8_skew``: FP8 experts (issue 22) on the 8-layer checkpoint stored in FP8 with
  128 x 128 block scales (``make_moe_checkpoint.py --fp8-block``), plain and skewed: no
  offload, UVA at the expert memory of 32 slots (3.375 GiB offloaded), ``row`` with the device
  planner at 32 and 128 slots, each measuring b1 and b8 decode (``engines.fp8``); on the plain
  one also online FP8 (``quantization="fp8"`` on the bf16 checkpoint) at b1, no offload and
  ``row`` 32, and ``row`` 32 with the slot count alone set (``row32default.full``: the
  plugin's default planner, recorded per layer and marked in the summary). Every record
  carries the MoE backend vLLM chose (``probe.moe_backend`` from the method,
  ``moe_backend_log`` from vLLM's log line); the summary marks issue 22's targets.
* ``archs``: random Mixtral and Qwen2-MoE checkpoints (``make_moe_checkpoint.py --arch``) in
  full graphs: no offload and ``row`` with the device planner at a slot count that misses and
  one whose decode steps need more than one pass (``engines.archs``), tokens against the same
  checkpoint's no-offload engine.
* ``story``: 24 layers of those shapes (about 30 GB of weights) under a GPU budget of
  ``gpu_memory_utilization`` 0.10: no cache (expected not to start), then ``row`` with 32 slots.

Each engine is a child process of this script (``e2e.py child JOB.json``,
``harness/child.py``); ``harness/orchestrate.py`` starts them, phase by phase, and collects
their results. An engine that starts alone is forked from ``e2e.py zygote``, a process that
imported vLLM once for the call (``harness/zygote.py``; ``--no-zygote``: every engine a fresh
process). Writes OUTDIR/results.json, OUTDIR/summary.txt and OUTDIR/logs.tar.gz and
prints the summary (``harness/summary.py``).

The modules are imported from this checkout (``tools/``), put last on ``sys.path``: rowcache
itself comes from wherever it is installed (on the GPU machine, the wheel under test on
PYTHONPATH), also under ``python -m`` from the checkout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_path() -> None:
    """Make ``tools`` importable from the end of ``sys.path`` (and check that it is ours)."""
    if sys.path and Path(sys.path[0] or ".").resolve() == ROOT:
        sys.path.append(sys.path.pop(0))  # ``python -m`` put the checkout first
    elif str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    import tools

    found = Path(tools.__file__ or "").resolve().parent
    if found != ROOT / "tools":
        raise SystemExit(f"e2e.py: the module 'tools' is {found}, not this checkout's")


def main(argv: list[str] | None = None) -> int:
    _import_path()
    from tools.vllm.harness import child, engines, orchestrate, phases, register_probe

    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "child":
        child.main(args[1])  # leaves through os._exit
        return 0
    if args[:1] == ["zygote"]:
        from tools.vllm.harness import zygote

        return zygote.serve(
            zygote.preload_vllm, child.main, zygote.cuda_canary, sys.stdin, sys.stdout
        )
    if len(args) >= 2 and args[0] == "register-probe":
        register_probe.main(args[1], fused_moe_first="--fused-moe-first" in args[2:])
        return 0
    profiled = [spec.name for spec in engines.qwen8() + engines.steps() if spec.profiled]
    ap = argparse.ArgumentParser(
        prog="e2e.py",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="phases, in the order they run: "
        + "; ".join(f"{phase.name}: {phase.about}" for phase in phases.PHASES),
    )
    ap.add_argument("mode", choices=["run", "merge"])
    ap.add_argument("inputs", nargs="*", help="merge: the results.json files to merge")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/rc-e2e")
    ap.add_argument("--phases", default=phases.DEFAULT_PHASES)
    ap.add_argument(
        "--profile",
        action="store_true",
        help=f"qwen8 and steps: profile {', '.join(profiled)} after their timed runs",
    )
    ap.add_argument("--deadline", type=float, default=540.0)
    ap.add_argument(
        "--only",
        default="",
        help="budgeted phases (steps, curve, fp8, the models and their _skew): these engines "
        "only, by label (" + ", ".join(phases.BUDGETED_LABELS) + ")",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="budgeted phases (steps, curve, fp8, the models and their _skew): skip the "
        "engines whose complete records an earlier call on this machine left in "
        "WORK/records.jsonl (and include them)",
    )
    ap.add_argument(
        "--no-zygote",
        action="store_true",
        help="start every engine as a fresh process (default: engines that start alone are "
        "forked from one process that imported vLLM once for the call)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="budgeted phases: every engine measures each batch size and prompt this many "
        "times (default: the phase's, three); 1 is complete at one repeat for --resume",
    )
    ap.add_argument(
        "--shadow",
        action="store_true",
        help="budgeted phases: every cache engine runs vLLM's kernel over the whole expert "
        "set beside each cached forward and counts the forwards whose bits differ, eager and "
        "in CUDA graphs (harness/shadow.py): a diagnostic; its engines' speeds are not the "
        "cache's",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="budgeted phases: every engine keeps digests of each MoE layer's input, routes "
        "and output over its first generation (harness/trace.py); the summary names the first "
        "forward where a cache engine's differ from its no-offload reference's; a cache "
        "engine also checks at every prepare that each mapped slot holds its expert's bytes "
        "(harness/slot_watch.py) (its engines' speeds are not for comparison)",
    )
    ns = ap.parse_intermixed_args(args)  # merge: files after --out too
    if ns.mode == "merge":
        if not ns.inputs:
            ap.error("merge needs one or more results.json or records.jsonl files")
        return orchestrate.merge(ns.inputs, ns.out)
    only = tuple(label for label in ns.only.split(",") if label)
    unknown = sorted(set(only) - set(phases.BUDGETED_LABELS))
    if unknown:
        known = ", ".join(phases.BUDGETED_LABELS)
        ap.error(f"--only: unknown engines {unknown}; known: {known}")
    if ns.repeats is not None and ns.repeats < 1:
        ap.error(f"--repeats: must be at least 1, got {ns.repeats}")
    return orchestrate.run(
        Path(ns.out),
        Path(ns.work),
        ns.phases.split(","),
        ns.profile,
        ns.deadline,
        only,
        ns.resume,
        ns.repeats,
        not ns.no_zygote,
        shadow=ns.shadow,
        trace=ns.trace,
    )


if __name__ == "__main__":
    sys.exit(main())
