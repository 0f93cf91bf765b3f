"""The steps comparison of tools/vllm/e2e.py (phases ``steps`` and ``steps_skew``) without vLLM
or a GPU: the engines' specs and engine arguments (checked against vLLM's ``EngineArgs`` in the
wheels where they are at hand), the measurement order and deadline logic on a fake clock, the
engine deadlines and records of a budgeted phase, the route probe, token comparison and the
summary's table and targets.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm_wheels

from tools.vllm.harness import (
    child,
    engines,
    measure,
    model_engines,
    orchestrate,
    phases,
    probe_lines,
    probes,
    scale_guard,
    shadow,
    slot_watch,
    steps_report,
    trace,
)
from tools.vllm.harness.measure import Completion
from tools.vllm.harness.specs import EngineSpec, Job, Mode, Planner, Workload

ROOT = Path(__file__).resolve().parents[1]


# -- specs --------------------------------------------------------------------------------


def test_steps_engines_and_their_arguments() -> None:
    plain = engines.steps()
    assert [s.name for s in plain] == [f"steps.plain.{label}" for label in engines.STEPS_LABELS]
    skew = engines.steps(engines.QWEN8_SKEW)
    assert {s.checkpoint.builder_args()[-2:] == ["--router-skew", "1.0"] for s in skew} == {True}
    assert [s.name for s in engines.steps(only=("row32dev.eager", "none.eager"))] == [
        "steps.plain.none.eager",
        "steps.plain.row32dev.eager",
    ]
    with pytest.raises(SystemExit, match="unknown engines"):
        engines.steps(only=("row8",))
    by = {s.name.split(".", 2)[2]: s for s in plain}
    for label, spec in by.items():
        assert EngineSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
        job = Job(spec, "/m", "/b", 30.0, deadline=123.0)
        assert Job.from_json(json.loads(json.dumps(job.to_json()))) == job
        ref = {Mode.EAGER: "none.eager", Mode.PIECEWISE: "none.piecewise"}.get(
            spec.mode, "none.full"
        )
        assert spec.compare_with == (f"steps.plain.{ref}",), label
        assert label.split(".")[-1] == ref.split(".")[-1], label  # the same graph mode
        assert 0 < spec.time_once_s <= spec.time_full_s
    common = {
        "model": "/w/qwen8",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": 2304,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_bytes": 2 << 30,
        "gpu_memory_utilization": 0.02,
        "hf_overrides": {"max_position_embeddings": 4096},
        "enable_prefix_caching": False,
    }
    graphs = {
        "compilation_config": {
            "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32],
            "inductor_compile_config": child.deterministic_inductor(),
        }
    }
    assert child.engine_kwargs(by["none.full"], "/w/qwen8") == common | graphs
    assert child.engine_kwargs(by["none.eager"], "/w/qwen8") == common | {"enforce_eager": True}
    uva = child.engine_kwargs(by["uva675.full"], "/w/qwen8")
    assert uva == common | graphs | {
        "offload_backend": "uva",
        "cpu_offload_gb": 6.75,
        "cpu_offload_params": ["experts"],
    }
    prefetch = child.engine_kwargs(by["prefetch.full"], "/w/qwen8")
    assert prefetch == common | graphs | {
        "offload_backend": "prefetch",
        "offload_group_size": 8,
        "offload_num_in_group": 7,
        "offload_prefetch_step": 1,
        "offload_params": ["experts"],
    }
    assert child.llm_arguments(prefetch)["offload_params"] == {"experts"}
    assert child.llm_arguments(uva)["cpu_offload_params"] == {"experts"}
    json.dumps(prefetch)  # recorded as llm_kwargs
    rowcache = {"moe_expert_cache_size": 32, "moe_expert_cache_provider": "row"}
    rowcache["moe_expert_cache_planner"] = "device"
    raw = rowcache | {"moe_expert_cache_compress": "off"}  # the raw-byte cache, set
    row = child.engine_kwargs(by["row32dev.full"], "/w/qwen8")
    assert row == common | graphs | {"additional_config": {"rowcache": raw}}
    row_eager = child.engine_kwargs(by["row32dev.eager"], "/w/qwen8")
    assert row_eager["enforce_eager"] and row_eager["additional_config"]["rowcache"] == raw
    host_eager = child.engine_kwargs(by["row32host.eager"], "/w/qwen8")
    assert host_eager["enforce_eager"]
    assert host_eager["additional_config"]["rowcache"] == rowcache | {
        "moe_expert_cache_planner": "host",
        "moe_expert_cache_split": "expert",  # the token split would copy far more at b32
    }
    assert by["row32dev.full"].knob is not None
    assert by["row32dev.full"].knob.planner is Planner.DEVICE
    # A 2,048-token prompt plus its first token fits the model length; the prompt is one step.
    w = engines.STEPS_WORKLOAD
    assert (w.batches, w.decode_tokens, w.repeats, w.prefill_tokens) == ((1, 8, 32), 256, 3, 2048)
    assert w.prefill_tokens < by["none.full"].max_model_len
    assert by["none.full"].max_num_batched_tokens >= w.prefill_tokens
    assert max(w.batches) in by["none.full"].capture_sizes


@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
def test_engine_argument_names_are_vllms(version: str) -> None:
    """Every argument a steps engine passes is a field of vLLM's ``EngineArgs`` (what ``LLM``
    hands its ``**kwargs`` to), and the offload backends are ``OffloadConfig``'s."""
    args_path, offload_path = "vllm/engine/arg_utils.py", "vllm/config/offload.py"
    found = vllm_wheels.read(version, args_path, offload_path)
    args, offload = found[args_path], found[offload_path]
    fields = set(re.findall(r"^    (\w+): ", args, flags=re.MULTILINE))
    names = {k for s in engines.steps() for k in child.engine_kwargs(s, "/m")}
    assert names - fields == set()
    backends = re.search(r"OffloadBackend = Literal\[([^\]]*)\]", offload)
    assert backends is not None
    for spec in engines.steps():
        if spec.offload is not None:
            assert f'"{spec.offload.backend.value}"' in backends.group(1)


# -- measurement order and deadlines --------------------------------------------------------


class FakeEngine:
    """``generate`` and ``stats`` of an engine on a fake clock: each call costs ``per_step``
    seconds per generated token position (plus ``prefill`` per prompt token / 1000)."""

    def __init__(self, per_step: dict[int, float], prefill: float = 0.1) -> None:
        self.now = 1000.0
        self.per_step = per_step
        self.prefill = prefill
        self.calls: list[tuple[int, int, int]] = []  # (batch, prompt length, max_tokens)
        self.hits = 0

    def clock(self) -> float:
        return self.now

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        self.calls.append((len(prompts), len(prompts[0]), max_tokens))
        self.now += self.per_step.get(len(prompts), 0.01) * max_tokens
        self.now += self.prefill * len(prompts[0]) / 1000
        self.hits += len(prompts) * max_tokens
        return [Completion([p[0] + k for k in range(max_tokens)], 0.05) for p in prompts]

    def stats(self) -> list[dict[str, Any]]:
        return [{"hits": self.hits, "misses": self.hits // 3, "passes": 2}]


def test_everything_measured_in_order_with_time_enough() -> None:
    fake = FakeEngine({1: 0.01, 8: 0.02, 32: 0.05})
    saved: list[int] = []
    w = Workload()
    record = measure.run_workload(
        w,
        fake.generate,
        fake.now + 600,
        fake.clock,
        fake.stats,
        lambda r: saved.append(len(r["events"])),
    )
    order = []
    for b in (1, 8, 32):
        order += [(b, 8, 16), (b, 8, 16), (b, 8, 256)]
    order += [(1, 2048, 1)] * 4 + [(b, 8, 256) for _ in range(2) for b in (1, 8, 32)]
    assert fake.calls == order
    for b in (1, 8, 32):
        entry = record["decode"][str(b)]
        assert entry["repeats_run"] == 3 and entry["skipped"] is None
        assert entry["tok_s"] == round(b * 256 / (fake.per_step[b] * 256 + 0.0008), 1)
        assert len(entry["tokens"]) == b and all(len(t) == 256 for t in entry["tokens"])
        assert entry["tokens"][0][0] == measure.FIRST_PROMPT[0]
        assert entry["repeats_identical"] is True
        assert entry["cache"]["hits"] == 3 * b * 256 and entry["cache"][
            "hit_rate"
        ] == pytest.approx(0.75, abs=0.01)
        assert entry["cache"]["passes"] == 0
    ttft = record["ttft"]
    assert len(ttft["ms_runs"]) == 3 and ttft["ms"] == pytest.approx(0.01 * 1000 + 0.2048 * 1000)
    assert ttft["engine_ms_runs"] == [50.0] * 3 and len(ttft["first_tokens"]) == 3
    assert len(saved) == 3 * 3 + 3 + 1  # after every timed generation, and at the end


def test_prompts_are_distinct_and_stable() -> None:
    w = Workload()
    b32 = measure.decode_prompts(w, 32)
    assert measure.decode_prompts(w, 8) == b32[:8] and len({tuple(p) for p in b32}) == 32
    assert b32[0] == list(measure.FIRST_PROMPT)
    long = measure.prefill_prompts(w)
    assert len(long) == 4 and {len(p) for p in long} == {2048}
    assert len({p[0] for p in long}) == 4  # no shared prefix block
    assert all(3 <= t < w.vocab for p in long + b32[1:] for t in p)
    assert measure.prefill_prompts(w) == long


def test_deadline_costs_repeats_first_and_keeps_ttft() -> None:
    # b32 at 0.2 s per step: a timed generation takes 51 s. With 50 s, b1 and b8 fit once,
    # b32's warm-ups run, but its generation would eat the time the long prompts need; then
    # b1's repeats fit, and b8's second, not its third.
    fake = FakeEngine({1: 0.01, 8: 0.05, 32: 0.2})
    w = Workload()
    record = measure.run_workload(w, fake.generate, fake.now + 50, fake.clock, None, None)
    b32 = record["decode"]["32"]
    assert b32["repeats_run"] == 0 and b32["tok_s"] is None
    assert b32["skipped"].startswith("deadline: a generation takes about 51.2 s")
    assert record["ttft"]["ms"] is not None and len(record["ttft"]["ms_runs"]) == 3
    assert record["decode"]["1"]["repeats_run"] == 3
    b8 = record["decode"]["8"]
    assert b8["repeats_run"] == 2 and b8["repeats_cut"].startswith("deadline")
    assert fake.now <= 1000 + 50
    assert any("b32 repeat 1 not run" in e for e in record["events"])


def test_no_time_at_all() -> None:
    fake = FakeEngine({})
    record = measure.run_workload(Workload(), fake.generate, fake.now - 1, fake.clock)
    assert fake.calls == []
    assert all(e["skipped"] for e in record["decode"].values())
    assert record["ttft"]["skipped"] == "deadline: no time left"


def test_child_workload_with_a_fake_llm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """child.workload against an object with vLLM's generate/apply_model surface."""

    class LLM:
        def __init__(self) -> None:
            self.model = SimpleNamespace(named_modules=lambda: [])

        def generate(self, batch: list[Any], sp: Any, use_tqdm: bool = False) -> list[Any]:
            ids = [p["prompt_token_ids"] for p in batch]
            return [
                SimpleNamespace(
                    outputs=[SimpleNamespace(token_ids=[i[0]] * sp.max_tokens)],
                    metrics=SimpleNamespace(first_token_latency=0.02),
                )
                for i in ids
            ]

    spec = engines.steps(only=("row32dev.full",))[0]
    small = Workload(batches=(1, 2), decode_tokens=4, warmup_tokens=2, prefill_tokens=16)
    spec = EngineSpec.from_json(
        {**spec.to_json(), "workload": small.__dict__ | {"batches": [1, 2]}}
    )
    job = Job(spec, "/m", str(tmp_path), 30.0, deadline=None)
    layer = {"hits": 3, "misses": 1, "capacity": 32, "provider": "DevicePlannedProvider"}

    asked: list[Any] = []

    def rpc(fn: Any, default: Any) -> Any:
        asked.append(fn)
        return [layer | {"split": "expert"}] if fn is probes.stats else {"routes": {}}

    saved: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    sampling = SimpleNamespace  # SamplingParams(**kw) stand-in
    child.workload(job, LLM(), rpc, result, saved.append, sampling)
    assert result["steps"]["decode"]["2"]["tokens"] == [
        [1] * 4,
        [measure.decode_prompts(small, 2)[1][0]] * 4,
    ]
    assert result["steps"]["ttft"]["engine_ms_runs"] == [20.0] * 3
    assert result["cache"]["capacity"] == 32 and result["route"] == {"routes": {}}
    assert saved and all(s["partial"] for s in saved)
    # the exactness probe, last, asks only for steps the engine can schedule
    assert asked[-1].func is probes.exactness
    assert asked[-1].keywords == {"row_counts": probes.exactness_rows(2048)}
    out = tmp_path / "r.json"
    child.write_atomic(out, result)
    assert "profile" not in result  # not asked for: no profile_out

    # With ``run --profile``: one profile of a b1 decode after the measurements; a failing
    # profile is recorded and the measurements stand.
    asked_profile: list[Any] = []

    def fake_profile(llm: Any, name: str, out: Path, prompts: list[Any]) -> dict[str, Any]:
        asked_profile.append((name, out, prompts))
        if len(asked_profile) > 1:
            raise RuntimeError("profiler busy")
        return {"tokens": 64}

    monkeypatch.setattr(child, "profile", fake_profile)
    profiled = Job(spec, "/m", str(tmp_path), 30.0, profile_out=str(tmp_path / "p.txt"))
    for expected in ({"tokens": 64}, None):
        again: dict[str, Any] = {}
        child.workload(profiled, LLM(), rpc, again, saved.append, sampling)
        assert again.get("profile") == expected and again["steps"]["decode"]["1"]["tok_s"]
    assert again["profile_error"] == "RuntimeError: profiler busy"
    assert asked_profile[0][2] == [{"prompt_token_ids": measure.decode_prompts(small, 1)[0]}]

    # With ``run --shadow``: the shadow check's counters are read after the measurements and
    # before the exactness probe (whose own forwards the check would count), and the check is
    # taken off in between (its counters take no forward outside inference mode); the job
    # says so.
    asked.clear()
    monkeypatch.setattr(shadow, "uninstall", lambda: asked.append("uninstalled"))
    shadowed = Job(spec, "/m", str(tmp_path), 30.0, shadow=True)
    assert Job.from_json(json.loads(json.dumps(shadowed.to_json()))) == shadowed
    child.workload(shadowed, LLM(), rpc, {}, saved.append, sampling)
    assert asked[-3] is shadow.counts and asked[-2] == "uninstalled"
    assert asked[-1].func is probes.exactness
    assert shadow.counts not in asked[: asked.index(shadow.counts)]

    # With ``run --trace``: on over the first generation only (the same in every engine), read
    # after the measurements, then taken off.
    asked.clear()
    generated: list[int] = []
    llm = LLM()
    real_generate = llm.generate

    def counted(batch: list[Any], sp: Any, use_tqdm: bool = False) -> list[Any]:
        generated.append(len(asked))
        return real_generate(batch, sp, use_tqdm)

    llm.generate = counted  # type: ignore[method-assign]
    monkeypatch.setattr(trace, "uninstall", lambda: asked.append("untraced"))
    traced = Job(spec, "/m", str(tmp_path), 30.0, trace=True)
    assert Job.from_json(json.loads(json.dumps(traced.to_json()))) == traced
    child.workload(traced, llm, rpc, {}, saved.append, sampling)
    assert asked[:2] == [trace.start, trace.stop] and generated[0] == 1
    assert asked.count(trace.start) == 1 and asked.count(trace.stop) == 1
    assert asked[asked.index(trace.read) + 1] == "untraced"

    # The decode profile leaves time for the probes after the workload only where they run:
    # a cache engine's, not no offload's.
    probes_after: list[bool] = []
    real = child.run_workload

    def spy(*args: Any) -> dict[str, Any]:
        probes_after.append(args[-1])
        return real(*args)

    monkeypatch.setattr(child, "run_workload", spy)
    plain = engines.steps(only=("none.full",))[0]
    plain = EngineSpec.from_json({**plain.to_json(), "workload": spec.to_json()["workload"]})
    for engine in (spec, plain):
        child.workload(
            Job(engine, "/m", str(tmp_path), 30.0), LLM(), rpc, {}, saved.append, sampling
        )
    assert probes_after == [True, False]
    assert json.loads(out.read_text())["steps"]["decode"]["1"]["repeats_run"] == 3


# -- the route the plugin took --------------------------------------------------------------


def test_route_of() -> None:
    assert probes.route_of(False, "token", None, False).startswith("exact: token split")
    assert probes.route_of(True, "expert", "_MoeSumTap", False).startswith("exact: passes'")
    assert probes.route_of(False, "expert", "_MoeSumTap", False).startswith("exact: passes'")
    assert probes.route_of(True, "expert", None, True).startswith("INEXACT")
    assert probes.route_of(True, "expert", None, False).startswith("unknown")


def test_routes_reads_the_plugin_objects() -> None:
    class _MoeSumTap:
        pass

    class DevicePlannedProvider:
        planner = "device"
        split = "expert"

        def stats(self) -> dict[str, int]:
            return {"passes": 5}

    experts = SimpleNamespace()
    experts.moe_sum = _MoeSumTap()
    method = SimpleNamespace(
        rowcache_provider=DevicePlannedProvider(),
        moe_kernel=SimpleNamespace(fused_experts=experts),
        _inexact_said=False,
    )
    plain = SimpleNamespace(quant_method=SimpleNamespace(rowcache_provider=None))
    model = SimpleNamespace(
        named_modules=lambda: [("a", SimpleNamespace(quant_method=method)), ("b", plain)] * 2
    )
    found = probes.routes(model)
    assert found == {
        "routes": {"exact: passes' unreduced entries, one moe_sum per step": 2},
        "planners": {"device": 2},
        "device_passes": 10,
        "planes_layers": 0,
    }
    # A host-planned layer (any other provider) with the token split.
    host = SimpleNamespace(
        rowcache_provider=SimpleNamespace(planner="host", split="token"),
        moe_kernel=SimpleNamespace(fused_experts=SimpleNamespace()),
    )
    model = SimpleNamespace(
        named_modules=lambda: [
            ("a", SimpleNamespace(quant_method=method)),
            ("c", SimpleNamespace(quant_method=host)),
        ]
    )
    found = probes.routes(model)
    assert found["planners"] == {"device": 1, "host": 1}
    assert found["device_passes"] == 5
    # A layer whose experts are held as planes (its provider names what it compressed).
    method.rowcache_provider.compressed = ("w13", "w2")
    assert probes.routes(model)["planes_layers"] == 1


# -- a budgeted phase -----------------------------------------------------------------------


def test_engine_deadline() -> None:
    # Enough for everything: 1.5 x its full estimate at most.
    assert orchestrate.engine_deadline(0, 1000, 100, 200, [50, 50]) == 300
    # Leaves the later engines their once where it can ...
    assert orchestrate.engine_deadline(0, 400, 100, 300, [150, 100]) == 150
    # ... but never less than its own once.
    assert orchestrate.engine_deadline(0, 200, 100, 300, [150, 100]) == 100
    # Not started without its once.
    assert orchestrate.engine_deadline(0, 90, 100, 300, []) is None
    assert orchestrate.engine_deadline(0, 500, 100, 0, []) == 500


def _fake_result(spec: EngineSpec, tokens: list[list[int]]) -> dict[str, Any]:
    decode = {
        str(b): {"tok_s": 100.0 * b, "repeats_run": 3, "tokens": tokens[:b], "cache": None}
        for b in (1, 8, 32)
    }
    ttft = {"ms": 200.0, "ms_runs": [200.0] * 3, "first_tokens": [t[0] for t in tokens[:3]]}
    return {
        "name": spec.name,
        "spec": spec.to_json(),
        "ok": True,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "steps": {"decode": decode, "ttft": ttft},
    }


def _fake_budget(
    tmp_path: Path, monkeypatch: Any
) -> tuple[Path, Path, list[float], list[tuple[str, float | None]]]:
    """OUT and WORK under ``tmp_path``, a fake clock, and ``Run.engines`` faked: each engine
    is recorded with its deadline and takes its once estimate on the clock."""
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (work / "logs").mkdir(parents=True)
    clock = [0.0]
    monkeypatch.setattr(orchestrate.time, "time", lambda: clock[0])
    given: list[tuple[str, float | None]] = []

    def engines_(self: Any, specs: list[EngineSpec], deadline: float | None = None) -> Any:
        given.append((specs[0].name, deadline))
        clock[0] += specs[0].time_once_s
        return [_fake_result(specs[0], [[1, 2]] * 32)]

    monkeypatch.setattr(orchestrate.Run, "engines", engines_)
    return out, work, clock, given


def test_budgeted_phase_records_deadlines_and_resume(tmp_path: Path, monkeypatch: Any) -> None:
    out, work, clock, given = _fake_budget(tmp_path, monkeypatch)
    phase = next(p for p in phases.PHASES if p.name == "steps")
    run = orchestrate.Run(
        out, work, 450.0, False, lambda: True, only=("none.full", "uva675.full", "prefetch.full")
    )
    results = run.phase(phase, phase.engines({}))
    assert [n for n, _ in given] == ["steps.plain.none.full", "steps.plain.uva675.full"]
    # none.full leaves uva and prefetch their once (160 + 370 s), but keeps its own 105 s and,
    # the call's first engine, the model-info cache's (FIRST_ENGINE_S); uva then ends at
    # 265 s (its own 160: not the first), and prefetch does not start with 185 s left.
    assert given[0][1] == 105.0 + orchestrate.FIRST_ENGINE_S
    assert given[1][1] == 105.0 + 160.0
    assert results["steps.plain.prefetch.full"]["error"].startswith("not run: time")
    lines = (out / orchestrate.RECORDS).read_text().splitlines()
    assert [json.loads(x)["name"] for x in lines] == [n for n, _ in given]
    assert (out / "logs.tar.gz").exists()
    # The next call on the same machine: --resume runs only what is missing.
    done = orchestrate.resumable(orchestrate.read_records(work / orchestrate.RECORDS))
    assert sorted(done) == ["steps.plain.none.full", "steps.plain.uva675.full"]
    given.clear()
    clock[0] = 0.0
    again = orchestrate.Run(out, work, 600.0, False, lambda: True, done=done)
    results = again.phase(phase, phase.engines({}))
    assert [n for n, _ in given][:4] == [
        "steps.plain.none2.full",
        "steps.plain.row32dev.full",
        "steps.plain.row32planes.full",
        "steps.plain.none.eager",
    ]
    assert results["steps.plain.none.full"] is done["steps.plain.none.full"]
    names = [json.loads(x)["name"] for x in (out / orchestrate.RECORDS).read_text().splitlines()]
    assert names[:2] == ["steps.plain.none.full", "steps.plain.uva675.full"]
    assert len(names) == len(set(names))


def test_a_resumed_call_s_records_keep_earlier_engines_it_does_not_run(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """OUT/records.jsonl of a resumed call holds the whole run: an earlier engine the deadline
    cut short (not resumable) stays there, while another phase runs, until it runs again, and
    an engine run again replaces its earlier record."""
    out, work, _clock, given = _fake_budget(tmp_path, monkeypatch)
    phase = next(p for p in phases.PHASES if p.name == "steps")
    specs = phase.engines({})
    cut = _fake_result(specs[2], [[1, 2]] * 32)
    cut["partial"] = True  # the deadline cut it short: runs again on resume
    failed = {"name": specs[3].name, "ok": False, "error": "RuntimeError: x"}
    earlier = [_fake_result(specs[0], [[1, 2]] * 32), cut, failed]
    done = orchestrate.resumable(earlier)
    assert sorted(done) == [specs[0].name]
    again = orchestrate.Run(
        out,
        work,
        600.0,
        False,
        lambda: True,
        only=("row32planes.full",),
        done=done,
        earlier=orchestrate.latest(earlier),
    )
    again.phase(phase, specs)
    assert [n for n, _ in given] == [specs[3].name]
    records = [json.loads(x) for x in (out / orchestrate.RECORDS).read_text().splitlines()]
    assert [r["name"] for r in records] == [specs[0].name, specs[2].name, specs[3].name]
    assert records[1]["partial"] and records[2].get("ok")


def test_a_resumed_call_judges_its_engines_against_earlier_calls_references(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A call that runs only the control and a cache engine (``--only``) after an earlier call
    ran their reference: its results hold the reference's record, so its summary judges the
    tokens (gpt-oss, 2026-12-07: call 5's summary said "not measured" for identical tokens)."""
    out, work, _clock, given = _fake_budget(tmp_path, monkeypatch)
    phase = next(p for p in phases.PHASES if p.name == "steps")
    specs = phase.engines({})
    none = next(s for s in specs if s.name.endswith(".none.full"))
    done = {none.name: _fake_result(none, [[1, 2]] * 32)}
    only = ("none2.full", "row32dev.full")
    run = orchestrate.Run(out, work, 900.0, False, lambda: True, only=only, done=done)
    results = run.phase(phase, specs)
    assert [n for n, _ in given] == ["steps.plain.none2.full", "steps.plain.row32dev.full"]
    assert list(results) == [none.name, *(n for n, _ in given)]
    assert results[none.name] is done[none.name]
    lines = steps_report.targets(results, "steps.plain")
    assert lines[1:] == [
        "  tokens none2.full identical to no offload (the control: a second no-offload "
        "engine): met",
        "  tokens row32dev.full identical to no offload: met",
    ]


def test_the_first_engine_that_starts_gets_the_first_engines_time(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """FIRST_ENGINE_S goes to the first engine the call starts (not to one an earlier call
    completed, nor to one that did not fit), and the zygote starts before that engine's
    deadline is set, only when the engine will start."""
    out, work, clock, events = _fake_budget(tmp_path, monkeypatch)

    def start_zygote(self: Any) -> None:
        events.append(("zygote", None))
        clock[0] += 20.0

    monkeypatch.setattr(orchestrate.Run, "start_zygote", start_zygote)
    phase = next(p for p in phases.PHASES if p.name == "steps")
    specs = phase.engines({})
    done = {specs[0].name: _fake_result(specs[0], [[1, 2]] * 32)}  # none.full: resumed
    only = ("none.full", "row32dev.full", "none.eager", "row32host.eager")
    # In 150 s: row32dev (170 s once, 195 as the first) does not fit, and starts no zygote;
    # none.eager (80 + 25) does, after the zygote's 20 s, leaving row32host its 130 s where it
    # can (it cannot: the first engine keeps its 105); row32host then does not fit.
    run = orchestrate.Run(out, work, 150.0, False, lambda: True, only=only, done=done, zygote=True)
    results = run.phase(phase, specs)
    first = 80.0 + orchestrate.FIRST_ENGINE_S
    assert events == [("zygote", None), ("steps.plain.none.eager", 20.0 + first)]
    assert results["steps.plain.row32dev.full"]["error"].startswith("not run: time")
    assert results["steps.plain.row32host.eager"]["error"].startswith("not run: time")
    assert run.started_any


def test_the_first_engine_on_a_fresh_machine_gets_its_cold_start(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A work directory no engine has run under (no ``vcache``) means empty compile caches:
    the call's first engine gets ``COLD_START_S`` beyond ``FIRST_ENGINE_S``, the next none."""
    out, work, clock, given = _fake_budget(tmp_path, monkeypatch)
    assert orchestrate.cold_machine(work)
    orchestrate.engine_cache_root(work, "steps.plain.none.full")
    assert not orchestrate.cold_machine(work)
    phase = next(p for p in phases.PHASES if p.name == "steps")
    specs = [s for s in phase.engines({}) if s.name.endswith((".none.full", ".uva675.full"))]
    deadlines = {}
    for cold in (True, False):
        given.clear()
        clock[0] = 0.0
        run = orchestrate.Run(out, work, 900.0, False, lambda: True, cold=cold)
        run.budgeted(specs)
        deadlines[cold] = [deadline for _, deadline in given]
    # With time enough each ends at 1.5 x its full estimate, the first's with its extra.
    extra = orchestrate.FIRST_ENGINE_S + orchestrate.COLD_START_S
    none, uva = specs
    assert deadlines[True][0] == 1.5 * (none.time_full_s + extra)
    assert deadlines[False][0] == 1.5 * (none.time_full_s + orchestrate.FIRST_ENGINE_S)
    for cold in (True, False):  # the second starts where the first's once ended: no extra
        assert deadlines[cold][1] == none.time_once_s + 1.5 * uva.time_full_s


def test_an_engine_without_an_estimate_is_not_capped(tmp_path: Path, monkeypatch: Any) -> None:
    """``time_full_s`` 0 means no estimate with every repeat: the engine may use the call's
    time (after the first engine's extra, its ``once`` still counts)."""
    out, work, _, given = _fake_budget(tmp_path, monkeypatch)
    phase = next(p for p in phases.PHASES if p.name == "steps")
    spec = dataclasses.replace(phase.engines({})[0], time_full_s=0.0)
    orchestrate.Run(out, work, 900.0, False, lambda: True).budgeted([spec])
    assert given == [(spec.name, 900.0)]


def test_a_budgeted_engine_waits_for_its_own_checkpoint_only(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The FP8 run of 2026-12-02: its first engine (FP8 checkpoint) waited for the whole
    background build, the online engines' bf16 checkpoint too (29 s). Each budgeted engine now
    starts once its own checkpoint is built; the phase itself waits for nothing."""
    out, work, clock, _ = _fake_budget(tmp_path, monkeypatch)
    monkeypatch.setattr(orchestrate.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    started: list[tuple[str, float]] = []

    def engines_(self: Any, specs: list[EngineSpec], deadline: float | None = None) -> Any:
        started.append((specs[0].name, clock[0]))
        clock[0] += 5.0
        return [_fake_result(specs[0], [[1, 2]] * 32)]

    monkeypatch.setattr(orchestrate.Run, "engines", engines_)
    monkeypatch.setattr(orchestrate, "require_quantization_packages", lambda: None)
    fp8 = next(p for p in phases.PHASES if p.name == "fp8")
    specs = [s for s in fp8.engines({}) if s.name.endswith(("plain.none.full", "online.none.full"))]
    assert [s.checkpoint for s in specs] == [engines.QWEN8_FP8, engines.QWEN8]
    built = {engines.QWEN8_FP8: 40.0, engines.QWEN8: 70.0}
    run = orchestrate.Run(
        out,
        work,
        2000.0,
        False,
        lambda: clock[0] >= 70.0,
        checkpoint_ready=lambda c: clock[0] >= built[c],
    )
    results = run.phase(fp8, specs)
    assert started == [(specs[0].name, 40.0), (specs[1].name, 70.0)]
    # Recorded: none.full from the call's start, online.none.full from none.full's end (45 s).
    assert [results[s.name]["checkpoint_wait_s"] for s in specs] == [40.0, 25.0]


def test_a_record_the_deadline_cut_short_runs_again_on_resume() -> None:
    """An engine whose start took its whole share measured nothing (steps run 4: none.full
    and none.eager); one that ran out of time before b32 measured part: neither is complete,
    and --resume starts both again. A measurement the workload never asks for is no cut."""
    spec = next(s for s in phases.PHASES if s.name == "steps").engines({})[0]
    whole = _fake_result(spec, [[1, 2]] * 32)
    nothing = copy.deepcopy(whole)
    for entry in nothing["steps"]["decode"].values():
        entry["skipped"] = "deadline: no time left for its warm-up"
    nothing["steps"]["ttft"]["skipped"] = "deadline: no time left"
    part = copy.deepcopy(whole)
    part["steps"]["decode"]["32"]["skipped"] = "deadline: a generation takes about 33.2 s"
    part["steps"]["decode"]["8"]["repeats_cut"] = "deadline: a generation takes about 15 s"
    by_design = copy.deepcopy(whole)
    by_design["steps"]["ttft"]["skipped"] = "not measured (no prefill prompts in the workload)"
    assert measure.cut_short(whole["steps"]) == [] == measure.cut_short(by_design["steps"])
    assert len(measure.cut_short(nothing["steps"])) == 4
    assert measure.cut_short(part["steps"]) == [
        "b8: deadline: a generation takes about 15 s",
        "b32: deadline: a generation takes about 33.2 s",
    ]
    for record in (nothing, part):
        assert orchestrate.resumable([record]) == {}
    # the later complete record of the same engine is the one kept
    assert orchestrate.resumable([part, by_design]) == {spec.name: by_design}


def test_one_repeat_measures_everything_once_and_is_complete() -> None:
    """``run --repeats 1``: a call short of device time measures every batch size and prompt
    once; the record is complete (``--resume`` keeps it), and the engine's estimate is its
    estimate once. Bad values are refused, naming the value."""
    spec = next(s for s in phases.PHASES if s.name == "steps").engines({})[0]
    once = orchestrate.with_repeats(spec, 1)
    assert once.repeats == 1 and once.workload is not None and once.workload.repeats == 1
    assert once.time_full_s == spec.time_once_s and once.name == spec.name
    assert orchestrate.with_repeats(spec, None) is spec
    assert orchestrate.with_repeats(spec, 3).time_full_s == spec.time_full_s
    with pytest.raises(ValueError, match="got 0"):
        orchestrate.with_repeats(spec, 0)
    fake = FakeEngine({1: 0.01, 8: 0.02, 32: 0.05})
    assert once.workload is not None
    record = measure.run_workload(once.workload, fake.generate, fake.now + 600, fake.clock)
    assert [record["decode"][str(b)]["repeats_run"] for b in (1, 8, 32)] == [1, 1, 1]
    # the time to first token is a median over distinct prompts, not repeats of one
    assert len(record["ttft"]["ms_runs"]) == 3 and measure.cut_short(record) == []
    done = subprocess.run(
        [sys.executable, "tools/vllm/e2e.py", "run", "--out", "/nonexistent", "--repeats", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "--repeats: must be at least 1, got 0" in done.stderr


def test_log_facts() -> None:
    log = "\n".join(
        [
            "INFO ... Model loading took 2.57 GiB memory and 3.1 seconds",
            "INFO rowcache: 32 slots per MoE layer, provider 'row', planned on the device",
            "WARNING rowcache: the MoE kernel's experts are X, not vLLM's TritonExperts: ...",
            "INFO Offloader set to PrefetchOffloader",
        ]
    )
    facts = orchestrate.log_facts(log)
    assert facts["model_loading_log"].startswith("2.57 GiB")
    assert len(facts["plugin_log"]) == 2 and "TritonExperts" in facts["plugin_log"][1]
    assert facts["offload_log"] == ["INFO Offloader set to PrefetchOffloader"]


# -- comparison and summary -----------------------------------------------------------------


def test_divergence() -> None:
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert steps_report.divergence(ref, ref) == [None, None, None]
    assert steps_report.divergence(ref, [[1, 2, 3], [4, 0, 6], [7, 8]]) == [None, 1, 2]
    assert steps_report.divergence(ref, [[1, 2, 3]]) == [None, 0, 0]
    assert steps_report.describe([None, None]) == "= (2)"
    assert steps_report.describe([None, 12]) == "1/2 at 12"
    assert steps_report.describe([3, None, 40]) == "2/3 at 3-40"
    assert steps_report.describe(None) == "n/a"


def _results() -> dict[str, Any]:
    tokens = [[s, s + 1, s + 2] for s in range(32)]
    out: dict[str, Any] = {}
    for checkpoint in (engines.QWEN8, engines.QWEN8_SKEW):
        for spec in engines.steps(checkpoint):
            out[spec.name] = _fake_result(spec, tokens)
    row = out["steps.plain.row32dev.full"]
    row["steps"]["decode"]["8"]["tokens"] = [[0, 1, 2], *tokens[1:7], [7, 8, 0]]
    row["steps"]["decode"]["8"]["tok_s"] = 700.0
    row["steps"]["decode"]["32"]["repeats_run"] = 1
    row["route"] = {"routes": {"exact: passes' unreduced entries, one moe_sum per step": 8}}
    row["steps"]["decode"]["1"]["cache"] = {"hit_rate": 0.5}
    out["steps.plain.uva675.full"]["steps"]["ttft"]["ms"] = 250.0
    out["steps.skew.row32dev.eager"] = {
        "name": "steps.skew.row32dev.eager",
        "ok": False,
        "error": "not run: time",
    }
    return out


def test_no_ratio_between_two_runs() -> None:
    """Records of two runs (another machine, load and compilation) give no ratio; records of
    one run, or of files from before run ids, do."""
    results = _results()
    uva = results["steps.plain.uva675.full"]
    results["steps.plain.row32dev.full"]["run_id"] = "20261201T180000Z-aaaaaa"
    uva["run_id"] = "20261202T090000Z-bbbbbb"
    text = "\n".join(steps_report.targets(results, "steps.plain"))
    assert (
        "  b8 row32dev.full vs uva675.full: measured in two runs (20261201T180000Z-aaaaaa, "
        "20261202T090000Z-bbbbbb): no ratio"
    ) in text
    assert "x uva675.full:" not in text
    del uva["run_id"]
    text = "\n".join(steps_report.targets(results, "steps.plain"))
    assert "(20261201T180000Z-aaaaaa, unnamed): no ratio" in text
    uva["run_id"] = "20261201T180000Z-aaaaaa"
    text = "\n".join(steps_report.targets(results, "steps.plain"))
    assert "  b8 row32dev.full >= 0.95 x uva675.full: 700 / 800 tok/s = 0.875 (MISSED)" in text


def test_a_resumed_call_keeps_the_run_a_new_one_starts_another(tmp_path: Path) -> None:
    first = orchestrate.run_identity(tmp_path, resume=False)
    assert orchestrate.run_identity(tmp_path, resume=True) == first
    assert orchestrate.run_identity(tmp_path, resume=False) != first
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert orchestrate.run_identity(fresh, resume=True) != first  # nothing to resume there


def test_every_record_names_its_run(tmp_path: Path) -> None:
    spec = engines.steps()[0]
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / f"{spec.name}.log").write_text("")
    run = orchestrate.Run(tmp_path / "out", work, 600.0, False, lambda: True, run_id="r-1")
    record = run.collect(spec, SimpleNamespace(returncode=0))  # type: ignore[arg-type]
    assert record["run_id"] == "r-1" and record["ok"] is False  # no result: still named


def test_report_table_and_targets() -> None:
    text = "\n".join(steps_report.report(_results()))
    assert "steps comparison, steps.plain" in text and "steps comparison, steps.skew" in text
    row = next(x for x in text.splitlines() if x.startswith("row32dev.full") and "moe_sum" in x)
    assert "1/8 at 2" in row and "= (1)" in row and "= (32)" in row and "= (3)" in row
    assert "3200(1)" in row and "0.50/-/-/-" in row
    assert "  b8 row32dev.full >= 0.95 x uva675.full: 700 / 800 tok/s = 0.875 (MISSED)" in text
    assert "  ttft row32dev.full <= 0.8 x uva675.full: 200 / 250 ms = 0.800 (met)" in text
    assert "  ttft row32dev.full <= 1 x prefetch.full: 200 / 200 ms = 1.000 (met)" in text
    assert "  tokens row32dev.full identical to no offload: MISSED" in text
    assert "  tokens row32dev.eager identical to no offload: met" in text
    assert "  tokens row32host.eager identical to no offload: met" in text
    eager = "  b1 row32dev.eager >= 1 x row32host.eager: 100 / 100 tok/s = 1.000 (met)"
    assert eager in text
    assert "  b1 row32dev.full >= 4 x uva675.full: 100 / 100 tok/s = 1.000 (MISSED)" in text
    assert "row32dev.eager   FAILED: not run: time" in text
    assert next(x for x in text.splitlines() if x.startswith("none.full")).endswith(
        "reference                                -"
    )


@pytest.mark.parametrize(
    ("arenas", "said"),
    [
        ({}, "pinned in all 9.67 GB, layers"),
        (
            {
                "host_pinned_arena_bytes": 7_516_192_768,
                "host_pinned_transient_bytes": 2_147_483_648,
            },
            "pinned in all 9.67 GB (arena slabs 7.52 GB, transient slabs 2.15 GB, other "
            "0.01 GB), layers",
        ),
    ],
)
def test_the_host_memory_line_splits_the_arenas_from_the_rest(
    arenas: dict[str, int], said: str
) -> None:
    """What the planes engine pins (no target); where the probe read the arenas, how much of
    it is their slabs and how much the rest (vLLM's, torch's, or a block cached after a slab)."""
    results = _results()
    results["steps.plain.row32planes.full"]["probe"] = {
        "expert_host_bytes": 6_760_000_000,
        "host_pinned_bytes": 9_672_160_172,
        "released_layers": 8,
        **arenas,
    }
    text = "\n".join(steps_report.targets(results, "steps.plain"))
    line = f"  host memory of row32planes.full: experts 6.76 GB, {said} released 8 (no target)"
    assert line in text


def test_the_planes_engine_is_held_to_issue_36s_targets() -> None:
    results = _results()
    planes = results["steps.plain.row32planes.full"]
    planes["steps"]["decode"]["1"]["tok_s"] = 170.0
    planes["steps"]["decode"]["8"]["tokens"][3] = [3, 4, 9]
    planes["slots"] = {"layers": 8, "slots": 256, "mismatches": ["layer 2: w13[slot 4]"]}
    text = "\n".join(steps_report.targets(results, "steps.plain"))
    assert "targets (steps.plain, issue 36):" in text
    assert "  b1 row32planes.full >= 1.7 x uva675.full: 170 / 100 tok/s = 1.700 (met)" in text
    assert "  b8 row32planes.full >= 1.25 x uva675.full: 800 / 800 tok/s = 1.000 (MISSED)" in text
    assert "  ttft row32planes.full <= 0.6 x uva675.full: 200 / 250 ms = 0.800 (MISSED)" in text
    assert "  ttft row32planes.full <= 0.85 x prefetch.full: 200 / 200 ms = 1.000 (MISSED)" in text
    assert "  b1 row32planes.full >= 1 x row32dev.full: 170 / 100 tok/s = 1.700 (met)" in text
    assert "  tokens row32planes.full identical to no offload: MISSED" in text
    assert "(256 slots in 8 layers, 1 differ; first: layer 2: w13[slot 4]): MISSED" in text
    skew = "\n".join(steps_report.targets(results, "steps.skew"))
    assert "  b32 row32planes.full >= 2 x uva675.full: 3200 / 3200 tok/s = 1.000 (MISSED)" in skew
    assert "b1 row32planes.full >= 1.7" not in skew
    # The host planner's planes against its raw bytes in eager mode (no target), its tokens
    # against no offload in eager mode; they stand without the device planner's planes too.
    host = "  b1 row32hostplanes.eager >= 1 x row32host.eager: 100 / 100 tok/s = 1.000 (met)"
    assert host in text
    assert "  tokens row32hostplanes.eager identical to no offload: met" in text
    del results["steps.plain.row32planes.full"]
    alone = "\n".join(steps_report.targets(results, "steps.plain"))
    assert "issue 36" in alone and host in alone and "row32planes.full" not in alone
    del results["steps.plain.row32hostplanes.eager"]
    assert "issue 36" not in "\n".join(steps_report.targets(results, "steps.plain"))


def test_merge_of_records_from_several_calls(tmp_path: Path) -> None:
    """Two calls' records.jsonl (and a results.json), merged on the host from the command
    line, as docs/RUNNING.md runs it."""
    results = _results()
    names = list(results)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(results[n]) + "\n" for n in names[:6]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(results[n]) + "\n" for n in names[6:]))
    done = subprocess.run(
        [
            sys.executable,
            "tools/vllm/e2e.py",
            "merge",
            "--out",
            str(tmp_path / "m"),
            str(tmp_path / "a.jsonl"),
            str(tmp_path / "b.jsonl"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "m" / "summary.txt").read_text()
    assert "targets (steps.plain, issue 18):" in summary
    assert "targets (steps.skew, issue 18):" in summary
    assert set(json.loads((tmp_path / "m" / "results.json").read_text())["results"]) == set(names)


def test_command_line_checks_only(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "tools/vllm/e2e.py",
            "run",
            "--out",
            str(tmp_path),
            "--phases",
            "steps",
            "--only",
            "row8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "unknown engines ['row8']" in done.stderr
    helped = subprocess.run(
        [sys.executable, "tools/vllm/e2e.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "steps_skew:" in helped.stdout and "--resume" in helped.stdout


def test_an_engine_with_the_cache_on_needs_the_plugins_entry_point(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Without rowcache's entry point vLLM ignores additional_config: the harness stops before
    such an engine starts, never measuring vLLM without the cache under the cache's name."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_kw: [])
    with pytest.raises(
        SystemExit, match=re.escape("no rowcache entry point in 'vllm.general_plugins'")
    ):
        orchestrate.require_plugin()
    spec = next(s for s in engines.steps() if s.caches)
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    run = orchestrate.Run(tmp_path / "out", work, 600.0, False, lambda: True)
    job = run.job(spec, work / "barrier")
    with pytest.raises(SystemExit):
        run.launch(job)
    assert not (work / "logs" / f"{spec.name}.log").exists()

    class Entry:
        value = "rowcache.vllm:register"

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_kw: [Entry()])
    orchestrate.require_plugin()


def test_a_call_without_the_plugin_is_refused_before_its_first_engine(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The steps phase starts with two engines without the cache: a call without rowcache's
    entry point stops before them, not after minutes of baselines; a call whose engines all
    run without the cache (``--only``, or ``--resume`` past the cached ones) needs no plugin."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_kw: [])
    started: list[str] = []

    def fake_engines(
        self: orchestrate.Run, specs: list[Any], deadline: float | None = None
    ) -> list[dict[str, Any]]:
        started.extend(s.name for s in specs)
        return [{"name": s.name, "ok": True} for s in specs]

    monkeypatch.setattr(orchestrate.Run, "engines", fake_engines)
    monkeypatch.setattr(orchestrate, "pack_logs", lambda *_a: None)
    steps_phase = phases.select(["steps"])[0]
    specs = engines.steps()
    assert not specs[0].caches and any(s.caches for s in specs)
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    far = time.time() + 10_000.0
    run = orchestrate.Run(tmp_path / "out", work, far, False, lambda: True)
    with pytest.raises(SystemExit, match="no rowcache entry point"):
        run.phase(steps_phase, specs)
    assert started == []

    only = orchestrate.Run(
        tmp_path / "out", work, far, False, lambda: True, only=("none.full", "none2.full")
    )
    only.phase(steps_phase, specs)
    assert started == ["steps.plain.none.full", "steps.plain.none2.full"]

    cached_done = {s.name: {"name": s.name, "ok": True} for s in specs if s.caches}
    started.clear()
    resumed = orchestrate.Run(tmp_path / "out", work, far, False, lambda: True, done=cached_done)
    resumed.phase(steps_phase, specs)
    assert started == [s.name for s in specs if not s.caches]


def test_the_control_engine_is_reported_against_the_reference() -> None:
    specs = {s.name: s for s in engines.steps()}
    assert list(specs)[:2] == ["steps.plain.none.full", "steps.plain.none2.full"]
    control = specs["steps.plain.none2.full"]
    assert control.knob is None and control.offload is None
    assert control.compare_with == ("steps.plain.none.full",)
    tokens = [[1, 2, 3]] * 32
    results = {n: _fake_result(specs[n], tokens) for n in ("steps.plain.none.full",)}
    results["steps.plain.none2.full"] = _fake_result(control, [[1, 2, 4]] * 32)
    lines = steps_report.targets(results, "steps.plain")
    assert any(
        "tokens none2.full identical to no offload (the control" in line and "MISSED" in line
        for line in lines
    ), lines


def test_compiled_engines_choose_no_kernel_by_timing() -> None:
    options = child.deterministic_inductor()
    assert options["triton.autotune_pointwise"] is False
    assert options["max_autotune"] is False and options["coordinate_descent_tuning"] is False
    # "deterministic" only where the torch has it (torch 2.11, on the H200, and 2.13 do).
    assert options.get("deterministic", True) is True
    # vLLM's horizontal fusion stays on, but not chosen by timing: deterministic mode refuses
    # that timing, and vLLM turns it on unless either option is named.
    assert options["combo_kernels"] is True and options["benchmark_combo_kernel"] is False
    assert set(options) <= {
        "triton.autotune_pointwise",
        "max_autotune",
        "coordinate_descent_tuning",
        "combo_kernels",
        "benchmark_combo_kernel",
        "deterministic",
    }
    eager = next(s for s in engines.steps() if s.name.endswith("none.eager"))
    assert "compilation_config" not in child.engine_kwargs(eager, "/w/qwen8")


def test_the_exactness_probe_asks_only_for_steps_the_engine_schedules() -> None:
    """vLLM locks its MoE workspace after start-up, sized by the largest step: an engine of
    512 tokens a step refused the probe's 2,048 rows (curve phase, 2026-12-02)."""
    assert probes.exactness_rows(2048) == probes.EXACTNESS_ROWS == (1, 8, 32, 512, 2048)
    assert probes.exactness_rows(4096) == probes.EXACTNESS_ROWS
    assert probes.exactness_rows(512) == (1, 8, 32, 512)
    assert probes.exactness_rows(100) == (1, 8, 32, 100)
    assert probes.exactness_rows(1) == (1,)
    with pytest.raises(ValueError, match="got 0"):
        probes.exactness_rows(0)
    for spec in [s for p in phases.PHASES if p.name in ("curve", "fp8") for s in p.engines({})]:
        assert max(probes.exactness_rows(spec.max_num_batched_tokens)) <= (
            spec.max_num_batched_tokens
        )


def test_the_in_engine_exactness_is_reported_per_row_count() -> None:
    found = {
        "rows": [1, 8, 2048],
        "layers": 8,
        "equal": {"1": 8, "8": 8, "2048": 8},
        "max_abs": {"1": 0.0, "8": 0.0, "2048": 0.0},
        "skipped": 0,
    }
    line = probe_lines.exactness_line({"exactness": found}, "row32dev.full")
    assert line is not None and line.endswith(": met") and "2048: 8/8" in line
    found["equal"]["2048"] = 7
    found["max_abs"]["2048"] = 0.0078125
    line = probe_lines.exactness_line({"exactness": found}, "row32dev.full")
    assert line is not None and line.endswith(": MISSED") and "2048: 7/8 (max |d| 0.00781)" in line
    assert probe_lines.exactness_line({}, "row32dev.full") is None
    assert probe_lines.exactness_line(None, "row32dev.full") is None
    # Each run of the cached forward alone, where a layer missed (probes.ORDERS).
    found["by_order"] = {
        "first": {
            "equal": {"1": 8, "8": 8, "2048": 7},
            "non_finite": {"1": 0, "8": 0, "2048": 1},
        },
        "after": {"equal": {"1": 8, "8": 8, "2048": 8}, "non_finite": {"1": 0, "8": 0, "2048": 0}},
    }
    line = probe_lines.exactness_line({"exactness": found}, "row32dev.full")
    assert line is not None and line.endswith(
        ": MISSED; the cached forward on poisoned memory (1: 8/8, 8: 8/8, 2048: 7/8 "
        "(1 non-finite)); run again just after vLLM's kernel (1: 8/8, 8: 8/8, 2048: 8/8)"
    )
    del found["by_order"]
    # gpt-oss's kernel: the launch options of the cached calls against the reference's.
    same = ["block_m=16 split_k=1"]
    found["launch_flags"] = {
        "1": {"reference": same, "cached": same, "layers_differing": 0},
        "2048": {"reference": same, "cached": [*same, "block_m=64"], "layers_differing": 3},
    }
    line = probe_lines.exactness_line({"exactness": found}, "row32dev.full")
    assert line is not None
    lines = line.split("\n")
    assert lines[1].endswith("by rows (1: same, 2048: 3/8 differ)")
    assert lines[2] == (
        "    2048 rows: reference block_m=16 split_k=1 | cached block_m=16 split_k=1; block_m=64"
    )
    assert len(lines) == 3
    assert probes.EXACTNESS_ROWS[-1] == 2048  # a prefill step: every expert, several passes


class _Exited:
    """A child engine that has already exited (``subprocess.Popen``'s face to the harness)."""

    returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_an_engine_that_starts_alone_compiles_with_more_workers(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Inductor's compile workers: an engine alone on the machine (budgeted and one-at-a-time
    phases) gets ``COMPILE_THREADS_ALONE``; engines that start together get two each."""
    seen: list[str] = []

    def popen(command: list[str], stdout: Any, stderr: Any, env: dict[str, str]) -> _Exited:
        seen.append(env["TORCHINDUCTOR_COMPILE_THREADS"])
        return _Exited()

    monkeypatch.setattr(orchestrate.subprocess, "Popen", popen)
    monkeypatch.setattr(orchestrate, "require_plugin", lambda: None)
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    run = orchestrate.Run(tmp_path / "out", work, time.time() + 60, False, lambda: True)
    specs = engines.steps()[:2]
    run.engines(specs[:1])
    run.engines(specs)
    assert seen == [str(orchestrate.COMPILE_THREADS_ALONE), "2", "2"]
    assert orchestrate.COMPILE_THREADS_ALONE > orchestrate.COMPILE_THREADS_TOGETHER == 2


def test_engines_share_model_infos_and_deep_gemm_kernels_and_nothing_else(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Each engine's ``VLLM_CACHE_ROOT`` is its own (its compile cache too), with the run's one
    ``modelinfos`` and ``deep_gemm`` directories linked in: what the first engine learns of its
    model class the next reads instead of importing torch and vLLM again in a subprocess (21 to
    25 s a start in steps run 5), and the DeepGEMM kernels the first FP8 engine compiles the
    next loads (46 to 59 s a start in FP8 runs 1 and 2 of 2026-12-02)."""
    roots: list[Path] = []

    def popen(command: list[str], stdout: Any, stderr: Any, env: dict[str, str]) -> _Exited:
        roots.append(Path(env["VLLM_CACHE_ROOT"]))
        return _Exited()

    monkeypatch.setattr(orchestrate.subprocess, "Popen", popen)
    monkeypatch.setattr(orchestrate, "require_plugin", lambda: None)
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    # A root left by a call before the link: its own model-info directory is replaced.
    (work / "vcache" / "steps.plain.none2.full" / orchestrate.MODELINFOS).mkdir(parents=True)
    run = orchestrate.Run(tmp_path / "out", work, time.time() + 60, False, lambda: True)
    specs = engines.steps()[:2]
    for spec in specs:
        run.engines([spec])
    run.engines(specs[:1])  # the same engine again (a resumed call): the link stays
    first, second, again = roots
    assert first != second and first == again
    for cache in (orchestrate.MODELINFOS, orchestrate.DEEP_GEMM):
        assert (first / cache).resolve() == (second / cache).resolve()
        (first / cache / "m.json").write_text("{}")
        assert (second / cache / "m.json").read_text() == "{}"
    (first / "torch_compile_cache").mkdir()
    assert not (second / "torch_compile_cache").exists()


@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
def test_vllm_keeps_model_infos_where_the_harness_links_them(version: str) -> None:
    path = "vllm/model_executor/models/registry.py"
    registry = vllm_wheels.read(version, path)[path]
    wanted = f'Path(envs.VLLM_CACHE_ROOT) / "{orchestrate.MODELINFOS}"'
    assert wanted in registry


@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
def test_vllm_keeps_deep_gemm_kernels_where_the_harness_links_them(version: str) -> None:
    path = "vllm/utils/deep_gemm.py"
    source = vllm_wheels.read(version, path)[path]
    indent = "\n" + " " * 12
    wanted = f'os.path.join({indent}envs.VLLM_CACHE_ROOT, "{orchestrate.DEEP_GEMM}"\n'
    assert wanted in source


def test_tokens_not_compared_everywhere_are_incomplete_not_met() -> None:
    """Steps run 5: the no-offload engines never reached b32, so the cache engines' tokens were
    compared at b1, b8 and the prompts only; that is incomplete, neither met nor missed."""
    results = _results()
    results["steps.plain.none.eager"]["steps"]["decode"]["32"]["tokens"] = None
    text = "\n".join(steps_report.targets(results, "steps.plain"))
    assert "  tokens row32dev.eager identical to no offload: incomplete (not measured: b32)" in text
    assert (
        "  tokens row32host.eager identical to no offload: incomplete (not measured: b32)" in text
    )
    fp8 = "\n".join(
        steps_report.fp8_targets(results, "steps.plain")  # same verdict, the FP8 line's words
    )
    assert "  tokens row32dev.full identical to none.full (b1, b8): MISSED" in fp8  # b8 differs


def test_the_compressed_engine_is_the_device_planner_with_planes() -> None:
    by = {s.name.removeprefix("steps.plain."): s for s in engines.steps()}
    planes, row = by["row32planes.full"].knob, by["row32dev.full"].knob
    assert planes is not None and row is not None
    assert planes.config() == {**row.config(), "moe_expert_cache_compress": "on"}
    # Raw bytes set: auto holds planes in full graphs since the planes' record.
    assert row.config()["moe_expert_cache_compress"] == "off"


def test_the_probe_finds_the_torch_tensor_behind_a_triton_kernels_tensor() -> None:
    # vLLM's MXFP4 methods replace w13_weight with a triton_kernels Tensor (no is_cuda): the
    # probe counts the bytes of its storage's torch tensor, and of nothing that is neither.
    import types

    import torch

    data = torch.zeros(4, dtype=torch.uint8)
    wrapped = types.SimpleNamespace(storage=types.SimpleNamespace(data=data))
    assert probes.torch_tensor(data) is data
    assert probes.torch_tensor(wrapped) is data
    assert probes.torch_tensor(types.SimpleNamespace(storage=None)) is None
    assert probes.torch_tensor(None) is None


def test_only_weights_in_the_allocator_s_segments_count_as_gpu_memory() -> None:
    """A UVA-offloaded weight is a CUDA tensor over pinned host memory (outside every segment of
    torch's caching allocator): the probe's GPU bytes leave it out (on gpt-oss's Marlin backend
    they counted it, and the summary said vLLM kept experts on the GPU that it had offloaded)."""
    segments = probes.device_segments(
        [{"address": 5000, "total_size": 1000}, {"address": 1000, "total_size": 500}]
    )
    assert segments == [(1000, 1500), (5000, 6000)]
    inside = [1000, 1499, 5000, 5999]
    outside = [0, 999, 1500, 4999, 6000, 1 << 47]
    assert all(probes.in_segments(a, segments) for a in inside)
    assert not any(probes.in_segments(a, segments) for a in outside)
    assert not probes.in_segments(1000, [])


@pytest.mark.parametrize("option", ["shadow", "trace"])
def test_the_in_process_diagnostics_refuse_a_multiprocess_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str
) -> None:
    """``child.install_hooks``: a job with ``--shadow`` or ``--trace`` gets its hook installed
    before the engine where the engine core runs in the harness's process, and is refused,
    naming the option, where it runs in another (the hook would patch the wrong process)."""
    installed: list[str] = []
    for name, hook in (("shadow", shadow), ("trace", trace), ("slot_watch", slot_watch)):
        monkeypatch.setattr(hook, "install", lambda name=name: installed.append(name))
    spec = next(
        s for s in model_engines.models(model_engines.GPT_OSS) if s.caches
    )  # no scale guard
    job = Job(spec, "/m", str(tmp_path), 30.0, **{option: True})
    child.install_hooks(job, multiprocess=False)
    # The trace brings the slot watch (both read over the first generation).
    hooks = ["trace", "slot_watch"] if option == "trace" else [option]
    assert installed == hooks
    with pytest.raises(RuntimeError, match=f"--{option} patches .* in another"):
        child.install_hooks(job, multiprocess=True)
    assert installed == hooks
    child.install_hooks(Job(spec, "/m", str(tmp_path), 30.0), multiprocess=True)  # neither
    assert installed == hooks


def test_the_scale_guard_is_installed_where_the_spec_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``child.install_hooks``: an engine whose spec guards its scale tails (gpt-oss's no
    offload, harness/scale_guard.py) gets the guard before the engine is built, whatever the
    job's options; refused where the engine core runs in another process."""
    installed: list[str] = []
    monkeypatch.setattr(scale_guard, "install", lambda: installed.append("guard"))
    by = {s.name.split(".", 2)[2]: s for s in model_engines.models(model_engines.GPT_OSS)}
    child.install_hooks(Job(by["nonebare.full"], "/m", str(tmp_path), 30.0), multiprocess=False)
    assert installed == []
    job = Job(by["none.full"], "/m", str(tmp_path), 30.0)
    child.install_hooks(job, multiprocess=False)
    assert installed == ["guard"]
    with pytest.raises(RuntimeError, match=r"guard_scale_tails patches .* in another"):
        child.install_hooks(job, multiprocess=True)
    assert installed == ["guard"]


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("option", ["shadow", "trace"])
def test_run_diagnostics_reach_their_engines_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: bool, option: str
) -> None:
    """``e2e.py run --shadow`` and ``--trace`` hand the orchestrator their flag, which puts it
    into the jobs of the engines measuring a workload: every cache engine's for the shadow
    check, every engine's (the cache's and its references) for the trace; an engine of one
    timed generation gets neither (it never reads them)."""
    from tools.vllm import e2e

    asked: dict[str, Any] = {}

    def fake_run(*args: Any, **kwargs: Any) -> int:
        asked.update(kwargs)
        return 0

    monkeypatch.setattr(orchestrate, "run", fake_run)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() reorders it for its imports
    argv = ["run", "--out", str(tmp_path), "--phases", "gpt_oss", *([f"--{option}"] * flag)]
    assert e2e.main(argv) == 0
    assert asked[option] is flag
    runner = orchestrate.Run(tmp_path, tmp_path, time.time() + 60, False, lambda: True)
    setattr(runner, option, flag)
    models = model_engines.models(model_engines.GPT_OSS)
    assert any(not s.caches for s in models) and any(s.caches for s in models)
    for spec in models:
        wanted = flag and (spec.caches or option == "trace")
        assert getattr(runner.job(spec, tmp_path), option) is wanted, spec.name
    single = [s for s in engines.qwen8() if s.caches and s.workload is None]
    assert single and not any(getattr(runner.job(s, tmp_path), option) for s in single)


def test_the_expert_bytes_line_names_the_experts_whose_sources_differ() -> None:
    """probe_lines.expert_bytes_line: a cache engine's source digests against its no-offload
    reference's (harness/expert_bytes.py), met where every digest agrees, else the experts
    named; an engine whose digests failed says why; without digests, no line."""
    layer = {"w13": [1, 2, 3], "w2": [4, 5, 6]}
    theirs = {"layers": {"l0": layer, "l1": layer}, "skipped": 0}
    ours = {"layers": {"l0": layer, "l1": {**layer, "w2": [4, 9, 6]}}, "skipped": 0}
    results: dict[str, Any] = {
        "p.row.full": {"expert_digests": theirs, "spec": {"compare_with": ["p.none.full"]}},
        "p.none.full": {"expert_digests": theirs},
    }
    line = probe_lines.expert_bytes_line(results, "p", "row.full")
    assert line == (
        "  expert bytes of row.full's sources against none.full's own tensors (2 layers, 12 "
        "expert tensors): every digest identical: met"
    )
    results["p.row.full"]["expert_digests"] = ours
    line = probe_lines.expert_bytes_line(results, "p", "row.full")
    assert line is not None and line.endswith(": 1 differ (l1 w2 expert 1): MISSED")
    del results["p.row.full"]["expert_digests"]
    assert probe_lines.expert_bytes_line(results, "p", "row.full") is None
    results["p.row.full"]["expert_digests_error"] = "RuntimeError: out of memory"
    assert probe_lines.expert_bytes_line(results, "p", "row.full") == (
        "  expert bytes of row.full: not read (RuntimeError: out of memory)"
    )


def test_poisoning_fills_vllms_workspace_made_under_inference_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """probes.poison_device_memory sets every byte of vLLM's MoE workspace (an inference tensor:
    vLLM makes it in a forward, and the probe runs outside inference mode) and leaves a
    manager without a workspace alone."""
    import types

    import torch

    with torch.inference_mode():
        buffer = torch.zeros(64, dtype=torch.uint8)
    manager = SimpleNamespace(_current_workspaces=[buffer, None])
    module = types.ModuleType("vllm.v1.worker.workspace")
    module.is_workspace_manager_initialized = lambda: True  # type: ignore[attr-defined]
    module.current_workspace_manager = lambda: manager  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.workspace", module)
    probes.poison_device_memory("cpu")
    assert bool((buffer == 0xFF).all())
    module.is_workspace_manager_initialized = lambda: False  # type: ignore[attr-defined]
    probes.poison_device_memory("cpu")  # nothing to fill: no error
