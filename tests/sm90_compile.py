"""Compiling Triton kernels for Hopper (SM90) here, without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on the CPU and so checks
what it computes, but it never runs the compiler's front end: a name the code generator cannot
resolve, an annotation it cannot read, a constexpr of the wrong kind, a type it cannot lower,
all pass the interpreter and stop the first launch on the GPU. ``triton.compile`` for an SM90
target runs that whole chain (the AST to TTIR, TTGIR, LLVM IR and PTX, then ptxas) on any
machine. ``Recorder`` stands in for a kernel at its launcher, so that the arguments compiled
are the ones the launcher passes; ``compile_sm90`` compiles a kernel for them."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

SM90 = GPUTarget("cuda", 90, 32)
"""Hopper (H100, H200), 32 threads a warp."""

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")
"""Keyword arguments of a launch that are the compiler's options, not the kernel's."""


@dataclass
class Recorder:
    """A stand-in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` keeps the
    launch instead of running it."""

    launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((args, kwargs))

        return launch


@contextmanager
def recording(owner: Any, name: str) -> Iterator[Recorder]:
    """``owner.name`` (a kernel where its launcher looks it up) replaced by a recorder for the
    duration, and put back after."""
    kernel = getattr(owner, name)
    recorder = Recorder()
    setattr(owner, name, recorder)
    try:
        yield recorder
    finally:
        setattr(owner, name, kernel)


def jit_kernel(module: str, name: str) -> JITFunction[Any]:
    """``module.name`` as a compiled (not interpreted) kernel: ``triton.jit`` chooses when it
    decorates, so a module first imported under ``TRITON_INTERPRET=1`` is imported again."""
    kernel = getattr(importlib.import_module(module), name)
    if not isinstance(kernel, JITFunction):
        if os.environ.get("TRITON_INTERPRET"):
            raise RuntimeError("unset TRITON_INTERPRET to compile kernels for the GPU")
        kernel = getattr(importlib.reload(importlib.import_module(module)), name)
    assert isinstance(kernel, JITFunction), f"{module}.{name} is not a Triton kernel"
    return kernel


def compile_sm90(kernel: JITFunction[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``kernel`` compiled for SM90 for one launch's arguments (tensors by their dtype, other
    runtime values by their type, constexprs by value, defaults where the launch gives none).
    A launch on the GPU also specializes integers equal to 1 or divisible by 16, and pointers'
    alignment, where the kernel allows it; this compiles the general kernel, through the same
    front end."""
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in LAUNCH_OPTIONS if key in kwargs}
    bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in kernel.params:
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = mangle_type(value)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=SM90, options=options)
