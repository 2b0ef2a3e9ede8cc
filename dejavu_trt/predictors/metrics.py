"""Top-k recall: the fraction of the oracle's top-k units that the predictor's top-k also holds."""
from __future__ import annotations

import torch


def kept_count(fraction: float, units: int) -> int:
    """Units kept at a kept fraction (at least one), the same rounding everywhere."""
    return max(1, min(units, round(fraction * units)))


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [.., U] mask of each row's k largest scores."""
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, idx, True)


def topk_recall(pred_scores: torch.Tensor, activity: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row recall |top_k(pred) ∩ top_k(activity)| / k, shape [..]."""
    hit = topk_mask(activity, k)
    idx = pred_scores.topk(k, dim=-1).indices
    return hit.gather(-1, idx).float().mean(-1)


def mass_recall(pred_scores: torch.Tensor, activity: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row share of the oracle top-k's activity that the predicted top-k keeps (a softer view:
    swapping two near-equal units costs little here, but a full miss in `topk_recall`)."""
    kept = activity.gather(-1, pred_scores.topk(k, dim=-1).indices).sum(-1)
    best = activity.topk(k, dim=-1).values.sum(-1)
    return kept / best.clamp_min(1e-12)
