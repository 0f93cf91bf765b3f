"""Every Triton kernel of rowcache and of its vLLM harness compiled for Hopper (SM90) here,
for the arguments its launcher passes (``sm90_compile``): what Triton's interpreter, which the
other kernel tests run under, never checks. The launchers run on CPU tensors with the kernel
replaced by a recorder; the kernel is then compiled for each launch kept. A kernel the front
end cannot compile is shown to fail here (an annotation it cannot resolve, as the scale-tails
reader's once did on the GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sm90_compile import compile_sm90, jit_kernel, recording
from triton.compiler.errors import CompilationError

from rowcache.bench import link
from rowcache.compress import encode, triton_decode
from rowcache.device_plan import kernels
from rowcache.device_plan import triton_kernels as plan_module
from rowcache.device_plan.state import new_state
from tools.vllm.harness import scale_tails, scale_tails_kernel

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _compiled_not_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton 3.9 warns while its floating-point fusion default is unset; the kernels' PTX is
    # only looked at, never run.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")


def _compiled(module: str, name: str, launch: tuple[tuple[Any, ...], dict[str, Any]]) -> str:
    """The PTX of ``module.name`` compiled for one recorded launch."""
    args, kwargs = launch
    return str(compile_sm90(jit_kernel(module, name), args, kwargs).asm["ptx"])


@pytest.mark.parametrize(
    ("pass_index", "num_passes", "count_max", "rows"),
    [
        (0, 1, 0, 8),  # a decode step in one pass, lru
        (0, 2, 15, 8),  # the first of two passes, lfu
        (1, 3, 0, 8),  # a middle pass
        (1, 2, 15, 400),  # the last pass of a prompt-sized step (the wide block and its loop)
    ],
)
def test_the_planner_compiles_for_its_launches(
    pass_index: int, num_passes: int, count_max: int, rows: int
) -> None:
    state = new_state(128, 32, CPU, count_max=count_max)
    ids = torch.randint(0, 128, (rows, 8), dtype=torch.int32)
    with recording(plan_module, "plan_kernel") as recorder:
        kernels.launch_plan(state, ids, pass_index, num_passes)
    (launch,) = recorder.launches
    ptx = _compiled("rowcache.device_plan.triton_kernels", "plan_kernel", launch)
    assert ".visible .entry plan_kernel" in ptx


def test_the_gather_and_invalidation_compile() -> None:
    state = new_state(64, 16, CPU)
    table = torch.zeros((3, 7), dtype=torch.int64)  # regions.chunk_table's rows of 7 words
    gather = (
        (table, 3, state.miss_experts, state.miss_slots, state.miss_count, state.capacity),
        {"BLOCK": 2048, "num_warps": 4},  # CHUNK_BYTES // 8 words a load, as TritonKernels
    )
    ptx = _compiled("rowcache.device_plan.triton_kernels", "gather_kernel", gather)
    assert "ld.global" in ptx
    invalidate = ((state.resident, state.owners, state.counters, 5), {})
    ptx = _compiled("rowcache.device_plan.triton_kernels", "invalidate_kernel", invalidate)
    assert "st.global" in ptx


@pytest.mark.parametrize("code_bits", [3, 4])
def test_the_decode_compiles_for_both_launches(code_bits: int) -> None:
    planes = encode(torch.randn(4, 2, 1024).to(torch.bfloat16), code_bits)
    slots = torch.zeros(3, 2, 1024, dtype=torch.bfloat16)
    decoder = triton_decode.SlotDecoder(planes, slots, grid=8)
    state = new_state(4, 3, CPU)
    with recording(triton_decode, "decode_gather_kernel") as recorder:
        decoder(state.miss_experts, state.miss_slots, state.miss_count)  # the device planner's
        decoder.decode_one(1, 2)  # the host planner's one miss
    assert len(recorder.launches) == 2
    for launch in recorder.launches:
        ptx = _compiled("rowcache.compress.triton_decode", "decode_gather_kernel", launch)
        assert ".visible .entry decode_gather_kernel" in ptx


@pytest.mark.parametrize("cache", link.CACHE_MODIFIERS)
def test_the_link_bench_read_compiles(cache: str) -> None:
    with recording(link, "read_kernel") as recorder:
        # A host address as the bench maps them (above 4 GiB: an int64 argument).
        link.read_words(
            0x7F00_0000_0000,
            torch.zeros(4096, dtype=torch.int64),
            programs=4,
            block=512,
            warps=4,
            cache=cache,
        )
    (launch,) = recorder.launches
    ptx = _compiled("rowcache.bench.link_kernel", "read_kernel", launch)
    assert f"ld.global{cache}" in ptx


def test_the_scale_tails_reader_compiles() -> None:
    """The harness's reader of the bytes past gpt-oss's weight scales, for the launch its
    launcher makes (annotated, it once stopped on the GPU: the test below)."""
    raw = torch.zeros(100, dtype=torch.uint8)
    with recording(scale_tails_kernel, "peek_kernel") as recorder:
        scale_tails._read_on_cuda(raw, 90, scale_tails.TAIL_BYTES)
    (launch,) = recorder.launches
    ptx = _compiled("tools.vllm.harness.scale_tails_kernel", "peek_kernel", launch)
    assert "ld.global" in ptx


def test_a_kernel_the_front_end_cannot_compile_fails_here(tmp_path: Any, monkeypatch: Any) -> None:
    """The seeded bug: parameters annotated under ``from __future__ import annotations``, so
    the code generator looks the annotations' names up as globals (2026-12-07, on the GPU)."""
    (tmp_path / "annotated_kernel.py").write_text(
        "from __future__ import annotations\n"
        "from typing import Any\n"
        "import triton\n"
        "import triton.language as tl\n\n\n"
        "@triton.jit\n"
        "def peek(src: Any, out: Any, n: tl.constexpr) -> None:\n"
        "    tl.store(out + tl.arange(0, n), tl.load(src + tl.arange(0, n)))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    kernel = jit_kernel("annotated_kernel", "peek")
    raw = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(CompilationError, match="Cannot access global variable Any"):
        compile_sm90(kernel, (raw, raw), {"n": 64})
