"""The parts of tools/vllm/e2e.py that run without vLLM or a GPU (``tools/vllm/harness``).

A stand-in MoE method with the plugin's call structure (apply -> Tensor.cpu ->
run_with_expert_cache -> plan_chunks, prepare -> kernel apply -> _stable_output) checks that the
profile breakdown finds every part under cProfile and under the timers, and that the timers
leave every patched attribute as it was. The typed engine specs are checked for what the
phases pick, what each engine passes to vLLM, and the references the summary compares with.
"""

from __future__ import annotations

import cProfile
import dataclasses
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rowcache.forward import run_with_expert_cache
from tools.vllm.harness import (
    checkpoints,
    child,
    engines,
    orchestrate,
    phases,
    profiling,
    records,
    reruns,
    summary,
)
from tools.vllm.harness.engines import MP_ENGINE
from tools.vllm.harness.specs import EngineSpec, Job, Knob, Mode, Provider, Split

ROOT = Path(__file__).resolve().parents[1]


class FakeKernel:
    def apply(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states * 2


class FakeProvider:
    split = "token"
    capacity = 8

    def prepare(self, topk_ids: torch.Tensor, unique_ids: Any = None) -> None:
        return None


class FakeBase:
    def apply(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.moe_kernel.apply(x)  # type: ignore[attr-defined,no-any-return]


class FakeMethod(FakeBase):
    def __init__(self) -> None:
        self.rowcache_provider = FakeProvider()
        self.moe_kernel = FakeKernel()

    def _stable_output(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def apply(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        host = topk_ids.cpu()

        def run(weights: Any, rows: slice, shared: bool) -> torch.Tensor:
            return self.moe_kernel.apply(x)

        return self._stable_output(run_with_expert_cache(self.rowcache_provider, host, run))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(2, 4), torch.tensor([[0, 1], [1, 2]], dtype=torch.int64)


def test_cprofile_breakdown_finds_every_part() -> None:
    method = FakeMethod()
    keys = {
        label: profiling.code_key(fn) for label, fn in profiling.profile_functions(method).items()
    }
    assert set(keys) >= {"apply", "stable", "run_with_expert_cache", "plan", "prepare", "kernel"}
    x, ids = _inputs()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        method.apply(x, ids)
    torch.zeros(3).cpu()  # a Tensor.cpu outside apply: in d2h_any only
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    parts = profiling.breakdown(stats, keys)
    for label in ("apply", "stable", "run_with_expert_cache", "plan", "prepare", "kernel", "d2h"):
        assert parts[label]["calls"] == 5, (label, parts[label])
    assert parts["d2h_any"]["calls"] == 6
    assert parts["parent_apply"]["calls"] == 0
    per = profiling.per_forward(parts)
    assert per is not None and per["forwards"] == 5
    assert per["apply"] >= per["run_with_expert_cache"] >= per["prepare"]
    line = profiling.forward_line(per)
    assert line.startswith("apply ") and ", of which d2h " in line and "5 forwards" in line
    callees = [name for name, _calls, _cum in profiling.callees(stats, keys["apply"])]
    assert any("run_with_expert_cache" in name for name in callees)
    assert any("'cpu'" in name for name in callees)


def test_timers_count_the_parts_and_restore_everything() -> None:
    method = FakeMethod()
    this = sys.modules[__name__]
    before = {
        "apply": FakeMethod.__dict__["apply"],
        "rwec": this.run_with_expert_cache,
        "prepare": FakeProvider.__dict__["prepare"],
        "kernel": FakeKernel.__dict__["apply"],
    }
    import rowcache.forward as forward

    plan = forward.plan_chunks
    targets = profiling.timer_targets(method)
    assert {label for _owner, _attr, label in targets} == {
        "apply",
        "d2h",
        "stable",
        "run_with_expert_cache",
        "plan",
        "prepare",
        "kernel",
    }
    x, ids = _inputs()
    with profiling.Timers(targets) as timers:
        for _ in range(3):
            method.apply(x, ids)
        torch.zeros(3).cpu()  # outside apply: not timed
    for label in ("apply", "d2h", "stable", "run_with_expert_cache", "plan", "prepare", "kernel"):
        assert timers.parts[label]["calls"] == 3, (label, timers.parts[label])
    assert len(timers.apply_threads) == 1
    assert FakeMethod.__dict__["apply"] is before["apply"]
    assert this.run_with_expert_cache is before["rwec"]
    assert FakeProvider.__dict__["prepare"] is before["prepare"]
    assert FakeKernel.__dict__["apply"] is before["kernel"]
    assert forward.plan_chunks is plan
    assert "cpu" not in vars(torch.Tensor)
    per = profiling.per_forward(timers.parts)
    assert per is not None and per["forwards"] == 3 and per["other"] is not None


def _engine(name: str, tokens: list[list[int]], **extra: Any) -> dict[str, Any]:
    return {"name": name, "ok": True, "tokens": tokens, "tok_s": 1.0, "probe": {}, **extra}


def test_summary_and_merge(tmp_path: Path) -> None:
    per_b = {"forwards": 8, "apply": 100.0, "d2h": None, "plan": None, "prepare": None}
    per_b |= {"kernel": 90.0, "stable": 5.0, "run_with_expert_cache": None, "other": 5.0}
    per_c = {"forwards": 8, "apply": 700.0, "d2h": 300.0, "plan": 20.0, "prepare": 60.0}
    per_c |= {"kernel": 120.0, "stable": 5.0, "run_with_expert_cache": 250.0, "other": 145.0}
    profile_b = {"cprofile_per_forward": per_b, "timers_per_forward": per_b}
    profile_c = {"cprofile_per_forward": per_c, "timers_per_forward": per_c}
    profile_b["apply_in_this_thread_only"] = profile_c["apply_in_this_thread_only"] = True
    cache = {"timed": {"hits": 30, "misses": 10}, "hit_rate": 0.75, "layers": 2}
    a = {
        "meta": {"phases": ["tiny", "mp"], "gpu": "H200"},
        "results": {
            "tiny.eager.none": _engine("tiny.eager.none", [[1, 2, 3]]),
            MP_ENGINE: _engine(
                MP_ENGINE,
                [[1, 2, 4]],
                cache=cache,
                client_pid=10,
                probe={"pid": 11, "method": ["RowcacheMoEMethod"]},
                engine_shutdown="ok",
            ),
        },
    }
    b = {
        "meta": {"phases": ["qwen8"], "profile": True},
        "results": {
            "qwen8.b.eager_moe": _engine("qwen8.b.eager_moe", [[5]], profile=profile_b),
            "qwen8.c.row128": _engine("qwen8.c.row128", [[5]], profile=profile_c),
        },
    }
    paths = []
    for name, data in (("a", a), ("b", b)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        paths.append(str(path))
    assert orchestrate.merge(paths, str(tmp_path / "merged")) == 0
    summary = (tmp_path / "merged" / "summary.txt").read_text()
    assert "engine core in its own process (pid 11, client 10)" in summary
    assert "first divergence prompt 0 token 2 (3 vs 4)" in summary
    assert "hit rate 0.750 (30 hits, 10 misses, 2 layers)" in summary
    assert "qwen8.c.row128: per MoE forward: apply 700.0 us, of which d2h 300.0" in summary
    assert "(c) row128 minus (b), timers, us per MoE forward: apply +600.0, d2h +300.0" in summary
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert set(merged["results"]) == {
        "tiny.eager.none",
        MP_ENGINE,
        "qwen8.b.eager_moe",
        "qwen8.c.row128",
    }


class _FakeLayer:
    def __init__(self) -> None:
        self.quant_method = FakeMethod()
        self.w13_weight = torch.zeros(1)


class _FakeModel:
    def __init__(self) -> None:
        self.layers = [_FakeLayer(), _FakeLayer()]

    def named_modules(self) -> list[tuple[str, Any]]:
        return [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]


class _FakeLLM:
    """apply_model and generate as an in-process vLLM engine does them, on the fake model."""

    def __init__(self) -> None:
        self.model = _FakeModel()

    def apply_model(self, fn: Any) -> list[Any]:
        return [fn(self.model)]

    def generate(self, prompts: list[Any], sp: Any, use_tqdm: bool = False) -> list[Any]:
        x, ids = _inputs()
        for _ in range(sp.max_tokens):
            for layer in self.model.layers:
                layer.quant_method.apply(x, ids)
        return []


def test_profile_writes_the_report(tmp_path: Path, monkeypatch: Any) -> None:
    import types

    fake_vllm = types.ModuleType("vllm")
    fake_vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    out = tmp_path / "profile_qwen8.c.row128.txt"
    report = profiling.profile(_FakeLLM(), "qwen8.c.row128", out, [{"prompt_token_ids": [1]}])
    assert "timers_error" not in report and "cprofile_error" not in report, report
    forwards = 2 * profiling.PROFILE_TOKENS
    for source in ("timers", "cprofile"):
        per = report[f"{source}_per_forward"]
        assert per["forwards"] == forwards, (source, per)
        assert per["d2h"] is not None and per["prepare"] is not None
    assert report["apply_in_this_thread_only"] is True
    text = out.read_text()
    assert "== top 40 by cumulative time ==" in text and "== top 40 by self time ==" in text
    assert "cProfile: what apply calls" in text
    assert out.with_suffix(".pstats").exists()
    json.dumps(report)  # goes into results.json


def _all_engines() -> dict[str, list[EngineSpec]]:
    """Every phase's engines (``mp`` with and without its own reference)."""
    out = {phase.name: phase.engines({}) for phase in phases.PHASES}
    out["mp.with_tiny"] = engines.mp(with_reference=False)
    return out


def test_specs_round_trip_through_json() -> None:
    for name, specs in _all_engines().items():
        names = [s.name for s in specs]
        assert len(names) == len(set(names)), name
        for spec in specs:
            text = json.dumps(spec.to_json())
            assert EngineSpec.from_json(json.loads(text)) == spec, spec.name
            job = Job(spec, "/m", "/b", 30.0, profile_out=None)
            assert Job.from_json(json.loads(json.dumps(job.to_json()))) == job


def test_phases_pick_engines_by_their_attributes() -> None:
    split = reruns.split()
    assert [s.name for s in split] == [
        "tiny.piecewise.eager_moe",
        "tiny.piecewise.cached.token",
        "tiny.piecewise.row.token",
        "tiny.piecewise.row.expert",
    ]
    assert all(s.mode is Mode.DEFAULT and not s.debug_checks for s in split)
    assert [s.name for s in reruns.qwen8seq()] == ["qwen8seq.b.eager_moe", "qwen8seq.c.row128"]
    assert [s.name for s in reruns.rerun()] == [
        "tiny.piecewise.eager_moe",
        "tiny.piecewise.eager_moe.idmap",
        "qwen8.b.eager_moe",
        "qwen8.b.eager_moe.idmap",
        "qwen8.c.row128",
        "qwen8.d.cached32",
        "qwen8.d.row32",
    ]
    assert [s.name for s in reruns.rerun() if s.identity_expert_map] == [
        "tiny.piecewise.eager_moe.idmap",
        "qwen8.b.eager_moe.idmap",
    ]
    # With --profile: the qwen8 phase's (b) and (c), and the steps phases' eager engines.
    profiled = [s.name for specs in _all_engines().values() for s in specs if s.profiled]
    eager = [f"{p}.{e}.eager" for p in ("plain", "skew") for e in ("none", "row32dev", "row32host")]
    assert profiled == ["qwen8.b.eager_moe", "qwen8.c.cached128", "qwen8.c.row128"] + [
        f"steps.{name}" for name in eager
    ]
    assert [p.name for p in phases.select(["story", "tiny", "rerun"])] == [
        "rerun",
        "tiny",
        "story",
    ]
    with pytest.raises(SystemExit, match="unknown phases"):
        phases.select(["tiny", "qwen9"])
    assert [c.directory for c in phases.select(["rerun"])[0].checkpoints()] == [
        "tiny-moe",
        "qwen8",
    ]
    assert engines.QWEN24.builder_args() == ["--qwen3-30b-a3b", "--layers", "24"]
    assert engines.TINY.builder_args() == []


def _spec(name: str) -> EngineSpec:
    return next(s for specs in _all_engines().values() for s in specs if s.name == name)


def test_engine_kwargs() -> None:
    tiny = child.engine_kwargs(_spec("tiny.eager.row.expert"), "/w/tiny-moe")
    assert tiny == {
        "model": "/w/tiny-moe",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
        "kv_cache_memory_bytes": 1 << 30,
        "gpu_memory_utilization": 0.02,
        "enforce_eager": True,
        "additional_config": {
            "rowcache": {
                "moe_expert_cache_size": 6,
                "moe_expert_cache_provider": "row",
                "moe_expert_cache_split": "expert",
                "moe_expert_cache_planner": "host",
            }
        },
    }
    c = child.engine_kwargs(_spec("qwen8.c.row128"), "/w/qwen8")
    assert c["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2],
        "inductor_compile_config": child.deterministic_inductor(),
    }
    assert c["kv_cache_memory_bytes"] == 2 << 30 and c["max_num_seqs"] == 1
    assert c["additional_config"] == {
        "rowcache": {
            "moe_expert_cache_size": 128,
            "moe_expert_cache_provider": "row",
            "moe_expert_cache_planner": "host",
        }
    }
    b = child.engine_kwargs(_spec("qwen8.b.eager_moe"), "/w/qwen8")
    assert b["additional_config"] == {"rowcache": {"moe_eager_between_graphs": True}}
    piecewise = child.engine_kwargs(_spec("tiny.piecewise.none"), "/w/tiny-moe")
    assert piecewise["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2, 4],
        "cudagraph_mode": "PIECEWISE",
        "inductor_compile_config": child.deterministic_inductor(),
    }
    assert "additional_config" not in piecewise
    story = child.engine_kwargs(_spec("story.none"), "/w/qwen24")
    assert story["gpu_memory_utilization"] == 0.10 and "kv_cache_memory_bytes" not in story
    assert _spec(MP_ENGINE).env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert _spec("tiny.debug.naive").env() == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    knob = Knob(size=6, provider=Provider.CACHED, split=Split.TOKEN)
    assert knob.caches and not Knob(eager_between_graphs=True).caches


def test_references_are_the_recorded_runs() -> None:
    """Each engine's ``compare_with`` picks what the summaries of the recorded runs compared it
    with (``records``: by name), alone and next to the other phases' engines."""
    groups = [
        ["tiny"],
        ["split"],
        ["mp"],
        ["tiny", "mp.with_tiny"],
        ["tiny", "split"],
        ["qwen8"],
        ["qwen8seq"],
        ["rerun"],
        ["rerun", "tiny", "qwen8"],
        ["story"],
    ]
    every = _all_engines()
    for group in groups:
        specs = [s for name in group for s in every[name]]
        recorded = {s.name: {"ok": True, "spec": s.to_json()} for s in specs}
        by_name = {s.name: {"ok": True} for s in specs}
        for s in specs:
            assert s.compare_with == records.compare_with(s.name), s.name
            ref = summary.reference(s.name, recorded)
            assert ref == summary.reference(s.name, by_name), (group, s.name)
    results = {s.name: {"ok": True, "spec": s.to_json()} for s in reruns.rerun()}
    assert summary.reference("qwen8.c.row128", results) == "qwen8.b.eager_moe.idmap"
    assert summary.reference("tiny.piecewise.eager_moe", results) == (
        "tiny.piecewise.eager_moe.idmap"
    )
    results = {s.name: {"ok": True} for s in reruns.split()}
    assert summary.reference("tiny.piecewise.eager_moe", results) == "tiny.piecewise.eager_moe"
    # A reference that failed gives way to the next one that ran.
    results = {"tiny.eager.none": {"ok": False}, "mp.ref.eager.none": {"ok": True}}
    assert summary.reference(MP_ENGINE, results) == "mp.ref.eager.none"


def test_background_build_with_nothing_to_build(tmp_path: Path) -> None:
    (tmp_path / "qwen8").mkdir()
    (tmp_path / "qwen8" / "config.json").write_text("{}")
    # config.json alone: a build stopped halfway (save_pretrained writes it first).
    assert checkpoints.missing(tmp_path, [engines.QWEN8]) == [engines.QWEN8]
    # A marker of an older builder (empty: before version 2) is no whole checkpoint of this one.
    (tmp_path / "qwen8" / checkpoints.BUILT).touch()
    assert checkpoints.missing(tmp_path, [engines.QWEN8]) == [engines.QWEN8]
    checkpoints.mark_built(tmp_path / "qwen8")
    assert checkpoints.missing(tmp_path, [engines.QWEN8]) == []
    build = checkpoints.Background(tmp_path, [engines.TINY, engines.QWEN8], tmp_path / "b.log")
    assert build.proc is None and build.done() and build.wait(1.0)
    assert not build.needed_by([engines.QWEN8])
    assert checkpoints.command(tmp_path, engines.QWEN24)[2:] == [
        str(tmp_path / "qwen24"),
        "--qwen3-30b-a3b",
        "--layers",
        "24",
    ]


def test_background_build_says_each_checkpoint_ready_once_it_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budgeted engine waits for its own checkpoint, not the whole build: ``ready`` turns
    true for a checkpoint once its builder has returned, not once its ``config.json`` exists
    (written before the weights here, as a builder may), and for all once the build ends."""
    gate = tmp_path / "gate"
    gate.mkdir()
    tool = tmp_path / "builder.py"
    tool.write_text(
        "import pathlib, sys, time\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'config.json').write_text('{}')\n"
        "while not (pathlib.Path(sys.argv[0]).parent / 'gate' / out.name).exists():\n"
        "    time.sleep(0.05)\n"
        "(out / 'model.safetensors').write_text('')\n"
    )
    monkeypatch.setattr(checkpoints, "CKPT_TOOL", str(tool))
    work = tmp_path / "work"
    first, second = engines.QWEN8_FP8, engines.QWEN8
    build = checkpoints.Background(work, [first, second], tmp_path / "b.log")

    def until(condition: Any) -> None:
        deadline = time.time() + 30
        while not condition() and time.time() < deadline:
            time.sleep(0.05)

    until(lambda: (work / first.directory / "config.json").exists())
    assert not build.ready(first) and not build.ready(second)
    assert build.ready(engines.TINY)  # not one the build makes
    (gate / first.directory).write_text("")
    until(lambda: build.ready(first))
    assert build.ready(first) and not build.ready(second) and not build.done()
    (gate / second.directory).write_text("")
    assert build.wait(30)
    assert build.ready(second)
    assert (work / second.directory / checkpoints.BUILT).read_text().strip() == "2"
    # A checkpoint of an older builder is removed and built anew, nothing of it left behind.
    stale = work / first.directory
    (stale / checkpoints.BUILT).write_text("1\n")
    (stale / "left-over.safetensors").write_text("")
    again = checkpoints.Background(work, [first, second], tmp_path / "again.log")
    assert again.checkpoints == [first] and again.wait(30)
    assert not (stale / "left-over.safetensors").exists() and checkpoints.is_built(stale)
    # A build that fails ends: its engines start and fail to load, saying why.
    monkeypatch.setattr(checkpoints, "CKPT_TOOL", str(tmp_path / "missing.py"))
    failing = checkpoints.Background(work / "other", [first], tmp_path / "f.log")
    assert failing.wait(30) and failing.ready(first)
    assert not (work / "other" / first.directory / checkpoints.BUILT).exists()


@pytest.mark.parametrize("how", ["script", "module"])
def test_command_line_merges(tmp_path: Path, how: str) -> None:
    """``python3 tools/vllm/e2e.py`` (as docs/RUNNING.md runs it) and ``python -m
    tools.vllm.e2e``; neither imports torch or vLLM to get there."""
    data = {"meta": {}, "results": {"story.none": _engine("story.none", [[1]])}}
    (tmp_path / "a.json").write_text(json.dumps(data))
    command = ["tools/vllm/e2e.py"] if how == "script" else ["-m", "tools.vllm.e2e"]
    args = ["merge", "--out", str(tmp_path / "m"), str(tmp_path / "a.json")]
    done = subprocess.run(
        [sys.executable, *command, *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "story.none" in (tmp_path / "m" / "summary.txt").read_text()
    modules = [
        f"tools.vllm.harness.{m}"
        for m in ("child", "orchestrate", "probes", "profiling", "register_probe", "summary")
    ]
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules "
    code += "if m.split('.')[0] in ('torch', 'vllm', 'rowcache')))"
    light = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert light.stdout.strip() == "[]"


def test_spec_fields_have_defaults_that_change_nothing() -> None:
    """A new field needs a default, so that the engines of the recorded runs stay as they were."""
    required = [f.name for f in dataclasses.fields(EngineSpec) if f.default is dataclasses.MISSING]
    assert required == ["name", "checkpoint", "prompts", "max_tokens", "mode"]


def test_the_pinned_memory_probe_counts_released_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose ``w13_weight`` is on the meta device counts as released, one on the CPU
    does not; the allocator's figures are None where no pinned allocator has run; the arenas'
    slabs are read from the arenas."""
    from rowcache import pinned
    from tools.vllm.harness.probes import pinned_host_memory

    arenas = {
        name: pinned.PinnedArena(1 << 12, lambda n: torch.zeros(n, dtype=torch.uint8))
        for name in ("_ARENA", "_TRANSIENT")
    }
    for name, arena in arenas.items():
        monkeypatch.setattr(pinned, name, arena)
    views = [
        arenas["_ARENA"].empty((3,), torch.uint8),
        arenas["_TRANSIENT"].empty((5000,), torch.uint8),
    ]

    released, kept = torch.nn.Module(), torch.nn.Module()
    released.w13_weight = torch.nn.Parameter(torch.empty(2, 3, device="meta"))
    kept.w13_weight = torch.nn.Parameter(torch.empty(2, 3))
    model = torch.nn.ModuleList([released, kept, torch.nn.Linear(2, 2)])
    found = pinned_host_memory(model)
    assert found["released_layers"] == 1
    if not torch.cuda.is_available():
        assert found["host_pinned_bytes"] in (None, 0)
    # The arenas' share, so that a record can tell their slabs from vLLM's and torch's blocks.
    assert found["host_pinned_arena_bytes"] == 1 << 12
    assert found["host_pinned_transient_bytes"] == 1 << 14  # twice 5,000's next power of two
    del views
    kept.w13_weight = torch.nn.Parameter(torch.empty(2, 3, device="meta"))
    assert pinned_host_memory(model)["released_layers"] == 2
