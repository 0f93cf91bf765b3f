"""What lies past each gpt-oss layer's w13 scales (tools/vllm/harness/scale_tails.py), on the
CPU with a reader over storages that run past the tensors: the bytes from each tensor's end,
wherever its strides put it, the 0xFF bytes counted by layer, and the summary's words."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tools.vllm.harness import probe_lines, scale_tails


def _read(raw: torch.Tensor, start: int, count: int) -> list[int]:
    return [int(v) for v in raw[start : start + count].tolist()]


def _layer(experts: int, poke: dict[int, int]) -> Any:
    """A method whose w13 scales are the ``.mT`` of a contiguous ``[E, 4, 6]`` uint8 tensor,
    followed in its storage by 80 bytes, ``poke`` (offset past the end -> byte) set there."""
    size = experts * 4 * 6
    backing = torch.zeros(size + 80, dtype=torch.uint8)
    backing[:size] = 7
    for offset, value in poke.items():
        backing[size + offset] = value
    data = backing[:size].view(experts, 4, 6).mT
    scale = SimpleNamespace(storage=SimpleNamespace(data=data))
    method = SimpleNamespace(w13_precision_config=SimpleNamespace(weight_scale=scale))
    return SimpleNamespace(quant_method=method)


def test_the_bytes_past_each_scale_tensor_are_read_and_0xff_counted() -> None:
    layers = [
        ("model.layers.0.mlp.experts", _layer(3, {})),
        ("model.layers.1.mlp.experts", _layer(3, {0: 0xFF, 63: 0xFF, 64: 0xFF})),
        ("model.layers.1.mlp.router", SimpleNamespace()),  # no MoE method: skipped
    ]
    model = SimpleNamespace(named_modules=lambda: iter(layers))
    found = scale_tails.tails(model, read=_read)
    assert found["tail_bytes"] == scale_tails.TAIL_BYTES == 64
    assert list(found["layers"]) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    first, second = found["layers"].values()
    assert first == {"bytes": [0] * 64, "ff": 0}
    assert second["bytes"][0] == second["bytes"][63] == 0xFF and second["ff"] == 2  # not 64
    assert found["layers_with_ff"] == 1
    line = probe_lines.scale_tails_line({"scale_tails": found}, "none.full")
    assert line == (
        "  scale tails of none.full (2 layers, 64 bytes past each w13 scale tensor, where vLLM's "
        "MXFP4 kernel reads): 1 layers hold 0xFF bytes there: model.layers.1.mlp.experts (2); "
        "where one is among the 32 that reach outputs, the last expert's outputs in that layer "
        "are not the kernel's arithmetic over the experts' bytes"
    )
    clean = {"scale_tails": {**found, "layers": {"l0": first}, "layers_with_ff": 0}}
    assert probe_lines.scale_tails_line(clean, "row").endswith(": no 0xFF byte")
    assert probe_lines.scale_tails_line({"scale_tails_error": "E: x"}, "row") == (
        "  scale tails of row: not read (E: x)"
    )
    assert probe_lines.scale_tails_line({}, "row") is None


def test_the_end_follows_the_strides() -> None:
    base = torch.zeros(2 * 3 * 5 + 9, dtype=torch.uint8)
    plain = base[:30].view(2, 3, 5)
    assert scale_tails.storage_end(plain) == 30
    assert scale_tails.storage_end(plain.mT) == 30  # the same bytes, other strides
    assert scale_tails.storage_end(base[4:].as_strided((2, 3), (6, 1), 4)) == 4 + 6 + 3


def _kernel_module(monkeypatch: Any, interpret: bool) -> Any:
    """``scale_tails_kernel`` decorated afresh, for the GPU's compiler or Triton's interpreter
    (``triton.jit`` chooses when it decorates)."""
    import importlib

    from tools.vllm.harness import scale_tails_kernel

    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return importlib.reload(scale_tails_kernel)


def test_the_reading_kernel_reads_past_the_tensor(monkeypatch: Any) -> None:
    """Under Triton's interpreter: the bytes from ``start`` on, past the tensor's end into the
    storage behind it, as the launcher reads them."""
    _kernel_module(monkeypatch, interpret=True)
    try:
        raw = torch.arange(200, dtype=torch.uint8)[:100]
        assert scale_tails._read_on_cuda(raw, 90, 64) == list(range(90, 154))
    finally:
        _kernel_module(monkeypatch, interpret=False)
