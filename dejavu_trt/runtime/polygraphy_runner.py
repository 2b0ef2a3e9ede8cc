"""The runtime executor as a polygraphy runner, so `Comparator.run([...])` can include it beside
ONNX Runtime on the rewritten graph and the PyTorch reference (dejavu_trt/compare/runners.py).

The executor updates its preallocated caches in place; for polygraphy's functional feed/outputs
contract each step copies the feed's caches into the executor's buffers, runs one decode step
(graph replay on CUDA), and returns copies of the logits and the updated caches.
"""
from __future__ import annotations

import numpy as np
import torch

from ..compare.runners import DecodeStepRunner
from ..export.config import io_names


class ExecutorRunner(DecodeStepRunner):
    def __init__(self, engine, *, dense: bool = False, batch: int = 1, name: str | None = None):
        self.engine, self.dense, self.batch = engine, dense, batch
        dims = engine.config.model_dims
        shape = (batch, dims.num_kv_heads, engine.max_context, dims.head_dim)
        super().__init__(self._make, dims.num_layers, shape,
                         name=name or f"executor-{'dense' if dense else 'sparse'}-{engine.device.type}")

    def _make(self):
        ex = self.engine.executor(dense=self.dense, batch=self.batch, context=self.engine.max_context)
        names = io_names(self.num_layers)
        past, present = names["inputs"][2:], names["outputs"][1:]

        def step(feed):
            for i in range(self.num_layers):
                ex.k_caches[i].copy_(torch.from_numpy(np.asarray(feed[past[2 * i]])))
                ex.v_caches[i].copy_(torch.from_numpy(np.asarray(feed[past[2 * i + 1]])))
            pos = torch.from_numpy(np.asarray(feed["position"], dtype=np.int32))
            ex.position.copy_(pos)
            ex.pos_host = int(pos.max())
            logits = ex.step(torch.from_numpy(np.asarray(feed["input_ids"], dtype=np.int64)))
            caches = [t for kv in zip(ex.k_caches, ex.v_caches) for t in kv]
            outs = {"logits": logits.float().cpu().numpy().copy()}
            outs.update({n: t.float().cpu().numpy().copy() for n, t in zip(present, caches)})
            return outs
        return step
