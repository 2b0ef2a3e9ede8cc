"""`dejavu-trt build`: load -> calibrate -> predictors -> sparsity -> evaluate -> export -> rewrite ->
package -> TensorRT plan, each stage cached by the hash of its inputs (build/stages.py).

Where things go, for NAME (the --out folder's name):

    work/NAME/     calibration records, predictors, sparsity.json, evaluation.json, stages.json
    export/NAME/   the decode-step ONNX and its rewritten form (plugin nodes with local functions)
    engines/NAME/  the engine package (runtime/package.py), the build report, the .plan if built
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..artifacts import atomic_write_json
from ..errors import DejaVuError, check_fraction
from ..ops.contract import KV_POLICIES
from .stages import StageLog

DEFAULT_SEQ_LEN = 256
PREDICTOR_RANK = 64


@dataclass
class BuildOptions:
    model: str
    sparsity: float | None = None
    head_sparsity: float | None = None
    max_ppl_increase: float | None = None
    dtype: str = "fp16"
    corpus: str = "sotu"
    tokens: int = 8192
    out: Path | None = None
    max_context: int = 2048
    kv_policy: str = "dense"
    seq_len: int = DEFAULT_SEQ_LEN
    seed: int = 0
    progress: bool = True
    root: Path = Path(".")            # where work/, export/ and engines/ live
    workdir: Path | None = None       # reuse a calibrated work dir with trained predictors


@dataclass
class BuildResult:
    name: str
    work: Path
    export_dir: Path
    onnx: Path | None
    rewritten: Path | None
    engine: Path
    report: Path
    plan: Path | None
    trt_note: str
    evaluation: dict
    figures: dict
    ran: list = field(default_factory=list)
    cached: list = field(default_factory=list)

    def summary_lines(self) -> list[str]:
        f, ev = self.figures, self.evaluation
        lines = [
            f"engine package: {self.engine}",
            f"build report:   {self.report}",
            f"rewritten ONNX: {self.rewritten if self.rewritten else '(not written: ' + f.get('export_note', '') + ')'}",
            f"work dir:       {self.work}",
            f"TensorRT plan:  {self.plan if self.plan else self.trt_note}",
            f"validation perplexity: dense {ev['dense_ppl']:.3f}, sparse {ev['sparse_ppl']:.3f} "
            f"({100 * (ev['sparse_ppl'] / ev['dense_ppl'] - 1):+.2f}%)",
            f"kept per token: MLP {100 * f['mlp_kept_mean']:.1f}% of neurons, attention {100 * f['heads_kept_mean']:.1f}% of heads",
            f"bytes per token: dense {f['dense_bytes'] / 1e6:.1f} MB, sparse {f['sparse_bytes'] / 1e6:.1f} MB "
            f"-> expected speedup {f['expected_speedup']:.2f}x (memory-bound decode)",
        ]
        if self.cached:
            lines.append(f"reused cached stages: {', '.join(self.cached)}")
        return lines


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name.lower()).strip("-") or "engine"


def _validate(opts: BuildOptions) -> None:
    check_fraction("--sparsity", opts.sparsity)
    check_fraction("--head-sparsity", opts.head_sparsity)
    if opts.max_ppl_increase is not None and opts.max_ppl_increase <= 0:
        raise DejaVuError(f"--max-ppl-increase must be a positive relative increase (0.05 = +5%), got {opts.max_ppl_increase}")
    if opts.sparsity is None and opts.max_ppl_increase is None:
        raise DejaVuError("give --sparsity S (fraction of MLP neurons kept) or --max-ppl-increase P")
    if opts.sparsity is not None and opts.max_ppl_increase is not None:
        raise DejaVuError("give either --sparsity or --max-ppl-increase, not both")
    if opts.dtype not in ("fp16", "bf16", "fp32"):
        raise DejaVuError(f"--dtype must be fp16, bf16 or fp32, got {opts.dtype!r}")
    if opts.tokens < opts.seq_len:
        raise DejaVuError(f"--tokens must be at least one window of {opts.seq_len} tokens, got {opts.tokens}")
    if opts.kv_policy not in KV_POLICIES:
        raise DejaVuError(f"--kv-policy must be one of {', '.join(KV_POLICIES)}, got {opts.kv_policy!r}")
    if opts.max_context < 2:
        raise DejaVuError(f"--max-context must be at least 2, got {opts.max_context}")


class _Model:
    """The model, loaded on first use (cached stages may never need it)."""

    def __init__(self, name: str):
        self.name, self._loaded = name, None

    def get(self):
        if self._loaded is None:
            from ..models.loading import load_model
            self._loaded = load_model(self.name, "fp32", "cpu")
        return self._loaded


def run_build(opts: BuildOptions, say=print) -> BuildResult:
    from ..models.loading import locate, model_fingerprint
    from ..models.registry import resolve

    _validate(opts)
    spec = resolve(opts.model)
    folder = locate(spec)                      # a missing model fails here, before any work
    fingerprint = model_fingerprint(folder) if (folder / "config.json").is_file() else spec.alias
    name = _slug(opts.out.name if opts.out else f"{spec.alias}-s{opts.sparsity or 'ppl' + str(opts.max_ppl_increase)}")
    root = Path(opts.root)
    engine_dir = Path(opts.out) if opts.out else root / "engines" / name
    work = root / "work" / name
    export_dir = root / "export" / name
    log = StageLog.open(work)
    model = _Model(opts.model)
    from . import steps

    if opts.workdir is not None:
        calib_dir, k = _reuse_workdir(Path(opts.workdir), fingerprint, say)
        predictors_file = calib_dir / steps.PREDICTORS_FILE
    else:
        calib_dir = work / "calibration"
        predictors_file = calib_dir / steps.PREDICTORS_FILE
        k = log.run("calibrate", {"model": fingerprint, "corpus": opts.corpus, "tokens": opts.tokens,
                                  "seq_len": opts.seq_len}, "", [calib_dir / "manifest.json"],
                    lambda: steps.calibrate(opts, calib_dir), say)
        k = log.run("predictors", {"rank": PREDICTOR_RANK, "seed": opts.seed}, k, [predictors_file],
                    lambda: steps.train_predictors(opts, calib_dir), say)
    plan_file = work / "sparsity.json"
    k = log.run("sparsity", {"sparsity": opts.sparsity, "head_sparsity": opts.head_sparsity,
                             "max_ppl_increase": opts.max_ppl_increase}, k, [plan_file],
                lambda: steps.choose_plan(opts, model, predictors_file, work), say)
    eval_file = work / "evaluation.json"
    k_eval = log.run("evaluate", {}, k, [eval_file],
                     lambda: steps.evaluate(opts, model, predictors_file, work, eval_file), say)
    onnx_file, rewritten_file = export_dir / steps.ONNX_FILE, export_dir / steps.REWRITTEN_FILE
    export_note = ""
    k_exp = log.run("export", {"max_context": opts.max_context}, k, [onnx_file],
                    lambda: steps.export(opts, model, calib_dir, export_dir), say)
    log.run("rewrite", {"kv_policy": opts.kv_policy}, k_exp, [rewritten_file],
            lambda: steps.rewrite(opts, onnx_file, rewritten_file, work, predictors_file), say)
    evaluation = json.loads(eval_file.read_text())
    figures = steps.figures(opts, model, work, evaluation, predictors_file)
    figures["export_note"] = export_note
    report_text = steps.report_markdown(opts, name, evaluation, figures)
    (work / "build_report.md").write_text(report_text)
    # The package and the plan are cheap next to the stages above and always reflect this run.
    plan_path, trt_note = steps.trt_plan(opts, rewritten_file, work, say)
    say("[package] writing the engine package")
    steps.package(opts, model, predictors_file, work, engine_dir, report_text, plan_path)
    report = engine_dir / steps.REPORT_FILE
    result = BuildResult(name, work, export_dir, onnx_file, rewritten_file, engine_dir, report,
                         engine_dir / plan_path.name if plan_path else None, trt_note, evaluation, figures,
                         log.ran, log.cached)
    atomic_write_json(work / "build_result.json", {"engine": str(engine_dir), "ran": log.ran, "cached": log.cached,
                                                   "seconds": log.seconds})
    return result


def _reuse_workdir(path: Path, fingerprint: str, say) -> tuple[Path, str]:
    """A work dir from `dejavu-trt calibrate` + `train-predictors`: its predictors' checksum keys the stages after."""
    from ..calibrate.workdir import open_workdir
    from . import steps
    wd = open_workdir(path)
    entry = wd.manifest.get("files", {}).get(steps.PREDICTORS_FILE)
    if entry is None:
        raise DejaVuError(f"--workdir {path} has no trained predictors; run `dejavu-trt train-predictors {path}` first")
    from ..artifacts import verify_files
    verify_files(path, wd.manifest, [steps.PREDICTORS_FILE])   # a changed predictors file is refused
    theirs = wd.config.get("model", {}).get("fingerprint")
    if theirs and theirs != fingerprint:
        raise DejaVuError(f"--workdir {path} was calibrated for another model ({wd.config['model'].get('alias')}); "
                          f"pass that model or calibrate this one")
    say(f"[calibrate, predictors] reusing {path}")
    return path, entry["sha256"][:20]
