"""Probe: one OPT-13B-shape head-sparse attention call and one sparse MLP call at batch 1, for Nsight Compute.

    ncu --clock-control none --section SpeedOfLight ... python3 benchmarks/probes/ncu_ops.py

Attention: 8 of 40 heads, 2k context, kv active. MLP: 25% of 20480 neurons, ReLU. Each op runs WARM times
first (library load, workspace, first-launch attribute calls), then once more; profile that last call with
ncu's --launch-skip (device_run.sh's `ncu` step does). ncu replays each kernel alone with caches flushed,
so the counters describe the kernel by itself: no programmatic-dependent-launch overlap, weights from HBM.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import DT, SHAPES, kernels, rnd  # noqa: E402  (bench_kernels puts the repo on sys.path)

WARM = 3  # device_run.sh's ncu step skips WARM rounds of its 6 kernels


def main():
    torch.manual_seed(0)
    d, N, H, _, _ = SHAPES["OPT-13B"]
    hd, T, Kh = d // H, 2048, 8
    x = rnd(1, d)
    w_q, w_k, w_v, w_o_t = (rnd(d, d, scale=d ** -0.5) for _ in range(4))
    kc, vc = rnd(1, H, T, hd), rnd(1, H, T, hd)
    hidx = torch.randperm(H, device="cuda")[:Kh].sort().values.to(torch.int32)
    pos = torch.full((1,), T - 1, device="cuda", dtype=torch.int32)
    ang = torch.arange(T, device="cuda")[:, None] * (1e4 ** (-torch.arange(hd // 2, device="cuda") / (hd // 2)))
    rc, rs = ang.cos().to(DT), ang.sin().to(DT)
    mlp = dict(w_up=rnd(N, d, scale=d ** -0.5), w_down_t=rnd(N, d, scale=N ** -0.5), b_up=rnd(N, scale=0.1),
               b_down=rnd(d, scale=0.1))
    idx = torch.randperm(N, device="cuda")[:N // 4].sort().values.to(torch.int32)
    for _ in range(WARM + 1):
        kernels.head_sparse_attention(x, hidx, pos, w_q, w_k, w_v, w_o_t, None, None, None, None, rc, rs, kc, vc,
                                      num_heads=H, num_kv_heads=H, head_dim=hd, rotary=1, scale=hd ** -0.5,
                                      kv_policy="active")
        kernels.sparse_mlp(x, idx, activation="relu", **mlp)
    torch.cuda.synchronize()
    print("ncu_ops: done")


if __name__ == "__main__":
    main()
