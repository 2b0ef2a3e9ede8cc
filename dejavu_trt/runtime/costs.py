"""Bytes a decode step reads, dense vs sparse: the basis of the expected speedup and of GB/s.

Decoding is memory-bound, so the bytes of weights (and KV cache) read per step predict its time.
Counted per step of B rows: the weights once (one index set serves the whole batch), the KV cache
once per row, the predictors when sparse, the LM head always.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models.adapters import ModelDims

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass
class StepBytes:
    weights: int
    kv_cache: int
    predictors: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.predictors


def step_bytes(dims: ModelDims, *, dtype: str, mlp_kept_units: list[int] | None = None,
               heads_kept: list[int] | None = None, block_size: int = 1, kv_policy: str = "dense",
               context: int = 512, batch: int = 1, predictor_rank: tuple[int, int] = (0, 0)) -> StepBytes:
    """Bytes read by one decode step; kept lists None = dense."""
    eb = DTYPE_BYTES[dtype]
    d, hd, H, Hkv, N = dims.hidden_size, dims.head_dim, dims.num_heads, dims.num_kv_heads, dims.intermediate_size
    mats = 3 if dims.activation == "silu_glu" else 2
    group = H // Hkv
    dense = mlp_kept_units is None
    weights = kv = pred = 0
    for layer in range(dims.num_layers):
        kh = H if dense else heads_kept[layer]
        neurons = N if dense else mlp_kept_units[layer] * block_size
        kv_heads = Hkv if dense or kv_policy == "dense" else min(Hkv, -(-kh // group) if group > 1 else kh)
        read_kv = Hkv if dense else min(Hkv, kh)  # KV heads whose cache rows are read
        weights += (2 * kh * hd * d + 2 * kv_heads * hd * d + mats * neurons * d) * eb
        kv += 2 * batch * read_kv * context * hd * eb
        if not dense:
            r_m, r_h = predictor_rank
            pred += (d * r_m + r_m * (N // block_size) + d * r_h + r_h * H) * eb
    weights += dims.vocab_size * d * eb  # LM head
    return StepBytes(weights, kv, pred)


def expected_speedup(dense: StepBytes, sparse: StepBytes) -> float:
    return dense.total / sparse.total if sparse.total else float("nan")


def cost_forecast(dense_tps: float, sparse_tps: float, gpu_hour_price: float | None) -> dict:
    """GPU-hours (and money) per million tokens at the measured tokens/s per GPU."""
    hours = lambda tps: 1e6 / (tps * 3600.0) if tps > 0 else float("inf")  # noqa: E731
    out = {"dense_tokens_per_s_per_gpu": dense_tps, "sparse_tokens_per_s_per_gpu": sparse_tps,
           "dense_gpu_hours_per_mtok": hours(dense_tps), "sparse_gpu_hours_per_mtok": hours(sparse_tps)}
    out["gpu_hours_saved_per_mtok"] = out["dense_gpu_hours_per_mtok"] - out["sparse_gpu_hours_per_mtok"]
    if gpu_hour_price is not None:
        out["gpu_hour_price"] = gpu_hour_price
        out["cost_saved_per_mtok"] = out["gpu_hours_saved_per_mtok"] * gpu_hour_price
    return out
