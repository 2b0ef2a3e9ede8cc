"""The work of each build stage; each calls the module that owns that stage.

calibrate/predictors: dejavu_trt.calibrate, dejavu_trt.predictors; sparsity/evaluate:
dejavu_trt.sparsity; export/rewrite: dejavu_trt.export, dejavu_trt.rewrite; package: runtime/package.py;
plan: polygraphy's TensorRT loaders when `tensorrt` imports.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..artifacts import atomic_write_json, load_safetensors
from ..errors import DejaVuError

PREDICTORS_FILE = "predictors.safetensors"
ONNX_FILE = "decode.onnx"
REWRITTEN_FILE = "decode.sparse.onnx"
REPORT_FILE = "BUILD_REPORT.md"
PLAN_FILE = "engine.plan"
VALIDATION_SHARE = 0.25


class StageUnavailable(DejaVuError):
    """A stage's module is not part of this installation."""


# --- calibrate / predictors ----------------------------------------------------------------------

def calibrate(opts, out: Path) -> None:
    from ..calibrate import calibrate as run
    run(opts.model, opts.corpus, opts.tokens, out, seq_len=opts.seq_len, block_size=1, dtype="fp32",
        device="cpu", progress=opts.progress)


def train_predictors(opts, workdir: Path) -> None:
    from ..predictors.training import TrainConfig, train_workdir
    from .pipeline import PREDICTOR_RANK
    train_workdir(workdir, TrainConfig(rank_mlp=PREDICTOR_RANK, seed=opts.seed), progress=opts.progress)


def load_predictor_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors, _ = load_safetensors(path)
    return tensors


class TensorScorer:
    """Predictor scores straight from the tensors (the contract's `predictor_scores`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t = tensors

    def mlp_scores(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        from ..ops.reference import predictor_scores
        return predictor_scores(h, self.t[f"layers.{layer}.mlp_a"].to(h.dtype), self.t[f"layers.{layer}.mlp_b"].to(h.dtype))

    def head_scores(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        from ..ops.reference import predictor_scores
        return predictor_scores(h, self.t[f"layers.{layer}.head_a"].to(h.dtype), self.t[f"layers.{layer}.head_b"].to(h.dtype))


# --- sparsity plan and evaluation ----------------------------------------------------------------

def validation_windows(opts, tokenizer) -> torch.Tensor:
    from ..data.corpus import load_documents, split_windows, take_tokens, tokenize_documents
    windows = split_windows(tokenize_documents(load_documents(opts.corpus), tokenizer), opts.seq_len)
    n = max(opts.seq_len, int(opts.tokens * VALIDATION_SHARE))
    return take_tokens(windows["validation"], n, "validation", opts.corpus)


def choose_plan(opts, model, predictors_file: Path, work: Path) -> None:
    from ..sparsity.plan import SparsityPlan
    lm = model.get()
    if opts.max_ppl_increase is None:
        plan = SparsityPlan.from_fractions(lm.dims, opts.sparsity, opts.head_sparsity)
    else:
        from ..sparsity.budget import search_budget
        plan = search_budget(lm.adapter, TensorScorer(load_predictor_tensors(predictors_file)),
                             validation_windows(opts, lm.tokenizer), opts.max_ppl_increase, progress=opts.progress)
    plan.save(work)


def evaluate(opts, model, predictors_file: Path, work: Path, out: Path) -> None:
    """Validation perplexity, dense vs sparse (the sparse reference, predicted selection)."""
    from ..sparsity.metrics import evaluate_selection
    from ..sparsity.plan import SparsityPlan
    lm = model.get()
    plan = SparsityPlan.load(work, lm.dims)
    windows = validation_windows(opts, lm.tokenizer)
    scorer = TensorScorer(load_predictor_tensors(predictors_file))
    dense = evaluate_selection(lm.adapter, plan, "dense", windows, progress=opts.progress)
    sparse = evaluate_selection(lm.adapter, plan, "predicted", windows, predictors=scorer, progress=opts.progress)
    atomic_write_json(out, {"dense_ppl": dense.ppl, "sparse_ppl": sparse.ppl, "tokens": dense.tokens,
                            "recall_mlp": sparse.stats.recall_mlp, "recall_heads": sparse.stats.recall_heads,
                            "recall_mlp_per_layer": sparse.stats.recall_mlp_per_layer})


# --- export / rewrite ------------------------------------------------------------------------------

def export(opts, model, calib_dir: Path, export_dir: Path) -> None:
    from ..export.stage import export_decode
    export_decode(calib_dir, export_dir, max_context=opts.max_context, loaded=model.get())


def rewrite(opts, onnx_file: Path, out: Path, work: Path, predictors_file: Path) -> None:
    from ..rewrite.rewrite import rewrite as run
    run(onnx_file, out, workdir=work, predictors=predictors_file, kv_policy=opts.kv_policy)


# --- figures, report, package, plan ------------------------------------------------------------------

def figures(opts, model, work: Path, evaluation: dict, predictors_file: Path) -> dict:
    from ..runtime.costs import expected_speedup, step_bytes
    from ..sparsity.plan import SparsityPlan
    plan_d = json.loads((work / "sparsity.json").read_text())
    dims = model.get().dims
    plan = SparsityPlan.from_dict(plan_d, dims)
    t = load_predictor_tensors(predictors_file)
    rank = (t["layers.0.mlp_a"].shape[1], t["layers.0.head_a"].shape[1])
    ctx = min(opts.max_context, 512)
    dense = step_bytes(dims, dtype=opts.dtype, context=ctx)
    sparse = step_bytes(dims, dtype=opts.dtype, mlp_kept_units=plan.mlp_kept_units, heads_kept=plan.heads_kept,
                        block_size=plan.block_size, kv_policy=opts.kv_policy, context=ctx, predictor_rank=rank)
    return {"dims": dims.to_dict(), "mlp_kept_units": plan.mlp_kept_units, "heads_kept": plan.heads_kept,
            "block_size": plan.block_size, "mlp_fractions": plan.mlp_fractions, "head_fractions": plan.head_fractions,
            "mlp_kept_mean": sum(plan.mlp_fractions) / plan.num_layers,
            "heads_kept_mean": sum(plan.head_fractions) / plan.num_layers,
            "dense_bytes": dense.total, "sparse_bytes": sparse.total, "bytes_context": ctx,
            "expected_speedup": expected_speedup(dense, sparse), "plan_source": plan.source}


def report_markdown(opts, name: str, ev: dict, f: dict) -> str:
    rows = "\n".join(f"| {i} | {k} | {100 * mf:.1f}% | {h} | {100 * hf:.1f}% | "
                     f"{'' if r is None else f'{r:.3f}'} |"
                     for i, (k, mf, h, hf, r) in enumerate(zip(f["mlp_kept_units"], f["mlp_fractions"], f["heads_kept"],
                                                               f["head_fractions"],
                                                               ev.get("recall_mlp_per_layer") or [None] * len(f["mlp_kept_units"]))))
    inc = 100 * (ev["sparse_ppl"] / ev["dense_ppl"] - 1)
    return f"""# Build report: {name}

Model `{opts.model}`, engine dtype {opts.dtype}, corpus `{opts.corpus}` ({opts.tokens} calibration tokens,
windows of {opts.seq_len}), plan: {f['plan_source']}, KV policy `{opts.kv_policy}`, context {opts.max_context}.

## Accuracy (validation split, {ev['tokens']} predicted tokens)

| | perplexity |
|---|---|
| dense | {ev['dense_ppl']:.3f} |
| sparse (predicted selection) | {ev['sparse_ppl']:.3f} ({inc:+.2f}%) |

Predictor recall of the true top-K MLP units: {_fmt(ev.get('recall_mlp'))}; of heads: {_fmt(ev.get('recall_heads'))}.

## Bytes read per decode token (batch 1, context {f['bytes_context']})

| | MB/token |
|---|---|
| dense | {f['dense_bytes'] / 1e6:.2f} |
| sparse | {f['sparse_bytes'] / 1e6:.2f} |

Expected speedup of memory-bound decoding: **{f['expected_speedup']:.2f}x** (bytes ratio; measure it with
`dejavu-trt bench`).

## Kept per layer

| layer | MLP units kept | fraction | heads kept | fraction | predictor recall (MLP) |
|---|---|---|---|---|---|
{rows}
"""


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def trt_plan(opts, rewritten: Path | None, work: Path, say) -> tuple[Path | None, str]:
    """Build the .plan with polygraphy when TensorRT imports; otherwise say so in one line."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        note = "not built: TensorRT is not installed here (`import tensorrt` fails); the CUDA executor runs the package"
        say(f"[plan] {note}")
        return None, note
    if rewritten is None:
        note = "not built: there is no rewritten ONNX graph to build it from"
        say(f"[plan] {note}")
        return None, note
    from ..runtime.package import missing_plugin_library_message, plugin_library
    lib = plugin_library()
    if lib is None:
        raise DejaVuError(missing_plugin_library_message("TensorRT is installed; building the .plan"))
    from .trt_engine import build_plan
    out = build_plan(rewritten, work / PLAN_FILE, dtype=opts.dtype, library=lib, work=work)
    return out, f"built {out.name}"


def package(opts, model, predictors_file: Path, work: Path, engine_dir: Path, report_text: str,
            plan_path: Path | None) -> None:
    from ..runtime.package import EngineConfig, write_engine_package
    from ..sparsity.plan import SparsityPlan
    lm = model.get()
    dims = lm.dims
    plan = SparsityPlan.load(work, dims)
    ev = json.loads((work / "evaluation.json").read_text())
    config = EngineConfig(model=lm.spec.alias, dims=dims.to_dict(), dtype=opts.dtype,
                          mlp_kept_units=plan.mlp_kept_units, heads_kept=plan.heads_kept, block_size=plan.block_size,
                          kv_policy=opts.kv_policy, max_context=min(opts.max_context, dims.max_position),
                          eos_token_id=lm.tokenizer.eos_token_id, bos_token_id=lm.tokenizer.bos_token_id,
                          build={"dense_ppl": ev["dense_ppl"], "sparse_ppl": ev["sparse_ppl"],
                                 "corpus": opts.corpus, "tokens": opts.tokens, "plan": plan.source})
    write_engine_package(engine_dir, adapter=lm.adapter, tokenizer=lm.tokenizer,
                         predictors=load_predictor_tensors(predictors_file), config=config, plan_file=plan_path,
                         extra_files={REPORT_FILE: report_text})
