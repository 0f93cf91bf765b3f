"""The e2e phases ``curve``, ``curve_skew``, ``fp8`` and ``fp8_skew`` of tools/vllm/e2e.py without
vLLM or a GPU: their engines (order, arguments, checkpoints, the GiB of experts each keeps on
the GPU), argument names against vLLM's ``EngineArgs`` where the wheels are at hand, the
b1/b8-only workload, the budgeted run with ``--resume``, the MoE backend probe and log line,
and issue 22's targets in the summary."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm_wheels

from tools.vllm.harness import child, engines, measure, orchestrate, phases, probes, steps_report
from tools.vllm.harness.measure import Completion
from tools.vllm.harness.specs import EngineSpec, Job, Mode, OffloadBackend, Planner, Provider

ROOT = Path(__file__).resolve().parents[1]


def _labels(specs: list[EngineSpec]) -> list[str]:
    return [s.name.split(".", 2)[2] for s in specs]


# -- the curve ------------------------------------------------------------------------------


def test_curve_engines_in_run_order() -> None:
    plain = engines.curve(engines.QWEN8)
    assert _labels(plain) == [
        "none.full",
        "row32dev.full",
        "uva675.full",
        "row128dev.full",
        "uva900.full",
        "row8dev.full",
        "uva450.full",
        "row64dev.full",
        "uva225.full",
        "row16dev.full",
    ]
    gib = {
        label: engines.expert_gib_on_gpu(s) for label, s in zip(_labels(plain), plain, strict=True)
    }
    assert gib == {
        "none.full": 9.0,
        "row32dev.full": 2.25,
        "uva675.full": 2.25,
        "row128dev.full": 9.0,
        "uva900.full": 0.0,
        "row8dev.full": 0.5625,
        "uva450.full": 4.5,
        "row64dev.full": 4.5,
        "uva225.full": 6.75,
        "row16dev.full": 1.125,
    }
    # The points: UVA keeping 0, 2.25, 4.5, 6.75 GiB; row at 8 to 128 slots.
    uva = sorted(gib[x] for x in gib if x.startswith("uva"))
    assert uva == [0.0, 2.25, 4.5, 6.75]
    slots = sorted(s.knob.size for s in plain if s.knob is not None and s.knob.size)
    assert slots == [8, 16, 32, 64, 128]
    for spec in plain:
        assert spec.mode is Mode.DEFAULT and spec.checkpoint == engines.QWEN8
        assert spec.compare_with == ("curve.plain.none.full",)
        assert spec.workload == engines.CURVE_WORKLOAD
        assert 0 < spec.time_once_s <= spec.time_full_s
        if spec.knob is not None:
            assert spec.knob.provider is Provider.ROW and spec.knob.planner is Planner.DEVICE
        if spec.offload is not None:
            assert spec.offload.backend is OffloadBackend.UVA
            assert spec.offload.cpu_offload_params == ("experts",)
    w = engines.CURVE_WORKLOAD
    assert (w.batches, w.decode_tokens, w.repeats, w.prefill_prompts) == ((1,), 256, 3, 0)
    skew = engines.curve(engines.QWEN8_SKEW)
    assert [s.name for s in skew] == [
        "curve.skew.row32dev.full",
        "curve.skew.uva675.full",
        "curve.skew.none.full",
    ]
    assert {s.checkpoint.builder_args()[-2:] == ["--router-skew", "1.0"] for s in skew} == {True}
    # The plain phase in two calls of about 9 minutes (every engine's once estimate).
    assert sum(s.time_once_s for s in plain) < 2 * 540


def test_curve_engine_arguments() -> None:
    by = {label: s for label, s in zip(_labels(engines.curve()), engines.curve(), strict=True)}
    common = {
        "model": "/w/qwen8",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": 1024,
        "max_num_seqs": 1,
        "max_num_batched_tokens": 512,
        "kv_cache_memory_bytes": 2 << 30,
        "gpu_memory_utilization": 0.02,
        "compilation_config": {
            "cudagraph_capture_sizes": [1, 2],
            "inductor_compile_config": child.deterministic_inductor(),
        },
    }
    assert child.engine_kwargs(by["none.full"], "/w/qwen8") == common
    assert child.engine_kwargs(by["uva900.full"], "/w/qwen8") == common | {
        "offload_backend": "uva",
        "cpu_offload_gb": 9.0,
        "cpu_offload_params": ["experts"],
    }
    assert child.engine_kwargs(by["row8dev.full"], "/w/qwen8") == common | {
        "additional_config": {
            "rowcache": {
                "moe_expert_cache_size": 8,
                "moe_expert_cache_provider": "row",
                "moe_expert_cache_planner": "device",
                "moe_expert_cache_compress": "off",  # raw bytes, as the curve was recorded
            }
        }
    }


# -- FP8 ------------------------------------------------------------------------------------


def test_fp8_engines() -> None:
    plain = engines.fp8(engines.QWEN8_FP8)
    assert _labels(plain) == list(engines.FP8_LABELS)
    assert _labels(engines.fp8(engines.QWEN8_FP8_SKEW)) == list(engines.FP8_LABELS[:4])
    assert engines.QWEN8_FP8.builder_args() == [
        "--qwen3-30b-a3b",
        "--fp8-block",
        "--layers",
        "8",
    ]
    assert engines.QWEN8_FP8_SKEW.builder_args()[-2:] == ["--router-skew", "1.0"]
    assert "--fp8-block" in engines.QWEN8_FP8_SKEW.builder_args()
    by = dict(zip(_labels(plain), plain, strict=True))
    for label in engines.FP8_LABELS[:4]:
        spec = by[label]
        assert spec.checkpoint == engines.QWEN8_FP8 and spec.quantization is None
        assert spec.workload == engines.FP8_WORKLOAD
        assert spec.compare_with == ("fp8.plain.none.full",)
        assert max(spec.workload.batches) in spec.capture_sizes
        assert spec.max_num_seqs == 8 and spec.mode is Mode.DEFAULT
    for label in engines.FP8_LABELS[4:6]:
        spec = by[label]
        assert spec.checkpoint == engines.QWEN8 and spec.quantization == "fp8"
        assert spec.workload is not None and spec.workload.batches == (1,)
        # a one-token prompt: every step routes to 8 experts and fits 32 slots in one call
        assert measure.decode_prompts(spec.workload, 1) == [[1]]
        assert spec.compare_with == ("fp8.plain.online.none.full",)
    assert [by[x].knob.size if by[x].knob else None for x in engines.FP8_LABELS] == [
        None,
        32,
        None,
        128,
        None,
        32,
        32,
    ]
    # The slot count alone, as a user sets it: the planner is the plugin's default.
    default = by[engines.FP8_DEFAULT_LABEL]
    assert default.knob is not None and default.knob.config() == {"moe_expert_cache_size": 32}
    assert default.checkpoint == engines.QWEN8_FP8 and default.quantization is None
    assert default.compare_with == ("fp8.plain.none.full",)
    w = engines.FP8_WORKLOAD
    assert (w.batches, w.decode_tokens, w.repeats, w.prefill_prompts) == ((1, 8), 256, 3, 0)
    # UVA at the expert memory of 32 slots: 96 of 128 experts' FP8 weights a layer offloaded.
    weights = 3 * 768 * 2048
    offloaded = 8 * 96 * weights / 2**30
    assert offloaded == engines.FP8_UVA_GIB
    uva = by[engines.FP8_UVA_LABEL]
    assert uva.offload is not None and uva.offload.cpu_offload_gb == 3.375
    assert round(engines.FP8_EXPERT_GIB, 3) == 4.501
    online = child.engine_kwargs(by["online.row32dev.full"], "/w/qwen8")
    assert online["quantization"] == "fp8" and online["model"] == "/w/qwen8"
    assert "quantization" not in child.engine_kwargs(by["none.full"], "/w/qwen8-fp8")
    assert child.engine_kwargs(uva, "/m")["cpu_offload_gb"] == 3.375


def test_phases_and_labels() -> None:
    names = [p.name for p in phases.PHASES]
    for name in ("curve", "curve_skew", "fp8", "fp8_skew"):
        phase = phases.PHASES[names.index(name)]
        assert phase.budgeted and phase.one_at_a_time
        for spec in phase.engines({}):
            assert orchestrate._label(spec) in phases.BUDGETED_LABELS
            assert EngineSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
            job = Job(spec, "/m", "/b", 30.0, deadline=1.0)
            assert Job.from_json(json.loads(json.dumps(job.to_json()))) == job
    fp8 = phases.PHASES[names.index("fp8")]
    assert [c.directory for c in fp8.checkpoints()] == ["qwen8-fp8", "qwen8"]
    assert len(phases.BUDGETED_LABELS) == len(set(phases.BUDGETED_LABELS))


@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
def test_engine_argument_names_are_vllms(version: str) -> None:
    """Every argument these engines pass is a field of vLLM's ``EngineArgs``."""
    path = "vllm/engine/arg_utils.py"
    args = vllm_wheels.read(version, path)[path]
    fields = set(re.findall(r"^    (\w+): ", args, flags=re.MULTILINE))
    specs = [
        *engines.curve(),
        *engines.curve(engines.QWEN8_SKEW),
        *engines.fp8(),
        *engines.fp8(engines.QWEN8_FP8_SKEW),
    ]
    names = {k for s in specs for k in child.engine_kwargs(s, "/m")}
    assert "quantization" in names
    assert names - fields == set()


def test_fp8_sources_the_backend_record_rests_on() -> None:
    """The attribute and log line names ``probes.backend_of`` and ``orchestrate.log_facts``
    read, in the vLLM 0.25.0 wheel."""
    base = "vllm/model_executor/layers/"
    names = (
        "quantization/fp8.py",
        "quantization/online/fp8.py",
        "fused_moe/unquantized_fused_moe_method.py",
        "fused_moe/oracle/fp8.py",
        "fused_moe/oracle/unquantized.py",
    )
    found = vllm_wheels.read("0.25.0", *(base + name for name in names))
    fp8, online, unquantized, oracle, oracle_bf16 = (found[base + name] for name in names)
    assert "self.fp8_backend, self.experts_cls = select_fp8_moe_backend(" in fp8
    assert "self.fp8_backend, self.experts_cls = select_fp8_moe_backend(" in online
    assert "self.unquantized_backend, self.experts_cls = " in unquantized
    assert "self.moe_kernel = make_fp8_moe_kernel(" in fp8
    assert 'f"Using {backend.value} Fp8 MoE backend out "' in oracle
    assert '"of potential backends: {available_backend_strs}."' in oracle
    assert 'f"Using {backend.value} Unquantized MoE backend out "' in oracle_bf16


# -- measurement, records, backend ----------------------------------------------------------


def test_b1_only_workload_measures_no_ttft() -> None:
    now = [0.0]
    calls: list[tuple[int, int]] = []

    def generate(prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        calls.append((len(prompts), max_tokens))
        now[0] += 0.004 * max_tokens
        return [Completion([7] * max_tokens) for _ in prompts]

    record = measure.run_workload(engines.FP8_WORKLOAD, generate, 1000.0, lambda: now[0])
    assert all(max_tokens in (16, 256) for _, max_tokens in calls)  # no one-token prompt
    assert [b for b, t in calls if t == 256] == [1, 8, 1, 8, 1, 8]
    assert record["ttft"]["skipped"].startswith("not measured")
    assert record["decode"]["8"]["repeats_run"] == 3
    assert record["decode"]["1"]["tok_s"] == pytest.approx(250.0)


def _record(spec: EngineSpec, tok_s: dict[int, float], tokens: list[list[int]]) -> dict[str, Any]:
    decode = {
        str(b): {"tok_s": t, "repeats_run": 3, "tokens": tokens[:b], "cache": None}
        for b, t in tok_s.items()
    }
    return {
        "name": spec.name,
        "spec": spec.to_json(),
        "ok": True,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "probe": {"moe_backend": {"TRITON/TritonExperts": 8}},
        "moe_backend_log": [
            "INFO [oracle/fp8.py] Using TRITON Fp8 MoE backend out of potential backends: "
            "['TRITON', 'FLASHINFER_CUTLASS']."
        ],
        "steps": {"decode": decode, "ttft": {"ms": None, "skipped": "not measured"}},
    }


def test_budgeted_curve_with_resume(tmp_path: Path, monkeypatch: Any) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (work / "logs").mkdir(parents=True)
    clock = [0.0]
    monkeypatch.setattr(orchestrate.time, "time", lambda: clock[0])
    given: list[str] = []

    def engines_(self: Any, specs: list[EngineSpec], deadline: float | None = None) -> Any:
        given.append(specs[0].name)
        clock[0] += specs[0].time_once_s
        return [_record(specs[0], {1: 100.0}, [[1, 2]])]

    monkeypatch.setattr(orchestrate.Run, "engines", engines_)
    phase = next(p for p in phases.PHASES if p.name == "curve")
    first = orchestrate.Run(out, work, 540.0, False, lambda: True)
    results = first.phase(phase, phase.engines({}))
    ran = list(given)
    assert ran[:3] == [
        "curve.plain.none.full",
        "curve.plain.row32dev.full",
        "curve.plain.uva675.full",
    ]
    assert 3 <= len(ran) < 10
    assert all(results[n]["error"].startswith("not run: time") for n in results if n not in ran)
    done = orchestrate.resumable(orchestrate.read_records(work / orchestrate.RECORDS))
    assert sorted(done) == sorted(ran)
    given.clear()
    clock[0] = 0.0
    second = orchestrate.Run(out, work, 2000.0, False, lambda: True, done=done)
    second.phase(phase, phase.engines({}))
    assert set(given) & set(ran) == set() and len(given) + len(ran) == 10
    names = [json.loads(x)["name"] for x in (out / orchestrate.RECORDS).read_text().splitlines()]
    assert sorted(names) == sorted(s.name for s in phase.engines({}))


def test_fp8_phase_without_compressed_tensors_stops_before_its_first_engine(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """vLLM builds no quantization config without ``compressed_tensors``: in FP8 run 1 of
    2026-12-02 every FP8 engine failed on it in turn. The phase now stops before its first
    engine and names the package; an unquantized phase does not need it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "compressed_tensors" else real(name, *a),
    )
    monkeypatch.setattr(orchestrate, "require_plugin", lambda: None)
    monkeypatch.setattr(orchestrate, "pack_logs", lambda *_a: None)
    started: list[str] = []

    def engines_(self: Any, specs: list[EngineSpec], deadline: float | None = None) -> Any:
        started.extend(s.name for s in specs)
        return [{"name": s.name, "ok": True} for s in specs]

    monkeypatch.setattr(orchestrate.Run, "engines", engines_)
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (work / "logs").mkdir(parents=True)
    fp8 = next(p for p in phases.PHASES if p.name == "fp8")
    specs = fp8.engines({})
    assert all(s.quantized for s in specs)
    run = orchestrate.Run(out, work, 1e12, False, lambda: True)
    with pytest.raises(SystemExit, match=r"e2e: compressed_tensors(, loguru)? not found"):
        run.phase(fp8, specs)
    assert started == []
    curve = next(p for p in phases.PHASES if p.name == "curve")
    assert not any(s.quantized for s in curve.engines({}))
    run.phase(curve, curve.engines({})[:1])
    assert started == ["curve.plain.none.full"]


def test_moe_backend_probe_and_log_line() -> None:
    class TritonExperts:
        pass

    triton = SimpleNamespace(name="TRITON")
    fp8 = SimpleNamespace(
        fp8_backend=triton,
        experts_cls=TritonExperts,
        moe_kernel=SimpleNamespace(fused_experts=TritonExperts()),
    )
    assert probes.backend_of(fp8) == "TRITON/TritonExperts"
    bf16 = SimpleNamespace(unquantized_backend=triton, experts_cls=TritonExperts)
    assert probes.backend_of(bf16) == "TRITON/TritonExperts"
    assert probes.backend_of(SimpleNamespace()) == "?/?"

    class Layer:
        def __init__(self, method: Any) -> None:
            self.quant_method = method
            self.w13_weight = None

    class Model:
        def named_modules(self) -> list[tuple[str, Any]]:
            return [("a", Layer(fp8)), ("b", Layer(fp8)), ("c", SimpleNamespace())]

    assert probes.moe_backends(Model()) == {"TRITON/TritonExperts": 2}
    log = "\n".join(
        [
            "(EngineCore pid=1) INFO 12-01 [fp8.py:325] Using TRITON Fp8 MoE backend out of "
            "potential backends: ['TRITON', 'FLASHINFER_CUTLASS', 'DEEPGEMM'].",
            "INFO Using TRITON Unquantized MoE backend out of potential backends: ['TRITON'].",
        ]
    )
    facts = orchestrate.log_facts(log)
    assert len(facts["moe_backend_log"]) == 2 and "Fp8 MoE backend" in facts["moe_backend_log"][0]


def test_fp8_targets_in_the_summary() -> None:
    tokens = [[s, s + 1, s + 2] for s in range(8)]
    results: dict[str, Any] = {}
    speeds = {
        "none.full": {1: 600.0, 8: 2000.0},
        "row32dev.full": {1: 200.0, 8: 300.0},
        engines.FP8_UVA_LABEL: {1: 100.0, 8: 280.0},
        "row128dev.full": {1: 560.0, 8: 1700.0},
        "online.none.full": {1: 500.0},
        "online.row32dev.full": {1: 150.0},
        engines.FP8_DEFAULT_LABEL: {1: 200.0, 8: 300.0},
    }
    for spec in engines.fp8():
        label = spec.name.split(".", 2)[2]
        results[spec.name] = _record(spec, speeds[label], tokens)
    results["fp8.plain.row128dev.full"]["steps"]["decode"]["8"]["tokens"] = [
        [0, 1, 2],
        [1, 9, 3],
        *tokens[2:],
    ]
    results["fp8.plain.row32default.full"]["route"] = {"planners": {"device": 8}}
    text = "\n".join(steps_report.report(results))
    assert "FP8 experts, fp8.plain" in text and "targets (fp8.plain, issue 22):" in text
    assert "  b1 row128dev.full >= 0.9 x none.full: 560 / 600 tok/s = 0.933 (met)" in text
    assert "  b8 row128dev.full >= 0.9 x none.full: 1700 / 2000 tok/s = 0.850 (MISSED)" in text
    assert "  b1 row32dev.full >= 1.3 x uva3375.full: 200 / 100 tok/s = 2.000 (met)" in text
    assert "  b8 row32dev.full >= 1.3 x uva3375.full: 300 / 280 tok/s = 1.071 (MISSED)" in text
    assert "  tokens row32dev.full identical to none.full (b1, b8): met" in text
    assert "  tokens row128dev.full identical to none.full (b1, b8): MISSED" in text
    assert "  tokens online.row32dev.full identical to online.none.full (b1): met" in text
    assert "  MoE backend online.none.full: TRITON/TritonExperts (vLLM: INFO" in text
    assert "  tokens row32default.full identical to none.full (b1, b8): met" in text
    default = "  default planner of row32default.full: device in every layer"
    assert f"{default} (device 8): met" in text
    results["fp8.plain.row32default.full"]["route"] = {"planners": {"device": 7, "host": 1}}
    text = "\n".join(steps_report.report(results))
    assert f"{default} (device 7, host 1): MISSED" in text
    del results["fp8.plain.row32default.full"]["route"]
    assert f"{default} (none recorded): MISSED" in "\n".join(steps_report.report(results))
    # The curve gets a table and no targets; the steps comparison keeps issue 18's.
    curve = {s.name: _record(s, {1: 90.0}, tokens) for s in engines.curve()}
    text = "\n".join(steps_report.report(curve))
    assert "the curve, curve.plain" in text and "targets" not in text
    skewed = {
        s.name: _record(s, {1: 90.0, 8: 100.0}, tokens) for s in engines.fp8(engines.QWEN8_FP8_SKEW)
    }
    text = "\n".join(steps_report.report(skewed))
    assert "  b1 row32dev.full >= 3 x uva3375.full: 90 / 90 tok/s = 1.000 (MISSED)" in text


def test_command_line_knows_the_new_labels(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "tools/vllm/e2e.py",
            "run",
            "--out",
            str(tmp_path),
            "--phases",
            "curve",
            "--only",
            "uva900.full,row7dev.full",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "unknown engines ['row7dev.full']" in done.stderr
    helped = subprocess.run(
        [sys.executable, "tools/vllm/e2e.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    for phase in ("curve:", "curve_skew:", "fp8:", "fp8_skew:"):
        assert phase in helped.stdout
    assert "uva3375.full" in helped.stdout
