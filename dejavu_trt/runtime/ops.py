"""Op backends an executor can run the decode step with.

All three compute docs/ops.md; they differ in how:

* `ReferenceOps` — the torch reference functions themselves (dejavu_trt.ops.reference), for the CPU
  fallback and as the ground truth in tests.
* `TorchOps` — the same semantics in plain torch, but updating the KV cache in place, with no host
  synchronisation and static shapes, so a whole decode step can be captured in a CUDA graph. It reads
  the selected rows with gathers, so it moves more bytes than a fused kernel: it is the fallback
  until (or where) the kernel library is missing.
* `KernelOps` — libdejavu_kernels through dejavu_trt.kernels (engineer K's ctypes binding).

Each backend also has a dense path (every neuron and head active; cuBLAS on a GPU) — the baseline.
"""
from __future__ import annotations

import os
from functools import cached_property

import torch
import torch.nn.functional as F

from ..ops import reference as ref
from ..ops.contract import PREDICTOR_EPS


class StepContext:
    """Per-step tensors the torch attention paths need, computed once per decode step, not per layer, and
    only when first read: the kernels' sparse step reads none of them (four launches fewer per step)."""

    def __init__(self, position: torch.Tensor, T: int, rope):
        self.position, self.T, self.rope = position, T, rope

    @cached_property
    def pos(self):
        return self.position.long()

    @cached_property
    def rows(self):
        return torch.arange(self.position.shape[0], device=self.position.device)[:, None]

    @cached_property
    def mask(self):
        return (torch.arange(self.T, device=self.position.device)[None, :] <= self.pos[:, None])[:, None, None, :]

    @cached_property
    def cos(self):
        return None if self.rope is None else self.rope[0][self.pos][:, None, :]

    @cached_property
    def sin(self):
        return None if self.rope is None else self.rope[1][self.pos][:, None, :]


class LayerWeights(dict):
    """One layer's tensors by contract name (w_q, w_up, ...), plus predictor tensors (mlp_a, ...)."""

    def __getattr__(self, name):
        return self.get(name)


def torch_norm(x, weight, bias, kind: str, eps: float):
    if kind == "rmsnorm":  # as HF LlamaRMSNorm: normalise in fp32, scale in the input dtype
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class ReferenceOps:
    """The op contract's torch reference (functional caches are copied back in place)."""

    name = "reference"

    def norm(self, x, weight, bias, kind: str, eps: float):
        return torch_norm(x, weight, bias, kind, eps)

    def predictor(self, h, lw: LayerWeights, kept_units: int, kept_heads: int):
        return ref.lookahead_predictor(h, lw.mlp_a, lw.mlp_b, lw.head_a, lw.head_b, kept_units, kept_heads)

    # --- the decode step's ends ---------------------------------------------------------------
    def embed(self, emb, pos_emb, tokens, positions, pos_offset: int):
        h = emb[tokens]
        return h if pos_emb is None else h + pos_emb[positions.long() + pos_offset]

    def greedy_tail(self, logits, logits_out, tokens, position):
        """logits_out = float(logits); tokens = argmax; position += 1 (greedy decoding's buffer updates)."""
        logits_out.copy_(logits)
        tokens.copy_(logits_out.argmax(-1))
        position.add_(1)

    def mlp(self, x, idx, lw: LayerWeights, activation: str, block_size: int):
        return ref.sparse_mlp(x, idx, activation=activation, block_size=block_size, w_up=lw.w_up,
                              w_down_t=lw.w_down_t, w_gate=lw.w_gate, b_up=lw.b_up, b_down=lw.b_down)

    def step_context(self, position, T, rope):
        return None

    # Residual forms, h + op(x): the kernels fuse the add into their final pass (one rounding, two fewer
    # launches per layer); the torch paths add afterwards.
    def mlp_residual(self, h, x, idx, lw: LayerWeights, activation: str, block_size: int):
        return h + self.mlp(x, idx, lw, activation, block_size)

    def attention_residual(self, h, x, head_idx, position, lw: LayerWeights, k_cache, v_cache, **kw):
        return h + self.attention(x, head_idx, position, lw, k_cache, v_cache, **kw)

    def attention(self, x, head_idx, position, lw: LayerWeights, k_cache, v_cache, *, dims, scale, rope,
                  kv_policy: str, ctx=None):
        cos, sin = rope if rope is not None else (torch.zeros(1), torch.zeros(1))
        y, kc, vc = ref.head_sparse_attention(
            x, head_idx, position, lw.w_q, lw.w_k, lw.w_v, lw.w_o_t, lw.b_q, lw.b_k, lw.b_v, lw.b_o, cos, sin,
            k_cache, v_cache, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
            rotary=int(rope is not None), scale=scale, kv_policy=kv_policy)
        k_cache.copy_(kc)
        v_cache.copy_(vc)
        return y

    def dense_mlp(self, x, lw, activation, block_size):
        n_units = lw.w_up.shape[0] // block_size
        return self.mlp(x, torch.arange(n_units, dtype=torch.int32, device=x.device), lw, activation, block_size)

    def dense_attention(self, x, position, lw, k_cache, v_cache, *, dims, scale, rope, ctx=None):
        heads = torch.arange(dims.num_heads, dtype=torch.int32, device=x.device)
        return self.attention(x, heads, position, lw, k_cache, v_cache, dims=dims, scale=scale, rope=rope,
                              kv_policy="dense")


class TorchOps(ReferenceOps):
    """Graph-capturable torch implementation (in-place cache writes, static shapes)."""

    name = "torch"

    def predictor(self, h, lw, kept_units, kept_heads):
        # fp32 scores: fp16 scores tie often, and ties would make the selection depend on the backend.
        hf = h.float()
        z = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + PREDICTOR_EPS)

        def top(a, b, k):
            s = ((z @ a.float()) @ b.float()).amax(0)
            return torch.sort(torch.topk(s, k, sorted=False).indices).values.to(torch.int32)
        return top(lw.mlp_a, lw.mlp_b, kept_units), top(lw.head_a, lw.head_b, kept_heads)

    def mlp(self, x, idx, lw, activation, block_size):
        j = ref.expand_blocks(idx, block_size)
        up = F.linear(x, lw.w_up.index_select(0, j))
        if activation == "silu_glu":
            a = F.silu(F.linear(x, lw.w_gate.index_select(0, j))) * up
        else:
            up = up + lw.b_up.index_select(0, j)
            a = torch.relu(up) if activation == "relu" else F.gelu(up)
        y = a @ lw.w_down_t.index_select(0, j)
        return y + lw.b_down if activation != "silu_glu" and lw.b_down is not None else y

    def step_context(self, position, T, rope):
        return StepContext(position, T, rope)

    def dense_mlp(self, x, lw, activation, block_size):
        if activation == "silu_glu":
            a = F.silu(F.linear(x, lw.w_gate)) * F.linear(x, lw.w_up)
        else:
            up = F.linear(x, lw.w_up, lw.b_up)
            a = torch.relu(up) if activation == "relu" else F.gelu(up)
        b_down = lw.b_down if activation != "silu_glu" else None
        if lw.w_down is not None:  # HF layout [d, N], kept for the dense baseline: cuBLAS's fastest GEMV
            return F.linear(a, lw.w_down, b_down)
        return a @ lw.w_down_t if b_down is None else torch.addmm(b_down, a, lw.w_down_t)

    @staticmethod
    def _write_kv(k_cache, v_cache, k, v, kv_heads, ctx):
        k_cache.index_put_((ctx.rows, kv_heads[None, :], ctx.pos[:, None]), k.to(k_cache.dtype))
        v_cache.index_put_((ctx.rows, kv_heads[None, :], ctx.pos[:, None]), v.to(v_cache.dtype))

    def attention(self, x, head_idx, position, lw, k_cache, v_cache, *, dims, scale, rope, kv_policy, ctx=None):
        ctx = ctx or StepContext(position, k_cache.shape[2], rope)
        B, d = x.shape
        H, Hkv, hd = dims.num_heads, dims.num_kv_heads, dims.head_dim
        group = H // Hkv
        heads = head_idx.long()
        if kv_policy == "dense":
            kv_heads = torch.arange(Hkv, device=x.device)
            k = F.linear(x, lw.w_k, lw.b_k).view(B, Hkv, hd)
            v = F.linear(x, lw.w_v, lw.b_v).view(B, Hkv, hd)
        else:  # the KV heads of the selected heads (repeats write identical values)
            kv_heads = heads // group
            k = (F.linear(x, lw.w_k.view(Hkv, hd, d)[kv_heads].reshape(-1, d))
                 + lw.b_k.view(Hkv, hd)[kv_heads].reshape(-1)).view(B, -1, hd)
            v = (F.linear(x, lw.w_v.view(Hkv, hd, d)[kv_heads].reshape(-1, d))
                 + lw.b_v.view(Hkv, hd)[kv_heads].reshape(-1)).view(B, -1, hd)
        q = (F.linear(x, lw.w_q.view(H, hd, d)[heads].reshape(-1, d))
             + lw.b_q.view(H, hd)[heads].reshape(-1)).view(B, -1, hd)
        if ctx.cos is not None:
            k, q = ref.apply_rope(k, ctx.cos, ctx.sin).to(x.dtype), ref.apply_rope(q, ctx.cos, ctx.sin).to(x.dtype)
        self._write_kv(k_cache, v_cache, k, v, kv_heads, ctx)
        g = heads // group
        o = F.scaled_dot_product_attention(q[:, :, None, :], k_cache[:, g], v_cache[:, g], attn_mask=ctx.mask,
                                           scale=scale)[:, :, 0, :]
        w_o = lw.w_o_t.view(H, hd, d)[heads].reshape(-1, d)
        return torch.addmm(lw.b_o, o.reshape(B, -1), w_o)

    def dense_attention(self, x, position, lw, k_cache, v_cache, *, dims, scale, rope, ctx=None):
        ctx = ctx or StepContext(position, k_cache.shape[2], rope)
        B, d = x.shape
        H, Hkv, hd = dims.num_heads, dims.num_kv_heads, dims.head_dim
        q = F.linear(x, lw.w_q, lw.b_q).view(B, H, hd)
        k = F.linear(x, lw.w_k, lw.b_k).view(B, Hkv, hd)
        v = F.linear(x, lw.w_v, lw.b_v).view(B, Hkv, hd)
        if ctx.cos is not None:
            k, q = ref.apply_rope(k, ctx.cos, ctx.sin).to(x.dtype), ref.apply_rope(q, ctx.cos, ctx.sin).to(x.dtype)
        self._write_kv(k_cache, v_cache, k, v, torch.arange(Hkv, device=x.device), ctx)
        o = F.scaled_dot_product_attention(q[:, :, None, :], k_cache, v_cache, attn_mask=ctx.mask, scale=scale,
                                           enable_gqa=H != Hkv).reshape(B, H * hd)
        if lw.w_o is not None:
            return F.linear(o, lw.w_o, lw.b_o)
        return torch.addmm(lw.b_o, o, lw.w_o_t)


class KernelOps(TorchOps):
    """libdejavu_kernels through dejavu_trt.kernels; dense paths stay on cuBLAS (TorchOps)."""

    name = "kernels"
    folds_norms = True  # the *_folded calls (DecoderWeights.add_folded_norms)

    def __init__(self, torch_predictor: bool = False):
        from .. import kernels
        kernels.load_library()  # raises KernelsUnavailable when the library is not built
        self.k = kernels
        self._rope: dict = {}
        # the step's embedding and greedy tail as one launch each; DEJAVU_FUSED_STEP_ENDS=0 keeps torch's (A/B)
        self.fused_step_ends = os.environ.get("DEJAVU_FUSED_STEP_ENDS", "1") != "0"
        self.torch_predictor = torch_predictor
        if torch_predictor:
            self.name = "kernels+torch-predictor"

    def set_mlp_grid_slack(self, sms: int) -> int:
        """The fused MLP's grid sized for `sms` fewer SMs (kernels.set_mlp_grid_slack); returns the previous."""
        return self.k.set_mlp_grid_slack(sms)

    def set_indices_ready(self, ready: bool) -> bool:
        """kernels.set_indices_ready; returns the previous setting."""
        return self.k.set_indices_ready(ready)

    def norm(self, x, weight, bias, kind, eps):
        d = x.shape[-1]
        if x.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 16384 and x.is_contiguous() \
                and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
            return self.k.norm(x, weight, bias, kind=kind, eps=eps)
        return torch_norm(x, weight, bias, kind, eps)

    def predictor(self, h, lw, kept_units, kept_heads):
        if self.torch_predictor:
            return TorchOps.predictor(self, h, lw, kept_units, kept_heads)
        return self.k.predictor(h, lw.mlp_a, lw.mlp_b, lw.head_a, lw.head_b, kept_units=kept_units,
                                kept_heads=kept_heads)

    def embed(self, emb, pos_emb, tokens, positions, pos_offset):
        fits = tokens.dim() == 1 and tokens.dtype == torch.int64 and emb.shape[1] % 8 == 0 \
            and emb.dtype in (torch.float16, torch.bfloat16) and (pos_emb is None or positions.dtype == torch.int32)
        if self.fused_step_ends and fits:
            return self.k.embed(tokens, positions, emb, pos_emb, pos_offset=pos_offset)
        return super().embed(emb, pos_emb, tokens, positions, pos_offset)

    def greedy_tail(self, logits, logits_out, tokens, position):
        if self.fused_step_ends and logits.dtype in (torch.float16, torch.bfloat16) and logits.is_contiguous():
            self.k.greedy_tail(logits, tokens, position, logits_out=logits_out)
        else:
            super().greedy_tail(logits, logits_out, tokens, position)

    def mlp(self, x, idx, lw, activation, block_size, residual=None, y_stats=None):
        return self.k.sparse_mlp(x, idx, activation=activation, block_size=block_size, w_up=lw.w_up,
                                 w_down_t=lw.w_down_t, w_gate=lw.w_gate, b_up=lw.b_up, b_down=lw.b_down,
                                 residual=residual, y_stats=y_stats)

    def mlp_residual(self, h, x, idx, lw, activation, block_size, y_stats=None):
        return self.mlp(x, idx, lw, activation, block_size, residual=h, y_stats=y_stats)

    # --- norm folding: the op normalises its input from row statistics the op before wrote ----------
    def empty_stats(self, h):
        return self.k.empty_stats(h.shape[0], h.shape[-1], h.device)

    def row_stats(self, h):
        return self.k.row_stats(h)

    def mlp_residual_folded(self, h, h_stats, idx, lw, activation, block_size, norm_kind: str, eps: float,
                            y_stats=None):
        """h + MLP(mlp_norm(h)), the norm done from h's row statistics with its weight and bias folded into
        w_up_nf / w_gate_nf / b_up_nf."""
        return self.k.sparse_mlp(h, idx, activation=activation, block_size=block_size, w_up=lw.w_up_nf,
                                 w_down_t=lw.w_down_t, w_gate=lw.w_gate_nf, b_up=lw.b_up_nf, b_down=lw.b_down,
                                 residual=h, x_stats=h_stats, norm_kind=norm_kind, norm_eps=eps, y_stats=y_stats)

    def attention_residual_folded(self, h, h_stats, head_idx, position, lw, k_cache, v_cache, *, dims, scale,
                                  rope, kv_policy, norm_kind: str, eps: float, ctx=None, y_stats=None):
        """h + attention(attn_norm(h)), the norm done from h's row statistics with its weight and bias folded
        into w_q_nf / w_k_nf / w_v_nf and their biases."""
        cos, sin = self._rope_in(rope, h.dtype)
        y, _, _ = self.k.head_sparse_attention(
            h, head_idx, position, lw.w_q_nf, lw.w_k_nf, lw.w_v_nf, lw.w_o_t, lw.b_q_nf, lw.b_k_nf, lw.b_v_nf,
            lw.b_o, cos, sin, k_cache, v_cache, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim, rotary=int(rope is not None), scale=scale, kv_policy=kv_policy, residual=h,
            x_stats=h_stats, norm_kind=norm_kind, norm_eps=eps, y_stats=y_stats)
        return y

    def attention_residual(self, h, x, head_idx, position, lw, k_cache, v_cache, **kw):
        return self.attention(x, head_idx, position, lw, k_cache, v_cache, residual=h, **kw)

    def _rope_in(self, rope, dtype):
        """The kernels take every floating tensor in the activation dtype: cast the tables once."""
        if rope is None:
            return None, None
        key = (rope[0].data_ptr(), dtype)
        if key not in self._rope:
            self._rope[key] = (rope[0].to(dtype).contiguous(), rope[1].to(dtype).contiguous())
        return self._rope[key]

    def attention(self, x, head_idx, position, lw, k_cache, v_cache, *, dims, scale, rope, kv_policy, ctx=None,
                  residual=None, y_stats=None):
        cos, sin = self._rope_in(rope, x.dtype)
        y, _, _ = self.k.head_sparse_attention(
            x, head_idx, position, lw.w_q, lw.w_k, lw.w_v, lw.w_o_t, lw.b_q, lw.b_k, lw.b_v, lw.b_o, cos, sin,
            k_cache, v_cache, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
            rotary=int(rope is not None), scale=scale, kv_policy=kv_policy, residual=residual, y_stats=y_stats)
        return y


def make_ops(name):
    """'reference' | 'torch' | 'kernels' | 'auto' (kernels when the library loads, else torch), or an op
    backend object, returned as is (benchmarks pass instrumented backends)."""
    if not isinstance(name, str):
        return name
    if name == "reference":
        return ReferenceOps()
    if name == "torch":
        return TorchOps()
    if name == "kernels+torch-predictor":
        return KernelOps(torch_predictor=True)
    if name in ("kernels", "auto"):
        try:
            return KernelOps()
        except Exception as e:  # noqa: BLE001 - any failure to load the library means: no kernels
            if name == "kernels":
                from ..errors import DejaVuError
                raise DejaVuError(f"the kernel library could not be loaded ({str(e).splitlines()[0] if str(e) else e.__class__.__name__}); "
                                  f"build it with `python -m dejavu_trt.kernels.build` or use --ops torch") from None
            return TorchOps()
    from ..errors import DejaVuError
    raise DejaVuError(f"unknown op backend {name!r}; use auto, kernels, torch or reference")
