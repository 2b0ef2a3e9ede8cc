"""The sparse reference model: exactness, agreement of its two paths, and the acceptance criteria.

Acceptance (issue 2), on the real SmolLM2-135M and its work dir's validation tokens: the predicted
model's perplexity increase is at most 1.5x the oracle's at 50% of MLP neurons kept (heads dense)
and at 6 of 9 heads kept (MLP dense); MLP recall >= 0.9 at 50% kept.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dejavu_trt.ops.reference import sparse_mlp, topk_sorted
from dejavu_trt.sparsity import SparseReference, SparsityPlan, evaluate_selection, token_nll_batched
from dejavu_trt.sparsity.budget import greedy_steps, head_ladder
from dejavu_trt.sparsity.evaluation import validation_windows
from dejavu_trt.sparsity.metrics import bytes_per_token, token_nll_decode
from dejavu_trt.sparsity.reference import topk_mask


def _open(workdir):
    from dejavu_trt.calibrate.workdir import open_workdir
    from dejavu_trt.predictors.model import LookaheadPredictors

    path = Path(getattr(workdir, "path", workdir))
    return open_workdir(path), LookaheadPredictors.load(path)


def _windows(wd, tokens):
    return validation_windows(wd, int(wd.config["seq_len"]), tokens)


# --- no model needed -------------------------------------------------------------------------------

def test_topk_mask_follows_the_contract_tie_rule():
    g = torch.Generator().manual_seed(0)
    for scores in (torch.randint(0, 4, (64, 37), generator=g).float(),    # many ties
                   torch.randn(64, 37, generator=g)):
        for k in (1, 11, 36, 37):
            mask = topk_mask(scores, k)
            for row, m in zip(scores, mask):
                assert torch.equal(torch.nonzero(m).flatten().to(torch.int32), topk_sorted(row, k))


def test_plan_counts_roundtrip_and_bounds(tmp_path):
    from dejavu_trt.errors import DejaVuError
    from dejavu_trt.models.adapters import ModelDims

    dims = ModelDims("llama", 3, 8, 12, 9, 3, 2, 10, 16, "silu_glu", "rmsnorm", 1e-5, 1e4, False)
    plan = SparsityPlan.from_fractions(dims, 0.5, 6 / 9)
    assert plan.mlp_kept_units == [6, 6, 6] and plan.heads_kept == [6, 6, 6]
    assert SparsityPlan.from_fractions(dims, 0.01, 0.01).heads_kept == [1, 1, 1]   # max(1, round(f*n))
    plan.save(tmp_path)
    again = SparsityPlan.load(tmp_path, dims)
    assert again.to_dict() == plan.to_dict()
    for bad in (0, 1.5, -1):
        with pytest.raises(DejaVuError, match=r"\(0, 1\]"):
            SparsityPlan.from_fractions(dims, bad)
    b = bytes_per_token(dims, plan, [10, 10, 10])
    assert b["sparse"] < b["dense"] and b["predictors"] == 3 * 10 * 2


def test_greedy_order_is_cheapest_first_and_convex():
    sens = {(0, "mlp"): [(3, 10, 0.5), (2, 20, 0.6), (1, 30, 3.0)],     # level 2 is cheap after level 1
            (1, "mlp"): [(3, 10, 0.05), (2, 20, 0.1), (1, 30, 0.2)],
            (0, "heads"): [(2, 5, -0.01)]}                              # noise below zero counts as free
    order = greedy_steps(sens)
    costs = [s.cost for s in order]
    assert costs == sorted(costs)
    assert (order[0].layer, order[0].kind) == (0, "heads")
    # layer 0's MLP: (10, .5) lies above the hull chord to (20, .6), so it is skipped in one step to 2 kept
    l0 = [s.kept for s in order if (s.layer, s.kind) == (0, "mlp")]
    assert l0 == [2, 1]
    assert head_ladder(9) == [8, 7, 6, 5] and head_ladder(4) == [3, 2] and head_ladder(1) == []


# --- tiny OPT (ReLU MLP, multi-head attention) --------------------------------------------------------

def test_all_kept_is_exactly_dense_opt(tiny_opt, tiny_opt_workdir):
    wd, preds = _open(tiny_opt_workdir)
    ids = _windows(wd, 128)[:1]
    dense_plan = SparsityPlan.dense(tiny_opt.dims, preds.block_size)
    with torch.inference_mode():
        ref = tiny_opt.model(input_ids=ids).logits
        for mode in ("predicted", "oracle"):
            with SparseReference(tiny_opt.adapter, dense_plan, mode, preds) as r:
                assert r._handles, "hooks must be installed even when every unit is kept"
                out = tiny_opt.model(input_ids=ids).logits
            assert torch.equal(out, ref), mode


def test_skipped_neurons_contribute_exactly_zero_opt(tiny_opt, tiny_opt_workdir):
    """The hooked MLP output equals the contract's DejaVuSparseMLP on the same selection."""
    wd, preds = _open(tiny_opt_workdir)
    ad, dims = tiny_opt.adapter, tiny_opt.dims
    ids = _windows(wd, 64)[:1, :32]
    plan = SparsityPlan.from_fractions(dims, 0.25, 0.5, preds.block_size)
    layer = 1
    seen = {}
    hooks = [ad.mlp_input_module(layer).register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0])),
             ad.mlp_down(layer).register_forward_hook(lambda m, a, out: seen.update(a=a[0], y=out))]
    try:
        with torch.inference_mode(), SparseReference(ad, plan, "predicted", preds):
            tiny_opt.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    w = ad.mlp_weights(layer)
    # (OPT flattens [B, T, d] to [B*T, d] before fc1; B = 1 here)
    x, a, y = (seen[k].reshape(ids.shape[1], -1) for k in ("x", "a", "y"))
    assert w.activation == "relu"
    for t in range(x.shape[0]):
        kept = torch.nonzero(a[t]).flatten()
        assert kept.numel() <= plan.mlp_kept_units[layer] * plan.block_size
        units = torch.unique(kept // plan.block_size).to(torch.int32)
        ref = sparse_mlp(x[t:t + 1], units, activation="relu", block_size=plan.block_size, w_up=w.w_up,
                         w_down_t=w.w_down_t, b_up=w.b_up, b_down=w.b_down)
        torch.testing.assert_close(y[t:t + 1], ref, rtol=1e-5, atol=1e-5)


def test_skipped_heads_contribute_exactly_zero_opt(tiny_opt, tiny_opt_workdir):
    wd, preds = _open(tiny_opt_workdir)
    ad, dims = tiny_opt.adapter, tiny_opt.dims
    ids = _windows(wd, 64)[:1, :32]
    plan = SparsityPlan.from_fractions(dims, 1.0, 0.5, preds.block_size)
    seen = {}
    h = ad.attn_out(2).register_forward_hook(lambda m, a, out: seen.update(o=a[0], y=out))
    try:
        with torch.inference_mode(), SparseReference(ad, plan, "oracle"):
            tiny_opt.model(input_ids=ids)
    finally:
        h.remove()
    o = seen["o"][0].view(ids.shape[1], dims.num_heads, dims.head_dim)
    alive = o.abs().amax(-1) > 0
    assert (alive.sum(-1) <= plan.heads_kept[2]).all()
    w = ad.attention_weights(2)
    expect = torch.einsum("thk,hkd->td", o * alive[..., None], w.w_o_t.view(dims.num_heads, dims.head_dim, -1)) + w.b_o
    torch.testing.assert_close(seen["y"][0], expect, rtol=1e-5, atol=1e-5)


def _check_paths_agree(loaded, ids, plan, preds, tol):
    """Decode (KV cache, one token at a time) vs batched (teacher forcing), predicted selection.

    Replaying the batched path's selections, the decode path must give the same NLL up to float
    noise (what dense decode vs dense batched also differ by). Choosing freely, float noise may
    flip a near-tie at the top-k boundary, so there the selections must agree almost everywhere.
    """
    fast = evaluate_selection(loaded.adapter, plan, "predicted", ids, preds, path="batched", log_masks=True)
    replay = evaluate_selection(loaded.adapter, plan, "predicted", ids, preds, path="decode", replay=fast.masks)
    torch.testing.assert_close(replay.nll, fast.nll, rtol=tol, atol=tol)
    free = evaluate_selection(loaded.adapter, plan, "predicted", ids, preds, path="decode", log_masks=True)
    kept = same = 0
    for key, rows in free.masks.items():
        a, b = torch.cat(fast.masks[key])[: ids.shape[1] - 1], torch.cat(rows)
        kept, same = kept + int(a.sum()), same + int((a & b).sum())
    assert same / kept >= 0.99, same / kept
    return fast, free


def test_batched_and_decode_paths_agree_opt(tiny_opt, tiny_opt_workdir):
    wd, preds = _open(tiny_opt_workdir)
    ids = _windows(wd, 128)[:1, :48]
    plan = SparsityPlan.from_fractions(tiny_opt.dims, 0.5, 0.75, preds.block_size)
    fast, free = _check_paths_agree(tiny_opt, ids, plan, preds, 1e-4)
    assert abs(free.stats.recall_mlp - fast.stats.recall_mlp) < 0.01
    oracle_fast = evaluate_selection(tiny_opt.adapter, plan, "oracle", ids, path="batched")
    oracle_slow = evaluate_selection(tiny_opt.adapter, plan, "oracle", ids, path="decode")
    torch.testing.assert_close(oracle_slow.nll, oracle_fast.nll, rtol=1e-4, atol=1e-4)


def test_oracle_beats_predicted_opt(tiny_opt, tiny_opt_workdir):
    """Hindsight (oracle) selection loses less than the predictors' selection, checked per part.

    The MLP oracle keeps the largest true activations, the best a selection can do, so it must beat the
    predictors. The head oracle is a proxy (the norm of each head's output contribution), so it only has
    to come close. With both parts sparse they interact on this weak tiny model, and no order holds. One
    machine's tiny OPT gave oracle 376.9 vs predicted 316.2 at 25% MLP / 50% heads (dense 267.6). The
    predictors, trained on dense activations, skip neurons that the pruned heads' errors excite; the
    oracle keeps them. Training the tiny OPT on another CPU gives another model."""
    wd, preds = _open(tiny_opt_workdir)
    ids = _windows(wd, 1024)

    def run(mlp, heads):
        plan = SparsityPlan.from_fractions(tiny_opt.dims, mlp, heads, preds.block_size)
        return (evaluate_selection(tiny_opt.adapter, plan, "predicted", ids, preds),
                evaluate_selection(tiny_opt.adapter, plan, "oracle", ids))

    everything = SparsityPlan.from_fractions(tiny_opt.dims, 1.0, 1.0, preds.block_size)
    dense = evaluate_selection(tiny_opt.adapter, everything, "dense", ids)
    pred, oracle = run(0.25, 1.0)
    assert dense.ppl < oracle.ppl <= pred.ppl
    pred, oracle = run(1.0, 0.5)
    assert dense.ppl < oracle.ppl <= 1.05 * pred.ppl
    pred, oracle = run(0.25, 0.5)
    assert dense.ppl < min(oracle.ppl, pred.ppl)
    assert 0 < pred.stats.recall_mlp <= 1 and 0 < pred.stats.recall_heads <= 1
    assert all(r is not None for r in pred.stats.recall_mlp_per_layer)


# --- the real SmolLM2-135M ------------------------------------------------------------------------------

@pytest.mark.slow
def test_batched_and_decode_paths_agree_smollm2(smollm2, smollm2_workdir):
    wd, preds = _open(smollm2_workdir)
    ids = _windows(wd, 256)[:1, :16]
    plan = SparsityPlan.from_fractions(smollm2.dims, 0.5, 6 / 9, preds.block_size)
    _check_paths_agree(smollm2, ids, plan, preds, 2e-3)


@pytest.fixture(scope="module")
def smollm2_acceptance(smollm2, smollm2_workdir):
    """Dense, predicted and oracle perplexity on 2048 validation tokens, per acceptance case (cached)."""
    wd, preds = _open(smollm2_workdir)
    ids = _windows(wd, 2048)
    dims = smollm2.dims
    dense = evaluate_selection(smollm2.adapter, SparsityPlan.dense(dims, preds.block_size), "dense", ids)
    cache = {}

    def run(case):
        if case not in cache:
            s, h = {"mlp 50%": (0.5, 1.0), "heads 6/9": (1.0, 6 / 9)}[case]
            plan = SparsityPlan.from_fractions(dims, s, h, preds.block_size)
            pred = evaluate_selection(smollm2.adapter, plan, "predicted", ids, preds)
            oracle = evaluate_selection(smollm2.adapter, plan, "oracle", ids)
            cache[case] = dict(dense=dense.ppl, pred=pred.ppl, oracle=oracle.ppl, inc_pred=pred.ppl / dense.ppl - 1,
                               inc_oracle=oracle.ppl / dense.ppl - 1, recall_mlp=pred.stats.recall_mlp,
                               recall_heads=pred.stats.recall_heads)
            print(case, cache[case])
        return cache[case]
    return run


_MLP_TARGET_NOT_MET = (
    "issue 2 target not reached: the low-rank lookahead MLP predictors reach ~0.68 recall at 50% kept on "
    "SmolLM2, and predicted ppl rises ~+93% against the oracle's ~+4% (measured 2026-12-02 on 2048 "
    "validation tokens). No lookahead predictor tried gets near 0.9, even at 25-60x the byte budget "
    "(benchmarks/probe_mlp_predictor_capacity.py: best per layer 0.70-0.78); the reference itself agrees with the contract ops")


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param("mlp 50%", marks=pytest.mark.xfail(strict=True, reason=_MLP_TARGET_NOT_MET)),
                                  "heads 6/9"])
def test_acceptance_predicted_vs_oracle_smollm2(smollm2_acceptance, case):
    """Issue 2 acceptance on validation text: predicted ppl increase <= 1.5x the oracle's, at the
    same kept counts (50% of MLP neurons with heads dense; 6 of 9 heads with the MLP dense)."""
    r = smollm2_acceptance(case)
    assert 0 < r["inc_oracle"] and r["oracle"] <= r["pred"], r
    assert r["inc_pred"] <= 1.5 * r["inc_oracle"], r


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=_MLP_TARGET_NOT_MET)
def test_acceptance_mlp_recall_smollm2(smollm2_acceptance):
    """Issue 2 acceptance: MLP recall >= 0.9 at 50% kept, measured inside the sparse model."""
    r = smollm2_acceptance("mlp 50%")
    assert r["recall_mlp"] >= 0.9, r
