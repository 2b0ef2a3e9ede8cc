"""Low-rank lookahead predictors, one MLP-unit and one head predictor per layer.

Lookahead: layer l's predictors read hidden_states[l - 1] — the *input* of layer l - 1 — so they
can run on a side stream while layer l - 1 computes; layers 0 and 1 both read the embeddings
(hidden_states[0]). See `input_index`.

Scores are exactly the op contract's (docs/ops.md, `DejaVuLookaheadPredictor`):
`rmsnorm(h) @ a @ b` with a parameter-free RMS norm — computed by `ops.reference.predictor_scores`.

File: `predictors.safetensors` in the work dir, metadata format "dejavu-predictors", tensors
`layers.{l}.mlp_a` [d, r_m], `layers.{l}.mlp_b` [r_m, Nb], `layers.{l}.head_a` [d, r_h],
`layers.{l}.head_b` [r_h, H].
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..artifacts import load_safetensors, save_safetensors
from ..errors import ArtifactError
from ..ops.contract import PREDICTOR_EPS
from ..ops.reference import lookahead_predictor, predictor_scores

PREDICTORS_FILE = "predictors.safetensors"
PREDICTORS_FORMAT = "dejavu-predictors"


def input_index(layer: int) -> int:
    """Which hidden state layer `layer`'s predictors read: hidden_states[max(l - 1, 0)]."""
    return max(layer - 1, 0)


@dataclass
class LookaheadPredictors:
    mlp_a: list[torch.Tensor]    # per layer [d, r_m]
    mlp_b: list[torch.Tensor]    # per layer [r_m, Nb]
    head_a: list[torch.Tensor]   # per layer [d, r_h]
    head_b: list[torch.Tensor]   # per layer [r_h, H]
    block_size: int = 1
    fingerprint: str = ""        # model fingerprint (models.loading.model_fingerprint)
    info: dict = field(default_factory=dict)  # free-form training facts stored in the metadata

    input_index = staticmethod(input_index)

    @property
    def num_layers(self) -> int:
        return len(self.mlp_a)

    @property
    def rank_mlp(self) -> int:
        return int(self.mlp_a[0].shape[1])

    @property
    def rank_heads(self) -> int:
        return int(self.head_a[0].shape[1])

    def mlp_scores(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """[.., Nb] scores of layer `layer`'s MLP units from h = hidden_states[input_index(layer)]."""
        return predictor_scores(h, self.mlp_a[layer].to(h.dtype), self.mlp_b[layer].to(h.dtype), PREDICTOR_EPS)

    def head_scores(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """[.., H] scores of layer `layer`'s heads from h = hidden_states[input_index(layer)]."""
        return predictor_scores(h, self.head_a[layer].to(h.dtype), self.head_b[layer].to(h.dtype), PREDICTOR_EPS)

    def select(self, layer: int, h: torch.Tensor, kept_units: int, kept_heads: int):
        """The contract's index sets for h [B, d] (batch union): (mlp_idx [K], head_idx [Kh]) int32."""
        dt = h.dtype
        return lookahead_predictor(h, self.mlp_a[layer].to(dt), self.mlp_b[layer].to(dt),
                                   self.head_a[layer].to(dt), self.head_b[layer].to(dt), kept_units, kept_heads)

    def num_bytes(self, bytes_per_value: int = 2) -> int:
        n = sum(t.numel() for ts in (self.mlp_a, self.mlp_b, self.head_a, self.head_b) for t in ts)
        return n * bytes_per_value

    def to(self, dtype=None, device=None) -> "LookaheadPredictors":
        conv = lambda ts: [t.to(device=device, dtype=dtype) for t in ts]  # noqa: E731
        return LookaheadPredictors(conv(self.mlp_a), conv(self.mlp_b), conv(self.head_a), conv(self.head_b),
                                   self.block_size, self.fingerprint, dict(self.info))

    # --- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Atomic write; `path` is the file or a work dir (then predictors.safetensors inside it)."""
        path = Path(path)
        if path.is_dir():
            path = path / PREDICTORS_FILE
        tensors = {}
        for l in range(self.num_layers):
            tensors[f"layers.{l}.mlp_a"] = self.mlp_a[l].float()
            tensors[f"layers.{l}.mlp_b"] = self.mlp_b[l].float()
            tensors[f"layers.{l}.head_a"] = self.head_a[l].float()
            tensors[f"layers.{l}.head_b"] = self.head_b[l].float()
        meta = {"format": PREDICTORS_FORMAT, "num_layers": str(self.num_layers), "block_size": str(self.block_size),
                "rank_mlp": str(self.rank_mlp), "rank_heads": str(self.rank_heads),
                "model_fingerprint": self.fingerprint, "info": json.dumps(self.info, sort_keys=True)}
        save_safetensors(path, tensors, meta)

    @classmethod
    def load(cls, path: str | Path, expect_fingerprint: str | None = None) -> "LookaheadPredictors":
        """Load a predictors file (or a work dir's); corrupt, foreign or mismatched → ArtifactError.

        Given a work dir, its manifest is checked first (format version, predictors checksum).
        """
        path = Path(path)
        if path.is_dir():
            from ..artifacts import verify_files
            from ..calibrate.workdir import open_workdir

            wd = open_workdir(path)
            if PREDICTORS_FILE not in wd.manifest.get("files", {}):
                raise ArtifactError(f"{path} has no trained predictors; run `dejavu-trt train-predictors {path}`")
            verify_files(path, wd.manifest, [PREDICTORS_FILE])
            expect_fingerprint = expect_fingerprint or wd.config["model"]["fingerprint"]
            path = path / PREDICTORS_FILE
        tensors, meta = load_safetensors(path, expect_format=PREDICTORS_FORMAT)
        try:
            L, bs = int(meta["num_layers"]), int(meta["block_size"])
            parts = {k: [tensors[f"layers.{l}.{k}"] for l in range(L)] for k in ("mlp_a", "mlp_b", "head_a", "head_b")}
            info = json.loads(meta.get("info", "{}"))
        except (KeyError, ValueError) as e:
            raise ArtifactError(f"{path} is an incomplete predictors file ({e.__class__.__name__}: {e}); "
                                f"re-run `dejavu-trt train-predictors`") from None
        for l in range(L):
            a, b = parts["mlp_a"][l], parts["mlp_b"][l]
            ha, hb = parts["head_a"][l], parts["head_b"][l]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or ha.ndim != 2 or hb.ndim != 2 \
                    or ha.shape[1] != hb.shape[0] or a.shape[0] != ha.shape[0]:
                raise ArtifactError(f"{path}: layer {l} predictor shapes do not fit together; re-train")
        fp = meta.get("model_fingerprint", "")
        if expect_fingerprint and fp != expect_fingerprint:
            raise ArtifactError(f"{path} was trained for another model (fingerprint {fp}, expected "
                                f"{expect_fingerprint}); re-run `dejavu-trt train-predictors`")
        return cls(parts["mlp_a"], parts["mlp_b"], parts["head_a"], parts["head_b"], bs, fp, info)
