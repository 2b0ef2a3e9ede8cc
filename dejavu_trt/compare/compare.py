"""`compare(a, b)`: two decode-step executors on the same inputs, with polygraphy.

An endpoint is an ONNX file (run with ONNX Runtime on CPU through polygraphy's `OnnxrtRunner`),
a TensorRT `.plan` built from a rewritten graph (polygraphy's `TrtRunner`, with the plugin library
loaded; needs TensorRT, which cannot be installed on this project's machines), `torch` (the canonical
PyTorch decode module, dense) or `torch-sparse` (the same module with the lookahead predictors and the
sparse reference ops; its plan — predictors, kept counts, KV policy — is read from the rewritten
graph's metadata, or from --workdir and the fractions). One side must be an ONNX graph: it fixes the
model and the shapes.

1. A decodes `steps` tokens of held-out text with its own caches; each step's feed (token,
   position, caches) is recorded. That list is polygraphy's data loader: B receives exactly A's
   inputs (`Comparator.run`), and `Comparator.compare_accuracy` with `CompareFunc.simple` checks
   every output.
2. Each side also decodes the text on its own caches, for the end-to-end perplexity delta.

Tolerance: an element passes when |a - b| <= rtol * max|a| over that output (relative to the
output's range) or |a - b| <= rtol * |a|. Logits near zero make a plain element-wise relative
error meaningless, hence the range term.
"""
from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import DejaVuError
from ..export.config import DecodeConfig, io_names
from ..export.module import DecodeModel, SparsePlan
from .runners import Float32IORunner, TorchDecodeRunner

log = logging.getLogger(__name__)

TORCH_ENDPOINTS = ("torch", "torch-sparse")
PLAN_SUFFIX = ".plan"
DEFAULT_RTOL = 1e-5


@dataclass
class Endpoint:
    spec: str
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    plugin_library: Path | None = None  # a .plan's TensorRT plugin library

    @property
    def is_plan(self) -> bool:
        return self.path is not None and self.path.suffix == PLAN_SUFFIX

    @property
    def is_onnx(self) -> bool:
        return self.path is not None and not self.is_plan


def open_plan(spec: str) -> Endpoint:
    """A TensorRT plan: check everything running it needs before any work starts."""
    from ..runtime.package import missing_plugin_library_message, plugin_library

    path = Path(spec)
    if not path.is_file():
        raise DejaVuError(f"{path} does not exist")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise DejaVuError(f"{path} is a TensorRT plan, and TensorRT is not installed here (`import tensorrt` "
                          f"fails); compare the rewritten ONNX graph instead: ONNX Runtime runs its plugin nodes "
                          f"through their local functions") from None
    lib = plugin_library()
    if lib is None:
        raise DejaVuError(missing_plugin_library_message(str(path)))
    return Endpoint(spec, path, plugin_library=lib)


def open_endpoint(spec: str) -> Endpoint:
    if spec in TORCH_ENDPOINTS:
        return Endpoint(spec)
    if spec.endswith(PLAN_SUFFIX):
        return open_plan(spec)
    from ..rewrite.rewrite import graph_metadata, load_onnx

    path = Path(spec)
    proto = load_onnx(path, load_weights=False)
    return Endpoint(spec, path, graph_metadata(proto, path))


def merge_results(into, other):
    """Merge polygraphy RunResults. RunResults.update() raises TypeError in polygraphy 0.53.6
    (it indexes its list of (runner, results) pairs by name), so extend the list instead."""
    into.lst.extend(other.lst)
    return into


def eval_tokens(tokenizer, text: str | None, rows: int, length: int) -> torch.Tensor:
    """[rows, length] token ids: consecutive windows of --text, or of the newest SOTU address.

    Calibration reads the corpus from its start, so the last address is held out in practice; it
    is tokenized alone to keep a comparison's start-up short.
    """
    from ..data.corpus import load_documents

    if text is not None:
        p = Path(text)
        if not p.is_file():
            raise DejaVuError(f"--text {text} does not exist")
        body = p.read_text(encoding="utf-8", errors="replace")
    else:
        body = load_documents("sotu")[-1].text
    stream = torch.tensor(tokenizer(body, add_special_tokens=False)["input_ids"], dtype=torch.long)
    windows = stream[: (stream.numel() // length) * length].view(-1, length)
    if windows.shape[0] < rows:
        raise DejaVuError(f"the text has {windows.shape[0]} windows of {length} tokens, {rows} needed: pass a longer "
                          f"--text or fewer --steps/--batch")
    return windows[:rows]


def _plan_from(endpoints: list[Endpoint], cfg: DecodeConfig, workdir, sparsity, head_sparsity, kv_policy) -> SparsePlan:
    from ..rewrite.rewrite import check_predictors, kept_counts, load_predictors

    rw = next((json.loads(e.meta["rewrite"]) for e in endpoints if e.is_onnx and "rewrite" in e.meta), None)
    source = workdir or (rw or {}).get("predictors")
    if source is None:
        raise DejaVuError("torch-sparse needs predictors: compare against a rewritten graph or pass --workdir")
    pred = load_predictors(source)
    bs = int(pred.pop("__block_size__"))
    check_predictors(pred, cfg, bs)
    if rw is not None and sparsity is None and head_sparsity is None:
        mlp, heads, policy = rw["mlp_kept_units"], rw["heads_kept"], kv_policy or rw["kv_policy"]
    else:
        kept = kept_counts(cfg, Path(workdir) if workdir else None, sparsity, head_sparsity, bs)
        mlp, heads, policy = kept.mlp, kept.heads, kv_policy or "dense"
    return SparsePlan(pred, mlp, heads, bs, policy)


def make_runner(ep: Endpoint, model: DecodeModel | None, plan: SparsePlan | None):
    if ep.is_plan:
        from polygraphy.backend.common import BytesFromPath
        from polygraphy.backend.trt import EngineFromBytes, LoadPlugins, TrtRunner
        # The plugin creators must be registered before the engine is deserialised.
        engine = EngineFromBytes(LoadPlugins(plugins=[str(ep.plugin_library)], obj=BytesFromPath(str(ep.path))))
        return Float32IORunner(TrtRunner(engine, name=f"trt:{ep.path.name}"))
    if ep.is_onnx:
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
        # float32 I/O also for the .plan's typed ONNX copy, whose caches are fp16
        return Float32IORunner(OnnxrtRunner(SessionFromOnnx(str(ep.path), providers=["CPUExecutionProvider"]),
                                            name=f"onnxrt:{ep.path.name}"))
    return TorchDecodeRunner(model, plan if ep.spec == "torch-sparse" else None, name=ep.spec)


def _zero_caches(cfg: DecodeConfig, batch: int) -> dict:
    shape = cfg.cache_shape(batch)
    return {n: np.zeros(shape, np.float32) for n in io_names(cfg.num_layers)["inputs"][2:]}


def decode_trajectory(runner, cfg: DecodeConfig, tokens: torch.Tensor, steps: int):
    """Teacher-forced decode of tokens[:, :steps] on the runner's own caches.

    Returns (feeds, outputs, nll): the feed of every step, its outputs, and the mean next-token NLL.
    """
    names = io_names(cfg.num_layers)
    B = tokens.shape[0]
    caches = _zero_caches(cfg, B)
    feeds, outputs, nll = [], [], []
    for t in range(steps):
        feed = OrderedDict(input_ids=tokens[:, t].numpy().astype(np.int64), position=np.full(B, t, np.int32), **caches)
        out = runner.infer(feed)
        feeds.append(feed)
        outputs.append(OrderedDict((k, np.array(v)) for k, v in out.items()))
        logp = torch.log_softmax(torch.from_numpy(np.asarray(out["logits"])).double(), -1)
        nll.append(-logp[torch.arange(B), tokens[:, t + 1]].mean().item())
        caches = {n.replace("present_", "past_"): np.asarray(out[n]) for n in names["outputs"][1:]}
    return feeds, outputs, float(np.mean(nll))


def compare(a: str, b: str, *, workdir: str | Path | None = None, text: str | None = None, steps: int = 16,
            batch: int = 1, rtol: float = DEFAULT_RTOL, outputs: list[str] | None = None,
            sparsity: float | None = None, head_sparsity: float | None = None, kv_policy: str | None = None,
            max_ppl_delta: float | None = None, model=None, verbose: bool = False) -> dict:
    """Compare endpoint A (reference) with B; returns the report dict (report["passed"])."""
    from polygraphy.logger import G_LOGGER

    old = G_LOGGER.module_severity
    if not verbose:  # polygraphy prints histograms per output and iteration; our report summarises them
        G_LOGGER.module_severity = G_LOGGER.CRITICAL
    try:
        return _compare(a, b, workdir=workdir, text=text, steps=steps, batch=batch, rtol=rtol, outputs=outputs,
                        sparsity=sparsity, head_sparsity=head_sparsity, kv_policy=kv_policy,
                        max_ppl_delta=max_ppl_delta, model=model)
    finally:
        G_LOGGER.module_severity = old


def _compare(a, b, *, workdir, text, steps, batch, rtol, outputs, sparsity, head_sparsity, kv_policy,
             max_ppl_delta, model) -> dict:
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.comparator.struct import RunResults

    from ..models import load_model

    eps = [open_endpoint(a), open_endpoint(b)]
    graphs = [e for e in eps if e.is_onnx]
    if not graphs:
        raise DejaVuError("at least one of A and B must be an ONNX decode graph (it fixes the model and the context)")
    cfgs = {DecodeConfig.from_json(e.meta["config"]) for e in graphs}
    models = {e.meta.get("model") for e in graphs}
    if len(cfgs) > 1 or len(models) > 1:
        raise DejaVuError(f"{a} and {b} are graphs of different models or shapes; compare graphs of one export")
    cfg, model_name = cfgs.pop(), models.pop()
    steps = min(steps, cfg.max_context - 1)
    lm = model if model is not None else load_model(model_name)
    dm = DecodeModel.from_adapter(lm.adapter, cfg.max_context, cfg.num_layers) \
        if any(e.spec in TORCH_ENDPOINTS for e in eps) else None
    plan = _plan_from(eps, cfg, workdir, sparsity, head_sparsity, kv_policy) if "torch-sparse" in (a, b) else None
    tokens = eval_tokens(lm.tokenizer, text, batch, steps + 1)

    ra, rb = make_runner(eps[0], dm, plan), make_runner(eps[1], dm, plan)
    with ra:
        feeds, outs_a, nll_a = decode_trajectory(ra, cfg, tokens, steps)
    results = RunResults()
    results.add(outs_a, runner_name=ra.name)
    merge_results(results, Comparator.run([rb], data_loader=feeds))
    with rb:
        _, _, nll_b = decode_trajectory(rb, cfg, tokens, steps)

    names = outputs or list(outs_a[0].keys())
    unknown = [n for n in names if n not in outs_a[0]]
    if unknown:
        raise DejaVuError(f"unknown output(s) {', '.join(unknown)}; the graph's outputs are logits, present_key.i, "
                          f"present_value.i")
    scale = {n: float(max(np.abs(o[n]).max() for o in outs_a)) for n in names}
    atol = {n: rtol * s for n, s in scale.items()}
    func = SimpleCompareFunc(rtol={n: rtol for n in names}, atol=atol, check_error_stat="elemwise",
                              find_output_func=lambda name, idx, res: [name] if name in names else [])
    acc = Comparator.compare_accuracy(results, compare_func=func)
    per_iter = list(acc[0].values())[0]       # one compare func, one runner pair
    report_outputs = {}
    for n in names:
        rs = [it[n] for it in per_iter if n in it]
        max_abs = float(max(r.max_absdiff for r in rs))
        report_outputs[n] = {
            "max_absdiff": max_abs, "mean_absdiff": float(np.mean([r.mean_absdiff for r in rs])),
            "median_absdiff": float(np.median([r.median_absdiff for r in rs])),
            "max_reldiff": float(max(r.max_reldiff for r in rs)),
            "rel_to_range": max_abs / scale[n] if scale[n] else max_abs, "range": scale[n],
            "passed": bool(all(bool(r) for r in rs)),
        }
    ppl_a, ppl_b = math.exp(nll_a), math.exp(nll_b)
    ppl_delta = ppl_b / ppl_a - 1.0
    passed = all(o["passed"] for o in report_outputs.values())
    if max_ppl_delta is not None and abs(ppl_delta) > max_ppl_delta:
        passed = False
    return {"a": ra.name, "b": rb.name, "model": model_name, "steps": steps, "batch": batch, "rtol": rtol,
            "max_ppl_delta": max_ppl_delta, "kv_policy": plan.kv_policy if plan else None,
            "outputs": report_outputs, "ppl_a": ppl_a, "ppl_b": ppl_b, "ppl_delta": ppl_delta,
            "worst_output": max(report_outputs, key=lambda n: report_outputs[n]["rel_to_range"]),
            "passed": passed}
