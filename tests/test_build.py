"""`dejavu-trt build` end to end on SmolLM2, its stage cache, and its input errors.

The end-to-end test reuses the session's calibrated SmolLM2 work dir (`--workdir`, the same stages
`build` would run itself) so that only build's own stages run here.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_rewrite import exports  # noqa: F401  (the tiny OPT export, rewritten)


@pytest.mark.parametrize("args, message", [
    (["opt-13b", "--sparsity", "0.5"], "not available locally"),
    (["./no/such/model", "--sparsity", "0.5"], "does not exist"),
    (["smollm2-135m"], "give --sparsity"),
    (["smollm2-135m", "--sparsity", "1.5"], "(0, 1]"),
    (["smollm2-135m", "--sparsity", "0.5", "--dtype", "int8"], "--dtype"),
    (["smollm2-135m", "--sparsity", "0.5", "--max-ppl-increase", "0.05"], "not both"),
])
def test_build_rejects_bad_input_before_any_work(cli, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("build", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists() and not (tmp_path / "engines").exists()


def test_stage_cache_resumes_and_reruns_on_change(tmp_path):
    from dejavu_trt.build.stages import StageLog
    calls = []
    out = tmp_path / "a.txt"

    def stage():
        calls.append(1)
        out.write_text("x")
    log = StageLog.open(tmp_path)
    k1 = log.run("s", {"p": 1}, "", [out], stage, say=lambda m: None)
    log = StageLog.open(tmp_path)               # a later run
    assert log.run("s", {"p": 1}, "", [out], stage, say=lambda m: None) == k1 and len(calls) == 1
    assert log.cached == ["s"]
    log.run("s", {"p": 2}, "", [out], stage, say=lambda m: None)   # changed input -> re-run
    assert len(calls) == 2
    out.unlink()                                  # missing output -> re-run
    log.run("s", {"p": 2}, "", [out], stage, say=lambda m: None)
    assert len(calls) == 3


def _reference_greedy(lm, plan, predictors, prompt_ids, n):
    """The PyTorch sparse reference: dense prefill, then predicted-sparse decode through HF's KV cache."""
    from transformers import DynamicCache

    from dejavu_trt.build.steps import TensorScorer
    from dejavu_trt.sparsity.reference import sparse_model
    cache = DynamicCache(config=lm.model.config)
    out = []
    with torch.no_grad():
        logits = lm.model(prompt_ids[None], cache=cache, use_cache=True).logits[0, -1]
        with sparse_model(lm.adapter, plan, "predicted", TensorScorer(predictors)):
            for _ in range(n):
                tok = int(logits.argmax())
                if tok == lm.tokenizer.eos_token_id:
                    break
                out.append(tok)
                logits = lm.model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    return out


@pytest.mark.slow
def test_build_then_generate_equals_sparse_reference(cli, tmp_path, monkeypatch, smollm2_workdir, smollm2):
    from dejavu_trt.artifacts import load_safetensors
    from dejavu_trt.sparsity.plan import SparsityPlan

    import shutil
    monkeypatch.chdir(tmp_path)
    # build reads only the work dir's manifest and predictors: copy those (the shared fixture is read-only).
    wd = tmp_path / "calibrated"
    wd.mkdir()
    for name in ("manifest.json", "predictors.safetensors"):
        shutil.copy2(smollm2_workdir / name, wd / name)
    args = ["build", "smollm2-135m", "--sparsity", "0.5", "--dtype", "fp32", "--workdir", wd,
            "--tokens", "1024", "--max-context", "128", "--no-progress", "--out", "engines/sm"]
    code, out, err = cli(*args)
    assert code == 0, err
    engine = tmp_path / "engines" / "sm"
    for line in ("engine package: engines/sm", "build report:", "rewritten ONNX: export/sm/decode.sparse.onnx",
                 "validation perplexity: dense", "expected speedup"):
        assert line in out
    assert "TensorRT" in out  # either the plan or the one line saying TensorRT is absent
    assert (tmp_path / "export" / "sm" / "decode.sparse.onnx").is_file()
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["op_contract_version"] == "1" and "weights.safetensors" in manifest["files"]
    assert manifest["config"]["mlp_kept_units"] == [768] * 30
    report = (engine / "BUILD_REPORT.md").read_text()
    assert "| dense |" in report and "Expected speedup" in report

    prompt = "The state of the union is"
    code, text, err = cli("generate", engine, "--prompt", prompt, "--max-new-tokens", "12")
    assert code == 0, err
    plan = SparsityPlan.load(tmp_path / "work" / "sm", smollm2.dims)
    predictors, _ = load_safetensors(engine / "predictors.safetensors")
    ids = smollm2.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    ref_ids = _reference_greedy(smollm2, plan, predictors, ids, 12)
    assert text == smollm2.tokenizer.decode(ref_ids, skip_special_tokens=True) + "\n"
    dense_ref = _reference_greedy(smollm2, SparsityPlan.dense(smollm2.dims), predictors, ids, 12)
    code, dense_text, _ = cli("generate", engine, "--prompt", prompt, "--max-new-tokens", "12", "--dense")
    assert dense_text == smollm2.tokenizer.decode(dense_ref, skip_special_tokens=True) + "\n"

    code, out, err = cli(*args)                     # re-run: every cached stage is reused
    assert code == 0, err
    assert "reused cached stages: sparsity, evaluate, export, rewrite" in out


def _fake_tensorrt(monkeypatch, registered_namespace):
    """`import tensorrt` succeeds, its plugin registry holds our creators under `registered_namespace`
    (None: not at all), and polygraphy's TensorRT loaders only record how they were called. This checks our
    wiring of the .plan build; TensorRT itself cannot be installed on these machines."""
    import sys
    import types
    import polygraphy.backend.trt as pg_trt
    from dejavu_trt.ops.contract import OP_CONTRACT_VERSION, OP_NAMES

    import importlib.machinery
    trt = types.ModuleType("tensorrt")
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)   # torch's import probes ask for one
    creators = [] if registered_namespace is None else [
        types.SimpleNamespace(name=op, plugin_version=OP_CONTRACT_VERSION, plugin_namespace=registered_namespace)
        for op in OP_NAMES]

    class Registry:
        all_creators = creators

        def get_creator(self, name, version, ns):
            return next((c for c in creators if (c.name, c.plugin_version, c.plugin_namespace) == (name, version, ns)),
                        None)
    trt.get_plugin_registry = Registry
    trt.LayerType = types.SimpleNamespace(PLUGIN_V3="plugin_v3", MATRIX_MULTIPLY="matmul")
    trt.PreviewFeature = types.SimpleNamespace(ALIASED_PLUGIN_IO_10_03="aliased_plugin_io")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    calls = {}

    def recorder(name):
        def make(*args, **kwargs):
            calls[name] = (args, kwargs)

            def call():
                calls[name + "()"] = True
                if name == "SaveEngine":
                    Path(args[1]).write_bytes(b"plan")
            return call
        return make
    for name in ("NetworkFromOnnxPath", "LoadPlugins", "CreateConfig", "EngineFromNetwork", "SaveEngine",
                 "PostprocessNetwork"):
        monkeypatch.setattr(pg_trt, name, recorder(name))
    return trt, calls


def _plugin_libraries(tmp_path, monkeypatch):
    kernels = tmp_path / "libdejavu_kernels.so"
    kernels.write_bytes(b"")
    monkeypatch.delenv("DEJAVU_PLUGIN_LIBRARY", raising=False)
    monkeypatch.setenv("DEJAVU_KERNELS_LIB", str(kernels))
    return tmp_path / "libdejavu_trt_plugins.so"


def test_plan_build_needs_the_trt_plugin_library_and_its_creators(tmp_path, monkeypatch):
    from types import SimpleNamespace
    from dejavu_trt.build.steps import trt_plan
    from dejavu_trt.errors import DejaVuError
    _fake_tensorrt(monkeypatch, registered_namespace=None)
    plugins = _plugin_libraries(tmp_path, monkeypatch)
    opts = SimpleNamespace(dtype="fp16")
    # Only the kernels library: no plugin creators for TensorRT, so the build stops with a clear error.
    with pytest.raises(DejaVuError, match="libdejavu_trt_plugins.so, which is not at"):
        trt_plan(opts, tmp_path / "decode.sparse.onnx", tmp_path, say=lambda _: None)
    plugins.write_bytes(b"")
    # The library loads but registers nothing the graph names.
    with pytest.raises(DejaVuError, match="registry lacks DejaVuLookaheadPredictor, DejaVuSparseMLP"):
        trt_plan(opts, tmp_path / "decode.sparse.onnx", tmp_path, say=lambda _: None)


@pytest.mark.parametrize("namespace", ["dejavu_trt", ""])
def test_plan_build_wiring(exports, tmp_path, monkeypatch, namespace):
    import onnx
    from types import SimpleNamespace
    from dejavu_trt.build.steps import trt_plan
    from dejavu_trt.errors import DejaVuError
    from dejavu_trt.ops.contract import PLUGIN_NAMESPACE
    from dejavu_trt.rewrite.plan_graph import PLAN_GRAPH_FILE
    sparse = exports.rewritten("opt", 0.5, 0.67)
    trt, calls = _fake_tensorrt(monkeypatch, registered_namespace=namespace)
    plugins = _plugin_libraries(tmp_path, monkeypatch)
    plugins.write_bytes(b"")
    out, note = trt_plan(SimpleNamespace(dtype="fp16"), sparse, tmp_path, say=lambda _: None)
    assert calls["LoadPlugins"][1]["plugins"] == [str(plugins)] and calls["LoadPlugins()"]
    # built from the typed copy, strongly typed, with the nodes naming the namespace the registry holds
    typed = tmp_path / PLAN_GRAPH_FILE
    assert calls["NetworkFromOnnxPath"] == ((str(typed),), {"strongly_typed": True})
    g = onnx.load(str(typed)).graph
    assert {i.name: i.type.tensor_type.elem_type for i in g.input}["past_key.0"] == onnx.TensorProto.FLOAT16
    nodes = [n for n in g.node if n.domain == PLUGIN_NAMESPACE]
    assert {a.s.decode() for n in nodes for a in n.attribute if a.name == "plugin_namespace"} == {namespace}
    # no fp16/bf16 builder flag (TensorRT 11 is strongly typed); aliased plugin I/O for the in-place caches
    assert calls["CreateConfig"][1] == {"max_aux_streams": 2, "preview_features": ["aliased_plugin_io"]}
    assert out.read_bytes() == b"plan" and calls["SaveEngine()"] and note == f"built {out.name}"
    assert not list(tmp_path.glob(".*.tmp"))   # atomic writes left nothing behind
    # the parser check: every plugin node must be a plugin layer, not its expanded local function
    check = calls["PostprocessNetwork"][1]["func"]

    def network(n_plugin):
        layers = [SimpleNamespace(type=trt.LayerType.PLUGIN_V3)] * n_plugin + [SimpleNamespace(type="matmul")] * 5
        return SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])
    check(network=network(len(nodes)))          # polygraphy's PostprocessNetwork calls func(network=...)
    with pytest.raises(DejaVuError, match=f"made {len(nodes) - 1} plugin layers of the graph's {len(nodes)}"):
        check(network=network(len(nodes) - 1))
