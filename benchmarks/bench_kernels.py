"""Kernel benchmark on the GPU (issue 4 section 5): sparse MLP, head-sparse attention, predictor.

    python benchmarks/bench_kernels.py [--quick] [--json out.json]

Times are per call, from CUDA-graph replays (a graph holds a run of calls rotating over several copies
of the weights so that the active bytes exceed L2 several times), median over replays. "GB/s" counts the
bytes that must move: active weight rows (+ active KV cache for attention) read once, activations and
outputs. Copy bandwidth = a large device-to-device copy, (read + write) / time, measured in this run; the
"same-size copy" column is an elementwise SM copy moving the call's bytes, timed the same way (what a plain
streaming kernel reaches at that size).
Dense = torch F.linear chain (cuBLAS) on the same device, same dtype, same rotation.

--indices-ready 1 makes the kernels' indices-ready promise (djv_set_indices_ready), as the CUDA executor does in
its decode step: true here, since every call's indices are written before the graph. The MLP's and the QKV
projection's first kernels then read their indices and first weight rows before waiting for the call before,
overlapping its tail. --mlp-grid-slack N sizes the fused MLP's grid for N fewer SMs (the executor's slack
variants). Both default to the library's own defaults (off / 0, or DJV_INDICES_READY / DJV_MLP_SLACK), and the
settings in force are printed and kept in the JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dejavu_trt import kernels  # noqa: E402

DT = torch.float16
ES = 2
L2_BYTES = 60e6
SHAPES = {  # name: d, ffn, H, Hkv, activation
    "OPT-13B": (5120, 20480, 40, 40, "relu"),
    "LLaMA-2-7B": (4096, 11008, 32, 32, "silu_glu"),
    "LLaMA-3-70B-like": (8192, 28672, 64, 8, "silu_glu"),
}


def graph_time(fn_list, replays=30):
    """Median seconds per call of fn_list (each a no-arg launch) captured in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / len(fn_list))
    return statistics.median(ts)


def copy_bw():
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time, median of 20 event-timed
    dst.copy_(src) over 2 GiB fp32 buffers (64x L2; the old 1 GiB graph-of-4 probe read ~2.7 TB/s).
    Also a read-only probe (src.sum over the same buffer) for reference; returns (copy, read) in B/s."""
    n = 2 << 30
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    out = torch.empty((), device="cuda")

    def timed(fn, reps=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts)
    t_copy = timed(lambda: dst.copy_(src))
    t_read = timed(lambda: torch.sum(src, dim=0, out=out))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / t_copy, n / t_read


_same_size = {}


def copy_same_size(nbytes):
    """Bandwidth of an SM copy kernel (torch.mul(a, 1, out=b), fp16: an elementwise kernel, not the copy
    engines) that moves the same bytes as a kernel call (reads nbytes/2, writes nbytes/2), timed like the
    kernels (graph of calls rotating over copies of the buffers, so they come from HBM): what a plain streaming
    kernel reaches at this size, launch, ramp and tail included. Context for the target column, which stays
    against the large copy. (A same-size copy_ is a copy-engine memcpy node in a graph; its readings varied
    from 2.5 to 3.7 TB/s between neighbouring sizes, so it is not used.)"""
    n = max(8, (nbytes // 4) // 8 * 8)  # fp16 elements per buffer
    if n not in _same_size:
        bufs = [(torch.empty(n, dtype=DT, device="cuda").normal_(), torch.empty(n, dtype=DT, device="cuda"))
                for _ in range(ncopies(4 * n))]
        t = graph_time([lambda a=a, b=b: torch.mul(a, 1, out=b) for a, b in bufs] * 2)
        _same_size[n] = 4 * n / t
        del bufs
        torch.cuda.empty_cache()
    return _same_size[n]


def ncopies(active_bytes):
    return max(2, min(8, math.ceil(4 * L2_BYTES / max(active_bytes, 1))))


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(DT)


def mlp_weight_set(d, N, glu):
    """One copy of an MLP's weights as the kernels take them: neuron-major rows, the down projection stored
    transposed; gate rows (SwiGLU) or biases (OPT)."""
    w = dict(w_up=rnd(N, d, scale=d ** -0.5), w_down_t=rnd(N, d, scale=N ** -0.5))
    if glu:
        w["w_gate"] = rnd(N, d, scale=d ** -0.5)
    else:
        w["b_up"] = rnd(N, scale=0.1); w["b_down"] = rnd(d, scale=0.1)
    return w


def mlp_bytes(B, d, K, glu):
    """Bytes a sparse MLP call must move: the K neurons' rows, x and y, and the up biases (OPT)."""
    return (3 if glu else 2) * K * d * ES + 2 * B * d * ES + (0 if glu else K * ES)


def attn_weight_set(d, H, Hkv, hd, B, T):
    """One copy of an attention layer's projections (w_o stored transposed, as the kernel takes it) and its
    KV cache [B, Hkv, T, hd]."""
    return dict(w_q=rnd(H * hd, d, scale=d ** -0.5), w_k=rnd(Hkv * hd, d, scale=d ** -0.5),
                w_v=rnd(Hkv * hd, d, scale=d ** -0.5), w_o_t=rnd(H * hd, d, scale=(H * hd) ** -0.5),
                kc=rnd(B, Hkv, T, hd), vc=rnd(B, Hkv, T, hd))


def rope_tables(T, hd):
    """RoPE cos/sin [T, hd/2] in the benchmark dtype (base 10^4)."""
    ang = torch.arange(T, device="cuda")[:, None] * (1e4 ** (-torch.arange(hd // 2, device="cuda") / (hd // 2)))
    return ang.cos().to(DT), ang.sin().to(DT)


def bench_mlp(name, batches, kepts, cbw, rows):
    d, N, _, _, act = SHAPES[name]
    glu = act == "silu_glu"
    nmat = 3 if glu else 2
    full_bytes = nmat * N * d * ES
    nc = ncopies(0.1 * full_bytes)
    sets = []
    for _ in range(nc):
        w = mlp_weight_set(d, N, glu)
        w["w_down"] = w["w_down_t"].t().contiguous()  # HF layout for the dense baseline
        sets.append(w)
    for B in batches:
        x = rnd(B, d)
        y = torch.empty(B, d, device="cuda", dtype=DT)
        if glu:
            dense = [lambda w=w: F.linear(F.silu(F.linear(x, w["w_gate"])) * F.linear(x, w["w_up"]), w["w_down"])
                     for w in sets]
        else:
            dense = [lambda w=w: F.linear(torch.relu(F.linear(x, w["w_up"], w["b_up"])), w["w_down"], w["b_down"])
                     for w in sets]
        t_dense = graph_time(dense * 2)
        for kept in kepts:
            K = max(1, round(kept * N))
            idx = torch.randperm(N, device="cuda")[:K].sort().values.to(torch.int32)
            ws = torch.zeros(kernels.sparse_mlp_workspace_size(B, d, N, K, 1, act), dtype=torch.uint8, device="cuda")
            calls = []
            for w in sets:
                kw = {k: v for k, v in w.items() if k != "w_down"}
                calls.append(lambda kw=kw: kernels.sparse_mlp(x, idx, activation=act, out=y, workspace=ws, **kw))
            t = graph_time(calls * 2)
            nbytes = mlp_bytes(B, d, K, glu)
            same = copy_same_size(nbytes)
            rows.append(dict(op="mlp", shape=name, B=B, kept=kept, K=K, us=t * 1e6, GBps=nbytes / t / 1e9,
                             pct_copy=100 * nbytes / t / cbw, same_copy_GBps=same / 1e9, pct_same=100 * nbytes / t / same,
                             dense_us=t_dense * 1e6, speedup=t_dense / t))
            print_row(rows[-1])
    del sets
    torch.cuda.empty_cache()


def bench_attn(name, batches, head_frac, ctx, cbw, rows):
    d, _, H, Hkv, _ = SHAPES[name]
    hd = d // H
    T = ctx
    group = H // Hkv
    Kh = max(1, round(head_frac * H))
    w_bytes = 4 * H * hd * d * ES
    for B in batches:
        cache_bytes = 2 * B * Hkv * T * hd * ES
        nc = max(2, min(6, math.ceil(4 * L2_BYTES / (0.2 * (w_bytes + cache_bytes)))))
        sets = []
        for _ in range(nc):
            s = attn_weight_set(d, H, Hkv, hd, B, T)
            s["w_o"] = s["w_o_t"].t().contiguous()  # HF layout for the dense baseline
            sets.append(s)
        x = rnd(B, d)
        y = torch.empty(B, d, device="cuda", dtype=DT)
        pos = torch.full((B,), T - 1, device="cuda", dtype=torch.int32)
        posl = pos.long()
        rc, rs = rope_tables(T, hd)
        brow = torch.arange(B, device="cuda")

        def dense_call(s):
            q = F.linear(x, s["w_q"]).view(B, H, 1, hd)
            k = F.linear(x, s["w_k"]).view(B, Hkv, hd)
            v = F.linear(x, s["w_v"]).view(B, Hkv, hd)
            s["kc"][brow, :, posl] = k
            s["vc"][brow, :, posl] = v
            o = F.scaled_dot_product_attention(q, s["kc"], s["vc"], enable_gqa=group > 1)
            return F.linear(o.view(B, H * hd), s["w_o"])
        t_dense = graph_time([lambda s=s: dense_call(s) for s in sets] * 2)
        hidx = torch.randperm(H, device="cuda")[:Kh].sort().values.to(torch.int32)
        n_act_kv = len(torch.unique(hidx.long() // group))
        for pol in ("active", "dense"):
            ws = torch.zeros(kernels.head_attention_workspace_size(B, d, H, Hkv, hd, Kh, T, pol), dtype=torch.uint8,
                             device="cuda")
            calls = [lambda s=s: kernels.head_sparse_attention(
                x, hidx, pos, s["w_q"], s["w_k"], s["w_v"], s["w_o_t"], None, None, None, None, rc, rs, s["kc"],
                s["vc"], num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary=1, scale=hd ** -0.5, kv_policy=pol,
                out=y, workspace=ws) for s in sets]
            t = graph_time(calls * 2)
            nkv_proj = Hkv if pol == "dense" else n_act_kv
            nbytes = (2 * Kh * hd * d + 2 * nkv_proj * hd * d) * ES + 2 * B * n_act_kv * T * hd * ES
            same = copy_same_size(nbytes)
            rows.append(dict(op="attn", shape=name, B=B, kept=Kh / H, K=Kh, policy=pol, ctx=T, us=t * 1e6,
                             GBps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / cbw, same_copy_GBps=same / 1e9,
                             pct_same=100 * nbytes / t / same, dense_us=t_dense * 1e6, speedup=t_dense / t))
            print_row(rows[-1])
        del sets
        torch.cuda.empty_cache()


def bench_pred(name, batches, r_m, r_h, kept, rows):
    """Predictor time two ways: "L2" = one weight set replayed (weights stay in L2, as in the earlier runs),
    "HBM" = rotating over enough weight sets (one per layer in a real model) that they come from HBM."""
    d, N, H, _, _ = SHAPES[name]
    nbytes = (d * r_m + r_m * N + d * r_h + r_h * H) * ES
    nsets = max(2, math.ceil(2 * L2_BYTES / nbytes))
    sets = [(rnd(d, r_m, scale=d ** -0.5), rnd(r_m, N, scale=r_m ** -0.5), rnd(d, r_h, scale=d ** -0.5),
             rnd(r_h, H, scale=r_h ** -0.5)) for _ in range(nsets)]
    for B in batches:
        h = rnd(B, d)
        K, Kh = round(kept * N), max(1, round(0.2 * H))
        mi = torch.empty(K, dtype=torch.int32, device="cuda")
        hi = torch.empty(Kh, dtype=torch.int32, device="cuda")
        ws = torch.zeros(kernels.predictor_workspace_size(B, d, r_m, N, r_h, H), dtype=torch.uint8, device="cuda")
        calls = [lambda w=w: kernels.predictor(h, *w, kept_units=K, kept_heads=Kh, out=(mi, hi), workspace=ws)
                 for w in sets]
        t_l2 = graph_time(calls[:1] * 10)
        t = graph_time(calls)
        rows.append(dict(op="predictor", shape=name, B=B, kept=kept, K=K, r_m=r_m, r_h=r_h, us=t * 1e6,
                         us_l2=t_l2 * 1e6, GBps=nbytes / t / 1e9))
        print_row(rows[-1])
    del sets


def profile_kernels():
    """Per-kernel device times (torch.profiler) at the target points, to see which launch dominates."""
    from torch.profiler import ProfilerActivity, profile
    d, N, H, _, _ = SHAPES["OPT-13B"]
    h = rnd(1, d)
    ma, mb = rnd(d, 128, scale=d ** -0.5), rnd(128, N, scale=128 ** -0.5)
    ha, hb = rnd(d, 64, scale=d ** -0.5), rnd(64, H, scale=64 ** -0.5)
    K = N // 4
    w = dict(w_up=rnd(N, d, scale=d ** -0.5), w_down_t=rnd(N, d, scale=N ** -0.5), b_up=rnd(N), b_down=rnd(d))
    idx = torch.randperm(N, device="cuda")[:K].sort().values.to(torch.int32)
    x = rnd(1, d)
    for _ in range(3):
        kernels.predictor(h, ma, mb, ha, hb, kept_units=K, kept_heads=8)
        kernels.sparse_mlp(x, idx, activation="relu", **w)
    torch.cuda.synchronize()
    # attention at 2k context, 8 of 40 heads, kv_policy=active; 3 weight sets in rotation so they come from HBM
    hd, T, Kh = d // H, 2048, 8
    asets = [dict(w_q=rnd(d, d, scale=d ** -0.5), w_k=rnd(d, d, scale=d ** -0.5), w_v=rnd(d, d, scale=d ** -0.5),
                  w_o_t=rnd(d, d, scale=d ** -0.5), kc=rnd(1, H, T, hd), vc=rnd(1, H, T, hd)) for _ in range(3)]
    hidx = torch.randperm(H, device="cuda")[:Kh].sort().values.to(torch.int32)
    pos = torch.full((1,), T - 1, device="cuda", dtype=torch.int32)
    ang = torch.arange(T, device="cuda")[:, None] * (1e4 ** (-torch.arange(hd // 2, device="cuda") / (hd // 2)))
    rc, rs = ang.cos().to(DT), ang.sin().to(DT)

    def attn(s):
        kernels.head_sparse_attention(x, hidx, pos, s["w_q"], s["w_k"], s["w_v"], s["w_o_t"], None, None, None, None,
                                      rc, rs, s["kc"], s["vc"], num_heads=H, num_kv_heads=H, head_dim=hd, rotary=1,
                                      scale=hd ** -0.5, kv_policy="active")
    for s in asets:
        attn(s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(10):
            kernels.predictor(h, ma, mb, ha, hb, kept_units=K, kept_heads=8)
            kernels.sparse_mlp(x, idx, activation="relu", **w)
            attn(asets[i % 3])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)


def kernel_settings(indices_ready, mlp_grid_slack):
    """Apply the requested process-wide kernel settings (None: keep the library's) and return those in force."""
    prev_ready = kernels.set_indices_ready(bool(indices_ready))
    if indices_ready is None:
        kernels.set_indices_ready(prev_ready)
    prev_slack = kernels.set_mlp_grid_slack(mlp_grid_slack if mlp_grid_slack is not None else 0)
    if mlp_grid_slack is None:
        kernels.set_mlp_grid_slack(prev_slack)
    return dict(indices_ready=bool(prev_ready if indices_ready is None else indices_ready),
                mlp_grid_slack=prev_slack if mlp_grid_slack is None else mlp_grid_slack)


def print_row(r):
    if r["op"] == "predictor":
        print(f"{r['op']:9s} {r['shape']:17s} B={r['B']:2d} r_m={r['r_m']} r_h={r['r_h']} K={r['K']:6d} "
              f"{r['us']:8.1f} us (HBM weights) {r['us_l2']:8.1f} us (L2-resident) {r['GBps']:7.0f} GB/s", flush=True)
        return
    extra = f" {r['policy']:6s}" if r["op"] == "attn" else ""
    print(f"{r['op']:9s} {r['shape']:17s} B={r['B']:2d} kept={r['kept']:.2f}{extra} {r['us']:8.1f} us "
          f"{r['GBps']:7.0f} GB/s ({r['pct_copy']:5.1f}% copy)  dense {r['dense_us']:8.1f} us  x{r['speedup']:.2f}  "
          f"same-size copy {r['same_copy_GBps']:5.0f} GB/s ({r['pct_same']:5.1f}%)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default="mlp,attn,pred", help="comma list of mlp, attn, pred, profile")
    ap.add_argument("--focus", action="store_true",
                    help="the target points only (batch 1/16, 10-25%% and 100%% kept): fits a short device lease")
    ap.add_argument("--indices-ready", type=int, choices=(0, 1), default=None,
                    help="1: promise the indices are ready (as the executor does); 0: no promise. Default: the library's")
    ap.add_argument("--mlp-grid-slack", type=int, default=None, metavar="SMS",
                    help="size the fused MLP's grid for SMS fewer SMs. Default: the library's (DJV_MLP_SLACK, else 0)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    settings = kernel_settings(a.indices_ready, a.mlp_grid_slack)
    print(f"kernel settings: {json.dumps(settings)}", flush=True)
    only = a.only.split(",")
    cbw, rbw = copy_bw()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write, 2 GiB fp32 copy_): {cbw / 1e9:.0f} GB/s"
          f"  read-only (sum): {rbw / 1e9:.0f} GB/s", flush=True)
    rows = []
    batches = [1, 16] if a.focus else [1, 4, 16]
    kepts = [0.1, 0.25, 1.0] if a.quick else ([0.1, 0.2, 0.25, 1.0] if a.focus else [0.1, 0.2, 0.25, 0.5, 0.75, 1.0])
    shapes = ["OPT-13B"] if a.quick else list(SHAPES)
    if "profile" in only:
        profile_kernels()
    if "pred" in only:
        for s in shapes:
            bench_pred(s, batches, 128, 64, 0.25, rows)
    if "mlp" in only:
        for s in shapes:
            bench_mlp(s, batches if (s == "OPT-13B" or not a.focus) else [1], kepts, cbw, rows)
    if "attn" in only:
        for s in shapes:
            bench_attn(s, batches, 0.2, 2048, cbw, rows)
    if a.json:
        a.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_GBps=cbw / 1e9,
                                          read_GBps=rbw / 1e9, settings=settings, rows=rows), indent=1))


if __name__ == "__main__":
    main()
