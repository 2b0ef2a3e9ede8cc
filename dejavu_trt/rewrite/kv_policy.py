"""Measure the KV policies for skipped heads (docs/ops.md `kv_policy`) by decode-style perplexity.

    python -m dejavu_trt.rewrite.kv_policy WORKDIR [--heads-kept 6] [--sparsity 1.0] [--tokens 128] [--rows 2]

Runs the canonical decode module one token at a time with the work dir's trained predictors:
dense, then predicted heads under `kv_policy = dense` (K/V of every KV head always computed and
cached) and under `active` (K/V only for KV heads a selected query head reads; the others' slots
keep stale zeros). The numbers are recorded in docs/export.md and chose DEFAULT_KV_POLICY.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
from tqdm import tqdm

from ..export.module import DecodeModel, SparsePlan
from ..ops.contract import KV_POLICIES


def decode_ppl(model: DecodeModel, tokens: torch.Tensor, plan: SparsePlan | None, progress: bool = False) -> float:
    """Perplexity of tokens [R, S], decoding each row alone (B = 1: no batch union of the selections)."""
    nll = []
    for row in tokens:
        cache = model.new_cache(1)
        for t in tqdm(range(row.numel() - 1), disable=not progress, desc="decode", leave=False):
            logits = model.step(row[t:t + 1], torch.tensor([t], dtype=torch.int32), cache, plan)
            nll.append(-torch.log_softmax(logits[0].double(), -1)[row[t + 1]])
    return math.exp(torch.stack(nll).mean().item())


def measure(loaded, predictors: dict, tokens: torch.Tensor, heads_kept: int, mlp_kept: int,
            progress: bool = True) -> dict:
    dm = DecodeModel.from_adapter(loaded.adapter, tokens.shape[1])
    L = dm.cfg.num_layers
    out = {"tokens": int(tokens.numel() - tokens.shape[0]), "heads_kept": heads_kept, "mlp_kept": mlp_kept,
           "ppl_dense": decode_ppl(dm, tokens, None, progress)}
    for policy in KV_POLICIES:
        plan = SparsePlan(predictors, [mlp_kept] * L, [heads_kept] * L, 1, policy)
        out[f"ppl_{policy}"] = decode_ppl(dm, tokens, plan, progress)
        out[f"increase_{policy}"] = out[f"ppl_{policy}"] / out["ppl_dense"] - 1
    return out


def main(argv=None) -> None:
    from ..compare.compare import eval_tokens
    from ..models import load_model
    from ..export.stage import model_of_workdir
    from .rewrite import load_predictors

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("--heads-kept", type=int, default=6)
    ap.add_argument("--sparsity", type=float, default=1.0, help="MLP kept fraction (1.0: MLP dense)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per row")
    ap.add_argument("--rows", type=int, default=2)
    args = ap.parse_args(argv)
    name, _ = model_of_workdir(args.workdir)
    lm = load_model(name)
    pred = load_predictors(args.workdir)
    pred.pop("__block_size__")
    n = lm.adapter.dims().intermediate_size
    tokens = eval_tokens(lm.tokenizer, None, args.rows, args.tokens)
    r = measure(lm, pred, tokens, args.heads_kept, max(1, round(args.sparsity * n)))
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
