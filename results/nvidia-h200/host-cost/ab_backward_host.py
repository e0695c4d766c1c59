"""Eager backward host cost, A/B in one process: ``kernels`` (the tree on PYTHONPATH) against
``kernels_base`` (an older tree's ``kernels/`` copied beside this script, its custom-op namespace
renamed so both register: ``NAMESPACE = "dmattnb"`` in ops.py, ``"dmattnb::`` in topk_ops.py).
Each case alternates the two trees in rounds of 8 synchronized calls; medians of host time
(until the call returns, the GPU idle before) and wall, and the kernels per call (torch.profiler).
Synchronized single calls, not dmbench's timing. Usage: python ab_backward_host.py OUT.json
(AB_SLIM=1: the first two shapes and three routes; AB_ROUNDS: rounds per case)."""
import json, statistics, sys, time, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import kernels, kernels_base
dev, dt = "cuda", torch.bfloat16
sync = torch.cuda.synchronize
TREES = {"base": kernels_base, "new": kernels}

def topw_bool(bias, Lq, W):
    B, Hk, _, Lk = bias.shape
    idx = bias.float().topk(W, dim=-1).indices
    m = torch.zeros(B, Hk, 1, Lk, dtype=torch.bool, device=bias.device)
    m.scatter_(-1, idx, True)
    return m.expand(B, Hk, Lq, Lk)

def kernel_count(fn, n=5):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        sync()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(ev) / n, sum(e.device_time for e in ev) / n

SHAPES = [(2, 16, 4, 2048, 1024, True, True, True), (2, 16, 4, 2048, 0, False, False, True),
          (2, 16, 4, 2048, 0, False, True, False), (2, 16, 16, 4096, 0, False, True, False),
          (1, 32, 8, 8192, 0, False, False, True)]
ROUTES = [("triton", {"backward": "fused"}),
          ("hopper whole", {"backward": "hopper", "backward_split_heads": False}),
          ("hopper split", {"backward": "hopper", "backward_split_heads": True}),
          ("default", None)]

def calls(mod, shape, opts):
    B, Hq, Hk, L, W, masked, biased, causal = shape
    g = torch.Generator(device="cpu").manual_seed(1)
    qt = torch.randn(B, L, Hq, 128, generator=g).to(dev, dt).requires_grad_()
    kt = torch.randn(B, L, Hk, 128, generator=g).to(dev, dt).requires_grad_()
    vt = torch.randn(B, L, Hk, 128, generator=g).to(dev, dt).requires_grad_()
    bt = torch.randn(B, Hk, 1, L, generator=g).to(dev, dt).requires_grad_() if biased else None
    mask = topw_bool(torch.randn(B, Hk, 1, L, generator=g).to(dev), L, W) if masked else None
    pmt = mod.prepare_mask(mask, qt, kt, causal) if masked else None
    ins = (qt, kt, vt) + ((bt,) if biased else ())
    f = lambda: mod.dmattn_func(qt, kt, vt, attn_mask=pmt, attn_bias=bt, is_causal=causal, kernel_options=opts)
    out = f()
    go = torch.randn_like(out)
    bwd = lambda: torch.autograd.grad(out, ins, go, retain_graph=True)
    def fwdbwd():
        return torch.autograd.grad(f(), ins, go)
    return bwd, fwdbwd

def host_times(fn, n):
    hs, ws = [], []
    for _ in range(n):
        sync(); t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); sync(); t2 = time.perf_counter()
        hs.append((t1 - t0) * 1e6); ws.append((t2 - t0) * 1e6)
    return hs, ws

if os.environ.get("AB_SLIM"):
    SHAPES = SHAPES[:2]
    ROUTES = [r for r in ROUTES if r[0] in ("triton", "hopper split", "default")]
rows = []
for shape in SHAPES:
    B, Hq, Hk, L, W, masked, biased, causal = shape
    tag = f"B{B} H{Hq}/{Hk} L{L} {'topW' if masked else 'dense'}{' bias' if biased else ''}{' causal' if causal else ''}"
    for rname, opts in ROUTES:
        if Hq == Hk and "split" in rname:
            continue
        fns = {}
        for tree, mod in TREES.items():
            bwd, fwdbwd = calls(mod, shape, opts)
            fns[tree] = {"bwd": bwd, "fwd+bwd": fwdbwd}
        for kind in ("bwd", "fwd+bwd"):
            acc = {t: ([], []) for t in TREES}
            for t in TREES:
                for _ in range(3):
                    fns[t][kind]()
            for rnd in range(int(os.environ.get('AB_ROUNDS', 8))):  # interleaved rounds
                for t in (TREES if rnd % 2 == 0 else reversed(list(TREES))):
                    hs, ws = host_times(fns[t][kind], 8)
                    acc[t][0].extend(hs); acc[t][1].extend(ws)
            for t in TREES:
                nk, gpu = kernel_count(fns[t][kind])
                row = dict(tree=t, case=f"{tag} {kind} {rname}", host_us=round(statistics.median(acc[t][0]), 1),
                           wall_us=round(statistics.median(acc[t][1]), 1), kernels=nk, gpu_us=round(gpu, 1))
                print(json.dumps(row), flush=True)
                rows.append(row)
        del fns
        torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)
