"""Forward hooks that capture what the predictors learn from and are judged against.

* MLP activity: the input of the down projection is the per-neuron activation a [.., N]
  (OPT: ReLU(fc1·x + b); LLaMA: silu(gate·x)·(up·x)). Its magnitude |a_j| is how much neuron j
  can move the output, and zeroing it is exactly "neuron skipped" — so it is the oracle's score.
* Head importance: the input of the output projection is the concatenation of the heads'
  outputs o_h; head h contributes W_o[:, h] o_h, whose norm we record. It is computed through the
  per-head Gram matrix G_h = W_o[:, h]^T W_o[:, h] (hd x hd), ||W_o[:, h] o_h||^2 = o_h^T G_h o_h,
  so memory stays O(tokens x H) even for very wide models.
"""
from __future__ import annotations

import torch

from ..models.adapters import FamilyAdapter


def block_activity(a: torch.Tensor, block_size: int, reduce: str = "sum") -> torch.Tensor:
    """|a| per unit: [.., N] -> [.., N / block_size] (sum or max of the members' magnitudes)."""
    a = a.abs()
    if block_size == 1:
        return a
    a = a.unflatten(-1, (a.shape[-1] // block_size, block_size))
    return a.sum(-1) if reduce == "sum" else a.amax(-1)


def head_gram(adapter: FamilyAdapter, layer: int) -> torch.Tensor:
    """[H, hd, hd] Gram matrices of each head's slice of the output projection (fp32)."""
    dims = adapter.dims()
    w = adapter.attn_out(layer).weight.detach().float()            # [d, H*hd]
    w = w.T.reshape(dims.num_heads, dims.head_dim, dims.hidden_size)  # [H, hd, d]
    return w @ w.transpose(1, 2)


def head_importance(o: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """o [.., H*hd] concatenated head outputs -> [.., H] norms of each head's contribution."""
    H, hd, _ = gram.shape
    o = o.float().unflatten(-1, (H, hd))
    sq = torch.einsum("...hk,hkl,...hl->...h", o, gram, o)
    return sq.clamp_min(0).sqrt()


class ActivityRecorder:
    """Registers pre-hooks on every layer's down and output projections; `pop()` returns the
    records of the last forward pass as {"mlp.{l}": [b, t, Nb], "heads.{l}": [b, t, H]}."""

    def __init__(self, adapter: FamilyAdapter, block_size: int = 1, reduce: str = "sum"):
        self.adapter, self.block_size, self.reduce = adapter, block_size, reduce
        self.captured: dict[str, torch.Tensor] = {}
        self.handles = []
        for l in range(adapter.dims().num_layers):
            self.handles.append(adapter.mlp_down(l).register_forward_pre_hook(self._mlp_hook(l)))
            gram = head_gram(adapter, l)
            self.handles.append(adapter.attn_out(l).register_forward_pre_hook(self._head_hook(l, gram)))

    def _mlp_hook(self, layer: int):
        def hook(module, args):
            self.captured[f"mlp.{layer}"] = block_activity(args[0].detach(), self.block_size, self.reduce)
        return hook

    def _head_hook(self, layer: int, gram: torch.Tensor):
        def hook(module, args):
            self.captured[f"heads.{layer}"] = head_importance(args[0].detach(), gram.to(args[0].device))
        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        out, self.captured = self.captured, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
