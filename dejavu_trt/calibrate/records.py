"""On-disk calibration records: per split, a sequence of safetensors shards.

Each shard holds, for the tokens of a few windows (rows = tokens, in window order):

    tokens          [n] int64   token ids
    hidden.{l}      [n, d]      fp16  input hidden state of layer l (residual stream; l=0: embeddings)
    mlp.{l}         [n, Nb]     fp16  MLP activity per unit (neuron, or block of B neurons)
    heads.{l}       [n, H]      fp32  head importance ||W_o[:, h] o_h||

Shards are written as the model streams through the corpus, so memory stays bounded by one shard
whatever the model size; readers pull one key at a time (safetensors is memory-mapped), so a
trainer can load one layer's records without reading the others.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..artifacts import TOOL, load_safetensors, save_safetensors
from ..errors import ArtifactError

RECORDS_DIR = "records"
RECORDS_FORMAT = "dejavu-calibration-records"
KINDS = ("hidden", "mlp", "heads")
_STORE_DTYPE = {"hidden": torch.float16, "mlp": torch.float16, "heads": torch.float32}
_FP16_MAX = 65504.0


def shard_name(split: str, index: int) -> str:
    return f"{RECORDS_DIR}/{split}/shard-{index:05d}.safetensors"


class RecordWriter:
    """Accumulates per-batch records and flushes a shard whenever `shard_tokens` are buffered."""

    def __init__(self, root: Path, split: str, shard_tokens: int = 4096):
        self.root, self.split, self.shard_tokens = Path(root), split, shard_tokens
        self.buffer: dict[str, list[torch.Tensor]] = {}
        self.buffered = 0
        self.shards: list[str] = []
        self.tokens = 0

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        for key, value in batch.items():
            kind = key.split(".")[0]
            value = value.detach().cpu()
            if kind in _STORE_DTYPE:
                value = value.float()
                if _STORE_DTYPE[kind] == torch.float16:
                    value = value.clamp(-_FP16_MAX, _FP16_MAX)  # huge outliers saturate instead of inf
                value = value.to(_STORE_DTYPE[kind])
            self.buffer.setdefault(key, []).append(value)
        n = batch["tokens"].numel()
        self.buffered += n
        self.tokens += n
        if self.buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.buffered:
            return
        name = shard_name(self.split, len(self.shards))
        tensors = {k: torch.cat(v) for k, v in self.buffer.items()}
        save_safetensors(self.root / name, tensors, {"format": RECORDS_FORMAT, "split": self.split})
        self.shards.append(name)
        self.buffer, self.buffered = {}, 0


class CalibrationRecords:
    """Read access to one split's shards of a work dir (listed in its manifest config)."""

    def __init__(self, workdir: Path, split: str, shards: list[str]):
        self.workdir, self.split, self.shards = Path(workdir), split, list(shards)
        if not self.shards:
            raise ArtifactError(f"{workdir} holds no {split} records; re-run `dejavu-trt calibrate`")

    def _read(self, key: str | None) -> torch.Tensor | None:
        """Concatenate `key` over the shards (None: only check every shard's header)."""
        from safetensors import safe_open

        parts = []
        for name in self.shards:
            path = self.workdir / name
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("tool") != TOOL or meta.get("format") != RECORDS_FORMAT:
                        raise ArtifactError(f"{path} is not a dejavu-trt calibration shard (foreign file)")
                    if key is None:
                        continue
                    if key not in f.keys():
                        raise ArtifactError(f"{path} has no {key!r} records; re-run `dejavu-trt calibrate`")
                    parts.append(f.get_tensor(key))
            except ArtifactError:
                raise
            except Exception as e:  # safetensors raises several types for bad headers
                raise ArtifactError(f"{path} is not a readable safetensors file ({e.__class__.__name__}); "
                                    f"re-run `dejavu-trt calibrate`") from None
        return torch.cat(parts) if key is not None else None

    def check_headers(self) -> None:
        self._read(None)

    def tokens(self) -> torch.Tensor:
        return self._read("tokens")

    def hidden(self, layer: int) -> torch.Tensor:
        """[n, d] fp16: the input of layer `layer` (layer 0: the embeddings)."""
        return self._read(f"hidden.{layer}")

    def mlp(self, layer: int) -> torch.Tensor:
        """[n, Nb] fp16: MLP activity per unit of layer `layer`."""
        return self._read(f"mlp.{layer}")

    def heads(self, layer: int) -> torch.Tensor:
        """[n, H] fp32: per-head contribution norm of layer `layer`."""
        return self._read(f"heads.{layer}")


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one shard (checked), for tests and tools."""
    tensors, _ = load_safetensors(path, expect_format=RECORDS_FORMAT)
    return tensors
