"""Helpers for tests and samples: stand-in predictors and a plain teacher-forced ONNX decode loop."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .config import DecodeConfig, io_names


def stand_in_predictors(dims, path: str | Path, rank: int = 8, seed: int = 0, block_size: int = 1) -> Path:
    """Random low-rank predictors with the trained ones' tensor names and shapes.

    The graph math does not depend on whether the predictors are any good; tests that only check
    the compiler use these so they do not wait for calibration and training.
    """
    from ..predictors.model import LookaheadPredictors

    g = torch.Generator().manual_seed(seed)
    L, d, H = dims.num_layers, dims.hidden_size, dims.num_heads
    nb = dims.intermediate_size // block_size
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    p = LookaheadPredictors([r(d, rank) for _ in range(L)], [r(rank, nb) for _ in range(L)],
                            [r(d, rank) for _ in range(L)], [r(rank, H) for _ in range(L)], block_size)
    path = Path(path)
    p.save(path)
    return path


_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def ort_decode(session, cfg: DecodeConfig, tokens: torch.Tensor) -> list[np.ndarray]:
    """Teacher-forced decode of tokens [B, S] through an onnxruntime session: logits per step."""
    names = io_names(cfg.num_layers)
    B = tokens.shape[0]
    # caches in whatever type the graph declares (float32; fp16 in the plan-build copy)
    types = {i.name: i.type for i in session.get_inputs()}
    caches = {n: np.zeros(cfg.cache_shape(B), _NP_TYPES[types[n]]) for n in names["inputs"][2:]}
    logits = []
    for t in range(tokens.shape[1]):
        out = session.run(None, {"input_ids": tokens[:, t].numpy().astype(np.int64),
                                 "position": np.full(B, t, np.int32), **caches})
        logits.append(out[0])
        caches = {n.replace("present_", "past_"): v for n, v in zip(names["outputs"][1:], out[1:])}
    return logits
