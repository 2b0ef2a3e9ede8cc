"""`dejavu-trt build`, `generate` and `bench`: from a model to a running engine."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .app import HEAD_SPARSITY_HELP, MAX_PPL_HELP, SPARSITY_HELP, app

DEVICE_HELP = "auto (CUDA when torch sees a GPU, else the CPU reference), cuda or cpu."
OPS_HELP = ("Op backend on CUDA: auto (the kernel library when built, else torch), kernels, torch; "
            "reference is the op contract's torch reference.")


@app.command("build")
def build(
    model: str = typer.Argument(..., help="Model alias (see `dejavu-trt models`) or a local HF model folder."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help=SPARSITY_HELP),
    head_sparsity: Optional[float] = typer.Option(None, "--head-sparsity", help=HEAD_SPARSITY_HELP),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", help=MAX_PPL_HELP),
    dtype: str = typer.Option("fp16", "--dtype", help="Engine weight dtype: fp16, bf16 or fp32."),
    corpus: str = typer.Option("sotu", "--corpus", help="Calibration text: 'sotu' or a path to .txt/.md files."),
    tokens: int = typer.Option(8192, "--tokens", help="Calibration tokens (validation perplexity uses a quarter "
                                                      "of this, at least one window)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Engine package folder (default engines/NAME)."),
    max_context: int = typer.Option(2048, "--max-context", help="KV-cache length of the engine."),
    kv_policy: str = typer.Option("dense", "--kv-policy", help="dense: K/V of every head are computed (exact "
                                                              "history); active: only selected heads' (fewer bytes)."),
    seed: int = typer.Option(0, "--seed", help="Seed for predictor training."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Reuse a work dir from `dejavu-trt calibrate` + "
                                                                   "`train-predictors` instead of calibrating again."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
) -> None:
    """Run the whole pipeline: load -> calibrate -> predictors -> export -> rewrite -> package -> TensorRT plan."""
    from ..build.pipeline import BuildOptions, run_build

    opts = BuildOptions(model=model, sparsity=sparsity, head_sparsity=head_sparsity,
                        max_ppl_increase=max_ppl_increase, dtype=dtype, corpus=corpus, tokens=tokens, out=out,
                        max_context=max_context, kv_policy=kv_policy, seed=seed, progress=progress,
                        workdir=workdir)
    result = run_build(opts)
    for line in result.summary_lines():
        typer.echo(line)


@app.command("generate")
def generate(
    engine: Path = typer.Argument(..., help="Engine package folder written by `dejavu-trt build`."),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate (greedy)."),
    dense: bool = typer.Option(False, "--dense", help="Run every neuron and head (the baseline)."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    ops: str = typer.Option("auto", "--ops", help=OPS_HELP),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Override the engine's context length."),
    plan: bool = typer.Option(False, "--plan", help="Require the engine's TensorRT plan and its plugin library."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus metrics on this port."),
) -> None:
    """Stream a greedy continuation of --prompt to stdout."""
    from ..runtime.engine import Engine

    eng = Engine.load(engine, device=device, ops=ops, max_context=max_context, metrics_port=metrics_port, plan=plan)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()
    eng.generate(prompt, max_new_tokens, dense=dense, on_text=show)
    sys.stdout.write("\n")


@app.command("bench")
def bench(
    engine: Path = typer.Argument(..., help="Engine package folder written by `dejavu-trt build`."),
    batch: int = typer.Option(1, "--batch", help="Rows decoded together (1..16)."),
    steps: int = typer.Option(64, "--steps", help="Timed decode steps per mode."),
    warmup: int = typer.Option(8, "--warmup", help="Untimed decode steps before timing."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Prompt tokens (random ids) before decoding."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    gpu_hour_price: Optional[float] = typer.Option(None, "--gpu-hour-price", help="Price of one GPU-hour, for "
                                                                                  "the cost saved per million tokens."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    ops: str = typer.Option("auto", "--ops", help=OPS_HELP),
    side_stream: bool = typer.Option(True, "--side-stream/--same-stream", help="Predictors on a side CUDA stream."),
    cuda_graph: bool = typer.Option(True, "--cuda-graph/--no-cuda-graph", help="Replay the decode step as a CUDA graph."),
) -> None:
    """Time between tokens (p50/p99), tokens/s and GB/s, dense vs sparse in the same run, and the cost forecast."""
    from ..errors import DejaVuError
    from ..runtime.bench import bench_engine
    from ..runtime.engine import Engine

    if steps < 1 or warmup < 0 or prompt_len < 1:
        raise DejaVuError("--steps and --prompt-len must be at least 1 and --warmup at least 0")
    context = prompt_len + warmup + steps + 2
    eng = Engine.load(engine, device=device, ops=ops, max_context=context)
    if not 1 <= batch <= eng.config.max_batch:
        raise DejaVuError(f"--batch {batch} is outside 1..{eng.config.max_batch} (the engine's maximum)")
    res = bench_engine(eng.weights, batch=batch, steps=steps, warmup=warmup, prompt_len=prompt_len, ops=ops,
                       gpu_hour_price=gpu_hour_price, side_stream=side_stream, cuda_graph=cuda_graph)
    res["engine"] = str(engine)
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    _print_bench(res)


def step_variant_line(sparse: dict) -> str | None:
    """What batch 1's timed choice picked for the sparse step (GPU executor), or None when nothing was timed."""
    choice = sparse.get("step_choice")
    if not choice or "ms_per_step" not in choice:
        return None
    names = {"none": "mlp_norm unfolded", "mlp": "mlp_norm folded"}
    base, _, slack = choice["chosen"].partition("+")
    what = names.get(base, base) + (f", fused MLP grid {slack.removeprefix('slack')} SMs short" if slack else "")
    timed = ", ".join(f"{k} {v:.3f}" for k, v in choice["ms_per_step"].items())
    when = (f"timed earlier on this machine, from {choice['cached']}" if choice.get("cached")
            else "timed at the first decode step")
    line = f"sparse step: {what} ({when}, ms/step: {timed})"
    return line + (f"; {choice['reason']}" if choice.get("reason") else "")


def _print_bench(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("mode", "ops", "TBT p50 ms", "TBT p99 ms", "tokens/s", "MB/step", "GB/s",
              title=f"{res['engine']} on {res['device']} ({res['dtype']}, batch {res['batch']})")
    for m in (res["dense"], res["sparse"]):
        t.add_row(m["mode"], m["ops"], f"{m['tbt_ms_p50']:.3f}", f"{m['tbt_ms_p99']:.3f}", f"{m['tokens_per_s']:.1f}",
                  f"{m['bytes_per_step'] / 1e6:.1f}", f"{m['achieved_gb_s']:.1f}")
    c = Console()
    c.print(t)
    if res.get("copy_bandwidth_gb_s"):
        c.print(f"device copy bandwidth (read+write): {res['copy_bandwidth_gb_s']:.0f} GB/s")
    variant = step_variant_line(res["sparse"])
    if variant:
        c.print(variant)
    cost = res["cost"]
    unit = "GPU" if res["device"] != "cpu" else "device (CPU reference executor: not a GPU forecast)"
    c.print(f"speedup sparse vs dense: {res['speedup']:.2f}x; tokens/s per {unit}: dense "
            f"{cost['dense_tokens_per_s_per_gpu']:.1f}, sparse {cost['sparse_tokens_per_s_per_gpu']:.1f}")
    line = (f"{'GPU' if res['device'] != 'cpu' else 'device'}-hours per million tokens: dense {cost['dense_gpu_hours_per_mtok']:.3f}, sparse "
            f"{cost['sparse_gpu_hours_per_mtok']:.3f}, saved {cost['gpu_hours_saved_per_mtok']:.3f}")
    if "cost_saved_per_mtok" in cost:
        line += f" = {cost['cost_saved_per_mtok']:.2f} saved per million tokens at {cost['gpu_hour_price']:g} per hour"
    c.print(line)
