"""What serving gpt-oss's MXFP4 experts from slots rests on (docs/GPT_OSS.md): vLLM 0.25.0 on
Hopper swizzles the packed values and the e8m0 scales (``_swizzle_mxfp4``: the vendored
triton_kernels' ``HopperMXValueLayout`` and ``HopperMXScaleLayout``), and a ``[C, ...]`` slot
buffer can stand in for the ``[E, ...]`` one only if the swizzle keeps the expert dimension
outermost, each expert one contiguous byte range of equal size, and an expert swizzled alone
the same bytes as its slice of the whole.

The layouts' ``swizzle_data`` is torch integer code; its module imports ``triton`` only for the
in-kernel unswizzle helpers, so it runs here, on the CPU, under a stub ``triton`` (in a child
process, so that no stub reaches this one), from the files of the wheel itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import vllm_wheels

LAYOUTS = "vllm/third_party/triton_kernels/tensor_details/layout_details"
STUB_TRITON = """
def jit(fn=None, **kw):
    return (lambda f: f) if fn is None else fn
from . import language
"""
STUB_LANGUAGE = """
class _Any:
    def __getattr__(self, name): return _Any()
    def __call__(self, *args, **kw): return _Any()
constexpr = object
def __getattr__(name): return _Any()
"""
CHECK = """
import json, sys, torch
from layout_details.hopper_value import HopperMXValueLayout
from layout_details.hopper_scale import HopperMXScaleLayout

E, H, I = 2, 2880, 2880  # gpt-oss-20b's widths, two experts
gen = torch.Generator().manual_seed(0)

def value(w):  # _swizzle_mxfp4: the checkpoint's [E, N, K/2] transposed, mx_axis 1
    q = w.transpose(-2, -1)
    return HopperMXValueLayout(q.shape, mx_axis=1).swizzle_data(q)

def scale(s):
    q = s.transpose(-2, -1)
    return HopperMXScaleLayout(q.shape, mx_axis=1, num_warps=8).swizzle_data(q)

def raw(*shape, low=0, high=256):
    return torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)

out = {}
for name, source, swizzle in (
    ("w13", raw(E, 2 * I, H // 2), value),
    ("w2", raw(E, H, I // 2), value),
    ("w13_scale", raw(E, 2 * I, H // 32, low=100, high=140), scale),
    ("w2_scale", raw(E, H, I // 32, low=100, high=140), scale),
    # The control: a layout whose rows interleave the experts, which the check must refuse.
    ("control", raw(E, 64, 32), lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
):
    whole = swizzle(source)
    alone = [swizzle(source[e : e + 1])[0] for e in range(E)]
    storage = torch.as_strided(whole, (whole.untyped_storage().nbytes(),), (1,), 0)
    size = whole.stride(0) * whole.element_size()
    ranges = all(
        torch.equal(
            storage[e * size : (e + 1) * size],
            torch.as_strided(a, (a.untyped_storage().nbytes(),), (1,), a.storage_offset()),
        )
        for e, a in enumerate(alone)
    )
    out[name] = {
        "expert_bytes": size,
        "storage_bytes": whole.untyped_storage().nbytes(),
        "storage_offset": whole.storage_offset(),
        "shape": list(whole.shape),
        "stride": list(whole.stride()),
        "alone_is_slice": all(torch.equal(whole[e], alone[e]) for e in range(E)),
        "contiguous_ranges": ranges,
    }
print(json.dumps(out))
"""


def test_hopper_swizzle_keeps_each_expert_one_contiguous_range(tmp_path: Path) -> None:
    names = ("base.py", "hopper_value.py", "hopper_scale.py")
    sources = vllm_wheels.read("0.25.0", *(f"{LAYOUTS}/{n}" for n in names))
    package = tmp_path / "layout_details"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in names:
        (package / name).write_text(sources[f"{LAYOUTS}/{name}"])
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text(textwrap.dedent(STUB_TRITON))
    (tmp_path / "triton" / "language.py").write_text(textwrap.dedent(STUB_LANGUAGE))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECK)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    # Bytes per expert: the values unpadded (2I x H/2 and H x I/2), the scales' rows padded to
    # a multiple of 256 within each expert (5760 -> 5888 and 2880 -> 3072, times 90).
    assert {n: f["expert_bytes"] for n, f in found.items() if n != "control"} == {
        "w13": 8_294_400,
        "w2": 4_147_200,
        "w13_scale": 529_920,
        "w2_scale": 276_480,
    }
    # Each the transpose of a contiguous [E, ...] block (docs/GPT_OSS.md's table).
    assert {n: (f["shape"], f["stride"]) for n, f in found.items() if n != "control"} == {
        "w13": ([2, 5760, 1440], [8_294_400, 1, 5760]),
        "w2": ([2, 5760, 720], [4_147_200, 1, 5760]),
        "w13_scale": ([2, 2880, 184], [529_920, 1, 2880]),
        "w2_scale": ([2, 2880, 96], [276_480, 1, 2880]),
    }
    control = found.pop("control")
    assert not control["contiguous_ranges"]
    for name, facts in found.items():
        assert facts["storage_offset"] == 0, name
        assert facts["storage_bytes"] == 2 * facts["expert_bytes"], name
        assert facts["alone_is_slice"] and facts["contiguous_ranges"], name
