"""Top-k recall: the fraction of the oracle's top-k units that the predictor's top-k also holds."""
from __future__ import annotations

import torch


def kept_count(fraction: float, units: int) -> int:
    """Units kept at a kept fraction (at least one), the same rounding everywhere."""
    return max(1, min(units, round(fraction * units)))


def topk_recall(pred_scores: torch.Tensor, activity: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row recall |top_k(pred) ∩ top_k(activity)| / k, shape [..].

    Ties: a unit whose activity equals the k-th largest belongs to *some* oracle top-k set, so it
    counts as a hit, up to the number of places the oracle fills with tied units. This matters for
    ReLU models, where at 50% kept the oracle set is often filled up with exact zeros in arbitrary
    order; without it recall would punish picking a different zero.
    """
    kth = activity.topk(k, dim=-1).values[..., -1:]
    picked = activity.gather(-1, pred_scores.topk(k, dim=-1).indices)
    above = (picked > kth).sum(-1)
    tied = (picked == kth).sum(-1)
    tie_slots = k - (activity > kth).sum(-1)  # places the oracle set fills with tied units
    return (above + torch.minimum(tied, tie_slots)).float() / k


def mass_recall(pred_scores: torch.Tensor, activity: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row share of the oracle top-k's activity that the predicted top-k keeps (a softer view:
    swapping two near-equal units costs little here, but a full miss in `topk_recall`)."""
    kept = activity.gather(-1, pred_scores.topk(k, dim=-1).indices).sum(-1)
    best = activity.topk(k, dim=-1).values.sum(-1)
    return kept / best.clamp_min(1e-12)
