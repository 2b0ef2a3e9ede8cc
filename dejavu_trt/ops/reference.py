"""Plain torch implementations of the ops in docs/ops.md.

They are the executable form of the contract: the kernels, the ONNX local functions and the
sparse reference model are all tested against these. They favour clarity over speed and compute
in the dtype of their inputs (pass float32/float64 for a reference result).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import PREDICTOR_EPS


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores (ties toward the lower index), sorted ascending, int32."""
    # A stable descending sort gives the ONNX TopK tie rule: equal values keep index order.
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values.to(torch.int32)


def rms_normalize(h: torch.Tensor, eps: float = PREDICTOR_EPS) -> torch.Tensor:
    """The predictor's parameter-free RMS normalisation of its input."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def predictor_scores(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float = PREDICTOR_EPS) -> torch.Tensor:
    """Per-row low-rank scores: rmsnorm(h) @ a @ b, shape [..., units]."""
    return (rms_normalize(h, eps) @ a) @ b


def lookahead_predictor(h, mlp_a, mlp_b, head_a, head_b, kept_units: int, kept_heads: int,
                        eps: float = PREDICTOR_EPS):
    """DejaVuLookaheadPredictor: batch-union top-k over MLP units and heads."""
    s_mlp = predictor_scores(h, mlp_a, mlp_b, eps).amax(0)
    s_head = predictor_scores(h, head_a, head_b, eps).amax(0)
    return topk_sorted(s_mlp, kept_units), topk_sorted(s_head, kept_heads)


def expand_blocks(idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block indices -> neuron indices (ascending when idx is)."""
    if block_size == 1:
        return idx.long()
    offs = torch.arange(block_size, device=idx.device)
    return (idx.long()[:, None] * block_size + offs).reshape(-1)


def sparse_mlp(x, idx, *, activation: str, block_size: int = 1, w_up, w_down_t,
               w_gate=None, b_up=None, b_down=None):
    """DejaVuSparseMLP. x [B,d], idx [K] int32 -> y [B,d]."""
    j = expand_blocks(idx, block_size)
    up = x @ w_up[j].T
    if activation == "silu_glu":
        a = F.silu(x @ w_gate[j].T) * up
    else:
        up = up + b_up[j]
        a = torch.relu(up) if activation == "relu" else F.gelu(up)
    y = a @ w_down_t[j]
    if b_down is not None and activation != "silu_glu":
        y = y + b_down
    return y


def apply_rope(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """u [..., hd], cos/sin [..., hd/2] broadcastable -> rotate_half RoPE."""
    half = u.shape[-1] // 2
    u1, u2 = u[..., :half], u[..., half:]
    return torch.cat([u1 * cos - u2 * sin, u2 * cos + u1 * sin], dim=-1)


def head_sparse_attention(x, head_idx, position, w_q, w_k, w_v, w_o_t, b_q, b_k, b_v, b_o,
                          rope_cos, rope_sin, k_cache, v_cache, *, num_heads: int, num_kv_heads: int,
                          head_dim: int, rotary: int, scale: float, kv_policy: str = "dense"):
    """DejaVuHeadSparseAttention, one decode step. Returns (y, k_cache_out, v_cache_out).

    The caches are cloned, not modified: the reference is functional like the ONNX function.
    """
    B, _ = x.shape
    H, Hkv, hd = num_heads, num_kv_heads, head_dim
    group = H // Hkv
    heads = head_idx.long()
    pos = position.long()
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if kv_policy == "dense":
        kv_heads = torch.arange(Hkv, device=x.device)
    else:
        kv_heads = torch.unique(heads // group)

    k_new = (x @ w_k.view(Hkv, hd, -1)[kv_heads].reshape(-1, x.shape[1]).T
             + b_k.view(Hkv, hd)[kv_heads].reshape(-1)).view(B, -1, hd)
    v_new = (x @ w_v.view(Hkv, hd, -1)[kv_heads].reshape(-1, x.shape[1]).T
             + b_v.view(Hkv, hd)[kv_heads].reshape(-1)).view(B, -1, hd)
    q = (x @ w_q.view(H, hd, -1)[heads].reshape(-1, x.shape[1]).T
         + b_q.view(H, hd)[heads].reshape(-1)).view(B, -1, hd)
    if rotary:
        cos, sin = rope_cos[pos][:, None, :], rope_sin[pos][:, None, :]
        k_new, q = apply_rope(k_new, cos, sin), apply_rope(q, cos, sin)
    rows = torch.arange(B, device=x.device)
    k_cache[rows[:, None], kv_heads[None, :], pos[:, None]] = k_new.to(k_cache.dtype)
    v_cache[rows[:, None], kv_heads[None, :], pos[:, None]] = v_new.to(v_cache.dtype)

    T = k_cache.shape[2]
    kk = k_cache[:, heads // group]                      # [B, Kh, T, hd]
    vv = v_cache[:, heads // group]
    scores = torch.einsum("bhd,bhtd->bht", q, kk.to(q.dtype)) * scale
    valid = torch.arange(T, device=x.device)[None, :] <= pos[:, None]   # [B, T]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bht,bhtd->bhd", p, vv.to(q.dtype))  # [B, Kh, hd]
    y = o.reshape(B, -1) @ w_o_t.view(H, hd, -1)[heads].reshape(-1, w_o_t.shape[1]) + b_o
    return y, k_cache, v_cache
