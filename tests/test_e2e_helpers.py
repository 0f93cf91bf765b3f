"""Pure helpers of tools/vllm/e2e.py (the GPU script itself needs vLLM and a GPU).

A stand-in MoE method with the plugin's call structure (apply -> Tensor.cpu ->
run_with_expert_cache -> plan_chunks, prepare -> kernel apply -> _stable_output) checks that the
profile breakdown finds every part under cProfile and under the timers, and that the timers
leave every patched attribute as it was.
"""

from __future__ import annotations

import cProfile
import importlib.util
import json
import pstats
import sys
from pathlib import Path
from typing import Any

import torch

from rowcache.forward import run_with_expert_cache

ROOT = Path(__file__).resolve().parents[1]


def _load_e2e() -> Any:
    spec = importlib.util.spec_from_file_location("rowcache_e2e", ROOT / "tools/vllm/e2e.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


e2e = _load_e2e()


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
    keys = {label: e2e._code_key(fn) for label, fn in e2e._profile_functions(method).items()}
    assert set(keys) >= {"apply", "stable", "run_with_expert_cache", "plan", "prepare", "kernel"}
    x, ids = _inputs()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        method.apply(x, ids)
    torch.zeros(3).cpu()  # a Tensor.cpu outside apply: in d2h_any only
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    parts = e2e._breakdown(stats, keys)
    for label in ("apply", "stable", "run_with_expert_cache", "plan", "prepare", "kernel", "d2h"):
        assert parts[label]["calls"] == 5, (label, parts[label])
    assert parts["d2h_any"]["calls"] == 6
    assert parts["parent_apply"]["calls"] == 0
    per = e2e._per_forward(parts)
    assert per is not None and per["forwards"] == 5
    assert per["apply"] >= per["run_with_expert_cache"] >= per["prepare"]
    line = e2e._forward_line(per)
    assert line.startswith("apply ") and ", of which d2h " in line and "5 forwards" in line
    callees = [name for name, _calls, _cum in e2e._callees(stats, keys["apply"])]
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
    targets = e2e._timer_targets(method)
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
    with e2e._Timers(targets) as timers:
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
    per = e2e._per_forward(timers.parts)
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
            e2e.MP_ENGINE: _engine(
                e2e.MP_ENGINE,
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
    assert e2e.merge(paths, str(tmp_path / "merged")) == 0
    summary = (tmp_path / "merged" / "summary.txt").read_text()
    assert "engine core in its own process (pid 11, client 10)" in summary
    assert "first divergence prompt 0 token 2 (3 vs 4)" in summary
    assert "hit rate 0.750 (30 hits, 10 misses, 2 layers)" in summary
    assert "qwen8.c.row128: per MoE forward: apply 700.0 us, of which d2h 300.0" in summary
    assert "(c) row128 minus (b), timers, us per MoE forward: apply +600.0, d2h +300.0" in summary
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert set(merged["results"]) == {
        "tiny.eager.none",
        e2e.MP_ENGINE,
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
    spec = {"name": "qwen8.c.row128", "profile_out": str(out)}
    report = e2e._profile(_FakeLLM(), spec, [{"prompt_token_ids": [1]}])
    assert "timers_error" not in report and "cprofile_error" not in report, report
    forwards = 2 * e2e.PROFILE_TOKENS
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
