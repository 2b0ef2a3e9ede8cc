"""ONNX local functions for the plugin ops: the contract's math (docs/ops.md) in standard ops.

A plugin node `dejavu_trt::DejaVuSparseMLP` and the function of the same name and domain travel
in the same file, so ONNX Runtime inlines the function and runs the rewritten graph as it is,
while TensorRT (with our plugin library) maps the node to the plugin. Dimensions, K and the scale
come from the node's attributes (attribute references), so one function serves every layer.

Structural choices are fixed per model and baked into the body: the MLP activation (which also
fixes the input list), `rotary`, and `kv_policy`. The rewrite emits one body per op, checks that
every node's attributes agree with it, and records the variant in the function's doc string.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..export.emitter import INT32, INT64, Emitter
from ..export.onnx_graph import attend, write_cache
from ..ops.contract import HEAD_ATTENTION_OP, PLUGIN_NAMESPACE, PREDICTOR_EPS, PREDICTOR_OP, SPARSE_MLP_OP
from ..ops.contract import OP_CONTRACT_VERSION

FUNCTION_OPSET = 17
COMMON_ATTRS = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": OP_CONTRACT_VERSION}

MLP_INPUTS = {
    "relu": ["x", "idx", "w_up", "b_up", "w_down_t", "b_down"],
    "gelu": ["x", "idx", "w_up", "b_up", "w_down_t", "b_down"],
    "silu_glu": ["x", "idx", "w_gate", "w_up", "w_down_t"],
}
PREDICTOR_INPUTS = ["h", "mlp_a", "mlp_b", "head_a", "head_b"]
ATTENTION_INPUTS = ["x", "head_idx", "position", "w_q", "w_k", "w_v", "w_o_t", "b_q", "b_k", "b_v", "b_o",
                    "rope_cos", "rope_sin", "k_cache", "v_cache"]


def _function(name: str, inputs: list[str], attrs: dict, doc: str) -> tuple[gs.Function, Emitter, dict]:
    f = gs.Function(name, domain=PLUGIN_NAMESPACE, opset=FUNCTION_OPSET, attrs={**attrs, **COMMON_ATTRS},
                    doc_string=doc)
    f.inputs = [gs.Variable(n) for n in inputs]
    return f, Emitter(f, "f"), {t.name: t for t in f.inputs}


def _topk_sorted(e: Emitter, scores, k_attr: str):
    """Indices of the k largest (ties toward the lower index: ONNX TopK), sorted ascending, int32."""
    k = e.reshape(e.attr_int(k_attr), (1,))
    _, idx = e.op("TopK", [scores, k], {"axis": -1, "largest": 1, "sorted": 1}, outputs=2)
    asc, _ = e.op("TopK", [idx, k], {"axis": -1, "largest": 0, "sorted": 1}, outputs=2)
    return e.cast(asc, INT32)


def predictor_function() -> gs.Function:
    f, e, t = _function(PREDICTOR_OP, PREDICTOR_INPUTS,
                        {"kept_units": None, "kept_heads": None, "eps": PREDICTOR_EPS},
                        "DejaVuLookaheadPredictor (docs/ops.md): batch-union top-k of low-rank scores.")
    z = e.rms_normalize(t["h"], e.attr_float("eps"))

    def select(a, b, k_attr):
        s = e.matmul(e.matmul(z, t[a]), t[b])
        return _topk_sorted(e, e.op("ReduceMax", [s], {"axes": [0], "keepdims": 0}), k_attr)

    f.outputs = [select("mlp_a", "mlp_b", "kept_units"), select("head_a", "head_b", "kept_heads")]
    return f


def sparse_mlp_function(activation: str) -> gs.Function:
    f, e, t = _function(SPARSE_MLP_OP, MLP_INPUTS[activation],
                        {"activation": activation, "block_size": 1, "kept_units": None, "num_neurons": None},
                        f"DejaVuSparseMLP (docs/ops.md), activation={activation}.")
    # Selected units -> neuron rows: idx * block_size + [0, block_size).
    bs = e.attr_int("block_size")
    offs = e.op("Range", [e.scalar(0, np.int64), bs, e.scalar(1, np.int64)])
    rows = e.reshape(e.add(e.mul(e.unsqueeze(e.cast(t["idx"], INT64), 1), bs), offs), (-1,))
    x = t["x"]

    def proj(w):   # x @ w[rows].T -> [B, K*bs]
        return e.matmul(x, e.transpose(e.gather(t[w], rows), (1, 0)))

    if activation == "silu_glu":
        a = e.mul(e.silu(proj("w_gate")), proj("w_up"))
    else:
        up = e.add(proj("w_up"), e.gather(t["b_up"], rows))
        a = e.op("Relu", [up]) if activation == "relu" else e.gelu(up)
    y = e.matmul(a, e.gather(t["w_down_t"], rows))
    if activation != "silu_glu":
        y = e.add(y, t["b_down"])
    f.outputs = [y]
    return f


def head_attention_function(rotary: bool, kv_policy: str) -> gs.Function:
    f, e, t = _function(HEAD_ATTENTION_OP, ATTENTION_INPUTS,
                        {"num_heads": None, "num_kv_heads": None, "head_dim": None, "kept_heads": None,
                         "rotary": int(rotary), "scale": None, "kv_policy": kv_policy},
                        f"DejaVuHeadSparseAttention (docs/ops.md), rotary={int(rotary)}, kv_policy={kv_policy}.")
    x = t["x"]
    hd = e.unsqueeze(e.attr_int("head_dim"), 0)                       # [1]
    d = e.op("Shape", [x], {"start": 1, "end": 2})                    # [1]
    n_kv = e.attr_int("num_kv_heads")
    group = e.op("Div", [e.attr_int("num_heads"), n_kv])
    heads = e.cast(t["head_idx"], INT64)                              # [Kh]
    kv_of_head = e.op("Div", [heads, group])                          # g(h) = h // (H / Hkv)
    pos64 = e.cast(t["position"], INT64)
    per_head = e.op("Concat", [e.ints(-1), hd, d], {"axis": 0})       # [H*hd, d] -> [H, hd, d]
    rows_shape = e.op("Concat", [e.ints(-1), d], {"axis": 0})
    tokens_heads = e.op("Concat", [e.ints(0, -1), hd], {"axis": 0})   # [B, n*hd] -> [B, n, hd]

    def selected(w):                                                  # rows of the selected heads
        return e.reshape(e.gather(e.reshape(w, per_head), heads), rows_shape)

    def selected_bias(b):
        return e.reshape(e.gather(e.reshape(b, e.op("Concat", [e.ints(-1), hd], {"axis": 0})), heads), (-1,))

    k = e.reshape(e.add(e.matmul(x, e.transpose(t["w_k"], (1, 0))), t["b_k"]), tokens_heads)
    v = e.reshape(e.add(e.matmul(x, e.transpose(t["w_v"], (1, 0))), t["b_v"]), tokens_heads)
    q = e.reshape(e.add(e.matmul(x, e.transpose(selected(t["w_q"]), (1, 0))), selected_bias(t["b_q"])), tokens_heads)
    if rotary:
        cos, sin = (e.unsqueeze(e.gather(t[n], pos64), 1) for n in ("rope_cos", "rope_sin"))
        q, k = e.rope(q, cos, sin), e.rope(k, cos, sin)
    keep = None
    if kv_policy == "active":
        # Write only KV heads some selected query head reads: mask [1, Hkv, 1, 1].
        all_kv = e.op("Range", [e.scalar(0, np.int64), n_kv, e.scalar(1, np.int64)])
        hit = e.cast(e.op("Equal", [e.unsqueeze(all_kv, 1), e.unsqueeze(kv_of_head, 0)]), INT32)
        used = e.op("ReduceMax", [hit], {"axes": [1], "keepdims": 0})
        keep = e.reshape(e.cast(used, 9), (1, -1, 1, 1))               # 9 = BOOL
    k_cache = write_cache(e, t["k_cache"], pos64, k, keep)
    v_cache = write_cache(e, t["v_cache"], pos64, v, keep)
    kk, vv = e.gather(k_cache, kv_of_head, 1), e.gather(v_cache, kv_of_head, 1)   # [B, Kh, T, hd]
    o = attend(e, e.unsqueeze(q, 2), kk, vv, pos64, e.attr_float("scale"))        # [B, Kh, 1, hd]
    y = e.add(e.matmul(e.reshape(o, (0, -1)), selected(t["w_o_t"])), t["b_o"])
    f.outputs = [y, k_cache, v_cache]
    return f
