"""The e2e harness's phases of the models people offload (issue 34): DeepSeek-V2-Lite's engines
and budgets, its checkpoints' build commands (the skewed twin's hard links), the targets in
the summary on synthetic records (met and missed), the slot audit's line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tools.vllm import deepseek_layout as dl
from tools.vllm import make_moe_checkpoint as mk
from tools.vllm import shards
from tools.vllm.harness import (
    checkpoints,
    engines,
    model_engines,
    orchestrate,
    phases,
    probe_lines,
    steps_report,
)
from tools.vllm.harness.specs import EngineSpec, Mode, OffloadBackend, Planner


def test_budget_of_deepseek_v2_lite_is_its_checkpoints() -> None:
    config = dl.config("deepseek_v2", None)
    plan = mk.sharded_plan("deepseek_v2", config)
    experts = sum(shards.nbytes(*v) for n, v in plan.items() if ".experts." in n)
    budget = model_engines.DS2_BUDGET
    assert budget.expert_gib * 2**30 == experts
    assert (budget.experts, budget.moe_layers) == (64, len(dl.moe_layers(config)))
    # A quarter: 16 slots; UVA keeps 7 of 26 layers (at least the slots' memory).
    assert budget.slots(0.25) == 16 and budget.slots(0.5) == 32
    per_layer = budget.expert_gib / 26
    assert budget.uva_offloaded_gib(0.25) == 19 * per_layer
    assert budget.uva_offloaded_gib(0.5) == 13 * per_layer


def test_uva_keeps_at_least_the_slots_memory_and_stops_at_a_layer_boundary() -> None:
    """vLLM's UVA offloader takes parameters (w13, then w2 of each layer) while its total is
    below the limit: with the limit at whole layers it stops exactly there."""
    budget = model_engines.DS2_BUDGET
    per_layer = 2**30 * budget.expert_gib / budget.moe_layers
    w13 = per_layer * 2 / 3
    for fraction in (0.25, 0.5):
        limit = int(budget.uva_offloaded_gib(fraction) * 2**30)
        offloaded = 0.0
        for _layer in range(budget.moe_layers):
            for size in (w13, per_layer - w13):
                if offloaded >= limit:
                    break
                offloaded += size
        assert offloaded == limit
        on_gpu = budget.expert_gib - offloaded / 2**30
        assert on_gpu >= budget.expert_gib * budget.slots(fraction) / budget.experts


def test_models_phase_engines() -> None:
    plain = model_engines.models(model_engines.DS2)
    skew = model_engines.models(model_engines.DS2_SKEW)
    assert [s.name for s in plain] == [
        "models.ds2lite.none.full",
        "models.ds2lite.row16dev.full",  # the quarter's pair next to each other: one call
        "models.ds2lite.uva1959.full",
        "models.ds2lite.none2.full",  # the control
        "models.ds2lite.row32dev.full",
        "models.ds2lite.uva1341.full",
        "models.ds2lite.row16devlfu.full",  # the quarter's cache, victims by count
        "models.ds2lite.row16devlfuraw.full",  # the same on raw bytes (planes by default)
        "models.ds2lite.none.eager",  # on demand: the half's cache and its reference, eager
        "models.ds2lite.row32dev.eager",
    ]
    # Skewed: the quarter's pair first (the targets), then its token reference.
    assert [s.name.split(".", 2)[2] for s in skew] == [
        "row16dev.full",
        "uva1959.full",
        "none.full",
        "none2.full",
        "row32dev.full",
        "uva1341.full",
        "row16devlfu.full",
        "row16devlfuraw.full",
        "none.eager",
        "row32dev.eager",
    ]
    for spec in plain + skew:
        prefix = model_engines.MODELS_PREFIX[spec.checkpoint]
        eager = spec.name.endswith(".eager")
        assert spec.compare_with == (f"{prefix}.none.{'eager' if eager else 'full'}",)
        assert spec.mode is (Mode.EAGER if eager else Mode.DEFAULT)
        assert spec.on_demand is eager and spec.workload == model_engines.MODELS_WORKLOAD
        assert spec.max_num_batched_tokens >= spec.workload.prefill_tokens
        assert spec.max_model_len > spec.workload.prefill_tokens
        assert spec.time_once_s > 0
        if spec.knob is not None:
            assert spec.knob.planner is Planner.DEVICE
        if spec.offload is not None:
            assert spec.offload.backend is OffloadBackend.UVA
            assert spec.offload.cpu_offload_params == ("experts",)
        assert EngineSpec.from_json(spec.to_json()) == spec
    for label in ("row16dev.full", "uva1959.full", "uva1341.full", "row16devlfu.full"):
        assert label in phases.BUDGETED_LABELS
    assert "row16devlfuraw.full" in phases.BUDGETED_LABELS
    # DeepSeek-V2-Lite's estimates come from its own run on the V1 runner.
    assert [(s.time_once_s, s.time_full_s) for s in plain[:3]] == [
        (80, 100),
        (160, 220),
        (160, 220),
    ]
    # The eager pair runs only where --only names it.
    runner = orchestrate.Run(Path("/o"), Path("/w"), 0.0, False, lambda: True)
    assert [s.name for s in runner.picked(plain)] == [s.name for s in plain[:-2]]
    runner.only = ("none.eager", "row32dev.eager")
    assert runner.picked(plain) == plain[-2:]
    assert plain[-1].knob is not None and plain[-1].knob.size == 32  # the half
    assert "row32dev.eager" in phases.BUDGETED_LABELS and "none.eager" in phases.BUDGETED_LABELS
    lfu, raw = plain[-4].knob, plain[-3].knob
    assert lfu is not None and lfu.size == 16 and lfu.planner is Planner.DEVICE
    assert lfu.config()["moe_expert_cache_policy"] == "lfu"
    assert "moe_expert_cache_compress" not in lfu.config()  # the default: planes
    assert raw is not None and raw.config() == {
        **lfu.config(),
        "moe_expert_cache_compress": "off",
    }
    # Models whose experts are not bf16 hold no planes: no raw-bytes engine.
    for checkpoint in (model_engines.DS3, model_engines.QWEN48_FP8, model_engines.GPT_OSS):
        assert not any("raw" in s.name for s in model_engines.models(checkpoint))
    [plain_phase, skew_phase] = phases.select(["deepseek", "deepseek_skew"])
    assert plain_phase.budgeted and skew_phase.budgeted
    assert [c.directory for c in skew_phase.checkpoints()] == ["deepseek-v2-lite-skew"]


def test_the_skewed_twin_is_built_from_the_plain_checkpoint(tmp_path: Path) -> None:
    assert model_engines.DS2.builder_args() == ["--arch", "deepseek_v2"]
    assert checkpoints.command(tmp_path, model_engines.DS2)[1:] == [
        checkpoints.CKPT_TOOL,
        str(tmp_path / "deepseek-v2-lite"),
        "--arch",
        "deepseek_v2",
    ]
    assert checkpoints.command(tmp_path, model_engines.DS2_SKEW) == [
        sys.executable,
        checkpoints.CKPT_TOOL,
        str(tmp_path / "deepseek-v2-lite-skew"),
        "--arch",
        "deepseek_v2",
        "--router-skew",
        "1.0",
        "--experts-from",
        str(tmp_path / "deepseek-v2-lite"),
    ]
    # Both phases together: the plain checkpoint is built first (the twin links its shards).
    needed: list[Any] = []
    for phase in phases.select(["deepseek_skew", "deepseek"]):
        needed += [c for c in phase.checkpoints() if c not in needed]
    assert [c.directory for c in needed] == ["deepseek-v2-lite", "deepseek-v2-lite-skew"]


def _record(
    spec: EngineSpec, b1: float, ttft: float, tokens: list[list[int]], run: str = "r"
) -> dict[str, Any]:
    decode = {
        "1": {"tok_s": b1, "repeats_run": 3, "tokens": tokens[:1]},
        "8": {"tok_s": b1 * 4, "repeats_run": 3, "tokens": tokens[:8]},
    }
    record: dict[str, Any] = {
        "name": spec.name,
        "spec": spec.to_json(),
        "ok": True,
        "run_id": run,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "steps": {
            "decode": decode,
            "ttft": {"ms": ttft, "ms_runs": [ttft] * 3, "first_tokens": [t[0] for t in tokens[:3]]},
        },
    }
    if spec.caches:
        record["slots"] = {"layers": 26, "slots": 26 * spec.knob.size, "mismatches": []}  # type: ignore[union-attr]
    return record


def _results(skew: bool, row_b1: float, row_tokens: list[list[int]]) -> dict[str, Any]:
    specs = model_engines.models(model_engines.DS2_SKEW if skew else model_engines.DS2)
    tokens = [[i, i + 1, i + 2] for i in range(8)]
    speeds = {"none": (600.0, 20.0), "row": (row_b1, 100.0), "uva": (30.0, 200.0)}
    out = {}
    for spec in specs:
        kind = "row" if spec.knob else "uva" if spec.offload else "none"
        b1, ttft = speeds[kind]
        out[spec.name] = _record(spec, b1, ttft, row_tokens if kind == "row" else tokens)
    return out


def test_targets_met_and_missed() -> None:
    same = [[i, i + 1, i + 2] for i in range(8)]
    results = _results(False, 45.0, same)  # 1.5 x UVA at b1, TTFT 0.5 x
    lines = "\n".join(steps_report.report(results))
    assert "the models people offload, models.ds2lite" in lines
    assert "b1 row16dev.full >= 1.3 x uva1959.full: 45 / 30 tok/s = 1.500 (met)" in lines
    assert "ttft row16dev.full <= 0.8 x uva1959.full: 100 / 200 ms = 0.500 (met)" in lines
    assert "tokens row16dev.full identical to none.full (b1, b8, ttft): met" in lines
    # The quarter's lfu engine on raw bytes beside its planes and UVA, and both one's tokens.
    assert "  b1 row16devlfuraw.full / row16devlfu.full: 45 / 45 tok/s = 1.000\n" in lines
    assert "  b1 row16devlfuraw.full / uva1959.full: 45 / 30 tok/s = 1.500\n" in lines
    for label in ("row16devlfu.full", "row16devlfuraw.full"):
        assert f"tokens {label} identical to none.full (b1, b8, ttft): met" in lines
        assert f"slots of {label} byte-identical to their host bytes (416 slots" in lines
    # On demand, the half's cache and no offload in eager mode: b8 wants a control.
    eager = "tokens row32dev.eager identical to none.eager (b1, ttft): met; b8 not judged: no "
    assert eager + "control of its reference in this run" in lines
    # The control: no offload run again; a diverging control is reported, not hidden.
    assert "tokens none2.full identical to none.full (b1, b8, ttft): met" in lines
    control = "models.ds2lite.none2.full"
    results[control]["steps"]["decode"]["8"]["tokens"][3] = [3, 4, 99]
    lines = "\n".join(steps_report.report(results))
    assert "tokens none2.full identical to none.full (b1, b8, ttft): MISSED" in lines
    assert "slots of row16dev.full byte-identical to their host bytes (416 slots" in lines
    differs = "b8 not judged: the control none2.full differs from its reference there"
    assert f"tokens row16dev.full identical to none.full (b1, ttft): met; {differs}" in lines
    # Without a control of the reference's own run, b8 is not judged either (merged results
    # can hold a control of another run).
    alone = "b8 not judged: no control of its reference in this run"
    for change in ("run", "drop"):
        results = _results(False, 45.0, same)
        if change == "run":
            results[control]["run_id"] = "another"
        else:
            del results[control]
        lines = "\n".join(steps_report.report(results))
        assert f"tokens row16dev.full identical to none.full (b1, ttft): met; {alone}" in lines
    # Skewed: 3 x is asked; a diverging token and a bad slot are caught.
    bad = [list(t) for t in same]
    bad[5][2] = 99
    results = _results(True, 45.0, bad)
    name = "models.ds2lite-skew.row16dev.full"
    results[name]["slots"]["mismatches"] = ["model.layers.3.mlp.experts: expert 7 slot 2: w2"]
    lines = "\n".join(steps_report.report(results))
    assert "b1 row16dev.full >= 3 x uva1959.full: 45 / 30 tok/s = 1.500 (MISSED)" in lines
    assert "tokens row16dev.full identical to none.full (b1, b8, ttft): MISSED" in lines
    assert "1 differ; first: model.layers.3.mlp.experts: expert 7 slot 2: w2): MISSED" in lines


def test_a_cache_engines_b1_token_is_read_against_the_link() -> None:
    """Its misses a token times one expert's host bytes, moved in the time its token takes
    beyond no offload's; none between two runs, none for an engine without the cache."""
    same = [[i, i + 1, i + 2] for i in range(8)]
    results = _results(False, 45.0, same)  # no offload 600 tok/s
    record = results["models.ds2lite.row16dev.full"]
    record["cache"] = {"layers": 26, "capacity": 16}
    record["probe"] = {"cached_layers": 26, "expert_host_bytes": 26 * 64 * 12_000_000}
    # 40 misses a token over three timed generations of 64 tokens
    record["steps"]["decode"]["1"].update(batch=1, cache={"misses": 3 * 64 * 40})
    want = (
        "  b1 row16dev.full: 40.0 misses a token (its prefill included) x 12.00 MB = 0.480 GB, "
        "in 22.22 ms against none.full's 1.67 ms: 23.4 GB/s beside its work (no target)"
    )
    # UVA at the quarter keeps 7 of 26 layers: a b1 token reads the 19 others' 6 routed experts
    # of 3 x 1408 x 2048 x 2 bytes (the half's engine alike, 13 layers).
    uva = [
        "  b1 uva1959.full: reads 19 offloaded layers x 6 routed experts x 17.30 MB a decode "
        "token (its prefill's reads not counted) = 1.972 GB, in 33.33 ms against none.full's "
        "1.67 ms: 62.3 GB/s beside its work (no target)",
        "  b1 uva1341.full: reads 13 offloaded layers x 6 routed experts x 17.30 MB a decode "
        "token (its prefill's reads not counted) = 1.350 GB, in 33.33 ms against none.full's "
        "1.67 ms: 42.6 GB/s beside its work (no target)",
    ]
    versus = (
        "  b1 row16dev.full moves 0.24 x the bytes uva1959.full reads a token (the cache's "
        "prefill misses included; no target)"
    )
    # A UVA engine the probe did not count: whether it offloaded is not known, no line.
    found = steps_report.link_lines(results, "models.ds2lite", model_engines.DS2_BUDGET)
    assert found == [want]
    for label, kept in (("uva1959.full", 7), ("uva1341.full", 13)):
        results[f"models.ds2lite.{label}"]["probe"] = {"expert_gpu_bytes": kept * 64 * 17_301_504}
    found = steps_report.link_lines(results, "models.ds2lite", model_engines.DS2_BUDGET)
    assert sorted(found) == sorted([want, *uva, versus])
    assert found[-1] == versus
    assert want in steps_report.report(results) and versus in steps_report.report(results)
    # A UVA engine that kept every expert on the GPU read none over the link: no line of it.
    uva_record = results["models.ds2lite.uva1959.full"]
    uva_record["probe"] = {"expert_gpu_bytes": 26 * 64 * 17_301_504}
    found = steps_report.link_lines(results, "models.ds2lite", model_engines.DS2_BUDGET)
    assert sorted(found) == sorted([want, uva[1]])
    uva_record["probe"] = {"expert_gpu_bytes": 8 * 64 * 17_301_504}  # one layer not offloaded
    assert uva[0] not in steps_report.link_lines(
        results, "models.ds2lite", model_engines.DS2_BUDGET
    )
    uva_record["probe"] = {"expert_gpu_bytes": 7 * 64 * 17_301_504}  # the 7 layers it keeps
    assert versus in steps_report.link_lines(results, "models.ds2lite", model_engines.DS2_BUDGET)
    # No misses: no rate, nor a comparison of bytes; a reference from another run, or a
    # partial record: no line of the cache engine.
    record["steps"]["decode"]["1"]["cache"] = {"misses": 0}
    found = steps_report.link_lines(results, "models.ds2lite", model_engines.DS2_BUDGET)
    [line] = [line for line in found if "row16dev" in line]
    assert "= 0.000 GB" in line and "GB/s" not in line
    workload = record["spec"].pop("workload")
    assert steps_report.link_lines(results, "models.ds2lite", model_engines.DS2_BUDGET) == uva
    record["spec"]["workload"] = workload
    results["models.ds2lite.none.full"]["run_id"] = "another"
    assert steps_report.link_lines(results, "models.ds2lite", model_engines.DS2_BUDGET) == []


def test_gpt_oss_uva_is_read_on_marlin_against_marlin() -> None:
    """gpt-oss's UVA engines run on Marlin: their link lines count Marlin's padded experts of
    18 and 12 offloaded layers, against Marlin without offload; each cache engine's bytes are
    set against the UVA of its budget (the quarter's `lfu` against the quarter's)."""
    tokens = [[i, i + 1, i + 2] for i in range(8)]
    speeds = {"none": 300.0, "row": 40.0, "uva": 30.0}
    results = {}
    for spec in model_engines.models(model_engines.GPT_OSS):
        kind = "row" if spec.knob else "uva" if spec.offload else "none"
        results[spec.name] = _record(spec, speeds[kind], 100.0, tokens)
    prefix = "models.gptoss20b"
    budget = model_engines.GPT_OSS_BUDGET
    host = 24 * 32 * model_engines.GPT_OSS_EXPERT_BYTES
    for label, misses in (("row8dev.full", 52), ("row16dev.full", 30), ("row8devlfu.full", 40)):
        record = results[f"{prefix}.{label}"]
        record["cache"] = {"layers": 24}
        record["probe"] = {"cached_layers": 24, "expert_host_bytes": host}
        record["steps"]["decode"]["1"].update(batch=1, cache={"misses": 3 * 64 * misses})
    marlin_layer = 32 * model_engines.GPT_OSS_MARLIN_EXPERT_BYTES
    for label, kept in (("uva774marlin.full", 6), ("uva516marlin.full", 12)):
        results[f"{prefix}.{label}"]["probe"] = {"expert_gpu_bytes": kept * marlin_layer}
    found = steps_report.link_lines(results, prefix, budget)
    assert (
        "  b1 uva774marlin.full: reads 18 offloaded layers x 4 routed experts x 14.43 MB a "
        "decode token (its prefill's reads not counted) = 1.039 GB, in 33.33 ms against "
        "nonemarlin.full's 3.33 ms: 34.6 GB/s beside its work (no target)"
    ) in found
    assert (
        "  b1 uva516marlin.full: reads 12 offloaded layers x 4 routed experts x 14.43 MB a "
        "decode token (its prefill's reads not counted) = 0.693 GB, in 33.33 ms against "
        "nonemarlin.full's 3.33 ms: 23.1 GB/s beside its work (no target)"
    ) in found
    ratios = [line.split(" (the cache's")[0] for line in found if " moves " in line]
    assert ratios == [
        "  b1 row8dev.full moves 0.66 x the bytes uva774marlin.full reads a token",
        "  b1 row16dev.full moves 0.58 x the bytes uva516marlin.full reads a token",
        "  b1 row8devlfu.full moves 0.51 x the bytes uva774marlin.full reads a token",
    ]


def test_uva_reads_its_backends_experts_of_its_offloaded_layers() -> None:
    """gpt-oss's UVA runs on Marlin, whose experts are padded: its layers and bytes are
    Marlin's, its reference Marlin without offload."""
    budget = model_engines.GPT_OSS_BUDGET
    assert (
        budget.uva_offloaded_layers(budget.uva_offloaded_gib(model_engines.QUARTER), "marlin") == 18
    )
    assert budget.uva_offloaded_layers(budget.uva_offloaded_gib(model_engines.HALF), "marlin") == 12
    assert budget.expert_bytes("marlin") == model_engines.GPT_OSS_MARLIN_EXPERT_BYTES
    assert budget.expert_bytes("triton_unfused") == model_engines.GPT_OSS_EXPERT_BYTES
    assert model_engines.DS3_BUDGET.expert_bytes() == engines.FP8_EXPERT_BYTES


@pytest.mark.parametrize("checkpoint", sorted(model_engines.MODEL_BUDGETS, key=str))
def test_a_budgets_experts_and_top_k_are_its_checkpoints(checkpoint: Any) -> None:
    budget = model_engines.MODEL_BUDGETS[checkpoint]
    if checkpoint.arch == "qwen3":
        config = mk.fp8_config(True, checkpoint.layers)
    else:
        config = mk.sharded_config(checkpoint.arch, checkpoint.layers)
    assert mk.experts_of(config) == (budget.experts, budget.top_k)


def test_slots_line_without_a_record() -> None:
    assert probe_lines.slots_line(None, "x") is None
    assert probe_lines.slots_line({"slots": {"layers": 0, "slots": 0, "mismatches": []}}, "x") == (
        "  slots of x byte-identical to their host bytes (0 slots in 0 layers, 0 differ): MISSED"
    )


@pytest.mark.parametrize("phase", ["deepseek", "deepseek_skew"])
def test_phase_about_names_the_model(phase: str) -> None:
    [found] = phases.select([phase])
    assert "DeepSeek-V2-Lite" in found.about


def test_every_models_engine_runs_on_the_v1_model_runner() -> None:
    for spec in model_engines.models(model_engines.DS2) + model_engines.models(
        model_engines.DS2_SKEW
    ):
        assert spec.model_runner_v1
        assert spec.env()["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in engines.steps()[0].env()


def test_an_offload_engine_that_offloads_nothing_stops() -> None:
    """The H200 run of 2026-12-03: vLLM 0.25.0's V2 model runner left DeepSeek's UVA engine
    with its NoopOffloader, and it decoded as fast as no offload."""
    from tools.vllm.harness import child

    uva = next(s for s in model_engines.models(model_engines.DS2) if s.offload is not None)
    with pytest.raises(RuntimeError, match="offloader is NoopOffloader: nothing was offloaded"):
        child.check_offloader(uva, {"offloader": "NoopOffloader"})
    child.check_offloader(uva, {"offloader": "UVAOffloader"})
    child.check_offloader(uva, {"offloader": "UVAOffloader", "cpu_offload_bytes": 7 << 30})
    with pytest.raises(RuntimeError, match="it offloaded 0 bytes"):
        child.check_offloader(uva, {"offloader": "UVAOffloader", "cpu_offload_bytes": 0})
    none = model_engines.models(model_engines.DS2)[0]
    child.check_offloader(none, {"offloader": "NoopOffloader"})  # no offload asked: fine


def test_reduced_deepseek_v3_phases() -> None:
    config = dl.config("deepseek_v3", None)
    plan = mk.sharded_plan("deepseek_v3", config)
    experts = sum(shards.nbytes(*v) for n, v in plan.items() if ".experts." in n)
    budget = model_engines.DS3_BUDGET
    assert budget.expert_gib * 2**30 == experts
    assert (budget.experts, budget.moe_layers) == (256, len(dl.moe_layers(config)))
    names = [s.name for s in model_engines.models(model_engines.DS3)]
    assert names == [
        "models.ds3.none.full",
        "models.ds3.row64dev.full",
        "models.ds3.uva675.full",
        "models.ds3.none2.full",  # the control
        "models.ds3.row128dev.full",
        "models.ds3.uva450.full",
        "models.ds3.row64devlfu.full",
        "models.ds3.none.eager",  # on demand
        "models.ds3.row128dev.eager",
    ]
    for spec in model_engines.models(model_engines.DS3) + model_engines.models(
        model_engines.DS3_SKEW
    ):
        assert spec.quantized  # the run checks for vLLM's quantization packages first
        assert budget.gpu_gib(spec) >= budget.expert_gib * 0.25 - 1e-9
    assert not model_engines.models(model_engines.DS2)[0].quantized
    assert model_engines.DS3_SKEW.experts_from == model_engines.DS3.directory
    [phase] = phases.select(["deepseek_v3"])
    assert [c.directory for c in phase.checkpoints()] == ["deepseek-v3-reduced"]


def test_full_depth_qwen3_fp8_phases(tmp_path: Path) -> None:
    config = mk.fp8_config(True, 48)
    plan = mk.sharded_plan("qwen3", config)
    experts = sum(shards.nbytes(*v) for n, v in plan.items() if ".mlp.experts." in n)
    budget = model_engines.QWEN48_FP8_BUDGET
    assert budget.expert_gib * 2**30 == experts
    assert (budget.experts, budget.moe_layers) == (128, 48)
    names = [s.name for s in model_engines.models(model_engines.QWEN48_FP8)]
    assert names == [
        "models.qwen48fp8.none.full",
        "models.qwen48fp8.row32dev.full",
        "models.qwen48fp8.uva2025.full",
        "models.qwen48fp8.none2.full",  # the control
        "models.qwen48fp8.row64dev.full",
        "models.qwen48fp8.uva1350.full",
        "models.qwen48fp8.row32devlfu.full",
        "models.qwen48fp8.none.eager",  # on demand
        "models.qwen48fp8.row64dev.eager",
    ]
    for spec in model_engines.models(model_engines.QWEN48_FP8) + model_engines.models(
        model_engines.QWEN48_FP8_SKEW
    ):
        assert spec.quantized and spec.model_runner_v1
        # DeepGEMM's start-up warm-up of every FP8 GEMM shape to 2,048 tokens skipped.
        assert spec.env()["VLLM_DEEP_GEMM_WARMUP"] == "skip"
        # The builder's Qwen3 config says 2,048 positions: a 2,048-token prompt needs more.
        assert spec.max_position_embeddings is not None
        assert spec.max_position_embeddings >= spec.max_model_len > 2048
        assert budget.gpu_gib(spec) >= budget.expert_gib * 0.25 - 1e-9
    assert checkpoints.command(tmp_path, model_engines.QWEN48_FP8_SKEW)[2:] == [
        str(tmp_path / "qwen3-30b-a3b-fp8-full-skew"),
        "--qwen3-30b-a3b",
        "--fp8-block",
        "--sharded",
        "--layers",
        "48",
        "--router-skew",
        "1.0",
        "--experts-from",
        str(tmp_path / "qwen3-30b-a3b-fp8-full"),
    ]
    needed: list[Any] = []
    for phase in phases.select(["qwen3_full_skew", "qwen3_full"]):
        assert phase.budgeted and phase.one_at_a_time
        needed += [c for c in phase.checkpoints() if c not in needed]
    assert [c.directory for c in needed] == [
        "qwen3-30b-a3b-fp8-full",
        "qwen3-30b-a3b-fp8-full-skew",
    ]
    # The builder takes those arguments and writes the config the budget was read from.
    built = mk.main([str(tmp_path / "tiny"), "--layers", "2", "--fp8-block", "--sharded"])
    assert built == 0


def test_gpt_oss_phases() -> None:
    """gpt-oss-20b's engines: the cache and its reference on vLLM's triton_unfused MXFP4 backend
    (the one the cache serves), row at 8 and 16 of 32 slots; UVA on Marlin (where vLLM
    offloads MXFP4 experts: on triton_unfused the swizzle's new GPU tensors stay on the GPU)
    keeping 6 and 12 of 24 layers of Marlin's padded experts, its tokens against Marlin's own
    no-offload engine; the experts' bytes as the cache holds them after the swizzle."""
    from tools.vllm.harness import child

    budget = model_engines.GPT_OSS_BUDGET
    swizzled = 8_294_400 + 4_147_200 + 529_920 + 276_480  # tests/test_gpt_oss_swizzle.py
    assert swizzled + 4 * (5760 + 2880) == model_engines.GPT_OSS_EXPERT_BYTES  # float32 biases
    assert (budget.experts, budget.moe_layers) == (32, 24)
    # Marlin rounds hidden 2,880 up to 3,072 and intermediate 2,880 up to 2,944.
    assert model_engines.GPT_OSS_MARLIN_EXPERT_BYTES == 14_431_744
    assert budget.baseline is not None and budget.baseline.backend == "marlin"
    specs = model_engines.models(model_engines.GPT_OSS)
    names = [s.name.split(".", 2)[2] for s in specs]
    assert names == [
        "none.full",
        "nonemarlin.full",
        "row8dev.full",
        "uva774marlin.full",
        "none2.full",
        "row16dev.full",
        "uva516marlin.full",
        "nonemarlin2.full",  # the baseline's control, after the targets
        "row8devlfu.full",  # the quarter's cache with victims by request count
        "none.eager",  # on demand: the half's cache and its reference without graphs
        "row16dev.eager",
        "nonebare.full",  # on demand: no offload without the scale guard
    ]
    # No offload on the cache's backend has zeros after its weight scales, as the slots do
    # (harness/scale_guard.py); vLLM as it comes is the on-demand diagnostic.
    guarded = [s.name.split(".", 2)[2] for s in specs if s.guard_scale_tails]
    assert guarded == ["none.full", "none2.full", "none.eager"]
    assert "nonebare.full" in phases.BUDGETED_LABELS
    assert not any(s.guard_scale_tails for s in model_engines.models(model_engines.DS2))
    for spec in specs + model_engines.models(model_engines.GPT_OSS_SKEW):
        assert spec.quantized and spec.model_runner_v1
        prefix = model_engines.MODELS_PREFIX[spec.checkpoint]
        marlin = spec.offload is not None or ".nonemarlin" in spec.name
        want = "marlin" if marlin else "triton_unfused"
        assert child.engine_kwargs(spec, "/w/g")["moe_backend"] == want
        eager = spec.mode is Mode.EAGER
        assert child.engine_kwargs(spec, "/w/g").get("enforce_eager", False) is eager
        reference = "nonemarlin.full" if marlin else "none.eager" if eager else "none.full"
        assert spec.on_demand is (eager or spec.name.endswith(".nonebare.full"))
        assert spec.compare_with == (f"{prefix}.{reference}",)
        # At least the slots' expert memory stays on the GPU in every offloading engine.
        assert budget.gpu_gib(spec) >= budget.expert_gib * 0.25 - 1e-9
    uva = next(s for s in specs if s.offload is not None)
    assert uva.offload is not None
    assert uva.offload.cpu_offload_gb * 2**30 == 18 * 32 * model_engines.GPT_OSS_MARLIN_EXPERT_BYTES
    assert budget.gpu_gib(uva) * 2**30 == 6 * 32 * model_engines.GPT_OSS_MARLIN_EXPERT_BYTES
    # Its engines' time estimates come from its own run (the budget decides what starts).
    assert [s.time_once_s for s in specs[:5]] == [100, 100, 150, 150, 100]
    skew = [s.name.split(".", 2)[2] for s in model_engines.models(model_engines.GPT_OSS_SKEW)]
    assert skew[:5] == [
        "row8dev.full",
        "uva774marlin.full",
        "none.full",
        "nonemarlin.full",
        "none2.full",
    ]
    for spec in model_engines.models(model_engines.DS2):
        assert "moe_backend" not in child.engine_kwargs(spec, "/w/d")
    for label in ("nonemarlin.full", "nonemarlin2.full", "uva774marlin.full"):
        assert label in phases.BUDGETED_LABELS
    for phase in phases.select(["gpt_oss", "gpt_oss_skew"]):
        assert phase.budgeted and phase.one_at_a_time and "gpt-oss-20b" in phase.about


def test_the_scale_guard_and_vllm_as_it_comes_are_reported() -> None:
    """gpt-oss's guarded no offload says so; vLLM as it comes (``nonebare.full``, on demand)
    has its tokens judged against it, and every reference's scale tails are reported (the
    no-offload engines' too, which a label without its mode once missed)."""
    specs = {s.name: s for s in model_engines.models(model_engines.GPT_OSS)}
    tokens = [[i, i + 1, i + 2] for i in range(8)]
    prefix = "models.gptoss20b"
    results: dict[str, Any] = {
        name: _record(spec, 40.0, 100.0, tokens) for name, spec in specs.items()
    }
    tails = {"layers": {"l0": {"bytes": [0] * 64, "ff": 0}}, "layers_with_ff": 0, "tail_bytes": 64}
    results[f"{prefix}.none.full"] |= {"scale_guard": {"layers": 24}, "scale_tails": tails}
    bare_tails = {
        "layers": {"l0": {"bytes": [0xFF] * 64, "ff": 64}},
        "layers_with_ff": 1,
        "tail_bytes": 64,
    }
    results[f"{prefix}.nonebare.full"]["scale_tails"] = bare_tails
    results[f"{prefix}.nonebare.full"]["steps"]["decode"]["1"]["tokens"] = [[0, 1, 9]]
    lines = steps_report.report(results)
    assert (
        "  scale guard of none.full: 24 layers' w13 and w2 weight scales followed by zeros, as "
        "the cache's slots are (what vLLM's kernel reads past them)"
    ) in lines
    assert (
        "  scale tails of none.full (1 layers, 64 bytes past each w13 scale tensor, where "
        "vLLM's MXFP4 kernel reads): no 0xFF byte" in lines
    )
    assert any(line.startswith("  scale tails of nonebare.full (1 layers") for line in lines)
    bare = next(line for line in lines if line.startswith("  tokens nonebare.full identical"))
    assert "to none.full" in bare and "MISSED" in bare
    assert not any(line.startswith("  scale guard of nonebare") for line in lines)


def test_a_uva_engine_that_kept_its_experts_on_the_gpu_is_named() -> None:
    """The H200 run of 2026-12-04: gpt-oss's UVA engine on triton_unfused asked for 7.13 GiB
    offloaded and kept all 8.90 GiB of experts on the GPU; the summary says so beside its
    ratios. An engine within its budget gets no such line."""
    specs = {s.name: s for s in model_engines.models(model_engines.GPT_OSS)}
    tokens = [[i, i + 1, i + 2] for i in range(8)]
    results: dict[str, Any] = {}
    for name, spec in specs.items():
        results[name] = _record(spec, 40.0, 100.0, tokens)
        results[name]["slots"] = None
    uva = "models.gptoss20b.uva774marlin.full"
    kept_within = (32 * 24 * model_engines.GPT_OSS_MARLIN_EXPERT_BYTES) - int(
        specs[uva].offload.cpu_offload_gb * 2**30  # type: ignore[union-attr]
    )
    results[uva]["probe"] = {"expert_gpu_bytes": kept_within}
    lines = "\n".join(steps_report.report(results))
    assert "UVA on vLLM's marlin MoE backend" in lines
    assert "did not offload" not in lines
    results[uva]["probe"] = {"expert_gpu_bytes": int(8.9 * 2**30)}
    lines = "\n".join(steps_report.report(results))
    assert "uva774marlin.full kept 8.90 GiB of experts on the GPU against the 2.58 GiB" in lines
    # Both controls' tokens are reported, each against its own reference; a diverging one too.
    assert "tokens none2.full identical to none.full (b1, b8, ttft): met" in lines
    assert "tokens nonemarlin2.full identical to nonemarlin.full (b1, b8, ttft): met" in lines
    control = "models.gptoss20b.nonemarlin2.full"
    results[control]["steps"]["ttft"]["first_tokens"] = [0, 99, 2]
    lines = "\n".join(steps_report.report(results))
    assert "tokens nonemarlin2.full identical to nonemarlin.full (b1, b8, ttft): MISSED" in lines
    # Where the Marlin control differs (the prompts, as on the H100 of 2026-12-06), its UVA
    # engines' tokens there are not judged; the cache's reference has its own control.
    results[uva]["steps"]["ttft"]["first_tokens"] = [5, 99, 2]
    lines = "\n".join(steps_report.report(results))
    noise = "ttft not judged: the control nonemarlin2.full differs from its reference there"
    assert f"tokens uva774marlin.full identical to nonemarlin.full (b1, b8): met; {noise}" in lines
    assert "tokens row8dev.full identical to none.full (b1, b8, ttft): met" in lines
    results[uva]["steps"]["decode"]["8"]["tokens"][2] = [2, 99, 4]
    lines = "\n".join(steps_report.report(results))
    assert (
        f"tokens uva774marlin.full identical to nonemarlin.full (b1, b8): MISSED; {noise}" in lines
    )
    for measure in ("1", "8"):
        results[control]["steps"]["decode"][measure]["tokens"][0] = [0, 99, 2]
    lines = "\n".join(steps_report.report(results))
    assert (
        "tokens uva774marlin.full identical to nonemarlin.full: not judged; b1 not judged" in lines
    )


def test_a_skewed_phase_alone_builds_its_plain_source_first() -> None:
    """A skewed twin links the plain checkpoint's expert shards: run alone on a fresh machine,
    its phase must build the plain one before it. Every twin's source is built by a phase."""
    known = [c for phase in phases.PHASES for c in phase.checkpoints()]
    for name, plain in (
        ("qwen3_full_skew", model_engines.QWEN48_FP8),
        ("deepseek_v3_skew", model_engines.DS3),
        ("deepseek_skew", model_engines.DS2),
        ("gpt_oss_skew", model_engines.GPT_OSS),
    ):
        [phase] = phases.select([name])
        needed = checkpoints.with_sources(phase.checkpoints(), known)
        assert needed.index(plain) < needed.index(phase.checkpoints()[0])
    orphan = engines.Checkpoint("x-skew", arch="deepseek_v3", router_skew=1.0, experts_from="x")
    with pytest.raises(ValueError, match="x-skew takes its experts from x, which no phase"):
        checkpoints.with_sources([orphan], known)
    for spec in model_engines.models(model_engines.DS2):  # bf16: DeepGEMM is not its path
        assert "VLLM_DEEP_GEMM_WARMUP" not in spec.env()
