"""The .plan build's typed copy of the rewritten graph: plugin weights, caches and plugin activations in
fp16/bf16, Casts at the plugin boundaries; the fp16 copy runs on ONNX Runtime and matches the float32 graph."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from dejavu_trt.errors import DejaVuError
from dejavu_trt.export import DecodeModel
from dejavu_trt.export.testing import ort_decode
from dejavu_trt.ops.contract import PLUGIN_NAMESPACE
from dejavu_trt.rewrite.plan_graph import typed_plan_graph
from test_rewrite import SMOLLM2_LAYERS, T, exports, rel_to_range, session, tokens_for  # noqa: F401


def _check_typed(typed: onnx.ModelProto, to: int) -> None:
    g = typed.graph
    inits = {t.name: t.data_type for t in g.initializer}
    produced_by_cast = {n.output[0]: n.attribute[0].i for n in g.node if n.op_type == "Cast"}
    graph_io = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output]}
    plugins = [n for n in g.node if n.domain == PLUGIN_NAMESPACE]
    assert plugins
    for n in plugins:
        for name in n.input:
            if name in inits:
                assert inits[name] in (to, TensorProto.INT32, TensorProto.INT64), (n.name, name)
            elif name in graph_io:
                assert graph_io[name] in (to, TensorProto.INT32), (n.name, name)
            elif name in produced_by_cast:
                assert produced_by_cast[name] == to, (n.name, name)
            else:   # the predictors' index outputs
                assert name.endswith("_idx"), (n.name, name)
    for name, t in graph_io.items():
        if name.startswith(("past_", "present_")):
            assert t == to, name
        elif name == "logits":
            assert t == TensorProto.FLOAT          # the LM head stays float32
    # no float32 weight is left for a plugin, and nothing reads a dropped constant
    used = {i for n in g.node for i in n.input}
    assert used >= {t.name for t in g.initializer} - set(graph_io)


def _fp16_against_float32(exports, family, sparsity, head_sparsity):
    lm = exports[family][0]
    sparse = exports.rewritten(family, sparsity, head_sparsity)
    typed = typed_plan_graph(onnx.load(str(sparse)), "fp16")
    _check_typed(typed, TensorProto.FLOAT16)
    onnx.checker.check_model(typed, full_check=True)
    cfg = DecodeModel.from_adapter(lm.adapter, T, SMOLLM2_LAYERS if family == "llama" else None).cfg
    toks = tokens_for(lm)
    fp16 = ort.InferenceSession(typed.SerializeToString(), providers=["CPUExecutionProvider"])
    assert {i.name: i.type for i in fp16.get_inputs()}["past_key.0"] == "tensor(float16)"
    return [rel_to_range(b, a) for a, b in zip(ort_decode(session(sparse), cfg, toks), ort_decode(fp16, cfg, toks))]


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_fp16_plan_graph_matches_the_float32_graph(family, exports):
    # All neurons and heads kept: no selection can flip, so what differs is fp16 rounding alone; it is
    # small, and not zero (the types did change).
    errs = _fp16_against_float32(exports, family, 1.0, 1.0)
    assert 1e-6 < max(errs) < 1e-2, errs
    # Half kept: rounding the predictor's input can flip a neuron at the top-k boundary, so the bound is looser.
    errs = _fp16_against_float32(exports, family, 0.5, 0.67)
    assert max(errs) < 0.15, errs


def test_bf16_plan_graph_is_typed_and_valid(exports):
    source = onnx.load(str(exports.rewritten("llama", 0.5, 0.67)))
    before = source.SerializeToString()
    typed = typed_plan_graph(source, "bf16", plugin_namespace="")
    assert source.SerializeToString() == before          # a copy, unless in_place
    _check_typed(typed, TensorProto.BFLOAT16)
    assert typed_plan_graph(source, "bf16", in_place=True) is source
    onnx.checker.check_model(typed, full_check=True)
    attrs = [a.s for n in typed.graph.node if n.domain == PLUGIN_NAMESPACE for a in n.attribute
             if a.name == "plugin_namespace"]
    assert attrs and set(attrs) == {b""}


def test_plan_graph_refuses_a_dense_graph_and_a_bad_dtype(exports):
    dense = onnx.load(str(exports["opt"][1]))
    with pytest.raises(DejaVuError, match="no dejavu_trt plugin nodes"):
        typed_plan_graph(dense, "fp16")
    with pytest.raises(DejaVuError, match="must be one of fp16, bf16"):
        typed_plan_graph(dense, "fp32")


def test_plan_graph_cli(exports, tmp_path, cli):
    lm, dense, _ = exports["opt"]
    out = tmp_path / "decode.plan.onnx"
    code, stdout, err = cli("plan-graph", exports.rewritten("opt", 0.5, 0.67), "--out", out)
    layers = lm.adapter.dims().num_layers
    assert code == 0 and f"({3 * layers} plugin nodes, fp16)" in stdout, err
    g = onnx.load(str(out)).graph
    assert {i.name: i.type.tensor_type.elem_type for i in g.input}["past_value.0"] == TensorProto.FLOAT16
    code, _, err = cli("plan-graph", dense, "--out", tmp_path / "x.onnx")
    assert code == 2 and "no dejavu_trt plugin nodes" in err and not (tmp_path / "x.onnx").exists()
    code, _, err = cli("plan-graph", tmp_path / "absent.onnx")
    assert code == 2 and "does not exist" in err
