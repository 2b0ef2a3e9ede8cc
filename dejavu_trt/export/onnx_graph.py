"""Emit the dense ONNX decode-step graph from the canonical `DecodeModel`, with onnx-graphsurgeon.

We write the graph node by node instead of tracing with torch.onnx.export: the node and tensor
names are then ours and stable (`layers.{i}.mlp/...`), the cache update is exactly one
ScatterElements per cache, nothing depends on which exporter (TorchScript or dynamo/onnxscript)
a torch version defaults to, and the plugin ops' local functions reuse the same helpers
(`attend`, `write_cache`). See docs/export.md.

Graph I/O (B dynamic, T fixed):
  inputs  input_ids [B] int64, position [B] int32, past_key.{i} / past_value.{i} [B, Hkv, T, hd]
  outputs logits [B, V] float32, present_key.{i} / present_value.{i} [B, Hkv, T, hd]
Per layer i the residual stream is `hidden.{i}` (hidden.0 = embeddings); the attention reads
`layers.{i}.attn_in` and writes `layers.{i}.attn_out`, the MLP reads `layers.{i}.mlp_in` and writes
`layers.{i}.mlp_out`.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from .config import METADATA_PREFIX, ONNX_IR_VERSION, ONNX_OPSET, DecodeConfig, io_names
from .emitter import INT64, Emitter
from .module import DecodeModel, Norm

BATCH = "batch"


def np32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to(torch.float32).cpu().numpy())


# --- pieces shared with the local functions -----------------------------------------------------
def write_cache(e: Emitter, cache, pos64, new, keep_mask=None):
    """cache[b, kv, pos[b], :] = new[b, kv, :] via ScatterElements on axis 2.

    keep_mask (bool [1, Hkv, 1, 1], true = write) leaves the other KV heads' slots as they were.
    """
    upd = e.unsqueeze(new, 2)                                              # [B, Hkv, 1, hd]
    idx = e.op("Expand", [e.reshape(pos64, (-1, 1, 1, 1)), e.op("Shape", [upd])])
    if keep_mask is not None:
        upd = e.op("Where", [keep_mask, upd, e.op("GatherElements", [cache, idx], {"axis": 2})])
    return e.op("ScatterElements", [cache, idx, upd], {"axis": 2})


def attend(e: Emitter, q4, k4, v4, pos64, scale):
    """Softmax attention of q4 [B, X, Y, hd] over k4/v4 [B, X, T, hd], slots 0..pos[b] -> [B, X, Y, hd]."""
    s = e.mul(e.matmul(q4, e.transpose(k4, (0, 1, 3, 2))), scale)          # [B, X, Y, T]
    t_len = e.op("Squeeze", [e.op("Shape", [k4], {"start": 2, "end": 3}), e.ints(0)])
    slots = e.op("Range", [_zero(e), t_len, _one(e)])
    valid = e.op("LessOrEqual", [slots, e.reshape(pos64, (-1, 1, 1, 1))])  # [B, 1, 1, T]
    s = e.op("Where", [valid, s, e.scalar(-np.inf)])
    p = e.op("Softmax", [s], {"axis": -1})
    return e.matmul(p, v4)


def _zero(e: Emitter):
    return gs.Constant(f"{e.scope or 'c'}/zero_{e._bump('z')}", np.array(0, dtype=np.int64))


def _one(e: Emitter):
    return gs.Constant(f"{e.scope or 'c'}/one_{e._bump('o')}", np.array(1, dtype=np.int64))


# --- dense layers -------------------------------------------------------------------------------
def emit_norm(e: Emitter, x, norm: Norm, prefix: str):
    w = e.const(f"{prefix}.weight", np32(norm.weight))
    if norm.kind == "layernorm":
        b = e.const(f"{prefix}.bias", np32(norm.bias))
        return e.op("LayerNormalization", [x, w, b], {"axis": -1, "epsilon": norm.eps})
    return e.mul(e.rms_normalize(x, e.scalar(norm.eps)), w)


def emit_dense_mlp(e: Emitter, x, mlp, prefix: str):
    """Standard exporter layout: MatMul weights [in, out] (the rewrite re-lays them out neuron-major)."""
    if mlp.activation == "silu_glu":
        gate = e.matmul(x, e.const(f"{prefix}.w_gate_t", np32(mlp.w_gate.T)))
        up = e.matmul(x, e.const(f"{prefix}.w_up_t", np32(mlp.w_up.T)))
        a = e.mul(e.silu(gate), up)
        return e.matmul(a, e.const(f"{prefix}.w_down", np32(mlp.w_down_t)))
    up = e.add(e.matmul(x, e.const(f"{prefix}.w_up_t", np32(mlp.w_up.T))), e.const(f"{prefix}.b_up", np32(mlp.b_up)))
    a = e.op("Relu", [up]) if mlp.activation == "relu" else e.gelu(up)
    return e.add(e.matmul(a, e.const(f"{prefix}.w_down", np32(mlp.w_down_t))), e.const(f"{prefix}.b_down", np32(mlp.b_down)))


def emit_dense_attention(e: Emitter, cfg: DecodeConfig, x, pos64, past_k, past_v, attn, rope, prefix: str):
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    biased = cfg.family == "opt"

    def proj(name, w, b, heads):
        y = e.matmul(x, e.const(f"{prefix}.{name}_t", np32(w.T)))
        if biased:
            y = e.add(y, e.const(f"{prefix}.b_{name[-1]}", np32(b)))
        return e.reshape(y, (-1, heads, hd))

    q = proj("w_q", attn.w_q, attn.b_q, H)
    k = proj("w_k", attn.w_k, attn.b_k, Hkv)
    v = proj("w_v", attn.w_v, attn.b_v, Hkv)
    if cfg.rotary:
        cos, sin = (e.unsqueeze(e.gather(t, pos64), 1) for t in rope)      # [B, 1, hd/2]
        q, k = e.rope(q, cos, sin), e.rope(k, cos, sin)
    k_cache = write_cache(e, past_k, pos64, k)
    v_cache = write_cache(e, past_v, pos64, v)
    q4 = e.reshape(q, (-1, Hkv, cfg.group, hd))                              # head h = kv * group + j
    o = e.reshape(attend(e, q4, k_cache, v_cache, pos64, e.scalar(attn.scale)), (-1, H * hd))
    y = e.matmul(o, e.const(f"{prefix}.w_o_t", np32(attn.w_o_t)))
    if biased:
        y = e.add(y, e.const(f"{prefix}.b_o", np32(attn.b_o)))
    return y, k_cache, v_cache


def _rename(t: gs.Tensor, name: str) -> gs.Tensor:
    t.name = name
    return t


def build_decode_graph(model: DecodeModel, extra_metadata: dict | None = None) -> onnx.ModelProto:
    """The dense decode-step graph for `model` (see the module docstring for its I/O)."""
    cfg = model.cfg
    g = gs.Graph(opset=ONNX_OPSET, name=f"dejavu_decode_{cfg.family}")
    e = Emitter(g)
    ids = gs.Variable("input_ids", np.int64, [BATCH])
    position = gs.Variable("position", np.int32, [BATCH])
    cache_shape = [BATCH, cfg.num_kv_heads, cfg.max_context, cfg.head_dim]
    past = [gs.Variable(n, np.float32, cache_shape) for n in io_names(cfg.num_layers)["inputs"][2:]]
    g.inputs = [ids, position, *past]

    emb = e.scoped("embed")
    embed_w = emb.const("embed.weight", np32(model.embed))
    h = emb.gather(embed_w, ids)
    pos64 = emb.cast(position, INT64)
    _rename(pos64, "position_i64")
    if model.pos_embed is not None:
        h = emb.add(h, emb.gather(emb.const("embed.positions", np32(model.pos_embed)), pos64))
    _rename(h, "hidden.0")
    rope = (e.const("rope.cos", np32(model.rope_cos)), e.const("rope.sin", np32(model.rope_sin))) if cfg.rotary else None

    presents = []
    for i, blk in enumerate(model.blocks):
        p = f"layers.{i}"
        x = _rename(emit_norm(e.scoped(f"{p}.attn_norm"), h, blk.attn_norm, f"{p}.attn_norm"), f"{p}.attn_in")
        a, kc, vc = emit_dense_attention(e.scoped(f"{p}.attn"), cfg, x, pos64, past[2 * i], past[2 * i + 1],
                                         blk.attn, rope, f"{p}.attn")
        _rename(a, f"{p}.attn_out")
        presents += [_rename(kc, f"present_key.{i}"), _rename(vc, f"present_value.{i}")]
        h = _rename(e.scoped(f"{p}.attn_residual").add(h, a), f"{p}.mid")
        x = _rename(emit_norm(e.scoped(f"{p}.mlp_norm"), h, blk.mlp_norm, f"{p}.mlp_norm"), f"{p}.mlp_in")
        m = _rename(emit_dense_mlp(e.scoped(f"{p}.mlp"), x, blk.mlp, f"{p}.mlp"), f"{p}.mlp_out")
        h = _rename(e.scoped(f"{p}.mlp_residual").add(h, m), f"hidden.{i + 1}")

    out = e.scoped("lm_head")
    h = emit_norm(out, h, model.final_norm, "final_norm")
    # Tied embeddings: one initializer serves the Gather and the Gemm (halves the file).
    tied = model.lm_head.data_ptr() == model.embed.data_ptr()
    head_w = embed_w if tied else out.const("lm_head.weight", np32(model.lm_head))
    logits = _rename(out.op("Gemm", [h, head_w], {"transB": 1}), "logits")
    logits.dtype, logits.shape = np.float32, [BATCH, cfg.vocab_size]
    for t in presents:
        t.dtype, t.shape = np.float32, cache_shape
    g.outputs = [logits, *presents]

    proto = gs.export_onnx(g)
    proto.ir_version = ONNX_IR_VERSION
    proto.producer_name = "dejavu-trt"
    meta = {"kind": "decode-dense", "config": cfg.to_json(), **(extra_metadata or {})}
    onnx.helper.set_model_props(proto, {f"{METADATA_PREFIX}{k}": str(v) for k, v in meta.items()})
    return proto
