"""`dejavu-trt calibrate` and `dejavu-trt train-predictors`."""
from __future__ import annotations

from pathlib import Path

import typer

from .app import app


@app.command("calibrate")
def calibrate_cmd(
    model: str = typer.Argument(..., help="Model alias (see `dejavu-trt models`) or a local HF folder."),
    corpus: str = typer.Option("sotu", "--corpus", help="'sotu' or a path to a text file / folder of .txt/.md files."),
    tokens: int = typer.Option(16384, "--tokens", help="Calibration tokens to record (plus a quarter as many "
                                                       "validation tokens for early stopping and reports)."),
    out: Path = typer.Option(..., "--out", help="Work dir to write (replaced atomically if it is an earlier work dir)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per window."),
    block_size: int = typer.Option(1, "--block-size", help="Neurons per selectable MLP unit (1 = single neurons)."),
    batch_windows: int = typer.Option(4, "--batch-windows", help="Windows per forward pass (bounds memory)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, fp16 or bf16."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda."),
) -> None:
    """Run MODEL over corpus windows and record, per layer, the input hidden states, MLP activity per
    unit and head importance into a work dir."""
    from ..calibrate import calibrate

    wd = calibrate(model, corpus, tokens, out, seq_len=seq_len, block_size=block_size,
                   batch_windows=batch_windows, dtype=dtype, device=device, progress=True)
    s = wd.config["splits"]
    typer.echo(f"wrote {wd.path}: {s['calibration']['tokens']} calibration + {s['validation']['tokens']} "
               f"validation tokens, {wd.dims['num_layers']} layers")


@app.command("train-predictors")
def train_predictors_cmd(
    workdir: Path = typer.Argument(..., help="Work dir written by `dejavu-trt calibrate`."),
    rank_mlp: int = typer.Option(None, "--rank-mlp", help="Rank of each layer's MLP-unit predictor (default 64); more rank, more recall and bytes."),
    rank_heads: int = typer.Option(None, "--rank-heads", help="Rank of each layer's head predictor (default 16, at most the head count)."),
    epochs: int = typer.Option(None, "--epochs", help="Max fine-tuning epochs (early-stopped on validation "
                                                     "recall; default 0 = closed-form fit only, the ridge strength chosen by validation recall)."),
    json_out: bool = typer.Option(False, "--json", help="Print the training report as JSON."),
) -> None:
    """Train the lookahead predictors on a work dir's records; writes predictors.safetensors and
    predictors_report.json and updates the manifest."""
    import json

    from ..errors import DejaVuError
    from ..predictors.training import TrainConfig, train_workdir

    cfg = TrainConfig()
    for name, value in (("--rank-mlp", rank_mlp), ("--rank-heads", rank_heads), ("--epochs", epochs)):
        if value is not None and (value < 0 or (value == 0 and name != "--epochs")):
            raise DejaVuError(f"{name} must be {'>= 0' if name == '--epochs' else 'positive'}, got {value}")
    cfg.rank_mlp = rank_mlp or cfg.rank_mlp
    cfg.rank_heads = rank_heads or cfg.rank_heads
    cfg.epochs = cfg.epochs if epochs is None else epochs
    report = train_workdir(workdir, cfg, progress=True)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(format_report(report))


def format_report(report: dict) -> str:
    lines = [f"{'layer':>5} {'recall_mlp@' + str(report['kept_units']):>16} {'recall_heads@' + str(report['kept_heads']):>16}"]
    for p in report["per_layer"]:
        lines.append(f"{p['layer']:>5} {p['recall_mlp']:>16.3f} {p['recall_heads']:>16.3f}")
    lines.append(f"MLP recall at {report['mlp_fraction']:.0%} kept: mean {report['recall_mlp_mean']:.3f}, "
                 f"min {report['recall_mlp_min']:.3f}; head recall at {report['kept_heads']} heads: mean "
                 f"{report['recall_heads_mean']:.3f}, min {report['recall_heads_min']:.3f}")
    lines.append(f"predictors: {report['predictor_bytes_fp16'] / 1e6:.2f} MB fp16 = {report['bytes_fraction']:.2%} "
                 f"of the dense MLP+attention bytes they decide about ({report['seconds']:.0f} s)")
    return "\n".join(lines)
