"""polygraphy runners for our decode-step executors, so `Comparator.run([...])` can include them.

`DecodeStepRunner` adapts anything that computes one decode step from a feed dict (the ONNX
graph's I/O: input_ids, position, past_key.{i}/past_value.{i} -> logits, present_key.{i}/...) to
polygraphy's `BaseRunner` (activate / infer / deactivate). The CUDA executor plugs in by passing a
factory that returns such a step function (see `DecodeStepRunner`'s docstring); the PyTorch
reference does so in `TorchDecodeRunner`.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from ..export.config import io_names
from ..export.module import DecodeModel, KVCache, SparsePlan

StepFn = Callable[[dict], dict]


class DecodeStepRunner(BaseRunner):
    """A polygraphy runner over a decode-step function.

    `make_step` is called on activate and returns `step(feed: dict[str, np.ndarray]) ->
    dict[str, np.ndarray]` computing the graph's outputs functionally (the caches in the feed are
    not modified; updated copies come back as present_*). An executor that updates its caches in
    place should copy the feed's caches into its buffers first, run, and return its buffers.
    `cleanup` (optional) is called on deactivate, e.g. to free GPU memory.
    """

    def __init__(self, make_step: Callable[[], StepFn], num_layers: int, cache_shape: tuple, name: str | None = None,
                 cleanup: Callable[[], None] | None = None):
        super().__init__(name=name, prefix="dejavu-runner")
        self._make_step, self._cleanup = make_step, cleanup
        self.num_layers, self.cache_shape = num_layers, tuple(cache_shape)
        self.step: StepFn | None = None

    def activate_impl(self):
        self.step = self._make_step()

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        meta.add("input_ids", np.int64, ["batch"])
        meta.add("position", np.int32, ["batch"])
        for name in io_names(self.num_layers)["inputs"][2:]:
            meta.add(name, np.float32, ["batch", *self.cache_shape[1:]])
        return meta

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        out = OrderedDict(self.step(feed_dict))
        self.inference_time = time.perf_counter() - start   # polygraphy sums these per run
        return out

    def deactivate_impl(self):
        self.step = None
        if self._cleanup is not None:
            self._cleanup()


class TorchDecodeRunner(DecodeStepRunner):
    """The canonical PyTorch decode module (dense, or sparse with a `SparsePlan`) as a runner."""

    def __init__(self, model: DecodeModel, plan: SparsePlan | None = None, name: str | None = None):
        self.model, self.plan = model, plan
        cfg = model.cfg
        super().__init__(self._make, cfg.num_layers, cfg.cache_shape(1),
                         name=name or ("torch-sparse" if plan is not None else "torch-dense"))

    def _make(self) -> StepFn:
        names = io_names(self.model.cfg.num_layers)

        def step(feed):
            past = [torch.from_numpy(np.array(feed[n], dtype=np.float32)) for n in names["inputs"][2:]]
            cache = KVCache(past[0::2], past[1::2])
            logits = self.model.step(torch.from_numpy(np.asarray(feed["input_ids"])).long(),
                                     torch.from_numpy(np.asarray(feed["position"])).int(), cache, self.plan)
            outs = [logits, *[t for kv in zip(cache.keys, cache.values) for t in kv]]
            return {n: t.numpy() for n, t in zip(names["outputs"], outs)}
        return step


class Float32IORunner(BaseRunner):
    """Another runner seen with float32 I/O.

    The `.plan` and its ONNX copy (rewrite/plan_graph.py) take and return their KV caches in fp16 or bf16.
    Wrapped, they accept the float32 feeds every other endpoint uses (cast on the way in) and return float32
    outputs, so one trajectory's feeds drive both sides of a comparison. The rounding of the caches to the
    build dtype is part of what the comparison measures.
    """

    def __init__(self, inner: BaseRunner, name: str | None = None):
        super().__init__(name=name or inner.name, prefix="float32-io")
        self.inner = inner

    def activate_impl(self):
        self.inner.activate()

    def deactivate_impl(self):
        self.inner.deactivate()

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for name, (dtype, shape) in self.inner.get_input_metadata().items():
            meta.add(name, np.float32 if _is_float(dtype) else dtype, shape)
        return meta

    def infer_impl(self, feed_dict):
        want = self.inner.get_input_metadata()
        feed = OrderedDict((n, _cast_to(v, want[n].dtype) if n in want else v) for n, v in feed_dict.items())
        out = self.inner.infer(feed)
        self.inference_time = self.inner.last_inference_time()
        return OrderedDict((n, _to_float32(v)) for n, v in out.items())


def _is_float(dtype) -> bool:
    from polygraphy.datatype import DataType
    return DataType.from_dtype(dtype) in (DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT32)


def _cast_to(value, dtype):
    from polygraphy.datatype import DataType
    dt = DataType.from_dtype(dtype)
    if dt == DataType.BFLOAT16:          # numpy has no bfloat16; polygraphy's TrtRunner takes torch tensors
        return torch.from_numpy(np.asarray(value, np.float32)).to(torch.bfloat16)
    return np.asarray(value).astype(DataType.to_dtype(dt, "numpy"), copy=False)


def _to_float32(value):
    if isinstance(value, torch.Tensor):
        return value.float().cpu().numpy() if value.is_floating_point() else value.cpu().numpy()
    a = np.asarray(value)
    return a.astype(np.float32) if a.dtype.kind == "f" else a
