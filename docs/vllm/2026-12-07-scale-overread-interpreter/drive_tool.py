# Validate tools/vllm/scale_overread.py's logic on the CPU under the interpreter patches of repro.py.
import sys, types, os
sys.argv = ["repro", "--n", sys.argv[1] if len(sys.argv) > 1 else "512"]
src = open("/tmp/overread/repro.py").read()
cut = src.index("# Build w13-like weights")
g = {"__file__": "/tmp/overread/repro.py", "__name__": "patches"}
exec(compile(src[:cut], "repro_patches", "exec"), g)
# repro's swizzle as vLLM's
mod = types.ModuleType("vllm.model_executor.layers.quantization.utils.mxfp4_utils")
mod._swizzle_mxfp4 = g["_swizzle_mxfp4"]
iu = types.ModuleType("vllm.utils.import_utils"); iu.has_triton_kernels = lambda: True
for name in ["vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.quantization", "vllm.model_executor.layers.quantization.utils", "vllm.utils"]:
    sys.modules.setdefault(name, types.ModuleType(name))
sys.modules[mod.__name__] = mod; sys.modules[iu.__name__] = iu
import torch
_histc = torch.histc
torch.histc = lambda t, *a, **k: _histc(t.float(), *a, **k)
sys.path.insert(0, "/work/main")
tool = open("/work/main/tools/vllm/scale_overread.py").read()
tool = tool.replace('torch.device("cuda")', 'torch.device("cpu")').replace("torch.cuda.synchronize()", "None").replace("torch.cuda.get_device_name()", '"cpu-interpreter"')
t = {"__name__": "scale_overread_cpu"}
exec(compile(tool, "scale_overread", "exec"), t)
sys.exit(t["main"](["--n", sys.argv[2], "--json", "/tmp/overread/tool_%s.json" % sys.argv[2]]))
