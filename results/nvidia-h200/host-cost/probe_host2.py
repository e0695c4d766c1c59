"""torch.profiler CPU view of eager calls: each aten op's and each wrapped Python function's
CPU time (inclusive), per call. Run from this folder (it imports probe_host): python probe_host2.py OUTDIR [small]"""
import functools, sys, importlib
import torch
from torch.profiler import profile, ProfilerActivity, record_function
sys.argv.append("x") if len(sys.argv) < 2 else None
import probe_host as ph

WRAP = [
    ("kernels.planning.hopper_backward", "HopperBackwardPlan.run"),
    ("kernels.planning.hopper_backward", "HopperBackwardPlan._mask_args"),
    ("kernels.planning.hopper_backward", "HopperBackwardPlan._bias_args"),
    ("kernels.planning.hopper_backward", "loader_rows"),
    ("kernels.planning.hopper_backward", "dq_from_spread"),
    ("kernels.planning.backward", "attention_backward"),
    ("kernels.planning.backward", "BackwardPlan.run"),
    ("kernels.planning.dbias", "DbiasPlan.allocate"),
    ("kernels.planning.dbias", "DbiasPlan.finish"),
    ("kernels.runtime.launch", "DescriptorLaunch.__call__"),
    ("kernels.runtime.launch", "PlannedLaunch.__call__"),
    ("kernels.runtime.launch", "launch"),
    ("kernels.runtime.tma", "EncodedDescriptors.launch"),
    ("kernels.masks.key_order", "reorder_keys"),
    ("kernels.masks.key_order", "_KeysInOrder.backward"),
    ("kernels.interface", "_DMAttnFunction.forward"),
    ("kernels.interface", "_DMAttnFunction.backward"),
    ("kernels.interface", "_in_key_order"),
    ("kernels.interface", "dmattn_func"),
    ("kernels.call_plan", "plan_call"),
    ("kernels.call_plan", "CallPlan.run"),
    ("kernels.prepared", "PreparedMask.intervals_for"),
    ("kernels.topk_ops", "topk_intervals"),
]


def wrap(modname, qual):
    mod = importlib.import_module(modname)
    owner, _, name = qual.rpartition(".")
    holder = getattr(mod, owner) if owner else mod
    raw = holder.__dict__[name] if owner else getattr(mod, name)
    is_static = isinstance(raw, staticmethod)
    fn = raw.__func__ if is_static else raw

    @functools.wraps(fn)
    def inner(*a, **k):
        with record_function("PY " + qual):
            return fn(*a, **k)
    setattr(holder, name, staticmethod(inner) if is_static else inner)
    # re-export where imported by name
    if not owner:
        for m in list(sys.modules.values()):
            if m and getattr(m, "__name__", "").startswith("kernels") and getattr(m, name, None) is fn:
                setattr(m, name, inner)


for m, q in WRAP:
    try:
        wrap(m, q)
    except Exception as e:
        print("no wrap", m, q, e)

KEEP = ("gqa bwd", "gqa fwd no-grad", "gqa fwd (grad)", "decode select", "decode bool per-call",
        "decode bool prepared")
out = open(f"{ph.OUT}/host2.log", "w")
for name, fn in ph.cases():
    if not name.startswith(KEEP):
        continue
    for _ in range(5):
        fn()
    ph.sync()
    n = 20
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        ph.sync()
    rows = []
    for e in prof.key_averages():
        rows.append((e.cpu_time_total / n, e.self_cpu_time_total / n, e.count / n, e.key))
    rows.sort(reverse=True)
    out.write(f"==== {name}\n  incl_us  self_us  calls  name\n")
    for r in rows[:45]:
        out.write(f"{r[0]:9.1f} {r[1]:8.1f} {r[2]:6.1f}  {r[3][:90]}\n")
    out.flush()
    print("done", name, flush=True)
