"""`--max-ppl-increase P`: per-layer kept fractions within a perplexity budget, fewest bytes moved.

Algorithm (greedy on measured sensitivities, then a measured check), all with *predicted*
selection on a small validation slice:

1. Sensitivity. For every layer and kind (MLP, heads) and every level of a short ladder (MLP kept
   fractions 0.75 / 0.5 / 0.375 / 0.25; heads: up to 4 counts between H-1 and H/2), sparsify that
   one layer/kind alone and measure the increase of log-perplexity over dense:
   `num_layers * (len(mlp ladder) + len(head ladder))` forward passes over the slice.
2. Greedy order. Per layer/kind, take the lower convex hull of (bytes saved, log-ppl increase)
   so that each further step costs at least as much per byte as the one before; merge all steps
   of all layers/kinds by that cost (log-ppl per byte saved), cheapest first.
3. Check. Assuming the order is right (not that the increases add up), binary-search the longest
   prefix of the greedy order whose *measured* relative perplexity increase is within P
   (about log2(number of steps) more forward passes). Dense always qualifies, so a plan is always
   found; P too small for any step gives the dense plan.

Cost on 2 CPU cores: SmolLM2-135M (30 layers, 8 levels) with the default 256-token slice is 240 +
~8 short forward passes, measured 236 s; at P = 0.05 it took 28 of 130 steps (measured +1.6%, 0.845
of the dense layer bytes incl. predictors). The slice is small, so the result is tuned to it;
`evaluate` then reports the chosen plan on separate text.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..errors import DejaVuError
from ..models.adapters import FamilyAdapter
from .metrics import token_nll_batched
from .plan import SparsityPlan, kept_count
from .reference import Scorer, SparseReference

MLP_LADDER = (0.75, 0.5, 0.375, 0.25)


def head_ladder(num_heads: int, levels: int = 4) -> list[int]:
    """Kept-head counts to try: up to `levels` counts spread between H-1 and ceil(H/2)."""
    hi, lo = num_heads - 1, max(1, -(-num_heads // 2))
    if hi < lo:
        return []
    n = min(levels, hi - lo + 1)
    return sorted({round(hi - i * (hi - lo) / max(n - 1, 1)) for i in range(n)}, reverse=True)


@dataclass
class Step:
    layer: int
    kind: str          # "mlp" | "heads"
    kept: int          # the kept count after this step
    cost: float        # log-ppl increase per element saved (the greedy key)


def _mean_nll(adapter, plan, predictors, windows, batch_size) -> float:
    with SparseReference(adapter, plan, "predicted", predictors, record=False):
        nll = token_nll_batched(adapter.model, windows, batch_size)
    return float(nll.double().mean())


def _lower_hull(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Lower convex hull of (saved, delta, kept) points sorted by `saved` (monotone chain)."""
    hull: list[tuple[float, float, int]] = []
    for p in points:
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:   # hull[-1] is not below the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def greedy_steps(sensitivity: dict[tuple[int, str], list[tuple[int, float, float]]]) -> list[Step]:
    """Merge every layer/kind's hull steps, cheapest log-ppl per saved element first.

    `sensitivity[(layer, kind)]` = [(kept, elements_saved, delta_logppl), ...] for the ladder levels.
    """
    per_unit = []
    for (layer, kind), levels in sensitivity.items():
        pts = [(0.0, 0.0, -1)]
        worst = 0.0
        for kept, saved, delta in sorted(levels, key=lambda t: t[1]):
            worst = max(worst, delta)          # more sparsity never counts as helping (noise)
            pts.append((float(saved), worst, kept))
        hull = _lower_hull(pts)
        steps = [Step(layer, kind, b[2], (b[1] - a[1]) / (b[0] - a[0])) for a, b in zip(hull, hull[1:])]
        per_unit.append(steps)
    # Hull steps have non-decreasing cost within a unit, so a heap merge keeps each unit's order.
    heap = [(s[0].cost, n, 0) for n, s in enumerate(per_unit) if s]
    heapq.heapify(heap)
    order = []
    while heap:
        _, n, j = heapq.heappop(heap)
        order.append(per_unit[n][j])
        if j + 1 < len(per_unit[n]):
            heapq.heappush(heap, (per_unit[n][j + 1].cost, n, j + 1))
    return order


def apply_steps(base: SparsityPlan, steps: list[Step]) -> SparsityPlan:
    mlp, heads = list(base.mlp_kept_units), list(base.heads_kept)
    for s in steps:
        (mlp if s.kind == "mlp" else heads)[s.layer] = s.kept
    return base.replace(mlp, heads)


def search_budget(adapter: FamilyAdapter, predictors: Scorer, windows: torch.Tensor, max_increase: float,
                  block_size: int = 1, mlp_ladder=MLP_LADDER, head_levels: int = 4, batch_size: int = 4,
                  progress: bool = False) -> SparsityPlan:
    """The plan with the fewest bytes (per the greedy order) whose measured ppl increase is ≤ max_increase."""
    if not max_increase > 0:
        raise DejaVuError(f"--max-ppl-increase must be a positive relative increase (0.05 = +5%), got {max_increase}")
    dims = adapter.dims()
    dense = SparsityPlan.dense(dims, block_size)
    d, hd = dims.hidden_size, dims.head_dim
    mats = 3 if dims.activation == "silu_glu" else 2
    mlp_levels = sorted({kept_count(f, dense.num_units) for f in mlp_ladder} - {dense.num_units}, reverse=True)
    heads_levels = head_ladder(dims.num_heads, head_levels)
    base = _mean_nll(adapter, dense, predictors, windows, batch_size)

    jobs = [(l, "mlp", k) for l in range(dims.num_layers) for k in mlp_levels] + \
           [(l, "heads", k) for l in range(dims.num_layers) for k in heads_levels]
    sens: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    for layer, kind, kept in tqdm(jobs, desc="budget: layer sensitivity", disable=not progress):
        plan = apply_steps(dense, [Step(layer, kind, kept, 0.0)])
        delta = _mean_nll(adapter, plan, predictors, windows, batch_size) - base
        saved = (mats * d * (dense.num_units - kept) * block_size if kind == "mlp"
                 else 2 * hd * d * (dims.num_heads - kept))
        sens.setdefault((layer, kind), []).append((kept, saved, delta))
    order = greedy_steps(sens)

    limit = math.log1p(max_increase)
    lo, hi = 0, len(order)            # invariant: prefix `lo` is within budget
    measured = {0: 0.0}
    bar = tqdm(total=max(1, math.ceil(math.log2(len(order) + 1))), desc="budget: check", disable=not progress)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        measured[mid] = _mean_nll(adapter, apply_steps(dense, order[:mid]), predictors, windows, batch_size) - base
        bar.update()
        if measured[mid] <= limit:
            lo = mid
        else:
            hi = mid - 1
    bar.close()
    plan = apply_steps(dense, order[:lo])
    plan.source = f"budget {max_increase:g}"
    plan.extra = {"budget": {"max_ppl_increase": max_increase, "validation_tokens": int(windows.numel()),
                             "measured_increase": math.expm1(measured[lo]), "steps_taken": lo,
                             "steps_total": len(order), "ppl_dense": math.exp(base),
                             "mlp_levels": mlp_levels, "head_levels": heads_levels, "selection": "predicted"}}
    return plan
