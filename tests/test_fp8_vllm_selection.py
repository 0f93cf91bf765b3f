"""What vLLM picks for ``quantization="fp8"`` on the H200, pinned against its source.

The plugin serves the TRITON FP8 MoE backend (``TritonExperts``) only, because that is what
vLLM 0.25.0 selects on capability 9.0 for both FP8 variants (docs/PLUGIN.md, "FP8 experts"). These
checks read the selection code from the wheels (the seams test's download) and fail when it
changes, naming what moved: then the backend the H200 gets, and so what the plugin must serve,
may have changed.
"""

from __future__ import annotations

import ast
import re

import pytest
import vllm_wheels

from rowcache.vllm.seams import SUPPORTED_VLLM

_MOE = "vllm/model_executor/layers/fused_moe"
_QUANT = "vllm/model_executor/layers/quantization"


def _read(version: str, path: str) -> str:
    return vllm_wheels.read(version, path)[path]


def _function(source: str, name: str, cls: str | None = None) -> str:
    """The source text of top-level function ``name`` (or method ``cls.name``)."""
    tree = ast.parse(source)
    scope: list[ast.stmt] = tree.body
    if cls is not None:
        (found,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        scope = found.body
    (function,) = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    text = ast.get_source_segment(source, function)
    assert text is not None
    return " ".join(text.split())


@pytest.mark.parametrize("version", SUPPORTED_VLLM)
def test_hopper_moves_triton_to_the_front_for_block_fp8(version: str) -> None:
    """``_get_priority_backends``: capability 9.0, block weights x 128-group activations,
    no expert parallelism: TRITON first (FLASHINFER_CUTLASS with expert parallelism)."""
    text = _function(_read(version, f"{_MOE}/oracle/fp8.py"), "_get_priority_backends")
    hopper = text.index("current_platform.is_device_capability(90)")
    branch = text[hopper : hopper + 600]
    assert "activation_key == kFp8Dynamic128Sym" in branch
    assert "weight_key == kFp8Static128BlockSym" in branch
    assert "moe_config.moe_parallel_config.ep_size > 1" in branch
    expert_parallel, _, otherwise = branch.partition("else:")
    assert "_move_to_front(_AVAILABLE_BACKENDS, Fp8MoeBackend.FLASHINFER_CUTLASS)" in (
        expert_parallel
    )
    assert "_move_to_front(_AVAILABLE_BACKENDS, Fp8MoeBackend.TRITON)" in otherwise


@pytest.mark.parametrize("version", SUPPORTED_VLLM)
def test_triton_backend_is_triton_experts_for_both_variants(version: str) -> None:
    oracle = _function(_read(version, f"{_MOE}/oracle/fp8.py"), "backend_to_kernel_cls")
    triton = oracle.index("backend == Fp8MoeBackend.TRITON:")
    assert "return [TritonExperts]" in oracle[triton : triton + 300]
    schemes = _function(
        _read(version, f"{_MOE}/experts/triton_moe.py"), "_supports_quant_scheme", "TritonExperts"
    )
    assert "(kFp8Static128BlockSym, kFp8Dynamic128Sym)" in schemes
    assert "(kFp8StaticTensorSym, kFp8DynamicTensorSym)" in schemes


def test_online_per_tensor_finds_no_backend_before_triton_on_hopper() -> None:
    """vLLM 0.25.0, online per-tensor (static tensor weights x dynamic tensor activations):
    the backends ahead of TRITON in the default order cannot take it on the H200."""
    version = "0.25.0"
    oracle = _function(_read(version, f"{_MOE}/oracle/fp8.py"), "_get_priority_backends")
    order = oracle[oracle.index("_AVAILABLE_BACKENDS = [") :]
    ahead = order[: order.index("Fp8MoeBackend.TRITON,")]
    assert re.findall(r"Fp8MoeBackend\.(\w+)", ahead) == [
        "AITER",  # ROCm only
        "FLASHINFER_TRTLLM",
        "FLASHINFER_CUTLASS",
        "DEEPGEMM",
        "VLLM_CUTLASS",
    ]
    # VLLM_CUTLASS is removed: both FP8 methods pass allow_vllm_cutlass=False.
    select = _function(_read(version, f"{_MOE}/oracle/fp8.py"), "select_fp8_moe_backend")
    assert "if not allow_vllm_cutlass: AVAILABLE_BACKENDS.remove(Fp8MoeBackend.VLLM_CUTLASS)" in (
        select
    )
    trtllm = _function(
        _read(version, f"{_MOE}/experts/trtllm_fp8_moe.py"),
        "_supports_current_device",
        "TrtLlmFp8ExpertsBase",
    )
    assert "is_device_capability_family(100)" in trtllm  # Blackwell only
    flashinfer = _function(
        _read(version, f"{_MOE}/experts/flashinfer_cutlass_moe.py"),
        "_supports_quant_scheme",
        "FlashInferExperts",
    )
    assert "kFp8DynamicTensorSym" not in flashinfer  # static per-tensor activations only
    deep_gemm = _function(
        _read(version, f"{_MOE}/experts/deep_gemm_moe.py"),
        "_supports_quant_scheme",
        "DeepGemmExperts",
    )
    assert "kFp8StaticTensorSym" not in deep_gemm  # block scales only
    online = _read(version, f"{_QUANT}/online/fp8.py")
    base = _function(online, "__init__", "_Fp8OnlineMoEBase")
    assert "weight_key = kFp8StaticTensorSym" in base
    assert "activation_key = kFp8DynamicTensorSym" in base


def test_fp8_config_builds_the_two_methods_in_0_25_0() -> None:
    text = _function(_read("0.25.0", f"{_QUANT}/fp8.py"), "get_quant_method", "Fp8Config")
    assert "return Fp8MoEMethod(self, layer)" in text
    assert "return Fp8PerTensorOnlineMoEMethod(layer=layer)" in text
    method = _function(_read("0.25.0", f"{_QUANT}/fp8.py"), "__init__", "Fp8MoEMethod")
    assert "allow_vllm_cutlass=False" in method


_FP8_RECORDS = ("run1", "run2", "run3", "run3-control", "run4-default")
"""The FP8 runs of 2026-12-02 on the H200 (docs/records/): run 1's engines without the cache
started (the cached ones failed at the commit run then), run 2's block-scaled ones measured,
run 3 measured every engine of both checkpoints and online FP8 with and without the cache, its
control and run 4 (the default planner) some of them again."""


def test_the_h200_gave_both_fp8_variants_the_backend_the_plugin_serves() -> None:
    """The backend each FP8 variant got on the H200, as the engines' probe recorded it (every
    MoE layer's ``fp8_backend`` and experts class) and as vLLM logged it: TRITON with
    ``TritonExperts``, the one backend the plugin serves (``rowcache.vllm._fp8._check_backend``).
    Recording a run where vLLM picked another fails here: the plugin would have stopped that
    engine, and its figures would be vLLM's without the cache."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "docs" / "vllm" / "2026-12-02-fp8"
    methods: set[str] = set()
    for run in _FP8_RECORDS:
        for line in (root / run / "records.jsonl").read_text().splitlines():
            record = json.loads(line)
            for logged in record.get("moe_backend_log") or []:
                assert "Using TRITON Fp8 MoE backend" in logged, (record["name"], logged)
            if not record["ok"]:
                continue
            probe = record["probe"]
            assert probe["moe_backend"] == {"TRITON/TritonExperts": 8}, record["name"]
            methods.update(probe["method"])
    # Both variants: the FP8 checkpoint (block scales) and online per-tensor, each with and
    # without the cache where it ran.
    assert {
        "Fp8MoEMethod",
        "RowcacheFp8MoEMethod",
        "Fp8PerTensorOnlineMoEMethod",
        "RowcacheFp8OnlineMoEMethod",
    } <= methods
