"""Train the lookahead predictors on a work dir's calibration records, for top-k recall.

Per layer and per target (MLP units, heads), two steps:

1. **Closed-form fit.** Reduced-rank ridge regression of log(activity + eps) on z = rmsnorm(h)
   (logs tame the heavy-tailed magnitudes; on SmolLM2 they rank as well as per-token ranks at a
   fraction of the cost). The rank-r factorisation keeps the top-r right singular directions of
   the fitted scores; the ridge strength is picked per layer by validation recall.
2. **Fine-tuning for recall.** Adam on a binary cross-entropy against "is the unit in the
   oracle's top-k" at a few kept fractions. The contract's scores have no bias, and top-k only
   sees order within a token, so each token's logits are centred on their own quantile at that
   fraction before the loss. Early stopping keeps the epoch with the best validation recall at
   the report fraction (50% of MLP units; 6 of 9 heads scaled to the model's head count).

Layers are trained one at a time, so memory is one layer's records whatever the model size.

Measured on SmolLM2-135M (SwiGLU), 8192 calibration / 2048 validation SOTU tokens, rank 64: MLP
recall at 50% kept is 0.68 mean (0.64 min; layers 1-14 ≈ 0.64-0.66, the last layers up to 0.79),
and the predicted half keeps 83% of the oracle half's activity; heads at 6/9 reach 0.90. Neither
per-token ranks, BCE fine-tuning, rank 128, a 512-unit ReLU hidden layer nor a bias term moved MLP
recall by more than ~0.015: |silu(g·x)·(u·x)| is not well predicted by any linear score, even of
the layer's own MLP input (see the predictors report in the work dir for per-layer numbers).
Even the exact SwiGLU activity computed from the lookahead input reaches only 0.50-0.75 recall
(benchmarks/probe_mlp_lookahead.py): on this model the lookahead input itself is the limit.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..ops.contract import PREDICTOR_EPS
from ..ops.reference import rms_normalize as reference_rms_normalize
from .metrics import kept_count, mass_recall, topk_recall
from .model import LookaheadPredictors, input_index

REPORT_MLP_FRACTION = 0.5
REPORT_HEAD_FRACTION = 6 / 9


@dataclass
class TrainConfig:
    rank_mlp: int = 64
    rank_heads: int = 16
    epochs: int = 0
    lr: float = 2e-3
    batch_tokens: int = 512
    ridges: tuple = (0.01, 0.1)               # ridge strengths tried, relative to mean(diag(Z^T Z))
    mlp_fractions: tuple = (0.25, 0.5, 0.75)  # kept fractions the BCE is taken at
    head_fractions: tuple = (0.34, 0.67)
    patience: int = 4
    seed: int = 0


@dataclass
class FitResult:
    a: torch.Tensor
    b: torch.Tensor
    val_recall: float       # at the report fraction, best epoch
    start_recall: float     # after the closed-form start
    epochs: int             # epochs run (early stopping)
    mass_recall: float = 0.0  # share of the oracle top-k's activity the predicted top-k keeps


def rms_normalize(h: torch.Tensor) -> torch.Tensor:
    """The contract's normalisation (ops.reference.rms_normalize), in fp32 for fp16 records."""
    return reference_rms_normalize(h.float(), PREDICTOR_EPS)


def log_targets(y: torch.Tensor) -> torch.Tensor:
    """log(activity + eps), eps a hundredth of the mean activity (keeps zeros of ReLU finite)."""
    y = y.float()
    return torch.log(y + 1e-2 * y.mean().clamp_min(1e-12))


def reduced_rank_ridge(z: torch.Tensor, t: torch.Tensor, rank: int, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """a [d, r], b [r, U] minimising ||z a b - t||^2 + ridge * ||a b||^2 (rank-r projection of the ridge fit)."""
    d = z.shape[1]
    g = z.T @ z
    lam = ridge * g.diagonal().mean()
    w = torch.linalg.solve(g + lam * torch.eye(d, dtype=g.dtype), z.T @ t)      # [d, U]
    rank = min(rank, w.shape[0], w.shape[1])
    # Top-r right singular vectors of the fitted scores z @ w, without forming them:
    # (z w)^T (z w) = (C^T w)^T (C^T w) with g = C C^T, so an SVD of the small [d, U] matrix suffices.
    # C from a float64 eigendecomposition, not Cholesky: with few calibration tokens (or collinear
    # hidden states) g is only positive semi-definite and Cholesky fails.
    evals, q = torch.linalg.eigh(g.double())
    ct_w = (evals.clamp_min(0).sqrt()[:, None] * (q.T @ w.double())).to(w.dtype)  # C^T w, C = Q sqrt(L)
    v = torch.linalg.svd(ct_w, full_matrices=False).Vh[:rank]                    # [r, U]
    return w @ v.T, v.clone()


def _centered_bce(s: torch.Tensor, labels: list[tuple[int, torch.Tensor]], scale: torch.Tensor) -> torch.Tensor:
    loss = 0.0
    for k, lab in labels:
        thr = s.detach().topk(k, -1).values[..., -1:]  # each token's k-th score
        loss = loss + F.binary_cross_entropy_with_logits((s - thr) * scale, lab)
    return loss / len(labels)


def fit_scores(zc, yc, zv, yv, rank: int, fractions, report_fraction: float, cfg: TrainConfig) -> FitResult:
    """Fit one low-rank scorer (see module doc). zc/zv [n, d] normalised inputs, yc/yv [n, U] activity."""
    units = yc.shape[1]
    k_report = kept_count(report_fraction, units)

    def val_recall(a, b):
        with torch.no_grad():
            return topk_recall((zv @ a) @ b, yv, k_report).mean().item()

    targets = log_targets(yc)
    fits = [reduced_rank_ridge(zc, targets, rank, ridge) for ridge in cfg.ridges]
    recalls = [val_recall(a, b) for a, b in fits]
    a, b = fits[max(range(len(fits)), key=recalls.__getitem__)]
    start = max(recalls)
    a, b, best, epochs_run = _fine_tune(a, b, zc, yc, start, val_recall, fractions, cfg)
    with torch.no_grad():
        mass = mass_recall((zv @ a) @ b, yv, k_report).mean().item()
    return FitResult(a, b, best, start, epochs_run, mass)


def _fine_tune(a, b, zc, yc, start_recall: float, val_recall, fractions, cfg: TrainConfig):
    """Adam on the centred top-k BCE; keeps the epoch with the best validation recall."""
    units = yc.shape[1]
    ks = sorted({kept_count(f, units) for f in fractions if kept_count(f, units) < units})
    best, best_ab, epochs_run, stale = start_recall, (a, b), 0, 0
    if cfg.epochs <= 0 or not ks:
        return a, b, best, 0
    masks = {k: topk_recall_mask(yc, k) for k in ks}
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    # Logit scale so the start's scores are O(1) around each token's threshold.
    scale = torch.nn.Parameter((1.0 / ((zc[:512] @ a) @ b).detach().std().clamp_min(1e-6)) * torch.ones(()))
    opt = torch.optim.Adam([a, b, scale], lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = zc.shape[0]
    for epoch in range(cfg.epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, cfg.batch_tokens):
            rows = perm[i:i + cfg.batch_tokens]
            s = (zc[rows] @ a) @ b
            loss = _centered_bce(s, [(k, masks[k][rows]) for k in ks], scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        epochs_run = epoch + 1
        r = val_recall(a.detach(), b.detach())
        if r > best + 1e-4:
            best, best_ab, stale = r, (a.detach().clone(), b.detach().clone()), 0
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    return best_ab[0], best_ab[1], best, epochs_run


def topk_recall_mask(y: torch.Tensor, k: int) -> torch.Tensor:
    idx = y.topk(k, -1).indices
    return torch.zeros(y.shape, dtype=torch.float32).scatter_(-1, idx, 1.0)


def dense_layer_bytes(dims: dict, bytes_per_value: int = 2) -> int:
    """Bytes of one layer's MLP and attention projection weights (what the predictors decide about)."""
    d, N, H, Hkv, hd = (dims[k] for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"))
    mlp = (3 if dims["activation"] == "silu_glu" else 2) * d * N
    attn = 2 * d * H * hd + 2 * d * Hkv * hd
    return (mlp + attn) * bytes_per_value


def train_predictors(wd, cfg: TrainConfig | None = None, progress: bool = True) -> tuple[LookaheadPredictors, dict]:
    """Train every layer's predictors on `wd` (an opened WorkDir). Returns (predictors, report)."""
    cfg = cfg or TrainConfig()
    torch.manual_seed(cfg.seed)
    dims = wd.dims
    L = dims["num_layers"]
    cal, val = wd.records("calibration"), wd.records("validation")
    t0 = time.time()
    parts = {k: [] for k in ("mlp_a", "mlp_b", "head_a", "head_b")}
    per_layer = []
    layers = range(L)
    if progress:
        from tqdm import tqdm
        layers = tqdm(layers, desc="training predictors", unit="layer")
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for l in layers:
        src = input_index(l)
        if src not in cache:
            cache.clear()
            cache[src] = (rms_normalize(cal.hidden(src)), rms_normalize(val.hidden(src)))
        zc, zv = cache[src]
        mlp = fit_scores(zc, cal.mlp(l).float(), zv, val.mlp(l).float(), cfg.rank_mlp, cfg.mlp_fractions,
                         REPORT_MLP_FRACTION, cfg)
        head = fit_scores(zc, cal.heads(l).float(), zv, val.heads(l).float(), cfg.rank_heads, cfg.head_fractions,
                          REPORT_HEAD_FRACTION, cfg)
        parts["mlp_a"].append(mlp.a)
        parts["mlp_b"].append(mlp.b)
        parts["head_a"].append(head.a)
        parts["head_b"].append(head.b)
        per_layer.append({"layer": l, "input_index": src, "recall_mlp": round(mlp.val_recall, 4),
                          "recall_heads": round(head.val_recall, 4), "mass_recall_mlp": round(mlp.mass_recall, 4),
                          "mass_recall_heads": round(head.mass_recall, 4), "recall_mlp_start": round(mlp.start_recall, 4),
                          "recall_heads_start": round(head.start_recall, 4), "epochs_mlp": mlp.epochs,
                          "epochs_heads": head.epochs})
        if progress:
            layers.set_postfix(recall_mlp=f"{mlp.val_recall:.3f}", recall_heads=f"{head.val_recall:.3f}")
    preds = LookaheadPredictors(parts["mlp_a"], parts["mlp_b"], parts["head_a"], parts["head_b"],
                                block_size=wd.config["block_size"], fingerprint=wd.config["model"]["fingerprint"])
    rm = [p["recall_mlp"] for p in per_layer]
    rh = [p["recall_heads"] for p in per_layer]
    pred_bytes = preds.num_bytes(2)
    dense_bytes = dense_layer_bytes(dims, 2) * L
    report = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "mlp_fraction": REPORT_MLP_FRACTION, "head_fraction": REPORT_HEAD_FRACTION,
        "kept_units": kept_count(REPORT_MLP_FRACTION, wd.config["num_units"]),
        "kept_heads": kept_count(REPORT_HEAD_FRACTION, dims["num_heads"]),
        "recall_mlp_mean": round(sum(rm) / L, 4), "recall_mlp_min": round(min(rm), 4),
        "recall_heads_mean": round(sum(rh) / L, 4), "recall_heads_min": round(min(rh), 4),
        "mass_recall_mlp_mean": round(sum(p["mass_recall_mlp"] for p in per_layer) / L, 4),
        "mass_recall_heads_mean": round(sum(p["mass_recall_heads"] for p in per_layer) / L, 4),
        "predictor_bytes_fp16": pred_bytes, "dense_layer_bytes_fp16": dense_bytes,
        "bytes_fraction": round(pred_bytes / dense_bytes, 5),
        "validation_tokens": wd.config["splits"]["validation"]["tokens"],
        "seconds": round(time.time() - t0, 1), "per_layer": per_layer,
    }
    preds.info = {k: report[k] for k in ("recall_mlp_mean", "recall_mlp_min", "recall_heads_mean",
                                         "recall_heads_min", "bytes_fraction")}
    return preds, report


def train_workdir(path, cfg: TrainConfig | None = None, progress: bool = True) -> dict:
    """Train on the work dir at `path` and write predictors.safetensors, predictors_report.json and
    the updated manifest (each file atomically). Returns the report."""
    from ..artifacts import atomic_write_json
    from ..calibrate.workdir import open_workdir, update_workdir_manifest
    from .model import PREDICTORS_FILE

    wd = open_workdir(path)
    wd.verify_records()
    preds, report = train_predictors(wd, cfg, progress=progress)
    preds.save(wd.path / PREDICTORS_FILE)
    atomic_write_json(wd.path / REPORT_FILE, report)
    update_workdir_manifest(wd, {"predictors": {k: v for k, v in report.items() if k != "per_layer"}})
    return report


REPORT_FILE = "predictors_report.json"
