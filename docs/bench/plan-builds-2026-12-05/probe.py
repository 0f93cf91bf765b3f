"""Throwaway device probe (not committed): the jit_count hook on the device's Triton, and
which plan_kernel builds each routing shape of DeepSeek-V2-Lite (64 experts, 16 slots) makes."""
import json, os, sys, time
import torch, triton
from tools.vllm.harness.jit_count import counting
from rowcache.device_plan.state import new_state
from rowcache.device_plan.kernels import launch_plan
from rowcache.device_plan.passes import num_passes
c = counting(); c.describe_from(0)
dev = torch.device("cuda"); st = new_state(64, 16, dev)
out = {"triton": triton.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "steps": []}
def go(label, rows, topk=6):
    m = c.mark(); t = time.time()
    ids = torch.randint(0, 64, (rows, topk), device=dev, dtype=torch.int32)
    p = num_passes(ids.numel(), 64, 16)
    for i in range(p): launch_plan(st, ids, i, p)
    torch.cuda.synchronize()
    out["steps"].append({"label": label, "rows": rows, "passes": p, "built": c.since(m), "s": round(time.time()-t, 3)})
go("profile", 2048)
for r in (1, 2, 4, 8): go("capture", r)
for r in (8, 64, 9, 17, 100, 301, 511, 512, 2048, 1000, 333): go("prompt", r)
for r in (1, 8): go("decode", r)
out["described"] = c.descriptions
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "jit_probe.json"), "w"), indent=1)
for s in out["steps"]: print(s)
print(out["triton"], len(c.names), "builds")
