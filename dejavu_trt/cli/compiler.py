"""`dejavu-trt export | rewrite | compare`: the ONNX compiler stages."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from .app import HEAD_SPARSITY_HELP, SPARSITY_HELP, app

KV_POLICY_HELP = ("K/V projections of KV heads no selected query head reads: dense = always computed and "
                  "cached (default, most accurate), active = skipped (their cache slots stay stale).")


@app.command("export")
def export_cmd(
    source: str = typer.Argument(..., help="Work dir from `calibrate` (its model is exported), or a model alias/folder."),
    out: Path = typer.Option(..., "--out", help="Export directory, e.g. export/NAME (decode.onnx + manifest.json)."),
    max_context: int = typer.Option(512, "--max-context", help="KV-cache length T fixed in the graph."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Export only the first N layers (tests and "
                                         "debugging only: the logits are then not the model's)."),
) -> None:
    """Export the dense decode step (one token per row, KV cache of fixed length) to ONNX."""
    from ..export.stage import export_decode

    path = export_decode(source, out, max_context=max_context, num_layers=layers)
    typer.echo(f"decode graph: {path}")


@app.command("rewrite")
def rewrite_cmd(
    onnx_path: Path = typer.Argument(..., help="Dense decode graph written by `export` (export/NAME/decode.onnx)."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Work dir with trained predictors and sparsity.json; "
                                           "default: the one the graph was exported from."),
    predictors: Optional[Path] = typer.Option(None, "--predictors", help="A predictors.safetensors file "
                                              "instead of the work dir's."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help=SPARSITY_HELP + " Default: sparsity.json."),
    head_sparsity: Optional[float] = typer.Option(None, "--head-sparsity", help=HEAD_SPARSITY_HELP),
    kv_policy: str = typer.Option("dense", "--kv-policy", help=KV_POLICY_HELP),  # == rewrite.DEFAULT_KV_POLICY
    out: Optional[Path] = typer.Option(None, "--out", help="Output file; default decode.sparse.onnx next to the input."),
) -> None:
    """Replace each layer's MLP and attention with dejavu_trt plugin nodes and add the lookahead predictors."""
    from ..rewrite import rewrite

    path = rewrite(onnx_path, out, workdir=workdir, predictors=predictors, sparsity=sparsity,
                   head_sparsity=head_sparsity, kv_policy=kv_policy)
    typer.echo(f"rewritten graph: {path}")


@app.command("plan-graph")
def plan_graph_cmd(
    onnx_path: Path = typer.Argument(..., help="Rewritten graph written by `rewrite` (decode.sparse.onnx)."),
    dtype: str = typer.Option("fp16", "--dtype", help="Build dtype of the plugins' weights and caches: fp16 or bf16."),
    plugin_namespace: Optional[str] = typer.Option(None, "--plugin-namespace", help="Value of the nodes' "
                                                   "plugin_namespace attribute (default: the contract's, dejavu_trt)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output file; default decode.plan.onnx next to the input."),
) -> None:
    """Write the graph a TensorRT plan is built from: plugin weights and KV caches in fp16/bf16, Casts at the
    plugin boundaries (`build` does this itself when TensorRT is installed; use this to build elsewhere)."""
    from ..rewrite.plan_graph import PLAN_GRAPH_FILE, write_plan_graph

    out = out or onnx_path.with_name(PLAN_GRAPH_FILE)
    n = write_plan_graph(onnx_path, out, dtype, plugin_namespace)
    typer.echo(f"plan graph: {out} ({n} plugin nodes, {dtype})")


@app.command("compare")
def compare_cmd(
    a: str = typer.Argument(..., help="Reference: an ONNX decode graph, a TensorRT .plan (needs TensorRT), `torch` "
                            "or `torch-sparse`. A or B must be an ONNX graph."),
    b: str = typer.Argument(..., help="Compared: an ONNX decode graph, a TensorRT .plan (needs TensorRT), `torch` "
                            "or `torch-sparse`."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Predictors/sparsity for torch-sparse (default: "
                                           "those recorded in the rewritten graph)."),
    text: Optional[str] = typer.Option(None, "--text", help="Text file to decode; default: the newest SOTU address."),
    steps: int = typer.Option(16, "--steps", help="Decode steps (tokens per row)."),
    batch: int = typer.Option(1, "--batch", help="Rows decoded together."),
    rtol: float = typer.Option(1e-5, "--rtol", help="Tolerance, relative to each output's range (and element-wise)."),
    output: Optional[List[str]] = typer.Option(None, "--output", help="Compare only these outputs (repeatable)."),
    max_ppl_delta: Optional[float] = typer.Option(None, "--max-ppl-delta", help="Also fail when |ppl_b/ppl_a - 1| "
                                                  "exceeds this."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help=SPARSITY_HELP + " (torch-sparse only)"),
    head_sparsity: Optional[float] = typer.Option(None, "--head-sparsity", help=HEAD_SPARSITY_HELP),
    kv_policy: Optional[str] = typer.Option(None, "--kv-policy", help=KV_POLICY_HELP + " (torch-sparse only)"),
    verbose: bool = typer.Option(False, "--verbose", help="Show polygraphy's own per-output log."),
) -> None:
    """Run A and B on the same inputs with polygraphy; exit 1 when outside tolerance."""
    from ..compare import compare

    if steps < 1 or batch < 1:
        from ..errors import DejaVuError
        raise DejaVuError("--steps and --batch must be at least 1")
    r = compare(a, b, workdir=workdir, text=text, steps=steps, batch=batch, rtol=rtol, outputs=output,
                sparsity=sparsity, head_sparsity=head_sparsity, kv_policy=kv_policy, max_ppl_delta=max_ppl_delta,
                verbose=verbose)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
    else:
        typer.echo(f"{r['a']} vs {r['b']}: {r['steps']} steps x {r['batch']} rows, tolerance {r['rtol']:g} of range")
        caches = [n for n in r["outputs"] if n != "logits"]
        for n in (["logits"] if "logits" in r["outputs"] else []) + ([r["worst_output"]] if r["worst_output"] in caches else []):
            o = r["outputs"][n]
            typer.echo(f"  {n:>18}: max|diff| {o['max_absdiff']:.3g}  mean {o['mean_absdiff']:.3g}  "
                       f"rel-to-range {o['rel_to_range']:.3g}  {'ok' if o['passed'] else 'FAIL'}")
        if caches:
            typer.echo(f"  {len(caches)} cache outputs: {sum(r['outputs'][n]['passed'] for n in caches)} within tolerance")
        typer.echo(f"  perplexity: {r['ppl_a']:.4f} -> {r['ppl_b']:.4f} ({100 * r['ppl_delta']:+.4f}%)")
        typer.echo("PASSED" if r["passed"] else "FAILED")
    if not r["passed"]:
        raise typer.Exit(1)
