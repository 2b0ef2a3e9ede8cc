"""Where a fused-MLP call's fixed cost goes: a timeline from inside the kernels.

Batch 1's fused MLP (sm_90 `mlp_bulk_kernel` + `rows_reduce_kernel`) takes about bytes / bandwidth plus a
fixed cost of several microseconds per call. This probe loads a build of the library with the timeline stamps compiled in
(plugins/common/djv_trace.cuh; `cmake -S plugins -B plugins/build-trace -DDJV_TRACE=ON`), replays a CUDA graph of
back-to-back calls (rotating over weight copies, as bench_kernels.py times them), and reads every CTA's stamps:
start, launch wait returned, row table ready, first rows landed, last neuron done, partials stored; for the
reduction start, wait returned, partials read, end. Each call is measured from the end of the call before
(its reduction's last CTA), medians over the middle calls of the graph.

    python benchmarks/probes/mlp_trace.py [--lib plugins/build-trace/libdejavu_kernels.so] [--json out.json]
    python benchmarks/probes/mlp_trace.py --op attn   # the attention op: QKV, core, output projection, reduction

The stamps cost a few shared-memory stores and one record per CTA, so the traced call is timed too and
printed next to the fixed cost; compare it with bench_kernels.py's untraced time from the same run.
Prints the copy bandwidth measured in the same process first. Needs a CUDA device of compute capability 9.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LIB = ROOT / "plugins" / "build-trace" / "libdejavu_kernels.so"
SHAPE_NAMES = ("OPT-13B", "LLaMA-2-7B", "LLaMA-3-70B-like")  # bench_kernels.SHAPES holds their dimensions
BULK, REDUCE, QKV, ATTN_CORE, OUT_PROJ = 0, 1, 2, 3, 4  # djv_trace.cuh's kinds
ATTN_CHAIN = [("qkv", QKV), ("attn_core", ATTN_CORE), ("out_proj", OUT_PROJ), ("reduce", REDUCE)]


def record_dtype(events: int) -> np.dtype:
    """djv::TraceRec (plugins/common/djv_trace.cuh) as a numpy record."""
    return np.dtype([("t", "<u8", (events,)), ("launch", "<u4"), ("grid", "<u4"), ("smid", "<u4"), ("items", "<u4")])


def trace_api(lib: ctypes.CDLL, tu: str = "mlp"):
    """One translation unit's accessors in the traced build ("mlp": the fused MLP and its reduction; "attn": the
    attention op's kernels), or a clear error when the library has none."""
    if not hasattr(lib, f"djv_trace_read_{tu}"):
        raise SystemExit(f"{lib._name} has no timeline stamps: build it with -DDJV_TRACE=ON (see this file's doc)")
    layout_fn, reset_fn, read_fn = (getattr(lib, f"djv_trace_{n}_{tu}") for n in ("layout", "reset", "read"))
    layout = (ctypes.c_int * 5)()
    layout_fn(layout)
    kinds, ctas, calls, events, rec = list(layout)
    reset_fn.restype = ctypes.c_int
    read_fn.restype = ctypes.c_int
    read_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    dtype = record_dtype(events)
    if dtype.itemsize != rec:
        raise SystemExit(f"trace record is {rec} bytes in the library, {dtype.itemsize} here: rebuild both")

    def reset():
        rc = reset_fn()
        if rc:
            raise RuntimeError(f"djv_trace_reset: CUDA error {rc}")

    def read():
        buf = np.zeros((kinds, ctas, calls), dtype=dtype)
        rc = read_fn(buf.ctypes.data, buf.nbytes)
        if rc:
            raise RuntimeError(f"djv_trace_read: error {rc}")
        return buf

    return reset, read, calls


def per_call(buf, kind, launch):
    """The records of one launch of one kernel kind: a [CTAs] structured array (grid taken from the records)."""
    recs = buf[kind, :, launch % buf.shape[2]]
    recs = recs[(recs["launch"] == launch) & (recs["t"][:, 0] > 0)]
    if len(recs) == 0:
        return recs
    return recs[: int(recs["grid"][0])]


def us(x):
    return round(float(x) / 1e3, 2)


def middle_calls(buf, kinds, ncalls):
    """For each middle call i of the graph (2 .. ncalls-2) whose records are all there: the previous call's end
    (the last CTA of kinds[-1], the op's last kernel, at call i-1) and call i's records of each kind."""
    for i in range(2, ncalls - 1):
        prev = per_call(buf, kinds[-1], i - 1)
        recs = [per_call(buf, kind, i) for kind in kinds]
        if len(prev) and all(len(r) for r in recs):
            yield int(prev["t"][:, 5].max()), recs


def median_over_calls(rows, fixed=()):
    """The median of each statistic over the calls' rows; `fixed` ones (counts) are taken from the first row."""
    if not rows:
        raise RuntimeError("no complete calls in the trace (ring too small, or the kernels were not the traced ones)")
    keys = set.intersection(*(set(r) for r in rows))
    return {k: rows[0][k] if k in fixed else statistics.median(r[k] for r in rows) for k in sorted(keys)}


MLP_COUNTS = ("bulk_ctas", "reduce_ctas", "items_min", "items_max")


def analyse(buf, ncalls):
    """The fused MLP's and its reduction's stamps relative to the previous call's end, medians over the middle
    calls. Returns ({stat: ns, or a count}, calls used)."""
    rows = []
    for t_prev, (bulk, red) in middle_calls(buf, (BULK, REDUCE), ncalls):
        bt, rt = bulk["t"].astype(np.int64) - t_prev, red["t"].astype(np.int64) - t_prev
        rows.append(dict(
            bulk_ctas=len(bulk), reduce_ctas=len(red),
            start_first=bt[:, 0].min(), start_median=np.median(bt[:, 0]), start_last=bt[:, 0].max(),
            wait_returned_median=np.median(bt[:, 1]), wait_returned_last=bt[:, 1].max(),
            table_ready_median=np.median(bt[:, 2]),
            first_rows_median=np.median(bt[:, 3]), first_rows_last=bt[:, 3].max(),
            last_neuron_first=bt[:, 4].min(), last_neuron_median=np.median(bt[:, 4]), last_neuron_last=bt[:, 4].max(),
            partials_stored_last=bt[:, 5].max(),
            reduce_start_first=rt[:, 0].min(), reduce_wait_returned_first=rt[:, 1].min(),
            reduce_wait_returned_median=np.median(rt[:, 1]), reduce_reads_done_median=np.median(rt[:, 4]),
            reduce_end_last=rt[:, 5].max(),
            items_min=int(bulk["items"].min()), items_max=int(bulk["items"].max()),
        ))
    return median_over_calls(rows, MLP_COUNTS), len(rows)


def analyse_chain(buf, chain, ncalls):
    """For an op of several kernels (chain: [(name, kind)], the op's last kernel last), each kernel's stamps
    relative to the previous call's end, medians over the middle calls: first start, median wait return
    (stamp 1), median stamps 2 and 4, median and last end. Stamps a kernel does not set are left out.
    Returns ({name: {stat: ns, or "ctas": a count}}, calls used)."""
    per = {name: [] for name, _ in chain}
    for t_prev, recs in middle_calls(buf, [kind for _, kind in chain], ncalls):
        for (name, _), r in zip(chain, recs):
            t = r["t"].astype(np.int64)
            st = dict(ctas=len(r), start_first=t[:, 0].min() - t_prev, end_median=np.median(t[:, 5]) - t_prev,
                      end_last=t[:, 5].max() - t_prev)
            for e, key in ((1, "wait_returned_median"), (2, "stamp2_median"), (4, "stamp4_median")):
                if (t[:, e] > 0).all():
                    st[key] = np.median(t[:, e]) - t_prev
            per[name].append(st)
    return {name: median_over_calls(rows, ("ctas",)) for name, rows in per.items()}, len(per[chain[0][0]])


def stamp_resolution(buf):
    t = np.unique(buf["t"][buf["t"] > 0].astype(np.int64))
    d = np.diff(t)
    return int(d[d > 0].min()) if len(d) else 0


def attn_trace(a, torch, kernels, bk, trace_calls, cbw):
    """OPT-13B attention (d 5120, 40 heads of 128, 8 kept, 2k context, kv active, B=1), as bench_kernels.py
    times it, with and without the indices-ready promise: each kernel's stamps from the previous call's end."""
    d, H, hd, T, Kh, B = 5120, 40, 128, 2048, 8, 1
    nsets = 6
    sets = [bk.attn_weight_set(d, H, H, hd, B, T) for _ in range(nsets)]
    x = bk.rnd(B, d)
    y = torch.empty(B, d, device="cuda", dtype=x.dtype)
    pos = torch.full((B,), T - 1, device="cuda", dtype=torch.int32)
    rc, rs = bk.rope_tables(T, hd)
    hidx = torch.randperm(H, device="cuda")[:Kh].sort().values.to(torch.int32)
    ws = torch.zeros(kernels.head_attention_workspace_size(B, d, H, H, hd, Kh, T, "active"), dtype=torch.uint8,
                     device="cuda")
    nbytes = (4 * Kh * hd * d + 2 * B * Kh * T * hd) * 2  # Q/K/V/O rows of the kept heads, their KV cache
    out = []
    for ready in (int(r) for r in a.indices_ready.split(",")):
        prev = kernels.set_indices_ready(bool(ready))
        calls = [lambda s=s: kernels.head_sparse_attention(
            x, hidx, pos, s["w_q"], s["w_k"], s["w_v"], s["w_o_t"], None, None, None, None, rc, rs, s["kc"], s["vc"],
            num_heads=H, num_kv_heads=H, head_dim=hd, rotary=1, scale=hd ** -0.5, kv_policy="active", out=y,
            workspace=ws) for s in sets]
        calls = (calls * math.ceil(a.calls / len(calls)))[: a.calls]
        t, buf = trace_calls(calls)
        kernels.set_indices_ready(prev)
        med, n_used = analyse_chain(buf, ATTN_CHAIN, a.calls)
        row = dict(op="attn", shape="OPT-13B", B=B, heads_kept=Kh, ctx=T, indices_ready=ready,
                   MB=round(nbytes / 1e6, 1), traced_call_us=round(t * 1e6, 2),
                   bytes_at_copy_us=round(nbytes / cbw * 1e6, 2), calls_analysed=n_used,
                   stamp_resolution_ns=stamp_resolution(buf),
                   kernels={k: {s_: (v if s_ == "ctas" else us(v)) for s_, v in st.items()} for k, st in med.items()})
        out.append(row)
        print(json.dumps(row, default=float), flush=True)
        parts = "; ".join(f"{k} ({st['ctas']} CTAs) start {st['start_first']:.2f}"
                          + (f" wait {st['wait_returned_median']:.2f}" if "wait_returned_median" in st else "")
                          + (f" s4 {st['stamp4_median']:.2f}" if "stamp4_median" in st else "")
                          + f" end {st['end_median']:.2f}/{st['end_last']:.2f}" for k, st in row["kernels"].items())
        print(f"trace attn OPT-13B B=1 heads=8/40 ctx={T} ready={ready}  call {row['kernels']['reduce']['end_last']:.2f}"
              f" us (traced graph {row['traced_call_us']:.2f}; bytes at copy {row['bytes_at_copy_us']:.2f})  | {parts}",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", type=Path, default=DEFAULT_LIB, help="a -DDJV_TRACE=ON build of libdejavu_kernels")
    ap.add_argument("--shapes", default=",".join(SHAPE_NAMES), help="comma list of " + ", ".join(SHAPE_NAMES))
    ap.add_argument("--kept", default="0.2,0.25", help="comma list of kept fractions")
    ap.add_argument("--indices-ready", default="1,0", help="comma list of 0/1 (the promise the executor makes: 1)")
    ap.add_argument("--mlp-grid-slack", default="0,2", help="comma list of grid slacks (SMs; the executor's batch-1 "
                    "choice is usually 2)")
    ap.add_argument("--calls", type=int, default=32, help="calls per graph (at most the ring's launches per CTA)")
    ap.add_argument("--op", choices=("mlp", "attn"), default="mlp",
                    help="attn: the head-sparse attention op instead (OPT-13B, 20%% of heads, 2k context, kv active)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not a.lib.exists():
        raise SystemExit(f"{a.lib} not found: cmake -S plugins -B {a.lib.parent} -DDJV_TRACE=ON && "
                         f"cmake --build {a.lib.parent} -j")
    os.environ["DEJAVU_KERNELS_LIB"] = str(a.lib)  # before the kernels module opens a library
    import torch
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_kernels as bk  # noqa: E402
    from dejavu_trt import kernels  # noqa: E402

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("needs a CUDA device of compute capability >= 9 (the fused MLP kernel is sm_90's)")
    lib = kernels.load_library()
    reset, read, ring = trace_api(lib, a.op)
    if a.calls > ring:
        raise SystemExit(f"--calls {a.calls}: the ring keeps {ring} launches per CTA")
    torch.manual_seed(0)
    cbw, _ = bk.copy_bw()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write, 2 GiB fp32 copy_): {cbw / 1e9:.0f} GB/s",
          flush=True)

    def trace_calls(calls):
        """The traced graph's time per call, and its records: captured once more, counters reset, replayed."""
        t = bk.graph_time(calls)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in calls:
                f()
        g.replay(); torch.cuda.synchronize()
        reset()
        g.replay(); torch.cuda.synchronize()
        return t, read()

    if a.op == "attn":
        out = attn_trace(a, torch, kernels, bk, trace_calls, cbw)
        if a.json:
            a.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_GBps=cbw / 1e9, rows=out),
                                         indent=1, default=float))
        return 0
    out = []
    for name in a.shapes.split(","):
        d, N, _, _, act = bk.SHAPES[name]
        glu = act == "silu_glu"
        nmat = 3 if glu else 2
        sets = [bk.mlp_weight_set(d, N, glu) for _ in range(bk.ncopies(0.1 * nmat * N * d * 2))]
        x = bk.rnd(1, d)
        y = torch.empty(1, d, device="cuda", dtype=x.dtype)
        for kept in (float(k) for k in a.kept.split(",")):
            K = max(1, round(kept * N))
            idx = torch.randperm(N, device="cuda")[:K].sort().values.to(torch.int32)
            ws = torch.zeros(kernels.sparse_mlp_workspace_size(1, d, N, K, 1, act), dtype=torch.uint8, device="cuda")
            nbytes = bk.mlp_bytes(1, d, K, glu)
            for ready, slack in ((int(r), int(k)) for r in a.indices_ready.split(",")
                                 for k in a.mlp_grid_slack.split(",")):
                prev = kernels.set_indices_ready(bool(ready))
                prev_slack = kernels.set_mlp_grid_slack(slack)
                calls = [lambda w=w: kernels.sparse_mlp(x, idx, activation=act, out=y, workspace=ws, **w)
                         for w in sets]
                calls = (calls * math.ceil(a.calls / len(calls)))[: a.calls]
                t, buf = trace_calls(calls)
                kernels.set_indices_ready(prev)
                kernels.set_mlp_grid_slack(prev_slack)
                med, n_used = analyse(buf, a.calls)
                row = dict(shape=name, B=1, kept=kept, K=K, indices_ready=ready, slack=slack, MB=round(nbytes / 1e6, 1),
                           traced_call_us=round(t * 1e6, 2), bytes_at_copy_us=round(nbytes / cbw * 1e6, 2),
                           calls_analysed=n_used, stamp_resolution_ns=stamp_resolution(buf),
                           **{k: (v if k in MLP_COUNTS else us(v)) for k, v in med.items()})
                row["fixed_us"] = round(row["reduce_end_last"] - row["bytes_at_copy_us"], 2)
                out.append(row)
                print(json.dumps(row), flush=True)
                print(f"trace {name:16s} kept={kept:.2f} ready={ready} slack={slack}  call {row['reduce_end_last']:6.2f} us "
                      f"(traced graph {row['traced_call_us']:6.2f}; bytes at copy {row['bytes_at_copy_us']:6.2f}; "
                      f"fixed {row['fixed_us']:5.2f})  | from the previous call's end: bulk CTAs start "
                      f"{row['start_first']:5.2f}..{row['start_last']:5.2f}, wait returns {row['wait_returned_median']:5.2f}, "
                      f"first rows {row['first_rows_median']:5.2f} (last {row['first_rows_last']:5.2f}), "
                      f"last neuron {row['last_neuron_first']:6.2f}/{row['last_neuron_median']:6.2f}/"
                      f"{row['last_neuron_last']:6.2f}, partials {row['partials_stored_last']:6.2f}, "
                      f"reduce wait returns {row['reduce_wait_returned_first']:6.2f}, reads done "
                      f"{row['reduce_reads_done_median']:6.2f}, end {row['reduce_end_last']:6.2f}", flush=True)
            del ws
        del sets
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_GBps=cbw / 1e9, rows=out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
