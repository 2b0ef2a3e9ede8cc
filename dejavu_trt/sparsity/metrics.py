"""Perplexity of the sparse reference (batched and decode paths), recall, and bytes moved per token."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..models.adapters import FamilyAdapter, ModelDims
from .plan import SparsityPlan
from .reference import Scorer, SelectionStats, SparseReference

PATHS = ("batched", "decode")


@torch.inference_mode()
def token_nll_batched(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = False,
                      desc: str = "perplexity") -> torch.Tensor:
    """Next-token NLL [n, T-1] of every window, full sequences with teacher forcing."""
    out = []
    for start in tqdm(range(0, windows.shape[0], batch_size), desc=desc, disable=not progress, leave=False):
        ids = windows[start:start + batch_size]
        logits = model(input_ids=ids).logits.float()
        out.append(F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"))
    return torch.cat(out) if out else torch.zeros(0, max(windows.shape[1] - 1, 0))


@torch.inference_mode()
def token_nll_decode(model, windows: torch.Tensor, progress: bool = False, desc: str = "decode") -> torch.Tensor:
    """Next-token NLL [n, T-1], one token at a time through HF's KV cache (B = 1 decode)."""
    from transformers import DynamicCache

    n, T = windows.shape
    out = torch.zeros(n, T - 1)
    bar = tqdm(total=n * (T - 1), desc=desc, disable=not progress, leave=False)
    for w in range(n):
        cache = DynamicCache(config=model.config)
        for t in range(T - 1):
            logits = model(input_ids=windows[w:w + 1, t:t + 1], cache=cache, use_cache=True).logits.float()
            out[w, t] = F.cross_entropy(logits[0, -1:], windows[w, t + 1:t + 2])[()]
            bar.update()
    bar.close()
    return out


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean())) if nll.numel() else float("nan")


@dataclass
class SelectionResult:
    mode: str
    path: str
    ppl: float
    tokens: int
    stats: SelectionStats
    nll: torch.Tensor   # [n, T-1] per-token NLL, for paired comparisons
    masks: dict | None = None   # selections, when logged (SparseReference.masks)


def evaluate_selection(adapter: FamilyAdapter, plan: SparsityPlan, mode: str, windows: torch.Tensor,
                       predictors: Scorer | None = None, path: str = "batched", batch_size: int = 4,
                       progress: bool = False, **reference_kw) -> SelectionResult:
    """Perplexity (and, for `predicted`, recall) of one selection mode on the given windows.

    `reference_kw` go to SparseReference (log_masks, replay); `result.masks` holds logged masks."""
    if path not in PATHS:
        raise ValueError(path)
    with SparseReference(adapter, plan, mode, predictors, **reference_kw) as ref:
        if path == "batched":
            nll = token_nll_batched(adapter.model, windows, batch_size, progress, desc=f"ppl {mode}")
        else:
            nll = token_nll_decode(adapter.model, windows, progress, desc=f"decode {mode}")
    return SelectionResult(mode, path, perplexity(nll), nll.numel(), ref.stats, nll, ref.masks)


# --- bytes moved per decode token -----------------------------------------------------------------

def predictor_params(predictors, layer: int, dims: ModelDims, block_size: int = 1) -> int:
    """Parameters of layer `layer`'s predictor (mlp_a, mlp_b, head_a, head_b)."""
    if hasattr(predictors, "layer_params"):
        return int(predictors.layer_params(layer))
    if hasattr(predictors, "tensors"):          # {name: tensor} with per-layer names
        return sum(t.numel() for name, t in predictors.tensors.items() if _layer_of(name) == layer)
    r_m, r_h = predictors.mlp_rank, predictors.head_rank
    d, nb = dims.hidden_size, dims.intermediate_size // block_size
    return d * r_m + r_m * nb + d * r_h + r_h * dims.num_heads


def _layer_of(name: str) -> int | None:
    for part in name.replace("/", ".").split("."):
        if part.isdigit():
            return int(part)
    return None


def bytes_per_token(dims: ModelDims, plan: SparsityPlan, predictor_params_per_layer: list[int] | None = None,
                    dtype_bytes: int = 2) -> dict:
    """Weight bytes one decode token (B = 1) reads in the decoder layers, dense vs. this plan.

    MLP: every matrix reads only the kept neurons' rows (up/gate and down_t are neuron-major).
    Attention: q and o read only the kept heads; k and v are read for every KV head
    (kv_policy "dense", as in the sparse reference). Embeddings, lm_head, norms, biases and the
    KV cache are left out: they are the same dense and sparse. Default dtype: fp16 (2 bytes).
    """
    d, hd, N = dims.hidden_size, dims.head_dim, dims.intermediate_size
    mats = 3 if dims.activation == "silu_glu" else 2
    kv = 2 * dims.num_kv_heads * hd * d
    per_layer = []
    for i in range(dims.num_layers):
        mlp_dense = mats * d * N
        mlp_sparse = mats * d * plan.mlp_kept_units[i] * plan.block_size
        attn_dense = 2 * dims.num_heads * hd * d + kv
        attn_sparse = 2 * plan.heads_kept[i] * hd * d + kv
        pred = predictor_params_per_layer[i] if predictor_params_per_layer else 0
        per_layer.append(dict(mlp_dense=mlp_dense * dtype_bytes, mlp_sparse=mlp_sparse * dtype_bytes,
                              attn_dense=attn_dense * dtype_bytes, attn_sparse=attn_sparse * dtype_bytes,
                              predictor=pred * dtype_bytes))
    dense = sum(p["mlp_dense"] + p["attn_dense"] for p in per_layer)
    pred = sum(p["predictor"] for p in per_layer)
    sparse = sum(p["mlp_sparse"] + p["attn_sparse"] for p in per_layer) + pred
    return {
        "dtype_bytes": dtype_bytes,
        "dense": dense,
        "sparse": sparse,                          # including the predictors
        "predictors": pred,
        "sparse_over_dense": sparse / dense,
        "predictor_fraction": pred / dense,        # predictor bytes / dense bytes of the layers they decide about
        "per_layer_sparse": [p["mlp_sparse"] + p["attn_sparse"] + p["predictor"] for p in per_layer],
    }
