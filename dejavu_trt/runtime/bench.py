"""Time between tokens, dense vs sparse in the same run, achieved GB/s, and the cost forecast."""
from __future__ import annotations

import statistics

import torch

from .costs import cost_forecast, step_bytes
from .decoder import DecoderWeights
from .executor import Executor


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def copy_bandwidth_gbs(device, nbytes: int = 1 << 30, reps: int = 5) -> float | None:
    """Device-to-device copy rate, counting bytes read plus written (the ceiling for GB/s)."""
    if torch.device(device).type != "cuda":
        return None
    a = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize(device)
    ms = start.elapsed_time(end) / reps
    del a, b
    return 2 * nbytes / (ms * 1e-3) / 1e9


def predictor_rank(weights: DecoderWeights) -> tuple[int, int]:
    lw = weights.layers[0]
    return (lw.mlp_a.shape[1] if lw.mlp_a is not None else 0, lw.head_a.shape[1] if lw.head_a is not None else 0)


def time_mode(weights: DecoderWeights, *, dense: bool, batch: int = 1, steps: int = 64, warmup: int = 8,
              prompt_len: int = 32, ops: str = "auto", side_stream: bool = True, cuda_graph: bool = True,
              kv_policy: str | None = None, max_context: int | None = None, prompt: torch.Tensor | None = None,
              executor: Executor | None = None, fold_norms: bool | None = None,
              predictor_priority: str | None = None) -> dict:
    """Prefill a prompt, then time `steps` greedy decode steps after `warmup` untimed ones."""
    T = max_context or (prompt_len + warmup + steps + 2)
    ex = executor or Executor(weights, dense=dense, ops=ops, batch=batch, max_context=T, side_stream=side_stream,
                              cuda_graph=cuda_graph, kv_policy=kv_policy, fold_norms=fold_norms,
                              predictor_priority=predictor_priority)
    if prompt is None:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, weights.dims.vocab_size, (batch, prompt_len), generator=g)
    ex.prefill(prompt)
    for _ in range(warmup):
        ex.step()
    tbt = ex.timed_steps(steps)
    cfg = weights.config
    ctx = prompt.shape[-1] + warmup + steps // 2  # mean context over the timed steps
    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[weights.dtype]
    sb = step_bytes(weights.dims, dtype=dtype, mlp_kept_units=None if dense else cfg.mlp_kept_units,
                    heads_kept=None if dense else cfg.heads_kept, block_size=cfg.block_size,
                    kv_policy=kv_policy or cfg.kv_policy, context=ctx, batch=batch,
                    predictor_rank=predictor_rank(weights))
    mean = statistics.fmean(tbt)
    return {"mode": "dense" if dense else "sparse", "batch": batch, "ops": "cublas" if dense and ex.cuda else ex.ops.name,
            "side_stream": ex.decoder.side_stream is not None, "cuda_graph": ex.use_graph,
            "fold_norms": getattr(ex, "fold_norms", False), "step_choice": getattr(ex, "step_choice", None),
            "mlp_grid_slack": getattr(ex, "mlp_grid_slack", None),
            "steps": steps, "tbt_ms_p50": percentile(tbt, 50), "tbt_ms_p99": percentile(tbt, 99),
            "tbt_ms_mean": mean, "tokens_per_s": batch * 1e3 / mean, "bytes_per_step": sb.total,
            "achieved_gb_s": sb.total / (mean * 1e-3) / 1e9}


def bench_engine(weights: DecoderWeights, *, batch: int = 1, steps: int = 64, warmup: int = 8, prompt_len: int = 32,
                 ops: str = "auto", gpu_hour_price: float | None = None, side_stream: bool = True,
                 cuda_graph: bool = True) -> dict:
    """Dense and sparse measured in the same run, with the cost forecast from their tokens/s."""
    runs = [time_mode(weights, dense=dense, batch=batch, steps=steps, warmup=warmup, prompt_len=prompt_len,
                      ops=ops, side_stream=side_stream, cuda_graph=cuda_graph) for dense in (True, False)]
    dense, sparse = runs
    out = {"device": torch.cuda.get_device_name(weights.device) if weights.device.type == "cuda" else "cpu",
           "dtype": str(weights.dtype).replace("torch.", ""), "batch": batch, "dense": dense, "sparse": sparse,
           "speedup": dense["tbt_ms_mean"] / sparse["tbt_ms_mean"],
           "copy_bandwidth_gb_s": copy_bandwidth_gbs(weights.device),
           "cost": cost_forecast(dense["tokens_per_s"], sparse["tokens_per_s"], gpu_hour_price)}
    return out
