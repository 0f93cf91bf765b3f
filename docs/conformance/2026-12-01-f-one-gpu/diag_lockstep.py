# The diagnostic run on the H200 as attempt F ran it (call 4, from the repository root):
#   timeout -s KILL 400 python3 diag_lockstep.py bf16 separate 200
# The device planner's lockstep machine (tests/cuda/test_device_planner_cuda.py) run without
# pytest, one line per example: elapsed time, live harnesses, Python objects, CUDA memory and
# the time spent in the harness's parts so far. Output: diag-lockstep.log beside this file.
import faulthandler, gc, sys, time, weakref, os
sys.path[:0] = ["tests/cuda", "tests", "."]
import torch
import test_device_planner_cuda as t

out = open(os.environ["OUT"] + "/diag.log", "w", buffering=1)
faulthandler.dump_traceback_later(90, repeat=True, file=out)
live = []
stats = {"capture": 0.0, "forward": 0.0, "check": 0.0, "init": 0.0, "ncap": 0, "nfwd": 0, "steps": 0}
def timed(name, fn, count=None):
    def wrap(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            stats[name] += time.perf_counter() - s
            if count:
                stats[count] += 1
    return wrap
orig_init = t.Harness.__post_init__
def init(self):
    s = time.perf_counter()
    orig_init(self)
    stats["init"] += time.perf_counter() - s
    live.append(weakref.ref(self))
    ex = stats.setdefault("ex", 0) + 1
    stats["ex"] = ex
    now = time.perf_counter()
    print(f"ex {ex} t={now - T0:.1f} live={sum(r() is not None for r in live)} gcobj={len(gc.get_objects())} "
          f"alloc={torch.cuda.memory_allocated() >> 20}MiB reserved={torch.cuda.memory_reserved() >> 20}MiB "
          f"init={stats['init']:.1f} capture={stats['capture']:.1f}/{stats['ncap']} "
          f"forward={stats['forward']:.1f}/{stats['nfwd']} check={stats['check']:.1f}", file=out)
t.Harness.__post_init__ = init
t.Harness._capture = timed("capture", t.Harness._capture, "ncap")
t.Harness.forward = timed("forward", t.Harness.forward, "nfwd")
t.Harness.check = timed("check", t.Harness.check)
geometry, layout, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
T0 = time.perf_counter()
t.run_machine(geometry, layout, n)
print(f"done {geometry} {layout} {n} in {time.perf_counter() - T0:.1f}s", file=out)
