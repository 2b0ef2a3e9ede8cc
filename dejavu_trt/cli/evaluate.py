"""`dejavu-trt evaluate`: choose the sparsity, measure its cost in perplexity, write the report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .app import HEAD_SPARSITY_HELP, MAX_PPL_HELP, SPARSITY_HELP, app


@app.command("evaluate")
def evaluate(
    workdir: Path = typer.Argument(..., help="Work dir from `calibrate` + `train-predictors`."),
    text: Optional[str] = typer.Option(None, "--text", help="Text file or folder to evaluate on; default: the "
                                       "test windows of the corpus the work dir was calibrated on."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help=SPARSITY_HELP),
    head_sparsity: Optional[float] = typer.Option(None, "--head-sparsity", help=HEAD_SPARSITY_HELP),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", help=MAX_PPL_HELP),
    tokens: int = typer.Option(2048, "--tokens", help="Tokens of text to evaluate (whole windows of the work "
                               "dir's seq_len)."),
    budget_tokens: int = typer.Option(256, "--budget-tokens", help="Validation tokens the --max-ppl-increase "
                                      "search measures on."),
    path: str = typer.Option("batched", "--path", help="batched: full sequences, teacher forcing (fast); "
                             "decode: one token at a time through the KV cache (slow; the same up to top-k near-ties "
                             "that float noise flips)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as one JSON object."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars on stderr."),
) -> None:
    """Measure dense, predicted and oracle perplexity at the chosen sparsity, and per-layer recall.

    Writes the plan to DIR/sparsity.json (used by export/build) and the report to DIR/report.md and
    DIR/report.png. Without --sparsity/--head-sparsity/--max-ppl-increase it re-uses DIR/sparsity.json,
    or keeps half of the MLP neurons.
    """
    from ..sparsity.evaluation import run_evaluation

    r = run_evaluation(workdir, text, sparsity, head_sparsity, max_ppl_increase, tokens, budget_tokens, path,
                       progress=progress)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    typer.echo(f"plan: {r['plan_source']}  (mean kept: MLP {fmt(r['mlp_kept_fraction_mean'])}, "
               f"heads {fmt(r['head_kept_fraction_mean'])})")
    typer.echo(f"perplexity on {r['tokens']} tokens: dense {r['ppl_dense']:.3f}  predicted {r['ppl_sparse']:.3f} "
               f"({100 * r['ppl_increase_sparse']:+.2f}%)  oracle {r['ppl_oracle']:.3f} "
               f"({100 * r['ppl_increase_oracle']:+.2f}%)")
    typer.echo(f"recall: MLP {fmt(r['recall_mlp'])}  heads {fmt(r['recall_heads'])}")
    b = r["bytes_per_token"]
    typer.echo(f"layer bytes/token: {b['sparse_over_dense']:.3f} of dense (predictors "
               f"{100 * b['predictor_fraction']:.2f}%)")
    typer.echo(f"report: {Path(workdir) / 'report.md'}")
