"""The `.plan` build's copy of the rewritten graph: plugin I/O in the build dtype.

The rewritten graph (`decode.sparse.onnx`) is float32 throughout, so ONNX Runtime runs it on CPU as it
is. The plugins take fp16 or bf16 only, and TensorRT 11 networks are always strongly typed: a tensor's
type is the type the graph gives it, and no builder flag lowers float32 to half. So the `.plan` is built
from a copy in which

* the plugin nodes' weight constants (and the RoPE tables they read) are stored in the build dtype;
* the KV caches (`past_*` inputs, `present_*` outputs) are in the build dtype, which is what lets the
  attention plugin update them in place (aliased I/O must match in type);
* a Cast to the build dtype feeds each plugin's activation input, and a Cast back to float32 follows each
  plugin's activation output, so the norms, residual adds and LM head stay float32, as in the source graph;
* each local function casts its changed inputs to what its body was written for and its outputs back,
  so the copy still runs on ONNX Runtime (and inlining a function is still correct, only slow).

Integer inputs and outputs (the active-index tensors, `position`) are not touched.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..artifacts import atomic_file
from ..errors import DejaVuError
from ..ops.contract import PLUGIN_NAMESPACE

PLAN_GRAPH_FILE = "decode.plan.onnx"
BUILD_DTYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
_SUFFIX = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}


def _convert(t: TensorProto, to: int, name: str) -> TensorProto:
    a = numpy_helper.to_array(t).astype(np.float32)
    if to == TensorProto.FLOAT16:
        return numpy_helper.from_array(a.astype(np.float16), name)
    import ml_dtypes   # onnx's own dependency; numpy has no bfloat16
    return numpy_helper.from_array(a.astype(ml_dtypes.bfloat16), name)


def typed_plan_graph(proto: onnx.ModelProto, dtype: str, plugin_namespace: str | None = None,
                     in_place: bool = False) -> onnx.ModelProto:
    """A copy of a rewritten graph with plugin weights, caches and plugin activations in `dtype`.

    `plugin_namespace` overrides the nodes' `plugin_namespace` attribute (the namespace the TensorRT
    plugin registry actually holds our creators under); the ONNX domain stays the contract's.
    `in_place` retypes `proto` itself instead of a copy (a 13B graph is 52 GB in float32).
    """
    if dtype not in BUILD_DTYPES:
        raise DejaVuError(f"the plan's dtype must be one of {', '.join(BUILD_DTYPES)}, got {dtype!r}")
    to = BUILD_DTYPES[dtype]
    sfx = _SUFFIX[to]
    if in_place:
        out = proto
    else:
        out = onnx.ModelProto()
        out.CopyFrom(proto)
    g = out.graph
    plugins = [n for n in g.node if n.domain == PLUGIN_NAMESPACE]
    if not plugins:
        raise DejaVuError("the graph has no dejavu_trt plugin nodes: build the plan from the rewritten graph "
                          "(decode.sparse.onnx), not the dense one")
    inits = {t.name: t for t in g.initializer}
    g_inputs = {v.name: v for v in g.input}
    g_outputs = {v.name: v for v in g.output}
    # every tensor's float-ness, from what the graph declares (plugin outputs: by op, below)
    declared = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    declared.update({t.name: t.data_type for t in g.initializer})
    int_outputs = {o for n in plugins for o in n.output if declared.get(o) == TensorProto.INT32}
    for n in plugins:
        if n.op_type.endswith("Predictor"):
            int_outputs.update(n.output)

    converted: dict[str, str] = {}     # float32 constant -> its typed copy
    cast_in: dict[str, str] = {}       # float32 activation -> its typed Cast output
    changed_in: dict[str, set[int]] = {}
    changed_out: dict[str, set[int]] = {}
    new_nodes = []
    for node in g.node:
        if node.domain != PLUGIN_NAMESPACE:
            new_nodes.append(node)
            continue
        ins, outs = changed_in.setdefault(node.op_type, set()), changed_out.setdefault(node.op_type, set())
        for k, name in enumerate(node.input):
            kind = declared.get(name)
            if name in inits:
                if kind != TensorProto.FLOAT:
                    continue
                if name not in converted:
                    converted[name] = f"{name}.{sfx}"
                    g.initializer.append(_convert(inits[name], to, converted[name]))
                node.input[k] = converted[name]
            elif name in g_inputs:
                if kind != TensorProto.FLOAT:
                    continue
                g_inputs[name].type.tensor_type.elem_type = to          # a cache, fed in the build dtype
            elif name in int_outputs or kind in (TensorProto.INT32, TensorProto.INT64):
                continue
            else:
                if name not in cast_in:
                    cast_in[name] = f"{name}.{sfx}"
                    new_nodes.append(helper.make_node("Cast", [name], [cast_in[name]], name=f"{name}/to_{sfx}", to=to))
                node.input[k] = cast_in[name]
            ins.add(k)
        after = []
        for k, name in enumerate(node.output):
            if name in int_outputs:
                continue
            if name in g_outputs:
                g_outputs[name].type.tensor_type.elem_type = to         # a cache, returned in the build dtype
            else:
                node.output[k] = f"{name}.{sfx}"
                after.append(helper.make_node("Cast", [node.output[k]], [name], name=f"{name}/to_fp32",
                                              to=TensorProto.FLOAT))
            outs.add(k)
        if plugin_namespace is not None:
            for a in node.attribute:
                if a.name == "plugin_namespace":
                    a.s = plugin_namespace.encode()
        new_nodes.append(node)
        new_nodes.extend(after)
    del g.node[:]
    g.node.extend(new_nodes)
    # the float32 originals are now read by nobody
    used = {i for n in g.node for i in n.input} | set(g_outputs)
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    dropped = {v.name for v in g.value_info if v.name in cast_in.values() or v.name in converted}
    keep_vi = [v for v in g.value_info if v.name not in dropped]
    del g.value_info[:]
    g.value_info.extend(keep_vi)

    for f in out.functions:
        if f.domain == PLUGIN_NAMESPACE and f.name in changed_in:
            _wrap_function(f, changed_in[f.name], changed_out[f.name], to)
    return out


def _wrap_function(f: onnx.FunctionProto, ins: set[int], outs: set[int], to: int) -> None:
    """Cast the changed inputs to float32 before the body, and the changed outputs to `to` after it."""
    rename = {f.input[k]: f"{f.input[k]}__f32" for k in sorted(ins)}
    out_rename = {f.output[k]: f"{f.output[k]}__f32" for k in sorted(outs)}
    body = []
    for old, new in rename.items():
        body.append(helper.make_node("Cast", [old], [new], to=TensorProto.FLOAT))
    for n in f.node:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        for k, name in enumerate(m.input):   # the body may read its own outputs (the updated caches)
            m.input[k] = rename.get(name, out_rename.get(name, name))
        for k, name in enumerate(m.output):
            m.output[k] = out_rename.get(name, name)
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in m.attribute):
            raise DejaVuError(f"local function {f.name} has a subgraph node ({m.op_type}); the plan graph "
                              f"cannot re-type it")
        body.append(m)
    for old, new in out_rename.items():
        body.append(helper.make_node("Cast", [new], [old], to=to))
    del f.node[:]
    f.node.extend(body)


def write_plan_graph(rewritten: Path, out: Path, dtype: str, plugin_namespace: str | None = None) -> int:
    """Write the typed copy of the rewritten graph `rewritten` to `out` (atomically); returns its number of
    plugin nodes."""
    from ..export.stage import save_onnx
    from .rewrite import load_onnx

    typed = typed_plan_graph(load_onnx(rewritten), dtype, plugin_namespace=plugin_namespace, in_place=True)
    n = sum(1 for node in typed.graph.node if node.domain == PLUGIN_NAMESPACE)
    with atomic_file(out) as tmp:
        tmp_onnx = tmp.with_suffix(".onnx")   # the checker and ONNX Runtime want an .onnx name
        try:
            save_onnx(typed, tmp_onnx, data_name=Path(out).name)
            tmp_onnx.replace(tmp)
        finally:
            tmp_onnx.unlink(missing_ok=True)
    return n
