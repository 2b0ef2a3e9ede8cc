"""Probe: one OPT-13B-shape lookahead predictor call at batch 1 (rank 128 / 64, 25% of 20480 neurons and
8 of 40 heads kept), for Nsight Compute.

    ncu --clock-control none --section WarpStateStats ... python3 benchmarks/probes/ncu_pred.py

The call runs WARM times first (library load, workspace, first-launch attributes), then once more; profile
that last call's three kernels (u_kernel, scores_kernel, topk_kernel) with ncu's --launch-skip, as
device_run.sh's `ncu-pred` step does.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import SHAPES, kernels, rnd  # noqa: E402  (bench_kernels puts the repo on sys.path)

WARM = 3  # device_run.sh's ncu-pred step skips WARM rounds of the 3 predictor kernels


def main():
    torch.manual_seed(0)
    d, N, H, _, _ = SHAPES["OPT-13B"]
    h = rnd(1, d)
    ma, mb = rnd(d, 128, scale=d ** -0.5), rnd(128, N, scale=128 ** -0.5)
    ha, hb = rnd(d, 64, scale=d ** -0.5), rnd(64, H, scale=64 ** -0.5)
    mi = torch.empty(N // 4, dtype=torch.int32, device="cuda")
    hi = torch.empty(8, dtype=torch.int32, device="cuda")
    ws = torch.zeros(kernels.predictor_workspace_size(1, d, 128, N, 64, H), dtype=torch.uint8, device="cuda")
    for _ in range(WARM + 1):
        kernels.predictor(h, ma, mb, ha, hb, kept_units=N // 4, kept_heads=8, out=(mi, hi), workspace=ws)
    torch.cuda.synchronize()
    print("ncu_pred: done")


if __name__ == "__main__":
    main()
