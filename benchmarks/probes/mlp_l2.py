"""Is the fused MLP at batch 1 bound by HBM bytes or by its own latency? The same call timed with its active
rows L2-resident (the same rows every call) and from HBM (rotating over disjoint row sets whose footprint is
several times L2), OPT-13B shape (d 5120, ffn 20480, ReLU, fp16), CUDA-graph replays. Prints the copy
bandwidth measured in the same process first (bench_kernels.copy_bw), and each row's rotating GB/s as a share
of it.

If the L2-resident call is barely faster, what remains of the call's time is latency (ramp, per-neuron
pipeline, partial sums), not bytes, and moving bytes ahead of the call cannot pay.

    python benchmarks/probes/mlp_l2.py [--dtype fp16|bf16]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import copy_bw, graph_time  # noqa: E402

from dejavu_trt import kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    args = ap.parse_args()
    d, n = 5120, 20480
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    copy, _read = copy_bw()  # the same process's copy bandwidth, for the GB/s column
    print(json.dumps({"copy_GB_s": round(copy / 1e9, 0)}), flush=True)
    w_up = (torch.randn(n, d, device="cuda", generator=g) * d ** -0.5).to(dt)
    w_down_t = (torch.randn(n, d, device="cuda", generator=g) * n ** -0.5).to(dt)
    x = torch.randn(1, d, device="cuda", generator=g).to(dt)
    y = torch.empty(1, d, device="cuda", dtype=dt)
    perm = torch.randperm(n, device="cuda", generator=g)
    for k in (256, 512, 1024, 2048, 5120):
        sets = max(1, min(8, n // k))
        idx = [perm[i * k:(i + 1) * k].sort().values.to(torch.int32) for i in range(sets)]

        def call(i):
            return lambda: kernels.sparse_mlp(x, idx[i], activation="relu", w_up=w_up, w_down_t=w_down_t, out=y)

        call(0)()  # workspace before capture
        warm = graph_time([call(0)] * 16)
        cold = graph_time([call(i % sets) for i in range(16)])
        mb = k * 2 * d * 2 / 1e6
        print(json.dumps({"dtype": args.dtype, "kept": k, "MB_per_call": round(mb, 1), "sets": sets, "footprint_MB": round(mb * sets, 1),
                          "us_same_rows": round(warm * 1e6, 2), "us_rotating": round(cold * 1e6, 2),
                          "GB_s_rotating": round(mb / 1e3 / cold, 0),
                          "pct_of_copy_rotating": round(100 * mb * 1e6 / cold / copy, 1)}), flush=True)


if __name__ == "__main__":
    main()
