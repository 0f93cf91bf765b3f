#!/usr/bin/env python
# NOTE: run with  venv/bin/python -W ignore::DeprecationWarning repro.py
"""
Check the suspected unmasked over-read of Hopper-swizzled MXFP4 weight scales in
triton_kernels' non-persistent `_matmul_ogs` (bundled in vLLM 0.25.0), on CPU via
TRITON_INTERPRET=1.

Run:  /tmp/overread/venv/bin/python /tmp/overread/repro.py [--n N] [--experts E]

Everything lives under /tmp/overread. vllm itself is NOT imported; only
vllm/third_party/triton_kernels (from the vllm-0.25.0 wheel, unzipped in
/tmp/overread/src) is put on sys.path.
"""
import os
import sys
import argparse
import time

os.environ["TRITON_INTERPRET"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "src", "vllm", "third_party"))

import numpy as np
import torch
import triton
import triton.language as tl

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=5760, help="w13 output dim N (gpt-oss-20b: 5760)")
ap.add_argument("--k", type=int, default=2880, help="hidden size K (gpt-oss-20b: 2880)")
ap.add_argument("--experts", type=int, default=2)
ap.add_argument("--tokens", type=int, default=4)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

# ----------------------------------------------------------------------------
# Monkeypatches (all needed only because there is no GPU)
# ----------------------------------------------------------------------------
from triton.backends.compiler import GPUTarget

SM90 = GPUTarget("cuda", 90, 32)

# (1) triton target queries -> CUDA sm_90. Used by triton_kernels.target_info
#     (cuda_capability_geq / is_cuda / is_hip, constexpr_functions that call
#     triton.language.target_info.current_target) and by opt_flags
#     (triton.runtime.driver.active.get_current_target().backend).
import triton.language.target_info as _tlti
_tlti.current_target = lambda: SM90


class _FakeDriver:
    def get_current_target(self):
        return SM90

    def get_current_device(self):
        return 0


triton.runtime.driver.set_active(_FakeDriver())

# (2) torch.cuda queries made by matmul_ogs / opt_flags_nvidia.
class _Props:
    multi_processor_count = 132          # H100 SXM
    shared_memory_per_block_optin = 232448


torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_properties = lambda *a, **k: _Props()

# (3) interpreter has no `num_warps` option; tl.extra.cuda.num_warps() reads
#     builder.options.num_warps.  matmul_ogs launches with num_warps=8 (the
#     HopperMXScaleLayout's num_warps), so expose 8.
import triton.runtime.interpreter as _interp
_interp.InterpreterOptions.num_warps = 8
assert _interp.interpreter_builder.options.num_warps == 8
#     ...but the interpreter does not patch tl.extra.cuda builtins, so also
#     replace tl.extra.cuda.num_warps() by a host function returning the
#     num_warps the launch was made with (recorded by the launch adapter below).
import triton.language.extra.cuda as _xcuda
_cur_num_warps = {"v": 8}
_xcuda.num_warps = lambda *a, **k: tl.constexpr(_cur_num_warps["v"])

# (3b) tl.constexpr lacks __rmod__ in triton 3.5.1, so `int % constexpr`
#      (BLOCK_K % MX_PACK_DIVISOR in _matmul_ogs.py:113) fails in the
#      interpreter (the compiler folds it). Add the obvious reflected op.
if not hasattr(tl.constexpr, "__rmod__"):
    tl.constexpr.__rmod__ = lambda self, other: tl.constexpr(
        (other.value if isinstance(other, tl.constexpr) else other) % self.value)

# (4) interpreter cannot run inline PTX. Emulate, bit-exactly, the two
#     tl.inline_asm_elementwise blocks of hopper_value.py (pack=4):
#     (a) _unpack_fp4_to_bf16_triton: fp4 bit-untwiddling + mul.bf16x2 by 2^126
#     (b) mxfp4_to_bf16_triton scale upcast: prmt/shl -> bf16 bits = e8m0 << 7
#     Semantics of pack=4: 4 consecutive elements (along the last dim) are
#     packed into one b32 input register (element 0 in the low byte); a 16-bit
#     output uses 2 registers per pack (lo half = first element).
_M = np.uint32(0b10000001110000001000000111000000)


def _bf16bits_mul_2p126(h):
    # h: uint32 array of bf16 bit patterns (low 16 bits). Exact product by 2^126,
    # computed in float64 (no denormal flushing), result rounded to bf16 bits.
    f = (h.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64) * (2.0 ** 126)
    f32 = f.astype(np.float32)
    b = f32.view(np.uint32)
    # round to nearest even (values here are exact, so this is a no-op truncation)
    b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return b.astype(np.uint16)


_asm_calls = {"fp4": 0, "scale": 0}


class _AsmResult:
    def __init__(self, handles):
        self.handles = handles

    def get_result(self, i):
        return self.handles[i]


def _create_inline_asm(self, inlineAsm, constraints, values, type, isPure, pack):
    x = values[0].data
    assert x.dtype == np.uint8 and pack == 4 and x.shape[-1] % 4 == 0, (x.dtype, pack, x.shape)
    w = np.ascontiguousarray(x).view(np.uint32)  # [..., K/4]: byte j of word = element 4i+j
    if "mul.bf16x2" in inlineAsm and "0x7e807e80" in inlineAsm:
        _asm_calls["fp4"] += 1
        r = [w & _M, (w << np.uint32(3)) & _M, (w << np.uint32(6)) & _M,
             (((w << np.uint32(1)) & np.uint32(0b10000000000000001000000000000000))
              | ((w >> np.uint32(3)) & np.uint32(0b00000001100000000000000110000000))
              | ((w >> np.uint32(7)) & np.uint32(0b00000000010000000000000001000000)))]
        halves = []
        for reg in r:
            halves.append(_bf16bits_mul_2p126(reg & np.uint32(0xFFFF)))
            halves.append(_bf16bits_mul_2p126(reg >> np.uint32(16)))
        # out0 = [$0.lo, $0.hi, $1.lo, $1.hi], out1 = [$2.lo, $2.hi, $3.lo, $3.hi]
        o0 = np.stack(halves[0:4], axis=-1).reshape(x.shape)
        o1 = np.stack(halves[4:8], axis=-1).reshape(x.shape)
        return _AsmResult([_interp.TensorHandle(o0, tl.bfloat16), _interp.TensorHandle(o1, tl.bfloat16)])
    if "prmt.b32 $0, $2, 0, 0x5140" in inlineAsm:
        _asm_calls["scale"] += 1
        o = (x.astype(np.uint16) << np.uint16(7)).astype(np.uint16)
        return _AsmResult([_interp.TensorHandle(o, tl.bfloat16)])
    raise NotImplementedError("unexpected inline asm: " + inlineAsm[:200])


_interp.InterpreterBuilder.create_inline_asm = _create_inline_asm

# (4b) triton 3.5.1's interpreter stores bf16 as raw uint16 and its float
#      binary ops / tl.dot operate on those integers directly (np.multiply /
#      np.matmul on uint16 bit patterns), so bf16 arithmetic is wrong in the
#      interpreter. Do bf16 fmul/fadd/fsub/fdiv in fp32 with RNE rounding back to
#      bf16 (what the GPU does for mul.bf16x2 etc.), bf16 tl.dot as fp32 products
#      with fp32 accumulation, and fp32<->bf16 casts with RNE (the interpreter
#      truncates).
def _bf16_to_f32(u16):
    return (np.asarray(u16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16(f32):
    f = torch.from_numpy(np.ascontiguousarray(np.asarray(f32, dtype=np.float32)))
    return f.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _wrap_fbinop(name, op):
    orig = getattr(_interp.InterpreterBuilder, name)

    def f(self, lhs, rhs):
        if lhs.dtype.scalar == tl.bfloat16 or rhs.dtype.scalar == tl.bfloat16:
            assert lhs.dtype.scalar == rhs.dtype.scalar == tl.bfloat16
            r = op(_bf16_to_f32(lhs.data), _bf16_to_f32(rhs.data))
            return _interp.TensorHandle(_f32_to_bf16(r), tl.bfloat16)
        return orig(self, lhs, rhs)
    setattr(_interp.InterpreterBuilder, name, f)


for _n, _op in (("create_fmul", np.multiply), ("create_fadd", np.add),
                ("create_fsub", np.subtract), ("create_fdiv", np.divide)):
    _wrap_fbinop(_n, _op)

_orig_dot = _interp.InterpreterBuilder.create_dot


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
        assert a.dtype.scalar == b.dtype.scalar == tl.bfloat16 and d.data.dtype == np.float32
        r = np.matmul(_bf16_to_f32(a.data), _bf16_to_f32(b.data), dtype=np.float32) + d.data
        return _interp.TensorHandle(r, d.dtype.scalar)
    return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


_interp.InterpreterBuilder.create_dot = _create_dot
_orig_cast = _interp.InterpreterBuilder.cast_impl


def _cast_impl(self, src, dst_type):
    se, de = src.dtype.scalar, dst_type.scalar
    if se == tl.bfloat16 and de == tl.float32:
        return _interp.TensorHandle(_bf16_to_f32(src.data), tl.float32)
    if se == tl.float32 and de == tl.bfloat16:
        return _interp.TensorHandle(_f32_to_bf16(src.data), tl.bfloat16)
    return _orig_cast(self, src, dst_type)


_interp.InterpreterBuilder.cast_impl = _cast_impl
np.seterr(all="ignore")  # 0*inf etc. are intended

# (5) Instrument the interpreter's raw load to record every *enabled* load
#     address that falls in the guard region placed right after the scale
#     storage (the interpreter itself does NOT bounds-check pointers).
_real_native = _interp._interpreter
_watch = {"lo": 0, "hi": 0, "hits": []}


class _NativeProxy:
    def __getattr__(self, name):
        return getattr(_real_native, name)

    def load(self, ptrs, mask, other, dtype):
        lo, hi = _watch["lo"], _watch["hi"]
        if hi > lo:
            p = ptrs.astype(np.uint64)
            m = np.broadcast_to(mask, p.shape)
            sel = m & (p >= lo) & (p < hi)
            if sel.any():
                _watch["hits"].append(np.unique(p[sel] - np.uint64(lo)))
                _watch.setdefault("pids", set()).add(_interp.interpreter_builder.grid_idx[0])
        return _real_native.load(ptrs, mask, other, dtype)


_interp._interpreter = _NativeProxy()

# ----------------------------------------------------------------------------
# triton_kernels (vLLM 0.25.0 bundled copy)
# ----------------------------------------------------------------------------
import triton_kernels
import triton_kernels.matmul_ogs as mo
import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
from triton_kernels.matmul_ogs import matmul_ogs, PrecisionConfig, FlexCtx
from triton_kernels.numerics import InFlexData
from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
from triton_kernels.tensor_details import layout
from triton_kernels.routing import routing_torch
from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch

assert triton_kernels.__file__.startswith(os.path.join(HERE, "src")), triton_kernels.__file__

# (6) matmul_ogs.get_kernels() uses triton_kernels.specialize, which asserts a
#     real JITFunction and builds one (not interpretable). For the case used by
#     UnfusedOAITritonExperts (fused_activation=None, epilogue=None) the
#     specialization only binds ACTIVATION_FN=None, EPILOGUE_FN=None and empty
#     activation_fn_args / epilogue_fn_args and drops them from the signature.
#     Reproduce exactly that with an argument adapter around the original
#     (interpreted) _matmul_ogs.
from triton_kernels.matmul_ogs_details._matmul_ogs import _matmul_ogs as _orig_matmul_ogs

_DROP = {"ACTIVATION_FN": None, "EPILOGUE_FN": None, "activation_fn_args": (), "epilogue_fn_args": ()}
_spec_names = [a for a in _orig_matmul_ogs.arg_names if a not in _DROP]
_launch_info = {}


class _SpecializedNoActNoEpilogue:
    def __getitem__(self, grid):
        def launch(*a, **kw):
            assert len(a) <= len(_spec_names)
            named = dict(zip(_spec_names, a))
            named.update(kw)
            named.update(_DROP)
            # the compiled launcher accepts any object with data_ptr()/dtype
            # (WMxScale is passed as a triton_kernels Tensor); the interpreter
            # needs the underlying torch tensor.
            for k_, v_ in list(named.items()):
                if isinstance(v_, triton_kernels.tensor.Tensor):
                    named[k_] = v_.storage.data
            _launch_info.update({k: named.get(k) for k in (
                "BLOCK_M", "BLOCK_N", "BLOCK_K", "EVEN_K", "SPLIT_K", "SWIZZLE_MX_VALUE",
                "SWIZZLE_MX_SCALE", "num_warps", "N", "K", "stride_w_mx_e", "stride_w_mx_k",
                "stride_w_mx_n")})
            _launch_info["grid"] = grid
            _cur_num_warps["v"] = named["num_warps"]
            return _orig_matmul_ogs[grid](**named)
        return launch


class _Kernels:
    _matmul_ogs = _SpecializedNoActNoEpilogue()

    @property
    def _p_matmul_ogs(self):
        raise RuntimeError("persistent kernel was selected (unexpected on SM90 + MXFP4)")


def _get_kernels(epilogue=mo.FnSpecs.default(), fused_activation=mo.FnSpecs.default()):
    assert epilogue.fn is None and fused_activation.fn is None
    return _Kernels()


mo.get_kernels = _get_kernels


# ----------------------------------------------------------------------------
# vLLM's _swizzle_mxfp4 (vllm/model_executor/layers/quantization/utils/
# mxfp4_utils.py), CUDA SM90 + torch>=2.8.1 branch, reproduced verbatim.
# ----------------------------------------------------------------------------
def _swizzle_mxfp4(quant_tensor, scale, num_warps=8):
    value_layout, value_layout_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_layout_opts = layout.make_default_matmul_mxfp4_w_scale_layout(
        mx_axis=1, num_warps=num_warps)
    # current_platform.is_device_capability(90):
    opt_flags.update_opt_flags_constraints({"split_k": 1})
    quant_tensor = quant_tensor.transpose(-2, -1)
    scale = scale.transpose(-2, -1)
    quant_tensor = convert_layout(wrap_torch_tensor(quant_tensor, dtype=FP4), value_layout, **value_layout_opts)
    scale = convert_layout(wrap_torch_tensor(scale), scale_layout, **scale_layout_opts)
    return quant_tensor, InFlexData(), scale


# ----------------------------------------------------------------------------
# Build w13-like weights: E experts, [N, K/2] packed fp4 and [N, K/32] e8m0
# (vLLM checkpoint layout: w13_weight [E, 2I, H/2], w13_weight_scale [E, 2I, H/32])
# ----------------------------------------------------------------------------
E, N, K, M, TOPK = args.experts, args.n, args.k, args.tokens, 2 if args.experts >= 2 else 1
g = torch.Generator().manual_seed(args.seed)
w13_weight = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
w13_weight_scale = torch.randint(118, 128, (E, N, K // 32), dtype=torch.uint8, generator=g)  # never 0xFF
w13_bias = (torch.randn(E, N, generator=g) * 0.1).float()
x = (torch.randn(M, K, generator=g)).to(torch.bfloat16)

w_val, w_flex, w_scale = _swizzle_mxfp4(w13_weight, w13_weight_scale, num_warps=8)
print(f"value layout: {type(w_val.storage.layout).__name__}, storage {tuple(w_val.storage.data.shape)} "
      f"strides {w_val.storage.data.stride()}, logical shape {w_val.shape}")
sd = w_scale.storage.data
print(f"scale layout: {type(w_scale.storage.layout).__name__}(num_warps={w_scale.storage.layout.num_warps}), "
      f"storage {tuple(sd.shape)} strides {sd.stride()}, logical shape {w_scale.shape}")
assert sd.is_contiguous() is False and sd.mT.is_contiguous()

# Put the scale storage at the start of a bigger buffer; bytes right after it are
# a guard region we control.
GUARD = 4096
nbytes = sd.numel()
buf = torch.zeros(nbytes + GUARD, dtype=torch.uint8)
buf[:nbytes].view(sd.mT.shape).copy_(sd.mT)
sd_in_buf = buf[:nbytes].view(sd.mT.shape).mT
assert sd_in_buf.shape == sd.shape and sd_in_buf.stride() == sd.stride() and torch.equal(sd_in_buf, sd)
w_scale.storage.data = sd_in_buf
guard = buf[nbytes:]

# Routing: every token -> experts (0, 1) when E >= 2 (so the LAST expert gets all
# tokens, and expert 0 too); torch reference routing of the same triton_kernels.
expt_indx = torch.arange(E - TOPK, E, dtype=torch.int32)[None, :].repeat(M, 1)
logits = torch.randn(M, E, generator=g)
# (7) routing_torch uses torch.histc on int32, which has no CPU kernel; make
#     histc accept ints by computing it in float (same result).
_histc = torch.histc
torch.histc = lambda t, *a, **k: _histc(t.float(), *a, **k)
routing_data, gather_indx, scatter_indx = routing_torch(logits, TOPK, expt_indx=expt_indx)
torch.histc = _histc

precision = PrecisionConfig(weight_scale=w_scale, flex_ctx=FlexCtx(rhs_data=w_flex))


def run(fill, lo_b=0, hi_b=GUARD):
    guard.fill_(0)
    guard[lo_b:hi_b] = fill
    _watch.update(lo=buf.data_ptr() + nbytes, hi=buf.data_ptr() + nbytes + GUARD, hits=[], pids=set())
    y = torch.empty(1, M * TOPK, N, dtype=torch.bfloat16)  # like intermediate_cache1
    t0 = time.time()
    out = matmul_ogs(x, w_val, w13_bias, routing_data, gather_indx=gather_indx,
                     precision_config=precision, gammas=None, fused_activation=None, y=y)
    dt = time.time() - t0
    hits = np.unique(np.concatenate(_watch["hits"])) if _watch["hits"] else np.array([], dtype=np.uint64)
    return out.float().reshape(M * TOPK, N).clone(), hits, dt


print(f"E={E} N={N} K={K} tokens={M} topk={TOPK}; running zeros-after-storage ...", flush=True)
y0, hits0, dt0 = run(0x00)
print("launch:", _launch_info)
print(f"  done in {dt0:.1f}s; inline-asm emulations used: {_asm_calls}")
print(f"  enabled loads past the scale storage end (byte offsets past end): "
      f"{len(hits0)} distinct, range {hits0.min() if len(hits0) else None}..{hits0.max() if len(hits0) else None}")
print(f"  scale storage = {nbytes} bytes; program ids that loaded past its end: {sorted(_watch['pids'])} "
      f"(grid_m x grid_n = {_launch_info['grid'][0] // -(-N // 256)} x {-(-N // 256)})")
print("running 0xFE-after-storage (finite e8m0 2^127) ...", flush=True)
yE, hitsE, dtE = run(0xFE)
print(f"  done in {dtE:.1f}s; loads past end: {len(hitsE)} distinct; "
      f"identical to zeros run: {torch.equal(yE, y0)}")
print("running 0xFF-after-storage ...", flush=True)
yF, hitsF, dtF = run(0xFF)
print(f"  done in {dtF:.1f}s; loads past end: {len(hitsF)} distinct")

# Reference (pure torch, from the un-swizzled checkpoint tensors)
wdq = upcast_from_mxfp_torch(w13_weight, w13_weight_scale, torch.float32, axis=-1)  # [E, N, K]
rows_expt = torch.repeat_interleave(torch.arange(E), torch.as_tensor(routing_data.expt_hist.tolist()))
src = gather_indx.src_indx.long() // TOPK  # row r of y (expert-sorted) is token src[r]
ref = torch.stack([x[src[r]].float() @ wdq[rows_expt[r]].T + w13_bias[rows_expt[r]] for r in range(M * TOPK)])
ref32 = ref
ref = ref.to(torch.bfloat16).float()


def summarize(y, name):
    err = (y - ref).abs()
    nan = torch.isnan(y)
    ok = torch.isfinite(y)
    rel = (err[ok].max() / ref.abs().max()).item() if ok.any() else float("nan")
    ulp_ok = ((y - ref32).abs() <= ref32.abs() * 2.0 ** -8 + 1e-6)[ok].all().item()
    print(f"{name}: NaN count {int(nan.sum())}, max |y-ref|/max|ref| over finite = {rel:.3e}; "
          f"all finite outputs within 1 bf16 ulp of fp32 torch reference: {ulp_ok}")
    return nan


print()
nan0 = summarize(y0, "zeros guard")
nanF = summarize(yF, "0xFF  guard")
diff = ~((y0 == yF) | (torch.isnan(y0) & torch.isnan(yF)))
print()
if diff.any():
    rows, cols = torch.nonzero(diff, as_tuple=True)
    ucols = sorted(set(cols.tolist()))
    urows = sorted(set(rows.tolist()))
    print(f"outputs DIFFER in {int(diff.sum())} elements; rows {urows} "
          f"(experts {sorted(set(rows_expt[urows].tolist()))}); columns {ucols[0]}..{ucols[-1]} "
          f"({len(ucols)} cols: {ucols})")
    r = urows[0]
    print(f"  row {r} cols {ucols[0]-2}..{ucols[-1]+1}:")
    print("   zeros:", y0[r, ucols[0] - 2:ucols[-1] + 2].tolist())
    print("   0xFF :", yF[r, ucols[0] - 2:ucols[-1] + 2].tolist())
    print("   ref  :", ref[r, ucols[0] - 2:ucols[-1] + 2].tolist())
else:
    print("outputs IDENTICAL between zeros and 0xFF guard")
print("NaN columns (0xFF run):", sorted(set(torch.nonzero(nanF, as_tuple=True)[1].tolist())))
print("0xFF-run load offsets past end:", hitsF.tolist()[:8], "...", hitsF.tolist()[-4:] if len(hitsF) else [])

print()
for lo_b, hi_b in ((0, 32), (32, 64)):
    yp, _, _ = run(0xFF, lo_b, hi_b)
    c = sorted(set(torch.nonzero(torch.isnan(yp), as_tuple=True)[1].tolist()))
    print(f"0xFF only in guard bytes [{lo_b},{hi_b}) -> NaN columns: {c if c else 'none'}")
