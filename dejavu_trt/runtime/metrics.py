"""Prometheus metrics of the runtime (prometheus_client), served only when asked (--metrics-port).

* `dejavu_predictor_accuracy_ratio` — on sampled decode steps, the share of each layer's true top-K
  MLP units (by |activation|, computed exactly from that step's MLP input) that the predictor chose.
* `dejavu_active_sparsity_percentage` — percentage of MLP units / attention heads skipped per token
  by the running engine (0 in dense mode).
* `inference_tbt_latency_ms` — time between tokens, milliseconds.

The metrics live in their own CollectorRegistry so that several engines in one process (tests) don't
collide in the global one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

TBT_BUCKETS_MS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 200, 500, 1000, 2000)


class RuntimeMetrics:
    def __init__(self, sample_every: int = 16):
        self.registry = CollectorRegistry()
        self.sample_every = max(1, int(sample_every))
        self.accuracy = Gauge("dejavu_predictor_accuracy_ratio",
                              "Recall of the true top-K MLP units by the lookahead predictor on sampled decode steps",
                              ["layer"], registry=self.registry)
        self.accuracy_mean = Gauge("dejavu_predictor_accuracy_mean_ratio",
                                   "Mean over layers of dejavu_predictor_accuracy_ratio at the last sample",
                                   registry=self.registry)
        self.sparsity = Gauge("dejavu_active_sparsity_percentage",
                              "Percentage of units skipped per decoded token (0 when dense)", ["unit"],
                              registry=self.registry)
        self.tbt = Histogram("inference_tbt_latency_ms", "Time between tokens in milliseconds",
                             buckets=TBT_BUCKETS_MS, registry=self.registry)
        self._steps = 0

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def set_mode(self, config, dense: bool) -> None:
        n = config.model_dims
        units = n.intermediate_size // config.block_size
        mlp = 0.0 if dense else 100.0 * (1 - sum(config.mlp_kept_units) / (units * n.num_layers))
        heads = 0.0 if dense else 100.0 * (1 - sum(config.heads_kept) / (n.num_heads * n.num_layers))
        self.sparsity.labels(unit="mlp").set(mlp)
        self.sparsity.labels(unit="heads").set(heads)

    def should_sample(self) -> bool:
        self._steps += 1
        return self._steps % self.sample_every == 1 or self.sample_every == 1

    def observe_tbt(self, ms: float) -> None:
        self.tbt.observe(ms)

    def observe_accuracy(self, records, weights, activation: str, block_size: int) -> list[float]:
        """records: (layer, mlp_input [B,d], predicted idx [K]) from one decode step."""
        accs = []
        for layer, x, idx in records:
            acc = predictor_recall(x, idx, weights.layers[layer], activation, block_size)
            self.accuracy.labels(layer=str(layer)).set(acc)
            accs.append(acc)
        if accs:
            self.accuracy_mean.set(sum(accs) / len(accs))
        return accs


def exact_unit_magnitude(x, lw, activation: str, block_size: int) -> torch.Tensor:
    """|activation| per unit, batch max: [Nb] (what an oracle would rank)."""
    up = F.linear(x.float(), lw.w_up.float())
    if activation == "silu_glu":
        a = F.silu(F.linear(x.float(), lw.w_gate.float())) * up
    else:
        up = up + lw.b_up.float()
        a = torch.relu(up) if activation == "relu" else F.gelu(up)
    a = a.abs()
    if block_size > 1:
        a = a.view(a.shape[0], -1, block_size).sum(-1)
    return a.amax(0)


def predictor_recall(x, idx, lw, activation: str, block_size: int) -> float:
    k = idx.numel()
    true = torch.topk(exact_unit_magnitude(x, lw, activation, block_size), k).indices
    hit = torch.isin(idx.long().to(true.device), true).sum().item()
    return hit / k
