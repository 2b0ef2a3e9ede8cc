"""The quality report of `evaluate`: WORKDIR/report.md plus report.png (recall and kept fraction per layer).

Both files are written atomically; the PNG is drawn with matplotlib's Agg backend (no display).
"""
from __future__ import annotations

from pathlib import Path

from .artifacts import atomic_file, atomic_write_text

REPORT_MD = "report.md"
REPORT_PNG = "report.png"


def _fmt(x, digits=3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:+.2f}%"


def render_markdown(r: dict) -> str:
    b = r["bytes_per_token"]
    lines = [
        "# dejavu-trt quality report",
        "",
        f"* model: `{r['model']}`; work dir: `{r['workdir']}`",
        f"* text: {r['text']} — {r['tokens']} tokens in windows of {r['seq_len']} ({r['path']} path)",
        f"* sparsity plan: {r['plan_source']} (block size {r['block_size']}); written to `sparsity.json`",
        f"* KV policy of the reference: `{r['kv_policy']}` (K/V projections computed for every head)",
        "",
        "| selection | perplexity | increase over dense |",
        "|---|---|---|",
        f"| dense | {_fmt(r['ppl_dense'])} | |",
        f"| predicted (lookahead predictors) | {_fmt(r['ppl_sparse'])} | {_pct(r['ppl_increase_sparse'])} |",
        f"| oracle (hindsight top-k, same kept counts) | {_fmt(r['ppl_oracle'])} | {_pct(r['ppl_increase_oracle'])} |",
        "",
        f"* recall of predicted vs. oracle units (|pred ∩ oracle| / k, over sparse layers): "
        f"MLP {_fmt(r['recall_mlp'])}, heads {_fmt(r['recall_heads'])}",
        f"* mean kept fraction: MLP {_fmt(r['mlp_kept_fraction_mean'])}, heads {_fmt(r['head_kept_fraction_mean'])}",
        f"* decoder-layer weight bytes per token ({b['dtype_bytes']}-byte weights): dense {b['dense']:,}, "
        f"sparse {b['sparse']:,} including predictors ({_fmt(b['sparse_over_dense'])} of dense)",
        f"* predictors' bytes: {b['predictors']:,} = **{100 * b['predictor_fraction']:.2f}%** of the dense layer "
        f"bytes they decide about",
        "",
        f"![recall and kept fraction per layer]({REPORT_PNG})",
        "",
        "| layer | MLP kept | heads kept | MLP recall | head recall |",
        "|---|---|---|---|---|",
    ]
    for i, (mf, hk, rm, rh) in enumerate(zip(r["mlp_kept_fraction"], r["heads_kept"],
                                             r["recall_mlp_per_layer"], r["recall_heads_per_layer"])):
        lines.append(f"| {i} | {mf:.3f} | {hk}/{r['num_heads']} | {_fmt(rm)} | {_fmt(rh)} |")
    if r.get("budget"):
        bud = r["budget"]
        lines += ["", f"Budget search: {bud['steps_taken']} of {bud['steps_total']} greedy steps taken; "
                      f"measured increase {_pct(bud['measured_increase'])} on {bud['validation_tokens']} "
                      f"validation tokens (limit {_pct(bud['max_ppl_increase'])})."]
    return "\n".join(lines) + "\n"


def render_png(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers = list(range(len(r["mlp_kept_fraction"])))
    nan = float("nan")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(layers, [nan if x is None else x for x in r["recall_mlp_per_layer"]], "o-", label="MLP")
    ax1.plot(layers, [nan if x is None else x for x in r["recall_heads_per_layer"]], "s-", label="heads")
    ax1.set_ylabel("recall vs. oracle")
    ax1.set_ylim(0, 1.05)
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(layers, r["mlp_kept_fraction"], "o-", label="MLP")
    ax2.plot(layers, r["head_kept_fraction"], "s-", label="heads")
    ax2.set_ylabel("kept fraction")
    ax2.set_xlabel("layer")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylim(0, 1.05)
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{r['model']}: ppl dense {r['ppl_dense']:.2f}, predicted {r['ppl_sparse']:.2f}, "
                 f"oracle {r['ppl_oracle']:.2f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def write_report(r: dict, directory: str | Path) -> tuple[Path, Path]:
    """Write report.md and report.png into `directory` (each atomically; the PNG first)."""
    directory = Path(directory)
    png = directory / REPORT_PNG
    with atomic_file(png) as tmp:
        render_png(r, tmp)
    md = directory / REPORT_MD
    atomic_write_text(md, render_markdown(r))
    return md, png
