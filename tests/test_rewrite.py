"""Rewrite: plugin nodes with local functions, run by ONNX Runtime, against the dense graph and the
PyTorch sparse reference, on both families; bad inputs."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dejavu_trt.export import DecodeModel, SparsePlan
from dejavu_trt.export.stage import export_decode
from dejavu_trt.export.testing import ort_decode, stand_in_predictors
from dejavu_trt.ops.contract import OP_NAMES, PLUGIN_NAMESPACE
from dejavu_trt.rewrite import rewrite
from dejavu_trt.sparsity.plan import kept_count

SMOLLM2_LAYERS = 4   # truncated SmolLM2 graphs keep these tests fast; test_export checks the full model vs HF
T = 32
STEPS = 6


@pytest.fixture(scope="module")
def exports(request, tmp_path_factory):
    """Lazily built dense exports + stand-in predictor files: exports["opt"] -> (loaded, decode.onnx, predictors)."""
    root = tmp_path_factory.mktemp("rewrite")
    built = {}

    class Exports:
        def __getitem__(self, fam):
            if fam not in built:
                lm = request.getfixturevalue("tiny_opt" if fam == "opt" else "smollm2")
                layers = SMOLLM2_LAYERS if fam == "llama" else None
                onnx_path = export_decode(str(lm.folder), root / fam, max_context=T, num_layers=layers, loaded=lm)
                built[fam] = (lm, onnx_path, stand_in_predictors(lm.adapter.dims(), root / f"{fam}-pred.safetensors"))
            return built[fam]

        def rewritten(self, fam, sparsity, head_sparsity, kv_policy="dense"):
            """A rewrite of the family's export, shared by the tests that ask for the same settings."""
            key = (fam, sparsity, head_sparsity, kv_policy)
            if key not in built:
                _, dense, pred = self[fam]
                built[key] = rewrite(dense, root / f"{fam}-{sparsity}-{head_sparsity}-{kv_policy}.onnx",
                                     predictors=pred, sparsity=sparsity, head_sparsity=head_sparsity,
                                     kv_policy=kv_policy)
            return built[key]
    return Exports()


def tokens_for(lm, rows=2, steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return torch.randint(4, min(lm.adapter.dims().vocab_size, 5000), (rows, steps), generator=g)


def session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def rel_to_range(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_all_active_rewrite_equals_dense(family, exports, tmp_path):
    lm, dense, pred = exports[family]
    sparse = rewrite(dense, tmp_path / "all.onnx", predictors=pred, sparsity=1.0, head_sparsity=1.0)
    onnx.checker.check_model(str(sparse), full_check=True)
    cfg = DecodeModel.from_adapter(lm.adapter, T, SMOLLM2_LAYERS if family == "llama" else None).cfg
    toks = tokens_for(lm)
    for a, b in zip(ort_decode(session(dense), cfg, toks), ort_decode(session(sparse), cfg, toks)):
        assert rel_to_range(b, a) < 1e-5


@pytest.mark.parametrize("family,kv_policy", [("opt", "dense"), ("llama", "dense"), ("llama", "active")])
def test_predicted_sparsity_equals_torch_reference(family, kv_policy, exports, tmp_path):
    lm, dense, pred = exports[family]
    layers = SMOLLM2_LAYERS if family == "llama" else None
    dims = lm.adapter.dims()
    sparse = exports.rewritten(family, 0.5, 0.67, kv_policy)
    dm = DecodeModel.from_adapter(lm.adapter, T, layers)
    from dejavu_trt.rewrite.rewrite import load_predictors
    tensors = load_predictors(pred)
    tensors.pop("__block_size__")
    plan = SparsePlan(tensors, [kept_count(0.5, dims.intermediate_size)] * dm.cfg.num_layers,
                      [kept_count(0.67, dims.num_heads)] * dm.cfg.num_layers, 1, kv_policy)
    toks = tokens_for(lm)
    cache = dm.new_cache(2)
    onnx_steps = ort_decode(session(sparse), dm.cfg, toks)
    dense_cache = dm.new_cache(2)
    group = dims.num_heads // dims.num_kv_heads
    for t, lg in enumerate(onnx_steps):
        ref = dm.step(toks[:, t], torch.full((2,), t, dtype=torch.int32), cache, plan).numpy()
        assert rel_to_range(lg, ref) < 1e-5, t
        dense_logits = dm.step(toks[:, t], torch.full((2,), t, dtype=torch.int32), dense_cache).numpy()
        assert rel_to_range(dense_logits, ref) > 1e-3   # the sparsity is real
        for layer, (_, head_idx) in enumerate(plan.record):
            used = set((head_idx.long() // group).tolist())
            for kv in range(dims.num_kv_heads):
                written = bool(cache.keys[layer][:, kv, t].abs().sum() > 0)
                assert written == (kv_policy == "dense" or kv in used), (t, layer, kv)


def test_rewritten_graph_structure(exports, tmp_path):
    lm, dense, pred = exports["llama"]
    sparse = exports.rewritten("llama", 0.5, 0.67)
    m = onnx.load(str(sparse))
    assert {(f.name, f.domain) for f in m.functions} == {(n, PLUGIN_NAMESPACE) for n in OP_NAMES}
    plugin = {n.name: n for n in m.graph.node if n.domain == PLUGIN_NAMESPACE}
    assert set(plugin) == {f"layers.{i}.{p}" for i in range(SMOLLM2_LAYERS) for p in ("mlp", "attn", "predictor")}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in plugin["layers.2.mlp"].attribute}
    assert attrs["plugin_namespace"] == b"dejavu_trt" and attrs["plugin_version"] == b"1"
    assert attrs["activation"] == b"silu_glu" and attrs["block_size"] == 1 and attrs["kept_units"] == 768
    # Lookahead: layer i's predictor reads the input of layer i-1 (the embeddings for layers 0 and 1).
    assert [plugin[f"layers.{i}.predictor"].input[0] for i in range(3)] == ["hidden.0", "hidden.0", "hidden.1"]
    assert plugin["layers.2.mlp"].input[1] == "layers.2.mlp_idx"
    assert plugin["layers.2.attn"].input[1] == "layers.2.head_idx"
    # Weights are neuron-major exactly as the adapter gives them in contract layout.
    init = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    w = lm.adapter.mlp_weights(2)
    np.testing.assert_array_equal(init["layers.2.mlp.w_gate"], w.w_gate.numpy())
    np.testing.assert_array_equal(init["layers.2.mlp.w_up"], w.w_up.numpy())
    np.testing.assert_array_equal(init["layers.2.mlp.w_down_t"], w.w_down_t.numpy())
    a = lm.adapter.attention_weights(2)
    np.testing.assert_array_equal(init["layers.2.attn.w_o_t"], a.w_o_t.numpy())
    np.testing.assert_array_equal(init["layers.2.attn.w_q"], a.w_q.numpy())
    # Same graph I/O as the dense graph; the metadata records what the rewrite chose.
    d = onnx.load(str(dense), load_external_data=False)
    assert [i.name for i in m.graph.input] == [i.name for i in d.graph.input]
    assert [o.name for o in m.graph.output] == [o.name for o in d.graph.output]
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["dejavu_trt.kind"] == "decode-sparse"
    assert json.loads(meta["dejavu_trt.rewrite"])["kv_policy"] == "dense"


def test_rewrite_twice_is_refused(exports, tmp_path, cli):
    _, dense, pred = exports["opt"]
    once = exports.rewritten("opt", 0.5, 0.67)
    code, _, err = cli("rewrite", once, "--predictors", pred, "--sparsity", "0.5")
    assert code == 2 and "already rewritten" in err


def test_unrecognised_pattern_names_the_node(exports, tmp_path, cli):
    _, dense, pred = exports["opt"]
    m = onnx.load(str(dense))
    node = next(n for n in m.graph.node if n.name.startswith("layers.1.mlp/") and n.op_type == "Relu")
    node.op_type = "Sigmoid"
    onnx.save(m, str(tmp_path / "tampered.onnx"))
    code, _, err = cli("rewrite", tmp_path / "tampered.onnx", "--predictors", pred, "--sparsity", "0.5")
    assert code == 2 and node.name in err and "Relu" in err and len(err.strip().splitlines()) == 1


def test_bad_inputs(exports, tmp_path, cli):
    lm, dense, pred = exports["opt"]
    # Not an ONNX file.
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not a protobuf\xff" * 10)
    code, _, err = cli("rewrite", junk, "--predictors", pred)
    assert code == 2 and "not an ONNX model" in err
    # A graph of an unsupported family, and a foreign graph.
    m = onnx.load(str(dense))
    props = {p.key: p.value for p in m.metadata_props}
    cfg = json.loads(props["dejavu_trt.config"])
    cfg["family"] = "gpt2"
    props["dejavu_trt.config"] = json.dumps(cfg)
    onnx.helper.set_model_props(m, props)
    onnx.save(m, str(tmp_path / "gpt2.onnx"))
    code, _, err = cli("rewrite", tmp_path / "gpt2.onnx", "--predictors", pred)
    assert code == 2 and "unsupported family 'gpt2'" in err
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    foreign = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                     [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]))
    onnx.save(foreign, str(tmp_path / "foreign.onnx"))
    code, _, err = cli("rewrite", tmp_path / "foreign.onnx", "--predictors", pred)
    assert code == 2 and "not a dejavu-trt decode graph" in err
    # A work dir without predictors.
    (tmp_path / "wd").mkdir()
    code, _, err = cli("rewrite", dense, "--workdir", tmp_path / "wd", "--sparsity", "0.5")
    assert code == 2 and "no trained predictors" in err
    # Mismatched tensor names: predictors for another model (wrong unit count) ...
    from dejavu_trt.models.adapters import ModelDims
    other = ModelDims(**{**lm.adapter.dims().to_dict(), "intermediate_size": 256})
    wrong = stand_in_predictors(other, tmp_path / "wrong.safetensors")
    code, _, err = cli("rewrite", dense, "--predictors", wrong, "--sparsity", "0.5")
    assert code == 2 and "layers.0.mlp_b" in err
    # ... and a graph whose weight tensors were renamed.
    m = onnx.load(str(dense))
    next(t for t in m.graph.initializer if t.name == "layers.2.mlp.w_up_t").name = "fc1.weight"
    for n in m.graph.node:
        n.input[:] = ["fc1.weight" if i == "layers.2.mlp.w_up_t" else i for i in n.input]
    onnx.save(m, str(tmp_path / "renamed.onnx"))
    code, _, err = cli("rewrite", tmp_path / "renamed.onnx", "--predictors", pred, "--sparsity", "0.5")
    assert code == 2 and "layers.2.mlp.w_up_t" in err
    for e in (err,):
        assert len(e.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.sparse.onnx"))   # nothing half-written


def test_workdir_pipeline_with_trained_predictors(tiny_opt, tiny_opt_workdir, exports, tmp_path, cli):
    """export WORKDIR -> rewrite (work dir found through the export manifest) -> compare with torch-sparse."""
    code, out, err = cli("export", tiny_opt_workdir, "--out", tmp_path / "exp", "--max-context", "32")
    assert code == 0, err
    dense = tmp_path / "exp" / "decode.onnx"
    code, out, err = cli("rewrite", dense, "--sparsity", "0.5", "--head-sparsity", "0.75")
    assert code == 0, err
    sparse = tmp_path / "exp" / "decode.sparse.onnx"
    meta = {p.key: p.value for p in onnx.load(str(sparse), load_external_data=False).metadata_props}
    assert json.loads(meta["dejavu_trt.rewrite"])["predictors"] == str(tiny_opt_workdir.resolve())
    from dejavu_trt.artifacts import read_manifest
    m = read_manifest(tmp_path / "exp", "export")          # checksums cover the rewritten graph too
    assert "decode.sparse.onnx" in m["files"] and m["rewrite"]["mlp_kept_units"] == [256] * 4
    code, out, err = cli("compare", sparse, "torch-sparse", "--json", "--steps", "4")
    assert code == 0, err
    assert json.loads(out)["outputs"]["logits"]["rel_to_range"] < 1e-5
    # A work dir of another model is refused even though the predictor file itself is fine.
    _, llama_dense, _ = exports["llama"]
    code, _, err = cli("rewrite", llama_dense, "--workdir", tiny_opt_workdir, "--sparsity", "0.5")
    assert code == 2 and "calibrated on" in err
