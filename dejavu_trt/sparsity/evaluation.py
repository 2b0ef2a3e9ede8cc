"""`evaluate`: choose the sparsity plan, measure dense / predicted / oracle perplexity and recall, report.

Text evaluated: `--text FILE` (a file or folder, cut into windows of the work dir's seq_len), or,
without it, the *test* windows of the corpus the work dir was calibrated on. The budget search of
`--max-ppl-increase` runs on the work dir's *validation* tokens instead, so the chosen plan is
reported on text it was not tuned on.

Plan: `--max-ppl-increase P` (budget search), else `--sparsity`/`--head-sparsity` (missing one =
1.0), else the work dir's existing `sparsity.json`, else `--sparsity 0.5`. The plan used is written
to WORKDIR/sparsity.json; the report to WORKDIR/report.md and report.png. All inputs are checked
before any work, and every file is written only after all measurements succeeded.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import DejaVuError, check_fraction
from .metrics import PATHS, bytes_per_token, evaluate_selection
from .plan import PLAN_FILE, SparsityPlan

DEFAULT_SPARSITY = 0.5
DEFAULT_TOKENS = 2048
DEFAULT_BUDGET_TOKENS = 256
KV_POLICY = "dense"


def text_windows(text: str, tokenizer, seq_len: int, tokens: int) -> torch.Tensor:
    """The first ceil(tokens / seq_len) windows of a text file or folder (all of it, no split)."""
    from ..data.corpus import load_documents, take_tokens, tokenize_documents

    if not Path(text).expanduser().exists():
        raise DejaVuError(f"--text {text} does not exist; pass a text file or a folder of .txt/.md files")
    stream = tokenize_documents(load_documents(str(text)), tokenizer)
    n = stream.numel() // seq_len
    return take_tokens(stream[: n * seq_len].view(n, seq_len), tokens, "text", str(text))


def corpus_test_windows(corpus: str, tokenizer, seq_len: int, tokens: int) -> torch.Tensor:
    from ..data.corpus import load_documents, split_windows, take_tokens, tokenize_documents

    windows = split_windows(tokenize_documents(load_documents(corpus), tokenizer), seq_len)
    return take_tokens(windows["test"], tokens, "test", corpus)


def validation_windows(wd, seq_len: int, tokens: int) -> torch.Tensor:
    """The work dir's recorded validation tokens, as windows (what the budget search tunes on)."""
    stream = wd.records("validation").tokens().long()
    n = min(stream.numel() // seq_len, max(1, -(-tokens // seq_len)))
    if n < 1:
        raise DejaVuError(f"{wd.path} holds fewer than {seq_len} validation tokens; re-run calibrate with more --tokens")
    return stream[: n * seq_len].view(n, seq_len)


def check_options(sparsity, head_sparsity, max_ppl_increase, tokens: int, path: str) -> None:
    check_fraction("--sparsity", sparsity)
    check_fraction("--head-sparsity", head_sparsity)
    check_fraction("--max-ppl-increase", max_ppl_increase)
    if max_ppl_increase is not None and (sparsity is not None or head_sparsity is not None):
        raise DejaVuError("give either --max-ppl-increase or --sparsity/--head-sparsity, not both")
    if tokens < 2:
        raise DejaVuError(f"--tokens must be at least 2, got {tokens}")
    if path not in PATHS:
        raise DejaVuError(f"--path must be one of {', '.join(PATHS)}, got {path!r}")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def run_evaluation(workdir: str | Path, text: str | None = None, sparsity: float | None = None,
                   head_sparsity: float | None = None, max_ppl_increase: float | None = None,
                   tokens: int = DEFAULT_TOKENS, budget_tokens: int = DEFAULT_BUDGET_TOKENS,
                   path: str = "batched", batch_size: int = 4, progress: bool = True,
                   write: bool = True) -> dict:
    from ..calibrate.workdir import open_workdir, update_workdir_manifest
    from ..models.loading import load_model
    from ..predictors.model import LookaheadPredictors
    from ..report import write_report
    from .budget import search_budget

    check_options(sparsity, head_sparsity, max_ppl_increase, tokens, path)
    workdir = Path(workdir)
    wd = open_workdir(workdir)
    predictors = LookaheadPredictors.load(workdir)
    if text is not None and not Path(text).expanduser().exists():
        raise DejaVuError(f"--text {text} does not exist; pass a text file or a folder of .txt/.md files")
    cfg = wd.config
    seq_len, block_size = int(cfg["seq_len"]), int(cfg.get("block_size", 1))
    if predictors.block_size != block_size:
        raise DejaVuError(f"{workdir}: predictors use block size {predictors.block_size}, the work dir "
                          f"{block_size}; re-run train-predictors")

    loaded = load_model(cfg["model"]["folder"], dtype=cfg["model"].get("dtype", "fp32"))
    adapter, dims = loaded.adapter, loaded.dims
    if predictors.num_layers != dims.num_layers:
        raise DejaVuError(f"{workdir}: predictors cover {predictors.num_layers} layers, the model has "
                          f"{dims.num_layers}; re-run train-predictors")
    predictors = predictors.to(dtype=next(loaded.model.parameters()).dtype)
    loaded.model.eval()

    if text is not None:
        windows, text_desc = text_windows(text, loaded.tokenizer, seq_len, tokens), f"`{text}`"
    else:
        windows = corpus_test_windows(cfg["corpus"], loaded.tokenizer, seq_len, tokens)
        text_desc = f"test windows of corpus `{cfg['corpus']}`"

    if max_ppl_increase is not None:
        val = validation_windows(wd, seq_len, budget_tokens)
        plan = search_budget(adapter, predictors, val, max_ppl_increase, block_size, batch_size=batch_size,
                             progress=progress)
    elif sparsity is not None or head_sparsity is not None:
        plan = SparsityPlan.from_fractions(dims, sparsity, head_sparsity, block_size)
    elif (workdir / PLAN_FILE).is_file():
        plan = SparsityPlan.load(workdir, dims)
    else:
        plan = SparsityPlan.from_fractions(dims, DEFAULT_SPARSITY, None, block_size)

    kw = dict(path=path, batch_size=batch_size, progress=progress)
    dense = evaluate_selection(adapter, plan, "dense", windows, **kw)
    pred = evaluate_selection(adapter, plan, "predicted", windows, predictors, **kw)
    oracle = evaluate_selection(adapter, plan, "oracle", windows, **kw)

    pred_params = [sum(t[l].numel() for t in (predictors.mlp_a, predictors.mlp_b, predictors.head_a,
                                                predictors.head_b)) for l in range(dims.num_layers)]
    nbytes = bytes_per_token(dims, plan, pred_params)
    result = {
        "model": loaded.spec.alias if cfg["model"].get("alias") is None else cfg["model"]["alias"],
        "workdir": str(workdir), "text": text_desc, "tokens": dense.tokens, "seq_len": int(windows.shape[1]),
        "path": path, "kv_policy": KV_POLICY, "block_size": block_size,
        "plan_source": plan.source, "num_units": plan.num_units, "num_heads": plan.num_heads,
        "ppl_dense": dense.ppl, "ppl_sparse": pred.ppl, "ppl_oracle": oracle.ppl,
        "ppl_increase_sparse": pred.ppl / dense.ppl - 1, "ppl_increase_oracle": oracle.ppl / dense.ppl - 1,
        "recall_mlp": pred.stats.recall_mlp, "recall_heads": pred.stats.recall_heads,
        "recall_mlp_per_layer": pred.stats.recall_mlp_per_layer,
        "recall_heads_per_layer": pred.stats.recall_heads_per_layer,
        "mlp_kept_units": plan.mlp_kept_units, "heads_kept": plan.heads_kept,
        "mlp_kept_fraction": plan.mlp_fractions, "head_kept_fraction": plan.head_fractions,
        "mlp_kept_fraction_mean": _mean(plan.mlp_fractions), "head_kept_fraction_mean": _mean(plan.head_fractions),
        "bytes_per_token": nbytes, "predictor_bytes_fraction": nbytes["predictor_fraction"],
    }
    if "budget" in plan.extra:
        result["budget"] = plan.extra["budget"]
    for key in ("ppl_dense", "ppl_sparse", "ppl_oracle"):
        if not math.isfinite(result[key]):
            raise DejaVuError(f"{key} is not finite ({result[key]}); the model or the text is unusable")
    if write:
        plan.save(workdir)
        write_report(result, workdir)
        update_workdir_manifest(wd, {})
    return result
