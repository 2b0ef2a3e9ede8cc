"""The sparse reference: the real HF model, run in PyTorch, with units skipped exactly as the kernels skip them.

Hooks on the adapter's modules do the skipping:

* MLP: a forward pre-hook on `mlp_down(i)` zeroes the entries of its input (the per-neuron
  activation a [.., N]) that belong to unselected units (blocks of `block_size` neurons). A
  skipped unit then contributes exactly zero, as in `DejaVuSparseMLP`; the down bias stays.
* Heads: a forward pre-hook on `attn_out(i)` zeroes the slices of its input (the concatenated head
  outputs [.., H*hd]) of unselected heads, as in `DejaVuHeadSparseAttention`; the output bias stays.
  K/V projections are still computed for every head, i.e. this reference implements the op's
  `kv_policy = "dense"`: a head that wakes up later sees its full KV history.

Selection modes, at the plan's kept counts per layer:

* `dense`    — nothing skipped (the plan is ignored).
* `predicted`— per token, top-k of the lookahead predictor scores (`topk_sorted` tie rule). Layer
  l's predictor reads the input of layer max(l-1, 0) **of this sparse model** (a pre-hook on every
  decoder layer records it), exactly as at decode time.
* `oracle`   — per token, hindsight top-k of the true activity: the block's sum of |a_j| for the MLP,
  the norm of each head's contribution through the output projection for heads.

Every token is selected on its own (B = 1 decode semantics, no batch union), and a token's
selection depends only on its own hidden states, so running full sequences with teacher forcing
(the fast path) computes the same thing as decoding one token at a time with a KV cache (the
decode path); `tests/test_sparse_reference.py` checks that they agree.

While it runs, the reference records per-layer recall of the predicted units against the oracle
ones (|pred ∩ oracle| / k), measured on the sparse model's own activations. Oracle units with
exactly zero activity (ReLU) are not counted: k becomes the number of oracle units that matter.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import DejaVuError
from ..models.adapters import FamilyAdapter
from .plan import SparsityPlan

MODES = ("dense", "predicted", "oracle")


class Scorer(Protocol):
    """What the sparse reference needs from predictors (dejavu_trt.predictors.LookaheadPredictors)."""

    def mlp_scores(self, layer: int, h: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., N/block]
        ...

    def head_scores(self, layer: int, h: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., H]
        ...


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of each row's k largest scores; ties toward the lower index (ops.reference.topk_sorted)."""
    if k >= scores.shape[-1]:
        return torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    # Cheaper than a full stable sort: everything above the k-th value, then the lowest-index
    # entries equal to it until k are taken.
    kth = torch.topk(scores, k, dim=-1, sorted=True).values[..., -1:]
    above = scores > kth
    at = scores == kth
    room = k - above.sum(-1, keepdim=True)
    return above | (at & (at.cumsum(-1) <= room))


def oracle_mlp_scores(a: torch.Tensor, block_size: int) -> torch.Tensor:
    """True activity per unit: sum of |a_j| over the unit's neurons. a [..., N] -> [..., N/block]."""
    if block_size == 1:
        return a.abs()
    return a.abs().unflatten(-1, (-1, block_size)).sum(-1)


def oracle_head_scores(o: torch.Tensor, w_o_t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Norm of each head's contribution through the output projection. o [..., H*hd] -> [..., H]."""
    hd = o.shape[-1] // num_heads
    w = w_o_t.view(num_heads, hd, -1)
    contrib = torch.einsum("...hk,hkd->...hd", o.unflatten(-1, (num_heads, hd)), w.to(o.dtype))
    return torch.linalg.vector_norm(contrib, dim=-1)


@dataclass
class SelectionStats:
    """Per-layer counters of what the predicted selection got right (against the oracle)."""

    num_layers: int
    mlp_hits: list[int] = field(default_factory=list)
    mlp_total: list[int] = field(default_factory=list)
    head_hits: list[int] = field(default_factory=list)
    head_total: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name in ("mlp_hits", "mlp_total", "head_hits", "head_total"):
            setattr(self, name, [0] * self.num_layers)

    @staticmethod
    def _ratio(hits, total) -> list[float | None]:
        return [h / t if t else None for h, t in zip(hits, total)]

    @property
    def recall_mlp_per_layer(self) -> list[float | None]:
        """None for layers that keep every unit (nothing to predict)."""
        return self._ratio(self.mlp_hits, self.mlp_total)

    @property
    def recall_heads_per_layer(self) -> list[float | None]:
        return self._ratio(self.head_hits, self.head_total)

    @property
    def recall_mlp(self) -> float | None:
        t = sum(self.mlp_total)
        return sum(self.mlp_hits) / t if t else None

    @property
    def recall_heads(self) -> float | None:
        t = sum(self.head_total)
        return sum(self.head_hits) / t if t else None


class SparseReference:
    """Context manager: while active, `adapter.model` runs sparse according to `plan` and `mode`."""

    def __init__(self, adapter: FamilyAdapter, plan: SparsityPlan, mode: str = "predicted",
                 predictors: Scorer | None = None, record: bool = True, log_masks: bool = False,
                 replay: dict | None = None):
        """`log_masks` keeps every selection in `self.masks[(kind, layer)]` (rows = tokens in call
        order); `replay` (such a dict, from a B = 1 run) imposes those selections instead of
        choosing: the decode path replaying the batched path's choices must match it to float
        noise, which separates KV-cache/hook mechanics from top-k near-ties flipping."""
        if mode not in MODES:
            raise DejaVuError(f"unknown selection mode {mode!r}; use one of {', '.join(MODES)}")
        if mode == "predicted" and predictors is None:
            raise DejaVuError("predicted selection needs trained predictors (run `dejavu-trt train-predictors`)")
        dims = adapter.dims()
        if plan.num_layers != dims.num_layers or plan.num_heads != dims.num_heads or \
                plan.num_units * plan.block_size != dims.intermediate_size:
            raise DejaVuError("the sparsity plan does not fit this model (layers, heads or MLP units differ)")
        self.adapter, self.plan, self.mode, self.predictors = adapter, plan, mode, predictors
        self.record = record and mode == "predicted"
        self.dims = dims
        self.stats = SelectionStats(dims.num_layers)
        self._layer_inputs: dict[int, torch.Tensor] = {}
        self._w_o_t = {}
        self._handles: list = []
        self.log_masks, self.replay = log_masks, replay
        self.masks: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._cursor: dict[tuple[str, int], int] = {}

    # --- hooks --------------------------------------------------------------------------------
    def __enter__(self) -> "SparseReference":
        if self.mode == "dense":
            return self
        for i, layer in enumerate(self.adapter.layers()):
            self._handles.append(layer.register_forward_pre_hook(self._layer_input_hook(i), with_kwargs=True))
            # Hooks go on every layer, also those that keep all units (an all-true mask): the
            # "all kept == dense" test then exercises the same code path as a sparse run.
            self._handles.append(self.adapter.mlp_down(i).register_forward_pre_hook(self._mlp_hook(i)))
            self._w_o_t[i] = self.adapter.attn_out(i).weight.detach().T
            self._handles.append(self.adapter.attn_out(i).register_forward_pre_hook(self._head_hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._layer_inputs.clear()

    def _predictor_input(self, i: int) -> torch.Tensor:
        return self._layer_inputs[max(i - 1, 0)]

    def _layer_input_hook(self, i: int):
        def hook(module, args, kwargs):
            self._layer_inputs[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _mlp_hook(self, i: int):
        k, bs = self.plan.mlp_kept_units[i], self.plan.block_size

        def hook(module, args):
            a = args[0]
            if self.mode == "oracle":
                keep = topk_mask(oracle_mlp_scores(a, bs), k)
            else:
                # (OPT flattens [B, T, .] to [B*T, .] inside its MLP; the layer input is [B, T, d])
                scores = self.predictors.mlp_scores(i, self._predictor_input(i)).reshape(*a.shape[:-1], -1)
                keep = topk_mask(scores.to(torch.float32), k)
                if self.record and k < self.plan.num_units:
                    oracle = oracle_mlp_scores(a, bs)
                    # Units with exactly zero activity (ReLU) are left out: which of them the
                    # oracle "keeps" is arbitrary, and keeping or skipping them changes nothing.
                    relevant = topk_mask(oracle, k) & (oracle > 0)
                    self.stats.mlp_hits[i] += int((keep & relevant).sum().item())
                    self.stats.mlp_total[i] += int(relevant.sum().item())
            keep = self._log_or_replay(("mlp", i), keep)
            if bs > 1:
                keep = keep.repeat_interleave(bs, dim=-1)
            return (a.masked_fill(~keep, 0),) + tuple(args[1:])
        return hook

    def _head_hook(self, i: int):
        k, H = self.plan.heads_kept[i], self.plan.num_heads

        def hook(module, args):
            o = args[0]
            if self.mode == "oracle":
                keep = topk_mask(oracle_head_scores(o, self._w_o_t[i], H), k)
            else:
                scores = self.predictors.head_scores(i, self._predictor_input(i)).reshape(*o.shape[:-1], -1)
                keep = topk_mask(scores.to(torch.float32), k)
                if self.record and k < H:
                    hits = (keep & topk_mask(oracle_head_scores(o, self._w_o_t[i], H), k)).sum().item()
                    self.stats.head_hits[i] += int(hits)
                    self.stats.head_total[i] += keep[..., 0].numel() * k
            keep = self._log_or_replay(("heads", i), keep)
            keep = keep.repeat_interleave(o.shape[-1] // H, dim=-1)
            return (o.masked_fill(~keep, 0),) + tuple(args[1:])
        return hook

    def _log_or_replay(self, key: tuple[str, int], keep: torch.Tensor) -> torch.Tensor:
        if self.replay is not None:
            rows = keep.reshape(-1, keep.shape[-1]).shape[0]
            start = self._cursor.get(key, 0)
            keep = torch.cat(self.replay[key])[start:start + rows].reshape(keep.shape)
            self._cursor[key] = start + rows
        if self.log_masks:
            self.masks.setdefault(key, []).append(keep.reshape(-1, keep.shape[-1]).clone())
        return keep


@contextlib.contextmanager
def sparse_model(adapter: FamilyAdapter, plan: SparsityPlan, mode: str = "predicted",
                 predictors: Scorer | None = None, record: bool = True, **kw):
    """`with sparse_model(...) as ref: model(...)`; `ref.stats` holds recall afterwards."""
    with SparseReference(adapter, plan, mode, predictors, record, **kw) as ref:
        yield ref
