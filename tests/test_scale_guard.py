"""No offload's MXFP4 weight scales followed by zeros (tools/vllm/harness/scale_guard.py), on
the CPU over the fields of triton_kernels' wrappers: the copy keeps every value, stride and
offset and puts zeros where vLLM's kernel reads past the tensor; the guard reaches the scales
the kernel's quant config holds, or refuses with nothing changed; the hook wraps the class
once and the engine's record refuses an engine that guarded nothing."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from triton_wrappers import Storage, Wrapper

from rowcache.sources import SLOT_GUARD_BYTES
from tools.vllm.harness import scale_guard, scale_tails


@dataclass
class PrecisionConfig:  # triton_kernels.matmul_ogs.PrecisionConfig's field the guard reads
    weight_scale: Wrapper


def _scales(experts: int, after: int) -> torch.Tensor:
    """w13-like scales: the ``.mT`` of a contiguous ``[E, 4, 6]`` uint8 tensor, its storage
    running 80 bytes of ``after`` past its end (where the kernel's read finds them)."""
    size = experts * 4 * 6
    backing = torch.full((size + 80,), after, dtype=torch.uint8)
    backing[:size] = torch.arange(size, dtype=torch.uint8) % 200 + 1
    return backing[:size].view(experts, 4, 6).mT


def _method(after: int = 0xFF, shared: bool = True) -> Any:
    """A converted method as vLLM 0.25.0 leaves it: w13 and w2 precision configs, and quant
    configs (its own and its kernel's) holding the same ones (``shared``), or, for w2, a
    wrapper of their own."""
    w13 = PrecisionConfig(Wrapper(Storage(_scales(3, after))))
    w2 = PrecisionConfig(Wrapper(Storage(_scales(3, after))))
    kernel_w2 = w2 if shared else PrecisionConfig(Wrapper(Storage(w2.weight_scale.storage.data)))
    quant = SimpleNamespace(_w1=SimpleNamespace(scale=w13), _w2=SimpleNamespace(scale=w2))
    kernel_quant = SimpleNamespace(
        _w1=SimpleNamespace(scale=w13), _w2=SimpleNamespace(scale=kernel_w2)
    )
    return SimpleNamespace(
        w13_precision_config=w13,
        w2_precision_config=w2,
        moe_quant_config=quant,
        moe_kernel=SimpleNamespace(fused_experts=SimpleNamespace(quant_config=kernel_quant)),
    )


def _read(raw: torch.Tensor, start: int, count: int) -> list[int]:
    return [int(v) for v in raw[start : start + count].tolist()]


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    yield
    scale_guard._GUARDED.clear()


def test_the_copy_keeps_the_tensor_and_puts_zeros_after_it() -> None:
    data = _scales(3, 0xFF)
    copy = scale_guard.guarded_like(data)
    assert copy.shape == data.shape and copy.stride() == data.stride()
    assert torch.equal(copy, data)
    end = scale_tails.storage_end(copy)
    tail = torch.tensor([], dtype=torch.uint8).set_(copy.untyped_storage())[end:]
    assert tail.numel() >= SLOT_GUARD_BYTES and not tail.any()
    # An offset view: the bytes before it are zeros too, and its own come through.
    base = torch.full((40,), 0xFF, dtype=torch.uint8)
    view = base[7:].as_strided((2, 3), (6, 1), 7)
    moved = scale_guard.guarded_like(view)
    assert moved.storage_offset() == 7 and torch.equal(moved, view)
    assert scale_tails.storage_end(moved) == 7 + 6 + 3


def test_the_guard_changes_what_the_kernel_reads_past_the_scales() -> None:
    method = _method(after=0xFF)
    layer = SimpleNamespace(quant_method=method)
    model = SimpleNamespace(named_modules=lambda: iter([("layers.0.experts", layer)]))
    before = scale_tails.tails(model, read=_read)
    assert before["layers_with_ff"] == 1  # the seeded 0xFF is seen
    values = {
        k: getattr(method, f"{k}_precision_config").weight_scale.storage.data.clone()
        for k in ("w13", "w2")
    }
    scale_guard.guard(method)
    after = scale_tails.tails(model, read=_read)
    assert after["layers_with_ff"] == 0 and after["layers"]["layers.0.experts"]["bytes"] == [0] * 64
    for key in ("w13", "w2"):
        config = getattr(method, f"{key}_precision_config")
        assert torch.equal(config.weight_scale.storage.data, values[key])
        index = {"w13": "_w1", "w2": "_w2"}[key]
        for holder in (method.moe_quant_config, method.moe_kernel.fused_experts.quant_config):
            assert getattr(holder, index).scale.weight_scale.storage is config.weight_scale.storage
    assert scale_guard.record() == {"layers": 1}


def test_a_kernel_scale_of_its_own_is_refused_and_nothing_changes() -> None:
    method = _method(shared=False)
    w13_before = method.w13_precision_config.weight_scale.storage.data
    with pytest.raises(
        RuntimeError, match=r"moe_kernel.fused_experts.quant_config._w2.scale .* another w2"
    ):
        scale_guard.guard(method)
    assert method.w13_precision_config.weight_scale.storage.data is w13_before  # not guarded
    missing = SimpleNamespace(w13_precision_config=None, w2_precision_config=None)
    with pytest.raises(RuntimeError, match="has no w13 weight scale in w13_precision_config"):
        scale_guard.guard(missing)
    with pytest.raises(RuntimeError, match="no gpt-oss MXFP4 layer was guarded"):
        scale_guard.record()


def test_the_hook_guards_after_vllms_processing_once() -> None:
    calls: list[str] = []

    class Method:
        def __init__(self) -> None:
            self.w13_precision_config = PrecisionConfig(Wrapper(Storage(_scales(2, 0xFF))))
            self.w2_precision_config = PrecisionConfig(Wrapper(Storage(_scales(2, 0xFF))))

        def process_weights_after_loading(self, layer: Any) -> str:
            calls.append(layer)
            return "done"

    own = Method.process_weights_after_loading
    scale_guard.install(Method)
    scale_guard.install(Method)  # a second call changes nothing
    method = Method()
    original = method.w13_precision_config.weight_scale.storage.data
    assert method.process_weights_after_loading("layer") == "done" and calls == ["layer"]
    guarded = method.w13_precision_config.weight_scale.storage.data
    assert guarded is not original and torch.equal(guarded, original)
    assert scale_guard.record() == {"layers": 1}  # wrapped once: one guard a call
    scale_guard.uninstall(Method)
    assert Method.process_weights_after_loading is own
    with pytest.raises(RuntimeError, match="no gpt-oss MXFP4 layer"):
        scale_guard.record()
