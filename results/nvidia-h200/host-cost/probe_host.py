"""Host cost of eager calls: wall per call (synchronized after each call; not dmbench's timing), host time
to return (GPU idle before), GPU time (torch.profiler kernels), and cProfile's own times.
Run from this folder with the repository on PYTHONPATH: python probe_host.py OUTDIR [small]"""
import cProfile, io, pstats, statistics, sys, time, json
import torch
import kernels
from kernels import dmattn_func, prepare_mask, topk_intervals

OUT = sys.argv[1]
SMALL = len(sys.argv) > 2
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def decode_inputs(B, Hq, Hk, Lq, Lk, D=128, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, generator=g).to(dev, dt)
    k = torch.randn(B, Lk, Hk, D, generator=g).to(dev, dt)
    v = torch.randn(B, Lk, Hk, D, generator=g).to(dev, dt)
    bias = torch.randn(B, Hk, 1, Lk, generator=g).to(dev, dt)
    return q, k, v, bias


def topw_bool(bias, Lq, W):
    B, Hk, _, Lk = bias.shape
    idx = bias.float().topk(W, dim=-1).indices
    m = torch.zeros(B, Hk, 1, Lk, dtype=torch.bool, device=bias.device)
    m.scatter_(-1, idx, True)
    return m.expand(B, Hk, Lq, Lk)


def cases():
    if SMALL:
        B, Hq, Hk, Lk, W = 1, 4, 2, 512, 64
    else:
        B, Hq, Hk, Lk, W = 8, 32, 8, 32768, 2048
    q, k, v, bias = decode_inputs(B, Hq, Hk, 1, Lk)
    m = topw_bool(bias, 1, W)
    pm = prepare_mask(m, q, k, True)
    iv = topk_intervals(bias, W, seqlen_q=1, is_causal=True)
    yield "decode bool prepared", lambda: dmattn_func(q, k, v, attn_mask=pm, attn_bias=bias, is_causal=True)
    yield "decode bool per-call", lambda: dmattn_func(q, k, v, attn_mask=m, attn_bias=bias, is_causal=True)
    yield "decode intervals", lambda: dmattn_func(q, k, v, attn_mask=iv, attn_bias=bias, is_causal=True)
    yield "decode select", lambda: dmattn_func(
        q, k, v, attn_mask=topk_intervals(bias, W, seqlen_q=1, is_causal=True), attn_bias=bias,
        is_causal=True)
    yield "decode select only", lambda: topk_intervals(bias, W, seqlen_q=1, is_causal=True)
    yield "decode dense", lambda: dmattn_func(q, k, v, is_causal=True)
    yield "decode dense bias", lambda: dmattn_func(q, k, v, attn_bias=bias, is_causal=True)
    sdpa_q, sdpa_k, sdpa_v = (t.transpose(1, 2) for t in (q, k, v))
    yield "sdpa dense", lambda: torch.nn.functional.scaled_dot_product_attention(
        sdpa_q, sdpa_k, sdpa_v, enable_gqa=True)
    if SMALL:
        B, Hq, Hk, L, W = 1, 4, 2, 256, 64
    else:
        B, Hq, Hk, L, W = 2, 16, 4, 2048, 1024
    g = torch.Generator(device="cpu").manual_seed(1)
    qt = torch.randn(B, L, Hq, 128, generator=g).to(dev, dt).requires_grad_()
    kt = torch.randn(B, L, Hk, 128, generator=g).to(dev, dt).requires_grad_()
    vt = torch.randn(B, L, Hk, 128, generator=g).to(dev, dt).requires_grad_()
    bt = torch.randn(B, Hk, 1, L, generator=g).to(dev, dt).requires_grad_()
    mt = topw_bool(bt.detach(), L, W)
    pmt = prepare_mask(mt, qt, kt, True)
    for name, opts in [("triton", {"backward": "fused"}),
                       ("hopper whole", {"backward": "hopper", "backward_split_heads": False}),
                       ("hopper split", {"backward": "hopper", "backward_split_heads": True}),
                       ("default", None)]:
        if dev != "cuda" and name.startswith("hopper"):
            continue
        out = dmattn_func(qt, kt, vt, attn_mask=pmt, attn_bias=bt, is_causal=True,
                          kernel_options=opts)
        go = torch.randn_like(out)

        def bwd(out=out, go=go):
            return torch.autograd.grad(out, (qt, kt, vt, bt), go, retain_graph=True)

        def fwdbwd(opts=opts, go=go):
            o = dmattn_func(qt, kt, vt, attn_mask=pmt, attn_bias=bt, is_causal=True,
                            kernel_options=opts)
            return torch.autograd.grad(o, (qt, kt, vt, bt), go)

        def fwd(opts=opts):
            return dmattn_func(qt, kt, vt, attn_mask=pmt, attn_bias=bt, is_causal=True,
                               kernel_options=opts)

        yield f"gqa bwd {name}", bwd
        yield f"gqa fwd+bwd {name}", fwdbwd
        if name == "default":
            yield "gqa fwd (grad)", fwd
    with torch.no_grad():
        yield "gqa fwd no-grad", lambda: dmattn_func(qt, kt, vt, attn_mask=pmt, attn_bias=bt, is_causal=True)


def gpu_time(fn, n=10):
    if dev != "cuda":
        return float("nan"), ""
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        sync()
    tot = 0.0
    names = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot += e.device_time
            names[e.name[:50]] = names.get(e.name[:50], 0) + 1
    return tot / n, ", ".join(f"{k} x{v // n}" for k, v in sorted(names.items()))


def main():
    rows = []
    log = open(f"{OUT}/host.log", "w")
    for name, fn in cases():
        for _ in range(5):
            fn()
        sync()
        walls, hosts = [], []
        for _ in range(30 if not SMALL else 3):
            sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            hosts.append((t1 - t0) * 1e6)
            walls.append((t2 - t0) * 1e6)
        gt, kn = gpu_time(fn)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100 if not SMALL else 2):
            fn()
        pr.disable()
        sync()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        row = dict(case=name, wall_us=statistics.median(walls), host_us=statistics.median(hosts),
                   gpu_us=gt, kernels=kn)
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        log.write(f"==== {line}\n{s.getvalue()}\n")
        log.flush()
    json.dump(rows, open(f"{OUT}/host.json", "w"), indent=1)


if __name__ == "__main__":
    main()
