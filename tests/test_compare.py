"""compare: polygraphy Comparator over ONNX Runtime and our runners; the polygraphy CLI sample."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
from polygraphy.comparator import Comparator, SimpleCompareFunc
from polygraphy.comparator.struct import RunResults

from dejavu_trt.compare import DecodeStepRunner, TorchDecodeRunner, merge_results
from dejavu_trt.compare.compare import decode_trajectory
from dejavu_trt.export import DecodeModel
from dejavu_trt.export.stage import export_decode
from dejavu_trt.export.testing import stand_in_predictors
from dejavu_trt.rewrite import rewrite

T = 32
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def opt_graphs(tiny_opt, tmp_path_factory):
    """Tiny OPT: dense graph, all-active rewrite, and a sparse rewrite (stand-in predictors)."""
    root = tmp_path_factory.mktemp("cmp")
    dense = export_decode(str(tiny_opt.folder), root / "opt", max_context=T, loaded=tiny_opt)
    pred = stand_in_predictors(tiny_opt.adapter.dims(), root / "pred.safetensors")
    full = rewrite(dense, root / "opt" / "all_active.onnx", predictors=pred, sparsity=1.0, head_sparsity=1.0)
    sparse = rewrite(dense, predictors=pred, sparsity=0.25, head_sparsity=0.5)
    return {"dense": dense, "all_active": full, "sparse": sparse, "pred": pred}


def test_cli_all_active_matches_dense(opt_graphs, cli):
    code, out, err = cli("compare", opt_graphs["dense"], opt_graphs["all_active"], "--json", "--steps", "6",
                         "--batch", "2")
    assert code == 0, err
    r = json.loads(out)
    assert r["passed"] and set(r["outputs"]) >= {"logits", "present_key.0", "present_value.3"}
    assert r["outputs"]["logits"]["rel_to_range"] < 1e-5
    assert abs(r["ppl_delta"]) < 1e-5 and r["ppl_a"] > 1


def test_cli_sparse_vs_dense_fails_with_stats(opt_graphs, cli):
    code, out, _ = cli("compare", opt_graphs["dense"], opt_graphs["sparse"], "--steps", "6")
    assert code == 1
    assert "logits" in out and "perplexity" in out and "FAILED" in out


def test_cli_sparse_rewrite_matches_torch_sparse_reference(opt_graphs, cli):
    """Acceptance: predicted sparsity, rewritten graph (ORT) vs the PyTorch sparse reference runner."""
    code, out, err = cli("compare", opt_graphs["sparse"], "torch-sparse", "--json", "--steps", "6", "--batch", "2")
    assert code == 0, err
    r = json.loads(out)
    assert r["b"] == "torch-sparse" and r["outputs"]["logits"]["rel_to_range"] < 1e-5
    assert all(o["passed"] for o in r["outputs"].values())


def test_executor_runner_plugs_into_comparator(opt_graphs, tiny_opt):
    """A step-function runner (how the CUDA executor plugs in) next to polygraphy's ORT runner; a
    deliberately wrong executor is caught."""
    dm = DecodeModel.from_adapter(tiny_opt.adapter, T)
    torch_runner = TorchDecodeRunner(dm, name="torch")
    ort_runner = OnnxrtRunner(SessionFromOnnx(str(opt_graphs["dense"]), providers=["CPUExecutionProvider"]))
    import torch
    tokens = torch.randint(100, 3000, (1, 5), generator=torch.Generator().manual_seed(0))
    with ort_runner:
        feeds, _, _ = decode_trajectory(ort_runner, dm.cfg, tokens, 4)

    def broken():
        good = torch_runner._make()
        return lambda feed: {k: (v * 1.001 if k == "logits" else v) for k, v in good(feed).items()}

    bad = DecodeStepRunner(broken, dm.cfg.num_layers, dm.cfg.cache_shape(1), name="broken-executor")
    results = Comparator.run([ort_runner, torch_runner], data_loader=feeds)
    # Runners can also be run one at a time and merged (RunResults.update() is broken in 0.53.6).
    merge_results(results, Comparator.run([bad], data_loader=feeds))
    assert isinstance(results, RunResults) and [n for n, _ in results.lst][-1] == "broken-executor"
    func = SimpleCompareFunc(atol=1e-4, rtol=1e-5)
    acc = Comparator.compare_accuracy(results, compare_func=func,
                                      comparisons=[(0, 1), (0, 2)])
    verdicts = {pair: all(bool(it["logits"]) for it in its) for pair, its in acc[0].items()}
    assert verdicts[(ort_runner.name, "torch")] is True
    assert verdicts[(ort_runner.name, "broken-executor")] is False


def test_compare_bad_inputs(opt_graphs, tmp_path, cli):
    junk = tmp_path / "junk.onnx"
    junk.write_text("hello")
    code, _, err = cli("compare", junk, opt_graphs["dense"])
    assert code == 2 and "not an ONNX model" in err
    code, _, err = cli("compare", "torch", "torch-sparse")
    assert code == 2 and "ONNX decode graph" in err
    code, _, err = cli("compare", opt_graphs["dense"], opt_graphs["sparse"], "--output", "nope")
    assert code == 2 and "unknown output" in err


def test_polygraphy_cli_sample(opt_graphs, tmp_path):
    """samples/polygraphy_compare/run.sh: polygraphy run --save-outputs / --load-outputs."""
    env = dict(os.environ, PYTHON=sys.executable, POLYGRAPHY=str(Path(sys.executable).parent / "polygraphy"),
               STEPS="3")
    script = REPO / "samples" / "polygraphy_compare" / "run.sh"
    ok = subprocess.run([str(script), str(opt_graphs["dense"]), str(opt_graphs["all_active"]), str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert (tmp_path / "dense_outputs.json").is_file() and "PASSED" in ok.stdout + ok.stderr
    # The sparse rewrite against the same saved inputs/outputs is outside tolerance.
    bad = subprocess.run([env["POLYGRAPHY"], "run", str(opt_graphs["sparse"]), "--onnxrt",
                          "--load-inputs", str(tmp_path / "inputs.json"),
                          "--load-outputs", str(tmp_path / "dense_outputs.json"), "--atol", "1e-4", "--rtol", "1e-5"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "FAILED" in bad.stdout + bad.stderr


def test_compare_plan_needs_tensorrt_and_the_plugin_library(opt_graphs, tmp_path, cli, monkeypatch):
    """A .plan endpoint states what it lacks before any work: TensorRT, then libdejavu_trt_plugins.so."""
    import types
    plan = tmp_path / "engine.plan"
    code, _, err = cli("compare", opt_graphs["dense"], plan)
    assert code == 2 and "does not exist" in err
    plan.write_bytes(b"not really a plan")
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` fails, as on every machine here
    code, _, err = cli("compare", opt_graphs["dense"], plan)
    assert code == 2 and "TensorRT is not installed" in err
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    library = tmp_path / "plugins.so"  # not built yet
    monkeypatch.setenv("DEJAVU_PLUGIN_LIBRARY", str(library))
    code, _, err = cli("compare", opt_graphs["dense"], plan)
    assert code == 2 and "libdejavu_trt_plugins.so" in err and "plugins.so" in err
    # With both present the plan becomes polygraphy's TensorRT runner, the plugin library loaded first, seen
    # with float32 I/O (the plan's caches are fp16/bf16).
    from polygraphy.backend.trt import TrtRunner
    from dejavu_trt.compare.compare import make_runner, open_endpoint
    from dejavu_trt.compare.runners import Float32IORunner
    library.write_bytes(b"")
    ep = open_endpoint(str(plan))
    runner = make_runner(ep, None, None)
    assert ep.is_plan and not ep.is_onnx and isinstance(runner, Float32IORunner)
    assert isinstance(runner.inner, TrtRunner) and runner.name == "trt:engine.plan"
    assert ep.plugin_library == library


def test_trt_plan_matches_onnxruntime(opt_graphs, tmp_path, cli):
    """The all-active rewrite built into a TensorRT plan with the plugin library, against ONNX Runtime."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it cannot be installed on this project's "
                                           "machines), so no .plan can be built or run")
    from types import SimpleNamespace
    from dejavu_trt.build.steps import trt_plan
    from dejavu_trt.runtime.package import plugin_library
    if plugin_library() is None:
        pytest.skip("libdejavu_trt_plugins.so is not built (python -m dejavu_trt.kernels.build --trt-include ...)")
    plan, _ = trt_plan(SimpleNamespace(dtype="fp16"), opt_graphs["all_active"], tmp_path, say=lambda _: None)
    code, out, err = cli("compare", opt_graphs["dense"], plan, "--json", "--steps", "4", "--rtol", "2e-2")
    assert code == 0, err
    assert json.loads(out)["outputs"]["logits"]["rel_to_range"] < 2e-2


def test_compare_runs_the_plans_fp16_onnx_copy(opt_graphs, tmp_path, cli):
    """The graph a .plan is built from (fp16 caches in and out) compares against the float32 graph: its
    runner is seen with float32 I/O, and what differs is the fp16 rounding."""
    import onnx
    from dejavu_trt.rewrite.plan_graph import typed_plan_graph
    typed = tmp_path / "decode.plan.onnx"
    onnx.save(typed_plan_graph(onnx.load(str(opt_graphs["all_active"])), "fp16"), str(typed))
    args = ("compare", opt_graphs["dense"], typed, "--json", "--steps", "6", "--batch", "2")
    code, out, err = cli(*args, "--rtol", "2e-2")
    assert code == 0, err
    r = json.loads(out)
    assert 1e-6 < r["outputs"]["logits"]["rel_to_range"] < 2e-2 and abs(r["ppl_delta"]) < 1e-2
    assert r["outputs"]["present_key.0"]["passed"]
    code, out, _ = cli(*args, "--rtol", "1e-6")     # the rounding is real: a float32 tolerance fails
    assert code == 1 and not json.loads(out)["passed"]
