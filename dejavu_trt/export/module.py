"""The canonical decode-step module (gpt-fast style), built from an HF model through its adapter.

One call of `DecodeModel.step` consumes one new token per batch row, writes that token's K/V into
preallocated cache buffers at `position`, and returns the logits. Weights are held in the op
contract's layouts (docs/ops.md) and shared with the HF model (no copies). The same module is

* the source the ONNX decode graph is emitted from (`export/onnx_graph.py`), with stable per-layer
  names `layers.{i}.attn`, `layers.{i}.mlp`, `layers.{i}.predictor`;
* the PyTorch reference, dense or sparse: with a `SparsePlan`, each layer's lookahead predictor
  picks MLP units and heads and the layer runs the contract's torch reference ops
  (`dejavu_trt/ops/reference.py`), exactly as the plugin nodes will.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DejaVuError
from ..models.adapters import FamilyAdapter
from ..ops import reference as ref
from ..ops.contract import KV_POLICIES
from .config import DecodeConfig


@dataclass
class KVCache:
    """Preallocated per-layer buffers [B, Hkv, T, hd]; `step` updates them in place."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(cls, cfg: DecodeConfig, batch: int, dtype=torch.float32, device="cpu") -> "KVCache":
        shape = cfg.cache_shape(batch)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)])

    def as_feed(self) -> dict[str, torch.Tensor]:
        feed = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            feed[f"past_key.{i}"], feed[f"past_value.{i}"] = k, v
        return feed


@dataclass
class SparsePlan:
    """Predicted sparsity: per-layer predictor weights, kept counts, block size and KV policy."""

    predictors: dict[str, torch.Tensor]   # layers.{l}.mlp_a [d,r] / mlp_b [r,Nb] / head_a / head_b
    mlp_kept: list[int]                   # kept units (blocks) per layer
    heads_kept: list[int]                 # kept heads per layer
    block_size: int = 1
    kv_policy: str = "dense"
    record: list = field(default_factory=list)  # (mlp_idx, head_idx) per layer of the last step

    def __post_init__(self):
        if self.kv_policy not in KV_POLICIES:
            raise DejaVuError(f"kv policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")

    def predict(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.predictors
        return ref.lookahead_predictor(h, p[f"layers.{layer}.mlp_a"], p[f"layers.{layer}.mlp_b"],
                                       p[f"layers.{layer}.head_a"], p[f"layers.{layer}.head_b"],
                                       self.mlp_kept[layer], self.heads_kept[layer])


def predictor_source(layer: int) -> int:
    """Index of the hidden state a layer's lookahead predictor reads: the input of layer-1
    (hidden.0, the embeddings, for layers 0 and 1). This is what lets it run one layer ahead."""
    return max(layer - 1, 0)


class Norm(nn.Module):
    def __init__(self, kind: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        super().__init__()
        self.kind, self.eps = kind, float(eps)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MLP(nn.Module):
    """Weights in contract layout: w_up/w_gate [N, d], w_down_t [N, d]."""

    def __init__(self, activation: str, w_up, w_down_t, w_gate=None, b_up=None, b_down=None):
        super().__init__()
        self.activation = activation
        for name, t in dict(w_up=w_up, w_down_t=w_down_t, w_gate=w_gate, b_up=b_up, b_down=b_down).items():
            self.register_buffer(name, t, persistent=False)

    def forward(self, x, idx=None, block_size: int = 1):
        if idx is not None:
            return ref.sparse_mlp(x, idx, activation=self.activation, block_size=block_size, w_up=self.w_up,
                                  w_down_t=self.w_down_t, w_gate=self.w_gate, b_up=self.b_up, b_down=self.b_down)
        up = x @ self.w_up.T
        if self.activation == "silu_glu":
            return (F.silu(x @ self.w_gate.T) * up) @ self.w_down_t
        up = up + self.b_up
        a = torch.relu(up) if self.activation == "relu" else F.gelu(up)
        return a @ self.w_down_t + self.b_down


class Attention(nn.Module):
    """One decode step over the preallocated cache; the contract's DejaVuHeadSparseAttention."""

    def __init__(self, cfg: DecodeConfig, w, rope_cos, rope_sin):
        super().__init__()
        self.cfg = cfg
        self.scale = w.scale
        for name in ("w_q", "w_k", "w_v", "w_o_t", "b_q", "b_k", "b_v", "b_o"):
            self.register_buffer(name, getattr(w, name), persistent=False)
        self.rope_cos, self.rope_sin = rope_cos, rope_sin

    def forward(self, x, position, k_cache, v_cache, head_idx=None, kv_policy="dense"):
        cfg = self.cfg
        if head_idx is None:
            head_idx = torch.arange(cfg.num_heads, dtype=torch.int32, device=x.device)
        y, k_new, v_new = ref.head_sparse_attention(
            x, head_idx, position, self.w_q, self.w_k, self.w_v, self.w_o_t, self.b_q, self.b_k, self.b_v,
            self.b_o, self.rope_cos, self.rope_sin, k_cache, v_cache, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rotary=int(cfg.rotary), scale=self.scale,
            kv_policy=kv_policy)
        k_cache.copy_(k_new)   # in place, like the CUDA executor and TensorRT's aliased caches
        v_cache.copy_(v_new)
        return y


class Block(nn.Module):
    def __init__(self, attn_norm: Norm, attn: Attention, mlp_norm: Norm, mlp: MLP):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp


def _norm_from(kind: str, module: nn.Module, default_eps: float) -> Norm:
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None) or default_eps
    bias = getattr(module, "bias", None)
    return Norm(kind, module.weight.detach(), bias.detach() if bias is not None else None, eps)


class DecodeModel(nn.Module):
    """Embeddings -> L blocks -> final norm -> lm_head, one token per row per step."""

    def __init__(self, cfg: DecodeConfig, embed: torch.Tensor, blocks: list[Block], final_norm: Norm,
                 lm_head: torch.Tensor, pos_embed: torch.Tensor | None, rope_cos, rope_sin):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.register_buffer("embed", embed, persistent=False)          # [V, d]
        self.register_buffer("lm_head", lm_head, persistent=False)      # [V, d] (HF layout; may be tied)
        self.register_buffer("pos_embed", pos_embed, persistent=False)  # [T, d] (OPT) or None
        self.register_buffer("rope_cos", rope_cos, persistent=False)    # [T, hd/2] (LLaMA) or [1, 1]
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    @classmethod
    def from_adapter(cls, adapter: FamilyAdapter, max_context: int, num_layers: int | None = None) -> "DecodeModel":
        cfg = DecodeConfig.from_dims(adapter.dims(), max_context, num_layers)
        if cfg.rotary:
            cos, sin = adapter.rope_tables(cfg.max_context)
            pos_embed = None
        else:
            cos = sin = torch.zeros(1, 1)
            # OPT's learned positions are offset by 2 (HF OPTLearnedPositionalEmbedding).
            pos_embed = adapter.embed_positions().weight.detach()[2:2 + cfg.max_context]
        blocks = []
        for i in range(cfg.num_layers):
            m = adapter.mlp_weights(i)
            blocks.append(Block(_norm_from(cfg.norm, adapter.attn_norm(i), cfg.norm_eps),
                                Attention(cfg, adapter.attention_weights(i), cos, sin),
                                _norm_from(cfg.norm, adapter.mlp_norm(i), cfg.norm_eps),
                                MLP(m.activation, m.w_up, m.w_down_t, m.w_gate, m.b_up, m.b_down)))
        return cls(cfg, adapter.embed_tokens().weight.detach(), blocks,
                   _norm_from(cfg.norm, adapter.final_norm(), cfg.norm_eps),
                   adapter.lm_head().weight.detach(), pos_embed, cos, sin)

    def new_cache(self, batch: int) -> KVCache:
        return KVCache.empty(self.cfg, batch, self.embed.dtype, self.embed.device)

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, position: torch.Tensor, cache: KVCache,
             plan: SparsePlan | None = None) -> torch.Tensor:
        """input_ids [B] int64, position [B] int32 -> logits [B, V]; the cache is updated in place."""
        if int(position.max()) >= self.cfg.max_context:
            raise DejaVuError(f"position {int(position.max())} is beyond the max context {self.cfg.max_context}")
        h = self.embed[input_ids.long()]
        if self.pos_embed is not None:
            h = h + self.pos_embed[position.long()]
        hidden = [h]                  # hidden[l] = input of layer l
        if plan is not None:
            plan.record = []
        for i, blk in enumerate(self.blocks):
            mlp_idx = head_idx = None
            if plan is not None:
                mlp_idx, head_idx = plan.predict(i, hidden[predictor_source(i)])
                plan.record.append((mlp_idx, head_idx))
            a = blk.attn(blk.attn_norm(h), position, cache.keys[i], cache.values[i], head_idx,
                         plan.kv_policy if plan is not None else "dense")
            h = h + a
            h = h + blk.mlp(blk.mlp_norm(h), mlp_idx, plan.block_size if plan is not None else 1)
            hidden.append(h)
        return self.final_norm(h) @ self.lm_head.T

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: KVCache, plan: SparsePlan | None = None) -> torch.Tensor:
        """Documented prefill path: run the decode step over the prompt, token by token.

        input_ids [B, P] -> logits [B, P, V]. Rows share positions 0..P-1 (left-aligned prompts).
        """
        B, P = input_ids.shape
        if P > self.cfg.max_context:
            raise DejaVuError(f"prompt of {P} tokens is longer than the max context {self.cfg.max_context}")
        out = []
        for t in range(P):
            pos = torch.full((B,), t, dtype=torch.int32, device=input_ids.device)
            out.append(self.step(input_ids[:, t], pos, cache, plan))
        return torch.stack(out, 1)

    def forward(self, input_ids, position, *past):
        """Functional form matching the ONNX graph's I/O: (logits, present_key.0, present_value.0, ...)."""
        cache = KVCache([p.clone() for p in past[0::2]], [p.clone() for p in past[1::2]])
        logits = self.step(input_ids, position, cache)
        return (logits, *[t for kv in zip(cache.keys, cache.values) for t in kv])
