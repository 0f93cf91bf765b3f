"""Sharded safetensors checkpoints written one tensor at a time, for full-depth models.

A full-depth random checkpoint (DeepSeek-V2-Lite: 15.7 billion parameters, 31 GB in bf16) does
not fit in memory as float32 tensors, and one generator stream drawn on the CPU takes minutes.
Here every tensor is drawn from a generator of its own, seeded from the checkpoint's seed and
the tensor's name (:func:`tensor_seed`), on the GPU where there is one (the bytes then depend on
the seed and on the kind of device that drew them; the record says which), and written at once:
one tensor is alive at a time. Each shard's header is computed from the plan before any tensor
is drawn (shapes and dtypes are known), so a shard is written front to back.

Shards: the routers (``router_shard``) in one file of their own, everything else in files of at
most ``shard_bytes`` in name order, and ``model.safetensors.index.json`` mapping each tensor to
its file, as sharded Hugging Face checkpoints are laid out (vLLM loads every file the index
names). Because no tensor's bytes depend on another's, a checkpoint that differs only in its
routers (``--router-skew``) can take the other shards of a checkpoint built before as hard
links (:func:`link_shared_shards`): the skewed DeepSeek-V2-Lite then costs its routers' bytes on
a disk that would not hold two copies.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

Plan = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Every tensor of a checkpoint: its shape and stored dtype."""

INDEX = "model.safetensors.index.json"
ROUTER_SHARD = "model-routers.safetensors"
DTYPES = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8",
}
"""The safetensors names of the dtypes the builders store."""


def tensor_seed(seed: int, name: str) -> int:
    """The seed of ``name``'s own generator: 63 bits of a hash of the checkpoint's seed and the
    name (the CPU's generator keeps the low 32 of them, so a seed must not sit in the high
    bits; two tensors sharing a CPU stream by chance would only repeat random values)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_normal(
    name: str, shape: tuple[int, ...], seed: int, std: float, device: torch.device
) -> torch.Tensor:
    """N(0, std) float32 values of ``shape`` from ``name``'s own generator on ``device``."""
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=generator, device=device).mul_(std)


def draw_bytes(name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """Uniform random uint8 of ``shape`` from ``name``'s own generator on ``device``."""
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    return torch.randint(0, 256, shape, generator=generator, device=device, dtype=torch.uint8)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def assign_shards(plan: Plan, routers: Iterable[str], shard_bytes: int) -> dict[str, str]:
    """Each tensor's file: the routers in ``ROUTER_SHARD``, the rest in name order in files of
    at most ``shard_bytes`` (a larger tensor alone in its file), ``model-00001.safetensors``..."""
    router_set = set(routers)
    unknown = sorted(router_set - set(plan))
    if unknown:
        raise ValueError(f"routers not in the plan: {unknown[:3]}")
    files: dict[str, str] = {}
    index, used = 1, 0
    for name in sorted(plan):
        if name in router_set:
            files[name] = ROUTER_SHARD
            continue
        size = nbytes(*plan[name])
        if used and used + size > shard_bytes:
            index, used = index + 1, 0
        files[name] = f"model-{index:05d}.safetensors"
        used += size
    return files


def _header(plan: Plan, names: list[str], meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name in names:
        shape, dtype = plan[name]
        size = nbytes(shape, dtype)
        header[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # the data starts 8-byte aligned


def write_shard(
    path: Path,
    plan: Plan,
    names: list[str],
    produce: Callable[[str], torch.Tensor],
    meta: dict[str, str],
) -> None:
    """Write ``names`` (sorted) of ``plan`` into the safetensors file ``path``, each tensor
    made by ``produce(name)`` (any device; its shape and dtype must be the plan's) and written
    before the next is made."""
    names = sorted(names)
    text = _header(plan, names, meta)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for name in names:
            tensor = produce(name)
            shape, dtype = plan[name]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}: made {tuple(tensor.shape)} {tensor.dtype}, the plan says "
                    f"{shape} {dtype}"
                )
            host = tensor.contiguous().cpu()
            if host.numel():
                out.write(host.view(torch.uint8).numpy().tobytes())
    partial.rename(path)  # a file under its final name is whole


def write_index(out: Path, plan: Plan, files: dict[str, str]) -> None:
    total = sum(nbytes(*plan[name]) for name in plan)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(files.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")


def write_checkpoint(
    out: Path,
    plan: Plan,
    routers: Iterable[str],
    produce: Callable[[str], torch.Tensor],
    shard_bytes: int,
    skip_files: Iterable[str] = (),
) -> dict[str, str]:
    """Every shard of ``plan`` (but ``skip_files``, taken from elsewhere) and the index; the
    file of each tensor."""
    files = assign_shards(plan, routers, shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(skip_files)
    for file in sorted(set(files.values())):
        if file in skip:
            continue
        names = [name for name, f in files.items() if f == file]
        write_shard(out / file, plan, names, produce, {"format": "pt"})
    write_index(out, plan, files)
    return files


def link_shared_shards(source: Path, out: Path, files: dict[str, str]) -> list[str]:
    """Hard-link every shard of ``files`` but the routers' from ``source`` (a checkpoint built
    from the same plan and seed) into ``out``; the files linked. ``source``'s index must map
    every tensor to the same file, or its shards hold other tensors."""
    index_path = source / INDEX
    if not index_path.exists():
        raise ValueError(f"{source} has no {INDEX}: not a sharded checkpoint of this builder")
    theirs = json.loads(index_path.read_text())["weight_map"]
    if theirs != dict(sorted(files.items())):
        raise ValueError(f"{source}'s shards hold other tensors than this checkpoint's")
    out.mkdir(parents=True, exist_ok=True)
    linked = []
    for file in sorted(set(files.values()) - {ROUTER_SHARD}):
        target = out / file
        target.unlink(missing_ok=True)
        os.link(source / file, target)
        linked.append(file)
    return linked


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as source:
        size = int.from_bytes(source.read(8), "little")
        header: dict[str, Any] = json.loads(source.read(size))
        return header


def read_tensor(out: Path, name: str) -> torch.Tensor:
    """One tensor of a sharded checkpoint, read back through its index (for tests)."""
    file = json.loads((out / INDEX).read_text())["weight_map"][name]
    path = out / file
    header = read_header(path)
    size = int.from_bytes(path.read_bytes()[:8], "little")
    entry = header[name]
    start, end = entry["data_offsets"]
    with open(path, "rb") as source:
        source.seek(8 + size + start)
        raw = bytearray(source.read(end - start))
    dtype = {v: k for k, v in DTYPES.items()}[entry["dtype"]]
    return (
        torch.frombuffer(raw, dtype=dtype).reshape(entry["shape"])
        if raw
        else torch.empty(entry["shape"], dtype=dtype)
    )
