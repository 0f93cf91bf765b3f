"""The Triton builds counted in an engine's process (``tools/vllm/harness/jit_count.py``) and
named by the timed measurement they fell in (``measure.Measurement``, ``steps_report``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tools.vllm.harness import child, jit_count, measure, steps_report
from tools.vllm.harness.jit_count import JitCounter
from tools.vllm.harness.measure import Completion
from tools.vllm.harness.specs import Workload


def kernel(name: str) -> Any:
    return SimpleNamespace(name=name)


def test_the_hook_counts_every_build_and_passes_it_on() -> None:
    seen: list[dict[str, Any]] = []

    def theirs(**kw: Any) -> str:
        seen.append(kw)
        return "theirs"

    runtime = SimpleNamespace(jit_post_compile_hook=theirs)
    counter = JitCounter()
    jit_count.install(counter, runtime)
    assert runtime.jit_post_compile_hook(fn=kernel("plan_kernel"), repr="r1") == "theirs"
    assert runtime.jit_post_compile_hook(fn=kernel("fused_moe_kernel"), repr="r2") == "theirs"
    assert counter.names == ["plan_kernel", "fused_moe_kernel"]
    assert [kw["repr"] for kw in seen] == ["r1", "r2"]  # the earlier hook got every build


def test_a_build_is_described_by_what_made_it_distinct() -> None:
    runtime = SimpleNamespace(jit_post_compile_hook=None)
    counter = JitCounter()
    counter.describe_from(0)
    jit_count.install(counter, runtime)
    build = {"constants": {(18,): 64}, "configs": [{(1,): [["tt.divisibility", 16]]}], "x": 1}
    runtime.jit_post_compile_hook(fn=kernel("plan_kernel"), repr="plan_kernel[w=4]", compile=build)
    assert counter.descriptions == [
        "constants={(18,): 64}; configs=[{(1,): [['tt.divisibility', 16]]}]; plan_kernel[w=4]"
    ]


def test_a_hook_installed_first_still_counts_under_one_installed_after() -> None:
    # vLLM's JIT monitor installs its hook after start-up and chains the one it finds.
    runtime = SimpleNamespace(jit_post_compile_hook=None)
    counter = JitCounter()
    jit_count.install(counter, runtime)
    later: list[str] = []
    ours = runtime.jit_post_compile_hook

    def theirs(**kw: Any) -> None:
        later.append(kw["fn"].name)
        ours(**kw)

    runtime.jit_post_compile_hook = theirs
    runtime.jit_post_compile_hook(fn=kernel("plan_kernel"), repr=None)
    assert counter.names == ["plan_kernel"] and later == ["plan_kernel"]


def test_descriptions_kept_only_after_the_chosen_point_and_bounded() -> None:
    counter = JitCounter()
    for i in range(5):
        counter.record(kernel(f"startup{i}"), lambda: "startup")
    mark = counter.mark()
    counter.describe_from(mark)
    for _ in range(jit_count.KEPT + 3):
        counter.record(kernel("plan_kernel"), lambda: "x" * (jit_count.DESCRIPTION_CHARS + 50))
    assert counter.since(mark) == ["plan_kernel"] * (jit_count.KEPT + 3)
    assert len(counter.descriptions) == jit_count.KEPT
    assert all(len(d) == jit_count.DESCRIPTION_CHARS for d in counter.descriptions)
    assert not any(d.startswith("startup") for d in counter.descriptions)


class BuildingEngine:
    """A fake engine whose ``generate`` calls (counted from 0) build the kernels ``builds``
    names, as Triton's hook would report them, on a fake clock."""

    def __init__(self, builds: dict[int, list[str]], counter: JitCounter) -> None:
        self.now = 1000.0
        self.calls = 0
        self.builds = builds
        self.counter = counter

    def clock(self) -> float:
        return self.now

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        for name in self.builds.get(self.calls, []):
            self.counter.record(kernel(name), lambda name=name: name)
        self.calls += 1
        self.now += 0.01 * max_tokens
        return [Completion([p[0] + k for k in range(max_tokens)]) for p in prompts]


SMALL = Workload(batches=(1, 8), decode_tokens=4, warmup_tokens=2, prefill_tokens=16, repeats=1)
# Calls: b1 warm-up, warm-up, timed (0, 1, 2); b8 (3, 4, 5); the long prompts' warm-up (6),
# then its three timed prompts (7, 8, 9).


def test_each_timed_figure_names_the_builds_inside_it_and_only_those() -> None:
    counter = JitCounter()
    builds = {0: ["fused_moe_kernel"], 2: ["plan_kernel"], 6: ["x"], 8: ["plan_kernel", "y"]}
    fake = BuildingEngine(builds, counter)
    record = measure.run_workload(SMALL, fake.generate, fake.now + 600, fake.clock, jit=counter)
    assert fake.calls == 10
    assert record["decode"]["1"]["jit_compiles"] == ["plan_kernel"]  # not the warm-up's
    assert record["decode"]["8"]["jit_compiles"] == []
    assert record["ttft"]["jit_compiles"] == ["plan_kernel", "y"]


def test_without_a_counter_nothing_is_claimed() -> None:
    fake = BuildingEngine({2: ["plan_kernel"]}, JitCounter())
    record = measure.run_workload(SMALL, fake.generate, fake.now + 600, fake.clock)
    assert record["decode"]["1"]["jit_compiles"] is None
    assert record["ttft"]["jit_compiles"] is None


def test_the_engine_says_what_it_built_after_start_up_or_that_it_did_not_count() -> None:
    counter = JitCounter()
    counter.record(kernel("startup"), lambda: "s")
    started = counter.mark()
    counter.describe_from(started)
    counter.record(kernel("plan_kernel"), lambda: "plan_kernel[num_warps=4](n_ids: i32)")
    found = child.built_after_start(counter, started)
    assert found == {
        "counted": True,
        "kernels": ["plan_kernel"],
        "described": ["plan_kernel[num_warps=4](n_ids: i32)"],
    }
    assert child.built_after_start(None, 0)["counted"] is False


def results_with(builds: dict[str, Any]) -> dict[str, Any]:
    def record(b1: Any, ttft: Any) -> dict[str, Any]:
        return {
            "ok": True,
            "steps": {"decode": {"1": {"jit_compiles": b1}}, "ttft": {"jit_compiles": ttft}},
        }

    return {f"models.ds2lite.{label}": record(*pair) for label, pair in builds.items()}


def test_the_report_names_each_measurement_with_a_build() -> None:
    results = results_with(
        {"none.full": ([], ["fused_moe_kernel"]), "row16dev.full": (["plan_kernel"] * 2, [])}
    )
    lines = steps_report.jit_lines(results, "models.ds2lite")
    assert lines[0] == "  Triton builds inside timed runs (each stalls the run it falls in):"
    assert lines[1:] == [
        "    none.full ttft: fused_moe_kernel x1",
        "    row16dev.full b1: plan_kernel x2",
    ]


def test_the_report_says_none_where_counted_and_nothing_where_not() -> None:
    clean = results_with({"none.full": ([], []), "row16dev.full": ([], [])})
    assert steps_report.jit_lines(clean, "models.ds2lite") == [
        "  Triton builds inside timed runs: none (in 4 measurements)"
    ]
    old = results_with({"none.full": (None, None)})
    assert steps_report.jit_lines(old, "models.ds2lite") == []
    assert any("Triton builds" in line for line in steps_report.report(clean))


def test_a_build_that_cannot_be_counted_fails_nothing_and_voids_the_counts() -> None:
    seen: list[str] = []
    runtime = SimpleNamespace(jit_post_compile_hook=lambda **kw: seen.append(kw["fn"].name))
    counter = JitCounter()
    counter.describe_from(0)
    jit_count.install(counter, runtime)
    runtime.jit_post_compile_hook(fn=kernel("plan_kernel"), repr="r", compile="not a dict")
    runtime.jit_post_compile_hook(fn=kernel("fused_moe_kernel"), repr=object(), compile=None)
    assert counter.failure is None and seen == ["plan_kernel", "fused_moe_kernel"]

    class Unprintable:
        def __repr__(self) -> str:
            raise ValueError("no repr")

    bad = {"constants": Unprintable()}
    runtime.jit_post_compile_hook(fn=kernel("plan_kernel"), repr="r", compile=bad)
    assert seen[-1] == "plan_kernel"  # the earlier hook still ran: the build went on
    assert counter.failure == "ValueError: no repr"
    assert child.built_after_start(counter, 0)["counted"] is False
    fake = BuildingEngine({2: ["plan_kernel"]}, counter)
    record = measure.run_workload(SMALL, fake.generate, fake.now + 600, fake.clock, jit=counter)
    assert record["decode"]["1"]["jit_compiles"] is None


def test_engines_that_measured_without_counting_are_named() -> None:
    results = results_with({"none.full": ([], []), "row16dev.full": ([], [])})
    results["models.ds2lite.mp.full"] = {
        "ok": True,
        "steps": {"decode": {"1": {"tok_s": 5.0, "jit_compiles": None}}, "ttft": {}},
    }
    lines = steps_report.jit_lines(results, "models.ds2lite")
    assert lines[-1] == "  Triton builds not counted: mp.full b1"
