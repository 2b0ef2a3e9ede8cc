"""The runtime executor inside polygraphy's Comparator, against the canonical PyTorch decode module.

Runs the CPU executor (the GPU one is the same class) on a tiny random engine package; shapes and
plumbing only, the numerics of both sides are tested against HF elsewhere.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from polygraphy.comparator import Comparator
from polygraphy.comparator.compare import SimpleCompareFunc

from dejavu_trt.compare import TorchDecodeRunner
from dejavu_trt.export.module import DecodeModel
from dejavu_trt.models.adapters import adapter_for
from dejavu_trt.runtime.engine import Engine
from dejavu_trt.runtime.polygraphy_runner import ExecutorRunner

from test_runtime import _write_package, tokenizer  # noqa: F401 (fixture)


def _feeds(model_cfg, batch, steps, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = model_cfg.cache_shape(batch)
    for t in range(steps):
        feed = OrderedDict(input_ids=torch.randint(0, vocab, (batch,), generator=g).numpy(),
                           position=np.full(batch, t + 3, np.int32))
        for i in range(model_cfg.num_layers):
            feed[f"past_key.{i}"] = torch.randn(shape, generator=g).numpy()
            feed[f"past_value.{i}"] = torch.randn(shape, generator=g).numpy()
        yield feed


def test_executor_runner_in_comparator_dense(tmp_path, tokenizer):  # noqa: F811
    model = _write_package(tmp_path / "pkg", "llama", tokenizer, max_context=16)
    engine = Engine.load(tmp_path / "pkg", device="cpu")
    ref = TorchDecodeRunner(DecodeModel.from_adapter(adapter_for(model), 16))
    feeds = list(_feeds(ref.model.cfg, 2, 2, model.config.vocab_size))
    results = Comparator.run([ref, ExecutorRunner(engine, dense=True, batch=2)], data_loader=feeds)
    ok = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(rtol=1e-4, atol=1e-4))
    assert bool(ok), "executor differs from the PyTorch decode module"
    # The comparison can fail: a different engine (other weights) must not pass.
    other = _write_package(tmp_path / "pkg2", "llama", tokenizer, max_context=16)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    bad = TorchDecodeRunner(DecodeModel.from_adapter(adapter_for(other), 16), name="scaled")
    results = Comparator.run([bad, ExecutorRunner(engine, dense=True, batch=2, name="ex2")], data_loader=feeds)
    assert not bool(Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(rtol=1e-4, atol=1e-4)))
