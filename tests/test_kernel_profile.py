"""The kernel profile of one long prompt step (tools/vllm/harness/kernel_profile.py): its pure
summary, its reading of torch's profiler events, the measurement's call of it, and its table
in the steps summary."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tools.vllm.harness import kernel_profile, measure, steps_report
from tools.vllm.harness.kernel_profile import Activity, category, summarize
from tools.vllm.harness.measure import Completion
from tools.vllm.harness.specs import Workload


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("gather_kernel", "rowcache gather"),
        ("decode_gather_kernel", "rowcache gather"),
        ("plan_kernel", "rowcache planner"),
        ("void at::native::vectorized_gather_kernel<16, long>(char*, ...)", "elementwise"),
        ("fused_moe_kernel", "MoE GEMM"),
        ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x256x128x1", "MoE GEMM"),
        (
            "void marlin_moe_wna16::Marlin<1125899906909960l, 128, 1, 4>(int4 const*, ...)",
            "MoE GEMM",
        ),
        ("void vllm::moe::moe_align_block_size_kernel<int>(...)", "MoE align and sort"),
        ("void vllm::moe::moe_sum_kernel<c10::BFloat16, 8>(...)", "MoE sum"),
        ("void flash::flash_fwd_kernel<...>", "attention"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "dense GEMM"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("Memset (Device)", "set"),
        ("triton_poi_fused_add_0", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_categories(name: str, label: str) -> None:
    assert category(name) == label


def test_summary_span_busy_sum_categories_and_top() -> None:
    """Two activities at once (a copy beside a kernel) count once in the busy time and twice
    in the sum; a gap counts in the span only."""
    found = summarize(
        [
            Activity("gather_kernel", 0.0, 1000.0),
            Activity("fused_moe_kernel", 500.0, 1500.0),  # overlaps the gather by 500 us
            Activity("fused_moe_kernel", 3000.0, 3500.0),  # after a 1,500 us gap
            Activity("Memcpy HtoD (Pinned -> Device)", 3100.0, 3200.0),  # inside the last
        ]
    )
    assert found["activities"] == 4
    assert (found["span_ms"], found["busy_ms"], found["sum_ms"]) == (3.5, 2.0, 2.6)
    assert list(found["by_category"]) == ["MoE GEMM", "rowcache gather", "copy"]
    assert found["by_category"]["MoE GEMM"] == {"ms": 1.5, "count": 2}
    assert found["top"][0] == {"name": "fused_moe_kernel", "ms": 1.5, "count": 2}
    assert summarize([]) == {"activities": 0}


def test_device_activities_read_torchs_profiler_events() -> None:
    """The attribute names the summary reads, on this torch's own events (on the CPU here;
    the GPU run asks for the CUDA ones the same way)."""
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (a @ a).sum()
    cpu = kernel_profile.device_activities(prof.events(), "CPU")
    assert any(x.name == "aten::mm" for x in cpu)
    assert all(x.end_us >= x.start_us > 0 for x in cpu)
    assert kernel_profile.device_activities(prof.events(), "CUDA") == []


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.prompts: list[list[list[int]]] = []

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        self.prompts.append(prompts)
        self.now += 0.01 * max_tokens
        return [Completion([1] * max_tokens) for _ in prompts]


def _run(workload: Workload, seconds: float, profiler: Any) -> dict[str, Any]:
    fake = _Clock()
    return measure.run_workload(
        workload, fake.generate, fake.now + seconds, lambda: fake.now, profiler=profiler
    )


def test_the_measurement_profiles_one_timed_prompt_last_where_asked() -> None:
    seen: list[list[int]] = []

    def profiler(prompt: list[int], tokens: int) -> dict[str, Any]:
        assert tokens == 1  # the prompt's step alone
        seen.append(prompt)
        return {"activities": 1, "span_ms": 1.0}

    w = Workload(batches=(1,), ttft_kernel_profile=True)
    record = _run(w, 600, profiler)
    assert seen == [measure.prefill_prompts(w)[1]]  # the first timed prompt, not the warm-up
    assert record["ttft_kernels"] == {"activities": 1, "span_ms": 1.0}
    assert record["events"][-1].endswith("ttft kernels profiled")
    seen.clear()
    record = _run(Workload(batches=(1,)), 600, profiler)  # not asked
    assert seen == [] and "ttft_kernels" not in record
    w_short = Workload(batches=(1,), ttft_kernel_profile=True, repeats=1)
    record = _run(w_short, 9, profiler)  # everything else fits, the profile does not
    assert seen == [] and record["ttft_kernels"] == {"skipped": "deadline: no time left"}
    assert measure.cut_short(record) == []  # a profile left out is no measurement cut short


def test_a_failed_profile_leaves_the_measurements() -> None:
    def profiler(prompt: list[int], tokens: int) -> dict[str, Any]:
        raise RuntimeError("CUPTI unavailable")

    w = Workload(batches=(1,), ttft_kernel_profile=True, decode_kernel_profile=4)
    record = _run(w, 600, profiler)
    assert record["ttft_kernels"] == {"error": "RuntimeError: CUPTI unavailable"}
    assert record["decode_kernels"] == {"error": "RuntimeError: CUPTI unavailable"}
    assert record["decode"]["1"]["tok_s"] is not None and record["ttft"]["ms"] is not None


def test_the_measurement_profiles_b1_decode_twice_last_where_asked() -> None:
    """The decode prompt with its first token alone, then with the asked tokens more, after
    everything else (the prompt step's profile too); not asked, or no time left, no call."""
    seen: list[tuple[list[int], int]] = []

    def profiler(prompt: list[int], tokens: int) -> dict[str, Any]:
        seen.append((prompt, tokens))
        return {"activities": tokens}

    w = Workload(batches=(1, 8), ttft_kernel_profile=True, decode_kernel_profile=16)
    record = _run(w, 600, profiler)
    first = measure.decode_prompts(w, 1)[0]
    assert seen == [(measure.prefill_prompts(w)[1], 1), (first, 1), (first, 17)]
    assert record["decode_kernels"] == {
        "tokens": 16,
        "first": {"activities": 1},
        "whole": {"activities": 17},
    }
    assert record["events"][-1].endswith("decode kernels profiled")
    seen.clear()
    record = _run(Workload(batches=(1,)), 600, profiler)
    assert seen == [] and "decode_kernels" not in record
    w_short = Workload(batches=(1,), decode_kernel_profile=16, repeats=1, prefill_prompts=0)
    record = _run(w_short, 9, profiler)
    assert seen == [] and record["decode_kernels"] == {"skipped": "deadline: no time left"}
    # Enough time for the prompt's profile is not enough for decode's and the probes after.
    fake = _Clock()
    left = (measure.KERNEL_PROFILE_S + measure.DECODE_PROFILE_S) / 2
    m = measure.Measurement(w, fake.generate, fake.now + left, lambda: fake.now)
    m.kernels(profiler)
    m.decode_kernels(profiler)
    assert seen == [(measure.prefill_prompts(w)[1], 1)]
    assert m.record["decode_kernels"] == {"skipped": "deadline: no time left"}
    # An engine without the cache runs no probe after its workload: its decode profiles need
    # only their own time.
    seen.clear()
    fake = _Clock()
    left = (measure.DECODE_PROFILE_ALONE_S + measure.DECODE_PROFILE_S) / 2
    alone = measure.Measurement(
        w, fake.generate, fake.now + left, lambda: fake.now, probes_after=False
    )
    alone.decode_kernels(profiler)
    assert [count for _, count in seen] == [1, 17]
    cached = measure.Measurement(w, fake.generate, fake.now + left, lambda: fake.now)
    cached.decode_kernels(profiler)
    assert cached.record["decode_kernels"] == {"skipped": "deadline: no time left"}


def test_both_decode_profiles_start_from_one_cache_state_and_keep_their_counters() -> None:
    """The longer generation runs unprofiled just before each profile (so the second one's
    prefill does not find the first's experts resident), and each profile carries the cached
    layers' counters over it alone; an engine without the cache has no counters."""
    calls: list[tuple[str, list[list[int]], int]] = []
    misses = [0]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        calls.append(("generate", prompts, max_tokens))
        misses[0] += 100  # any unprofiled generation's misses stay out of the profiles
        return [Completion([1] * max_tokens) for _ in prompts]

    def profiler(prompt: list[int], tokens: int) -> dict[str, Any]:
        calls.append(("profile", [prompt], tokens))
        misses[0] += 3 + 2 * tokens
        return {"activities": tokens}

    def stats() -> list[dict[str, Any]]:
        return [{"hits": 5, "misses": misses[0] - 1}, {"misses": 1}]

    w = Workload(batches=(1,), decode_kernel_profile=16)
    m = measure.Measurement(w, generate, 600.0, lambda: 0.0, stats)
    m.decode_kernels(profiler)
    one = [measure.decode_prompts(w, 1)[0]]  # the profiled prompt alone, each time
    assert calls == [
        ("generate", one, 17),
        ("profile", one, 1),
        ("generate", one, 17),
        ("profile", one, 17),
    ]
    found = m.record["decode_kernels"]
    assert found["first"]["cache"]["misses"] == 5 and found["whole"]["cache"]["misses"] == 37
    assert found["first"]["cache"]["hits"] == 0
    token = kernel_profile.per_token(
        {**summarize([Activity("gather_kernel", 0.0, 1.0)]), "cache": found["first"]["cache"]},
        {**summarize([Activity("gather_kernel", 0.0, 9.0)]), "cache": found["whole"]["cache"]},
        16,
    )
    assert token["misses"] == 2.0
    no_cache = measure.Measurement(w, generate, 600.0, lambda: 0.0, lambda: None)
    no_cache.decode_kernels(profiler)
    assert "cache" not in no_cache.record["decode_kernels"]["whole"]


def test_a_decode_token_is_the_two_profiles_difference_over_the_tokens_more() -> None:
    """What the two generations share (the prompt's step, the first token) cancels; a category
    only the longer one has counts from zero."""
    first = summarize([Activity("gather_kernel", 0.0, 800.0), Activity("flash_fwd", 800.0, 1000.0)])
    whole = summarize(
        [
            Activity("gather_kernel", 0.0, 800.0),
            Activity("flash_fwd", 800.0, 1000.0),
            *(Activity("gather_kernel", 1000.0 + 300 * i, 1200.0 + 300 * i) for i in range(4)),
            *(Activity("plan_kernel", 1200.0 + 300 * i, 1250.0 + 300 * i) for i in range(4)),
        ]
    )
    token = kernel_profile.per_token(first, whole, 4)
    assert token["tokens"] == 4
    assert (token["span_ms"], token["busy_ms"]) == (0.2875, 0.25)  # 2.15 and 2.0 ms whole
    assert "misses" not in token  # no counters in either profile
    assert token["by_category"] == {
        "attention": {"ms": 0.0},
        "rowcache gather": {"ms": 0.2},
        "rowcache planner": {"ms": 0.05},
    }
    assert kernel_profile.per_token({"activities": 0}, whole, 4) == {"activities": 0}
    assert kernel_profile.per_token(first, whole, 0) == {"activities": 0}


def test_the_summary_shows_each_engines_step_by_category() -> None:
    row = summarize(
        [
            Activity("gather_kernel", 0.0, 17_800.0),
            Activity("fused_moe_kernel", 17_800.0, 18_300.0),
            Activity("weird", 18_300.0, 18_400.0),
        ]
    )
    results = {
        "steps.plain.row32dev.full": {"ok": True, "steps": {"ttft_kernels": row}},
        "steps.plain.none.full": {"ok": True, "steps": {"ttft_kernels": {"skipped": "deadline"}}},
        "steps.plain.uva675.full": {"ok": True, "steps": {}},
    }
    lines = steps_report.kernel_lines(results, "steps.plain")
    assert lines[1].split()[:4] == ["engine", "span", "busy", "gather"]
    mine = next(x for x in lines if x.startswith("row32dev.full"))
    assert mine.split()[1:5] == ["18.40", "18.40", "17.80", "0.00"]
    assert mine.split()[-1] == "0.10"  # 'weird' is in no column: the rest
    assert any(x.startswith("none.full") and x.endswith("deadline") for x in lines)
    assert not any(x.startswith("uva675.full") for x in lines)
    assert steps_report.kernel_lines({}, "steps.plain") == []


def test_the_summary_shows_a_decode_token_by_category() -> None:
    """The decode profiles' per-token table, after the prompt's (none here), with a skipped
    engine's reason."""
    first = summarize([Activity("fused_moe_kernel", 0.0, 500.0)])
    whole = summarize(
        [Activity("fused_moe_kernel", 0.0, 500.0), Activity("gather_kernel", 500.0, 2500.0)]
    )
    counted = {
        "tokens": 4,
        "first": {**first, "cache": {"misses": 10}},
        "whole": {**whole, "cache": {"misses": 40}},
    }
    results = {
        "models.ds2lite.row16dev.full": {"ok": True, "steps": {"decode_kernels": counted}},
        "models.ds2lite.uva1959.full": {
            "ok": True,
            "steps": {"decode_kernels": {"tokens": 4, "first": first, "whole": whole}},
        },
        "models.ds2lite.none.full": {
            "ok": True,
            "steps": {"decode_kernels": {"skipped": "deadline: no time left"}},
        },
    }
    lines = steps_report.kernel_lines(results, "models.ds2lite")
    assert lines[0].startswith("a b1 decode token on the GPU")
    assert lines[1].split()[:4] == ["engine", "span", "busy", "gather"]
    assert lines[1].split()[-1] == "misses"
    mine = next(x for x in lines if x.startswith("row16dev.full"))
    assert mine.split()[1:5] == ["0.500", "0.500", "0.500", "0.000"]
    assert mine.split()[-1] == "7.5"  # 30 misses over 4 tokens
    uva = next(x for x in lines if x.startswith("uva1959.full"))
    assert len(uva.split()) == len(mine.split()) - 1  # no counters: no misses
    del results["models.ds2lite.row16dev.full"]  # no engine with counters: no misses column
    lines = steps_report.kernel_lines(results, "models.ds2lite")
    assert "misses" not in lines[0] and lines[1].split()[-1] == "rest"
    assert any(x.startswith("none.full") and x.endswith("no time left") for x in lines)


def _step_misses(provider: Any, steps: list[torch.Tensor]) -> list[int]:
    """Each step's misses, the provider fed the steps as an engine feeds it."""
    from rowcache.forward import run_with_expert_cache

    def run(weights: Any, rows: slice, shared: bool) -> torch.Tensor:
        return torch.zeros(rows.stop - rows.start, 1)

    found = []
    for step in steps:
        before = int(provider.stats()["misses"])
        run_with_expert_cache(provider, step, run)
        found.append(int(provider.stats()["misses"]) - before)
    return found


def test_with_lru_victims_both_decode_profiles_start_from_one_cache_state() -> None:
    """The protocol's claim, on the providers' own device planner (CPU, 32 of 128 experts,
    top-8): a greedy generation routes the same way each time, so after the same 17-token
    generation the prompt's prefill misses as it did before the first profile, whatever ran
    before (here three 64-row prompts); profiled straight after the first profile (the old
    protocol) it misses fewer, which the difference counted against the decode tokens."""
    from rowcache.row_provider import RowCacheWeightProvider

    differed = 0
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)

        def routing(rows: int, gen: torch.Generator = gen) -> torch.Tensor:
            return torch.rand(rows, 128, generator=gen).topk(8, dim=1).indices.to(torch.int32)

        long_prompts = [routing(64) for _ in range(3)]
        generation = [routing(8), *(routing(1) for _ in range(16))]  # prefill, 16 tokens more
        for protocol in ("unprofiled run before each", "old"):
            provider = RowCacheWeightProvider(
                torch.zeros(128, 2, 1),
                torch.zeros(128, 1, 1),
                capacity=32,
                device="cpu",
                split="expert",
                planner="device",
            )
            _step_misses(provider, long_prompts)
            if protocol != "old":
                _step_misses(provider, generation)
            first = _step_misses(provider, generation[:1])  # the first profile: prefill alone
            if protocol != "old":
                _step_misses(provider, generation)
            whole = _step_misses(provider, generation)
            if protocol == "old":
                differed += whole[0] != first[0]
            else:
                assert whole[0] == first[0], seed
    assert differed > 0  # the old protocol's bias, which the new one removes
