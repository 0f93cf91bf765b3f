"""Whether vLLM's MXFP4 matmul reads past its weight scales, on the GPU, outside any engine.

vLLM 0.25.0's gpt-oss MoE runs triton_kernels' ``matmul_ogs``; on Hopper with 4-bit weights
its non-persistent kernel loads the swizzled weight scales without a mask, and the last K step
reads 64 bytes past the scale storage (docs/GPT_OSS.md, section 3). This builds a w13-like
weight of ``--experts`` experts (random packed values, scales 118 to 127, never ``0xFF``),
swizzles it with vLLM's own ``_swizzle_mxfp4``, places the scale storage at the start of a
buffer whose bytes after it are set per case, routes every token to the last experts and
runs the kernel once per case:

* ``zeros``: zeros after the storage (the cache's slots and the guarded no offload);
* ``finite``: ``0xFE`` (e8m0 2^127, finite);
* ``ff``: ``0xFF`` (e8m0's NaN);
* ``ff_first_32`` / ``ff_last_32``: ``0xFF`` only in bytes 0 to 31 / 32 to 63 past the end;
* ``ff_past_guard``: zeros for ``rowcache.sources.SLOT_GUARD_BYTES``, ``0xFF`` after them.

Verdict (exit status): 0, the over-read as read: ``ff``'s NaN outputs are those of its two
halves, in the last expert's rows only (at gpt-oss's 5,760 rows the second half lands in the
padding), and ``finite`` and ``ff_past_guard`` are bit-identical to ``zeros``; 1, no NaN with
``0xFF`` after the storage (the kernel does not read there on this GPU); 2, anything else
(NaN without ``0xFF`` in the 64 bytes, NaN in another expert's rows, ``zeros`` far from a
torch reference, or an error), named. Run where vLLM is installed (its ``triton_kernels`` under
``vllm/third_party``), on an SM90 GPU::

    PYTHONPATH=. python3 tools/vllm/scale_overread.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["CASES", "GUARD_BYTES", "main", "nan_cells", "place_before_tail", "verdict"]

GUARD_BYTES = 4096
"""Bytes after the scale storage that the cases set."""


def _cases(slot_guard: int) -> dict[str, tuple[int, int, int]]:
    """Each case: the byte written and the range of bytes past the storage it fills."""
    return {
        "zeros": (0x00, 0, GUARD_BYTES),
        "finite": (0xFE, 0, GUARD_BYTES),
        "ff": (0xFF, 0, GUARD_BYTES),
        "ff_first_32": (0xFF, 0, 32),
        "ff_last_32": (0xFF, 32, 64),
        "ff_past_guard": (0xFF, slot_guard, GUARD_BYTES),
    }


CASES = ("zeros", "finite", "ff", "ff_first_32", "ff_last_32", "ff_past_guard")
"""The cases' names, in the order they run."""

SAME_AS_ZEROS = ("finite", "ff_past_guard")
"""The cases whose outputs the reading says are ``zeros``'s bits."""


def place_before_tail(storage: Any) -> tuple[Any, Any]:
    """A copy of the swizzled scale storage at the start of a zeroed buffer of
    ``GUARD_BYTES`` more, with the same shape and strides, and those bytes after it.

    The storage must be dense uint8 laid out as the ``.mT`` of a contiguous tensor (vLLM
    0.25.0's Hopper swizzle); any other layout is named, since the bytes "past the end" would
    then not be the ones the kernel's last step reads."""
    import torch

    if storage.dtype != torch.uint8 or storage.dim() < 2:
        raise RuntimeError(
            f"the swizzled scales are {storage.dtype} of {storage.dim()} dimensions, not uint8 "
            f"of 2 or more: another vLLM layout"
        )
    size = storage.numel()
    backing = torch.zeros(size + GUARD_BYTES, dtype=torch.uint8, device=storage.device)
    placed = backing[:size].view(storage.mT.shape).mT
    if placed.stride() != storage.stride():
        raise RuntimeError(
            f"the swizzled scales are not the .mT of a contiguous tensor (shape "
            f"{tuple(storage.shape)}, strides {storage.stride()}): another vLLM layout"
        )
    placed.copy_(storage)
    return placed, backing[size:]


def nan_cells(output: Any) -> list[tuple[int, int]]:
    """The (row, column) of every NaN in a 2-D tensor, in order."""
    import torch

    rows, cols = torch.nonzero(torch.isnan(output), as_tuple=True)
    return list(zip((int(r) for r in rows.tolist()), (int(c) for c in cols.tolist()), strict=True))


def _columns(cells: list[tuple[int, int]]) -> str:
    found = sorted({col for _, col in cells})
    return f"columns {found[0]} to {found[-1]}" if found else "no column (padding)"


def verdict(
    nans: dict[str, list[tuple[int, int]]],
    same_as_zeros: dict[str, bool],
    last_expert_rows: set[int],
    reference_ok: bool,
) -> tuple[int, str]:
    """The exit status and its reason, from each case's NaN cells, whether each case's
    outputs are bit-identical to ``zeros``'s (NaN equal to NaN), the output rows routed to the
    last expert, and whether ``zeros`` matches the torch reference."""
    if not reference_ok:
        return 2, "the kernel's outputs with zeros after the scales are not the torch reference's"
    stray = [name for name in ("zeros", *SAME_AS_ZEROS) if nans.get(name)]
    if stray:
        return 2, f"NaN outputs without an 0xFF byte in the 64 past the storage: {stray}"
    if not nans.get("ff"):
        return 1, "no NaN output with 0xFF after the scale storage: no read past it seen"
    halves = set(nans["ff_first_32"]) | set(nans["ff_last_32"])
    if halves != set(nans["ff"]):
        return 2, "0xFF in the two halves of the 64 bytes does not give 0xFF's NaN outputs"
    others = sorted({row for row, _ in nans["ff"]} - last_expert_rows)
    if others:
        return 2, f"NaN outputs in rows of other experts than the last: {others}"
    moved = [name for name in SAME_AS_ZEROS if not same_as_zeros[name]]
    if moved:
        return 2, f"outputs moved without an 0xFF byte in the 64 past the storage: {moved}"
    return 0, (
        f"the kernel reads past the weight scales: 0xFF there gives {len(nans['ff'])} NaN "
        f"outputs in the last expert's rows, {_columns(nans['ff_first_32'])} from the first 32 "
        f"bytes, {_columns(nans['ff_last_32'])} from the next 32"
    )


def _run(args: argparse.Namespace) -> dict[str, Any]:
    """Build, swizzle and run every case on the GPU (imports vLLM and triton_kernels)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _swizzle_mxfp4
    from vllm.utils.import_utils import has_triton_kernels

    from rowcache.sources import SLOT_GUARD_BYTES

    # vLLM's own triton_kernels, as its MoE imports them (its bundled copy under the name).
    if not has_triton_kernels():
        raise RuntimeError("this vLLM finds no triton_kernels (site-packages or its third_party)")
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig, matmul_ogs
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    from triton_kernels.routing import routing_torch

    device = torch.device("cuda")
    experts, n, k, tokens, top_k = args.experts, args.n, args.k, args.tokens, 2
    gen = torch.Generator().manual_seed(args.seed)
    values = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 128, (experts, n, k // 32), dtype=torch.uint8, generator=gen)
    bias = (torch.randn(experts, n, generator=gen) * 0.1).float()
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen)
    w, flex, w_scale = _swizzle_mxfp4(values.to(device), scales.to(device), num_warps=8)
    storage = w_scale.storage.data
    size = storage.numel()
    placed, tail = place_before_tail(storage)
    w_scale.storage.data = placed
    ids = torch.arange(experts - top_k, experts, dtype=torch.int32)[None, :].repeat(tokens, 1)
    routing, gather, _ = routing_torch(logits.to(device), top_k, expt_indx=ids.to(device))
    precision = PrecisionConfig(weight_scale=w_scale, flex_ctx=FlexCtx(rhs_data=flex))
    outputs: dict[str, Any] = {}
    for name, (byte, start, end) in _cases(SLOT_GUARD_BYTES).items():
        tail.zero_()
        tail[start:end] = byte
        y = torch.empty(1, tokens * top_k, n, dtype=torch.bfloat16, device=device)
        out = matmul_ogs(
            x.to(device),
            w,
            bias.to(device),
            routing,
            gather_indx=gather,
            precision_config=precision,
            gammas=None,
            fused_activation=None,
            y=y,
        )
        torch.cuda.synchronize()
        outputs[name] = out.float().reshape(tokens * top_k, n).cpu()
    # Row r of the output (expert-sorted) is token src[r] // top_k of the expert it lies in.
    hist = [int(v) for v in routing.expt_hist.tolist()]
    row_expert = torch.repeat_interleave(torch.arange(experts), torch.tensor(hist))
    src = gather.src_indx.long().cpu() // top_k
    dense = upcast_from_mxfp_torch(values, scales, torch.float32, axis=-1)
    reference = torch.stack(
        [
            x[src[r]].float() @ dense[row_expert[r]].T + bias[row_expert[r]]
            for r in range(tokens * top_k)
        ]
    )
    zeros = outputs["zeros"]
    close = (zeros - reference).abs() <= reference.abs() * 2.0**-7 + 1e-3
    nans = {name: nan_cells(out) for name, out in outputs.items()}
    same = {
        name: bool(torch.equal(torch.nan_to_num(out, nan=1e30), torch.nan_to_num(zeros, nan=1e30)))
        for name, out in outputs.items()
    }
    last_rows = {r for r in range(tokens * top_k) if int(row_expert[r]) == experts - 1}
    status, reason = verdict(nans, same, last_rows, bool(close.all()))
    return {
        "status": status,
        "verdict": reason,
        "shape": {"experts": experts, "n": n, "k": k, "tokens": tokens, "top_k": top_k},
        "scale_storage": {
            "shape": list(storage.shape),
            "stride": list(storage.stride()),
            "bytes": size,
        },
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "slot_guard_bytes": SLOT_GUARD_BYTES,
        "cases": {
            name: {
                "nan": len(nans[name]),
                "nan_columns": sorted({c for _, c in nans[name]}),
                "nan_rows": sorted({r for r, _ in nans[name]}),
                "bit_identical_to_zeros": same[name],
            }
            for name in outputs
        },
        "last_expert_rows": sorted(last_rows),
        "zeros_within_reference": bool(close.all()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--n", type=int, default=5760, help="w13 rows (gpt-oss-20b: 5760)")
    parser.add_argument("--k", type=int, default=2880, help="hidden size (gpt-oss-20b: 2880)")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="where the findings are written")
    args = parser.parse_args(argv)
    if args.experts < 2:
        parser.error(f"--experts must be 2 or more (tokens route to the last two): {args.experts}")
    try:
        found = _run(args)
    except Exception as exc:  # the reason is the finding: printed and written, exit 2
        found = {"status": 2, "verdict": f"{type(exc).__name__}: {exc}"}
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps({k: v for k, v in found.items() if k != "cases"}))
    for name, case in (found.get("cases") or {}).items():
        print(f"  {name}: {case}")
    print(f"scale over-read: {found['verdict']}")
    return int(found["status"])


if __name__ == "__main__":
    sys.exit(main())
