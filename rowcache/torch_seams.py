"""Every private PyTorch name rowcache relies on, as data, with a checker against installed torch.

PyTorch gives no stable API for two things rowcache does: reading the current stream's raw
handle without building a ``torch.cuda.Stream`` (the hit path's host time), and telling the
stream sanitizer (``torch.cuda._sanitizer``) about copies it cannot see (batched copies are no
aten operation). The tests replay traces through the sanitizer's analysis half as well. Each
private name is listed here once (the module, the name, why rowcache needs it, what breaks
when it moves, and who uses it); ``rowcache.backends.cuda`` takes its names from this table
(``RAW_CURRENT_STREAM``, ``SANITIZER_*``), and ``tests/test_torch_seams.py`` checks every row
against the torch that CI installs and that every private torch name in ``rowcache/`` and
``tests/`` is a row. The vLLM counterpart is ``rowcache.vllm.seams``.

Name forms (a dotted path from the module, resolved with ``getattr``; a dataclass field of a
class counts as its attribute):

* ``"a.b"``: the path resolves.
* ``"a.b(x, y)"``: it resolves to a callable whose positional parameters (after a leading
  ``self``) start with ``x, y`` in that order, and that needs no other argument: rowcache calls
  it positionally with exactly those. ``"a.b()"``: callable with no argument.

``cuda_only`` rows are C functions that only CUDA builds of torch define (the CPU build CI
installs lacks them). On a CUDA build (``torch.backends.cuda.is_built()``) they are checked as
above; on a CPU build the checker reads their declaration in torch's own type stub
(``torch/_C/__init__.pyi``, generated for every build, CUDA functions included) instead.

Besides CI (torch 2.13.0, CPU build), the table was checked on the H200 machine's torch
2.11.0+cu130, where the CUDA-only row resolves.

``check_seam`` imports the row's module: importing ``torch.cuda._sanitizer`` switches on
PyTorch's GPU trace (harmless on the CPU; the backend itself only looks the module up).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RAW_CURRENT_STREAM",
    "SANITIZER",
    "SANITIZER_ENABLED",
    "SANITIZER_ERRORS",
    "SANITIZER_KERNEL_LAUNCH",
    "SEAMS",
    "STORAGE_CDATA",
    "STORAGE_USE_COUNT",
    "TorchSeam",
    "check_installed",
    "check_seam",
    "lookup",
]


@dataclass(frozen=True)
class TorchSeam:
    module: str
    name: str
    why: str
    breaks: str
    users: tuple[str, ...]
    """The files (relative to the repository root) that use the name."""
    cuda_only: bool = False
    path: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """``name`` without its parameter list, split at the dots."""
    params: tuple[str, ...] | None = field(init=False, repr=False, compare=False)
    """The parameters ``name`` lists, None when it lists none (no call check)."""

    def __post_init__(self) -> None:
        dotted, paren, rest = self.name.partition("(")
        params = tuple(p.strip() for p in rest.rstrip(")").split(",") if p.strip())
        object.__setattr__(self, "path", tuple(dotted.split(".")))
        object.__setattr__(self, "params", params if paren else None)

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


SANITIZER = "torch.cuda._sanitizer"
"""The stream sanitizer's module (CSAN; ``TORCH_CUDA_SANITIZER=1`` imports and enables it)."""

_BACKEND = "rowcache/backends/cuda.py"
_ORACLE = "tests/sanitizer_oracle.py"
_COPY_TEST = "tests/test_bench_copy_paths.py"
_CUDA_SUPPORT = "tests/cuda/cuda_support.py"
_CSAN_TEST = "tests/cuda/test_sanitizer_cuda.py"
_REPORT = "batched copies and map uploads are not reported to the stream sanitizer"

RAW_CURRENT_STREAM = TorchSeam(
    "torch._C",
    "_cuda_getCurrentRawStream(device)",
    "CudaBackend.current_stream reads the current stream's raw handle (what inductor's "
    "generated code calls) and rebuilds the torch.cuda.Stream only when it changes: building "
    "one costs several microseconds on every prepare",
    "none: the backend falls back to torch.cuda.current_stream on every call (correct, a few "
    "microseconds more host time per prepare)",
    (_BACKEND,),
    cuda_only=True,
)
HOST_EMPTY_CACHE = TorchSeam(
    "torch._C",
    "_host_emptyCache",
    "the device-path bench hands the pinned host blocks of one expert layout back before the "
    "next (the caching host allocator keeps freed pinned memory; the large layout pins tens of "
    "GiB)",
    "none: the bench skips it and the freed pinned blocks stay cached, so a host with little "
    "memory may not fit the next layout; the vLLM plugin skips it and the checkpoint tensors it "
    "released stay pinned in torch's cache",
    ("rowcache/bench/device_path.py", "rowcache/vllm/_method.py"),
    cuda_only=True,
)
STORAGE_USE_COUNT = TorchSeam(
    "torch._C",
    "_storage_Use_Count",
    "the arena of pinned slabs (rowcache.pinned) lets go of a slab once no tensor views it any "
    "longer: torch's count of the tensors sharing a storage (what torch.multiprocessing reads)",
    "none: the arena keeps every slab it made for the life of the process (a model's pinned "
    "memory outlives the model in a process that builds another), and the plugin's load-time "
    "checkpoint tensors take torch's own rounded blocks instead of the transient arena",
    ("rowcache/pinned.py",),
)
STORAGE_CDATA = TorchSeam(
    "torch",
    "UntypedStorage._cdata",
    "the handle of a storage that _storage_Use_Count takes",
    "as for _storage_Use_Count",
    ("rowcache/pinned.py",),
)
SANITIZER_ENABLED = TorchSeam(
    SANITIZER,
    "cuda_sanitizer.enabled",
    "the backend reports a batched copy or map upload to the sanitizer only while it is on",
    "every batched copy_rows and upload_map raises AttributeError in a process that imported "
    "the sanitizer module (the GPU conformance run under TORCH_CUDA_SANITIZER=1)",
    (_BACKEND, _CUDA_SUPPORT),
)
SANITIZER_KERNEL_LAUNCH = TorchSeam(
    SANITIZER,
    "cuda_sanitizer.dispatch.event_handler._handle_kernel_launch(stream, read_only, "
    "read_write, outputs, operator, tensor_aliases)",
    "the backend reports a batched copy (cudaMemcpyBatchAsync, no aten operation) as a write "
    "of every destination row on its stream, as the sanitizer's dispatch mode reports copy_",
    f"sanitizer runs fail on every batched copy (AttributeError or TypeError); were the call "
    f"dropped instead, {_REPORT} and races on them go unseen",
    (_BACKEND, _COPY_TEST),
)
SANITIZER_ERRORS = TorchSeam(
    SANITIZER,
    "CUDASanitizerErrors(errors)",
    "raised, as the dispatch mode raises it, when a reported batched copy races",
    "a race found in a batched copy surfaces as AttributeError instead of the sanitizer's error",
    (_BACKEND, _COPY_TEST),
)


def _handler(method: str, uses: tuple[str, ...] = (_ORACLE, _COPY_TEST)) -> TorchSeam:
    return TorchSeam(
        SANITIZER,
        f"EventHandler.{method}",
        "the sanitizer oracle replays recorded traces through the sanitizer's analysis half "
        "(vector clocks per stream and event), on the CPU",
        "the oracle tests (tests/test_sanitizer_oracle.py) and the batched-copy report test "
        "fail; the provider is unaffected",
        uses,
    )


SEAMS: tuple[TorchSeam, ...] = (
    RAW_CURRENT_STREAM,
    HOST_EMPTY_CACHE,
    STORAGE_USE_COUNT,
    STORAGE_CDATA,
    SANITIZER_ENABLED,
    SANITIZER_KERNEL_LAUNCH,
    SANITIZER_ERRORS,
    TorchSeam(
        SANITIZER,
        "enable_cuda_sanitizer()",
        "the GPU sanitizer test enables the sanitizer in its own process",
        "tests/cuda/test_sanitizer_cuda.py cannot start; the provider is unaffected",
        (_CSAN_TEST,),
    ),
    TorchSeam(
        SANITIZER,
        "cuda_sanitizer.enable()",
        "sanitizer_paused re-enables the sanitizer after a graph capture",
        "GPU tests that capture graphs under TORCH_CUDA_SANITIZER=1 fail",
        (_CUDA_SUPPORT,),
    ),
    TorchSeam(
        SANITIZER,
        "cuda_sanitizer.disable()",
        "sanitizer_paused pauses the sanitizer around a graph capture (captured ops run at "
        "replay, which it cannot see)",
        "GPU tests that capture graphs under TORCH_CUDA_SANITIZER=1 fail",
        (_CUDA_SUPPORT,),
    ),
    _handler("_handle_stream_creation(stream)"),
    _handler("_handle_event_creation(event)"),
    _handler("_handle_event_record(event, stream)"),
    _handler("_handle_event_wait(event, stream)"),
    _handler("_handle_device_synchronization()", (_ORACLE,)),
    _handler(
        "_handle_kernel_launch(stream, read_only, read_write, outputs, operator, tensor_aliases)"
    ),
    TorchSeam(
        SANITIZER,
        "SynchronizationError",
        "the oracle collects the errors the handler returns",
        "the oracle cannot be imported: its tests fail; the provider is unaffected",
        (_ORACLE,),
    ),
    TorchSeam(
        SANITIZER,
        "UnsynchronizedAccessError.__init__(data_ptr, allocation_stack_trace, current_access, "
        "previous_access)",
        "the oracle reads a race's data_ptr, current_access and previous_access (set from "
        "these parameters)",
        "the oracle's race reports fail; the provider is unaffected",
        (_ORACLE,),
    ),
    TorchSeam(
        SANITIZER,
        "Access.operator",
        "the oracle names a race by the operator strings (trace lines) of its two accesses",
        "the oracle's race reports fail; the provider is unaffected",
        (_ORACLE,),
    ),
    TorchSeam(
        "torch.cuda._gpu_trace",
        "DeviceSynchronizationCallbacks.callback_list",
        "importing the sanitizer module registers its handler in each of this module's "
        "callback registries for the life of the process (enabled or not), and the handler's "
        "cost grows with every event, stream and synchronization it sees; the oracle takes "
        "those callbacks back off when the sanitizer is not enabled",
        "the oracle cannot be imported (tests fail); were the registries renamed instead, "
        "every GPU test after the oracle's import runs at the sanitizer's cost again",
        (_ORACLE,),
    ),
    TorchSeam(
        "torch._utils",
        "CallbackRegistry",
        "the type of the GPU trace's registries, to find them in the module",
        "the oracle cannot be imported: its tests fail; the provider is unaffected",
        (_ORACLE,),
    ),
    TorchSeam(
        "torch.cuda",
        "_sleep(cycles)",
        "GPU tests keep a reader kernel running while provider calls are issued (the race "
        "fixtures); it calls torch._C._cuda_sleep",
        "the GPU race fixtures cannot hold the device busy: tests/cuda fails",
        (_CUDA_SUPPORT,),
    ),
)


_MISSING = object()


def _step(obj: Any, name: str) -> Any:
    found = getattr(obj, name, _MISSING)
    if (
        found is _MISSING
        and isinstance(obj, type)
        and is_dataclass(obj)
        and any(f.name == name for f in fields(obj))
    ):
        return obj.__dataclass_fields__[name]
    return found


def lookup(seam: TorchSeam, root: Any = None) -> Any:
    """The object ``seam`` names, or None where it is missing: resolved from ``root`` (default:
    the seam's module if it is already imported; this never imports anything)."""
    obj = sys.modules.get(seam.module) if root is None else root
    for name in seam.path:
        if obj is None:
            return None
        obj = getattr(obj, name, None)
    return obj


def _torch_version() -> str:
    torch = sys.modules.get("torch") or importlib.import_module("torch")
    return str(torch.__version__)


def _signature_problem(seam: TorchSeam, names: list[str], required: list[str]) -> str | None:
    """``names``: positional parameter names in order; ``required``: those without defaults."""
    assert seam.params is not None
    if names[:1] == ["self"] and seam.params[:1] != ("self",):
        names = names[1:]
        required = [n for n in required if n != "self"]
    want = list(seam.params)
    if names[: len(want)] != want:
        return f"takes ({', '.join(names)}), not ({', '.join(want)}) first"
    extra = [n for n in required if n not in want]
    if extra:
        return f"needs more arguments than rowcache passes: {', '.join(extra)}"
    return None


def _check_callable(seam: TorchSeam, obj: Any, stub: str | None) -> str | None:
    if not callable(obj):
        return f"resolves to {type(obj).__name__}, which is not callable"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        # A C function without a signature: torch._C's are declared in its type stub.
        return _check_stub(seam, stub) if seam.module == "torch._C" else None
    positional = [
        p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    names = [p.name for p in positional]
    required = [p.name for p in positional if p.default is p.empty]
    required += [
        p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    ]
    return _signature_problem(seam, names, required)


def _stub_path() -> Path:
    torch = importlib.import_module("torch")
    return Path(str(torch.__file__)).parent / "_C" / "__init__.pyi"


def _check_stub(seam: TorchSeam, stub: str | None) -> str | None:
    """A cuda_only row on a CPU build: its declaration in torch's ``_C`` type stub."""
    if seam.module != "torch._C" or len(seam.path) != 1:
        return "cuda_only rows must name a function of torch._C (the stub is checked)"
    if stub is None:
        path = _stub_path()
        if not path.is_file():
            return f"CPU build and no type stub at {path} to check the declaration against"
        stub = path.read_text()
    for node in ast.parse(stub).body:
        if isinstance(node, ast.FunctionDef) and node.name == seam.path[0]:
            if seam.params is None:
                return None
            args = [*node.args.posonlyargs, *node.args.args]
            names = [a.arg for a in args]
            defaults = len(node.args.defaults)
            required = names[: len(names) - defaults] if defaults else names
            return _signature_problem(seam, names, required)
    return "not declared in torch/_C/__init__.pyi (CPU build: the stub is what can be checked)"


def check_seam(
    seam: TorchSeam, *, cuda_built: bool | None = None, stub: str | None = None
) -> str | None:
    """None when ``seam`` holds in the installed torch, else one line naming the seam, the
    torch version, the problem, why rowcache needs it and what breaks.

    ``cuda_built`` (default: ``torch.backends.cuda.is_built()``) and ``stub`` (default: the
    installed ``torch/_C/__init__.pyi``) are for tests.
    """
    problem = _problem(seam, cuda_built, stub)
    if problem is None:
        return None
    return (
        f"torch {_torch_version()}: {seam}: {problem} (used by {', '.join(seam.users)}: "
        f"{seam.why}; if it moved: {seam.breaks})"
    )


def _problem(seam: TorchSeam, cuda_built: bool | None, stub: str | None) -> str | None:
    try:
        module = importlib.import_module(seam.module)
    except ImportError as exc:
        return f"module {seam.module} cannot be imported ({exc})"
    if cuda_built is None:
        import torch

        cuda_built = bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]
    if seam.cuda_only and not cuda_built:
        return _check_stub(seam, stub)
    obj: Any = module
    for index, name in enumerate(seam.path):
        obj = _step(obj, name)
        if obj is _MISSING:
            where = ".".join((seam.module, *seam.path[:index]))
            kind = " (a CUDA build, which must define it)" if seam.cuda_only else ""
            return f"{where} has no attribute {name!r}{kind}"
    if seam.params is not None:
        return _check_callable(seam, obj, stub)
    return None


def check_installed(seams: tuple[TorchSeam, ...] = SEAMS) -> list[str]:
    """One line per seam that does not hold in the installed torch (empty: all hold)."""
    return [problem for seam in seams if (problem := check_seam(seam)) is not None]
