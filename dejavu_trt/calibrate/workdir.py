"""The calibration work dir: records of a model run over a corpus, plus its manifest.

Layout:

    DIR/manifest.json                      kind "workdir"; config below; checksums
    DIR/records/calibration/shard-*.safetensors   predictors are trained on these
    DIR/records/validation/shard-*.safetensors    early stopping and recall reports
    DIR/predictors.safetensors             written by `train-predictors`

The whole directory is built under a temporary name and renamed into place at the end, so a
failed or interrupted calibration leaves nothing behind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifacts import atomic_dir, read_manifest, verify_files, write_manifest
from ..errors import DejaVuError
from .hooks import ActivityRecorder
from .records import CalibrationRecords, RecordWriter

WORKDIR_KIND = "workdir"
VALIDATION_SHARE = 0.25  # validation tokens recorded per calibration token (early stopping, reports)
BLOCK_REDUCE = "sum"


@dataclass
class WorkDir:
    """An opened, checked work dir."""

    path: Path
    manifest: dict

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def dims(self) -> dict:
        return self.config["dims"]

    def records(self, split: str) -> CalibrationRecords:
        return CalibrationRecords(self.path, split, self.config["splits"][split]["shards"])

    def verify_records(self) -> None:
        """Checksums and shard headers of every record file, before any long work starts."""
        names = [n for s in self.config["splits"].values() for n in s["shards"]]
        verify_files(self.path, self.manifest, names)
        for split in self.config["splits"]:
            self.records(split).check_headers()


def open_workdir(path: str | Path, verify: bool = False) -> WorkDir:
    """Check the manifest (tool, kind, format version); `verify` also checks every checksum."""
    path = Path(path)
    manifest = read_manifest(path, WORKDIR_KIND, verify=verify)
    if "splits" not in manifest.get("config", {}):
        from ..errors import ArtifactError
        raise ArtifactError(f"{path} is a work dir without calibration records; re-run `dejavu-trt calibrate`")
    return WorkDir(path, manifest)


def update_workdir_manifest(wd: WorkDir, extra: dict) -> dict:
    """Rewrite the manifest (atomically) after adding files, keeping config and earlier extras."""
    keep = {k: v for k, v in wd.manifest.items()
            if k not in ("tool", "tool_version", "format_version", "kind", "created", "versions", "config", "files")}
    keep.update(extra)
    wd.manifest = write_manifest(wd.path, WORKDIR_KIND, wd.config, keep)
    return wd.manifest


def _batches(windows: torch.Tensor, batch_windows: int):
    for i in range(0, windows.shape[0], batch_windows):
        yield windows[i:i + batch_windows]


@torch.no_grad()
def record_split(loaded, windows: torch.Tensor, root: Path, split: str, *, block_size: int,
                 batch_windows: int, shard_tokens: int, progress: bool) -> RecordWriter:
    """Run the model over `windows` [n, seq_len] and write the split's shards under `root`."""
    adapter, model = loaded.adapter, loaded.model
    L = adapter.dims().num_layers
    device = next(model.parameters()).device
    writer = RecordWriter(root, split, shard_tokens)
    batches = _batches(windows, batch_windows)
    if progress:
        from tqdm import tqdm
        batches = tqdm(batches, total=math.ceil(windows.shape[0] / batch_windows),
                       desc=f"calibrating ({split})", unit="batch")
    with ActivityRecorder(adapter, block_size, BLOCK_REDUCE) as rec:
        for ids in batches:
            out = model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False)
            acts = rec.pop()
            # hidden_states[l] is the input of layer l (0: embeddings); the last one is post-norm.
            batch = {"tokens": ids.reshape(-1)}
            # Rows are tokens; some families (OPT) already flatten [b, t] inside the MLP.
            for l in range(L):
                batch[f"hidden.{l}"] = out.hidden_states[l].reshape(-1, out.hidden_states[l].shape[-1])
                batch[f"mlp.{l}"] = acts[f"mlp.{l}"].reshape(-1, acts[f"mlp.{l}"].shape[-1])
                batch[f"heads.{l}"] = acts[f"heads.{l}"].reshape(-1, acts[f"heads.{l}"].shape[-1])
            writer.add(batch)
            del out, acts, batch
    writer.flush()
    return writer


def _enough_windows(docs, tokenizer, seq_len: int, need: dict[str, int]) -> dict[str, torch.Tensor]:
    """Split windows of the shortest document prefix that holds `need` tokens per split.

    Window i's split depends only on i, so a prefix's windows are exactly the first windows of the
    whole corpus: tokenising only what is needed gives the same records, much sooner (SOTU is ~2M
    tokens, a test calibration needs a few thousand).
    """
    from ..data.corpus import split_windows, tokenize_documents

    parts, used, chunk = [], 0, 8
    while True:
        parts.append(tokenize_documents(docs[used:used + chunk], tokenizer))
        used, chunk = used + chunk, chunk * 2
        windows = split_windows(torch.cat(parts), seq_len)
        if used >= len(docs) or all(windows[s].shape[0] * seq_len >= n for s, n in need.items()):
            return windows


def _load_quietly(model: str, dtype: str, device: str):
    """load_model without transformers' weight-loading bar, so a user error after it stays one line."""
    from transformers.utils import logging as hf_logging

    from ..models.loading import load_model

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load_model(model, dtype=dtype, device=device)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def calibrate(model: str, corpus: str, tokens: int, out: str | Path, *, seq_len: int = 256,
              block_size: int = 1, batch_windows: int = 4, shard_tokens: int = 4096,
              dtype: str = "fp32", device: str = "cpu", progress: bool = True) -> WorkDir:
    """Calibrate `model` on `tokens` tokens of `corpus` into the work dir `out` (atomically)."""
    from ..data.corpus import load_documents, take_tokens
    from ..models.loading import locate, model_fingerprint
    from ..models.registry import resolve

    if tokens < 1:
        raise DejaVuError(f"--tokens must be a positive number of tokens, got {tokens}")
    if seq_len < 2:
        raise DejaVuError(f"--seq-len must be at least 2, got {seq_len}")
    if block_size < 1:
        raise DejaVuError(f"--block-size must be at least 1, got {block_size}")
    out = Path(out)
    if out.exists() and not (out / "manifest.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        # Only an earlier work dir may be replaced; never delete unrelated files.
        raise DejaVuError(f"--out {out} exists and is not a dejavu-trt work dir; choose a new or empty folder")
    locate(resolve(model))  # fail fast, before any work, when the weights are absent
    docs = load_documents(corpus)
    loaded = _load_quietly(model, dtype, device)
    dims = loaded.dims
    if dims.intermediate_size % block_size:
        raise DejaVuError(f"--block-size {block_size} does not divide the {dims.intermediate_size} MLP neurons")
    if seq_len > dims.max_position:
        raise DejaVuError(f"--seq-len {seq_len} exceeds the model's {dims.max_position} positions")
    val_tokens = max(seq_len, int(tokens * VALIDATION_SHARE))
    windows = _enough_windows(docs, loaded.tokenizer, seq_len, {"calibration": tokens, "validation": val_tokens})
    chosen = {"calibration": take_tokens(windows["calibration"], tokens, "calibration", corpus),
              "validation": take_tokens(windows["validation"], val_tokens, "validation", corpus)}

    with atomic_dir(out) as tmp:
        splits = {}
        for split, w in chosen.items():
            writer = record_split(loaded, w, tmp, split, block_size=block_size, batch_windows=batch_windows,
                                  shard_tokens=shard_tokens, progress=progress)
            splits[split] = {"tokens": writer.tokens, "windows": int(w.shape[0]), "shards": writer.shards}
        config = {
            "model": {"alias": loaded.spec.alias, "folder": str(Path(loaded.folder).resolve()),
                      "fingerprint": model_fingerprint(loaded.folder), "dtype": dtype},
            "corpus": corpus if corpus == "sotu" else str(Path(corpus).resolve()),
            "tokens": tokens, "seq_len": seq_len, "block_size": block_size, "block_reduce": BLOCK_REDUCE,
            "num_units": dims.intermediate_size // block_size, "dims": dims.to_dict(), "splits": splits,
        }
        write_manifest(tmp, WORKDIR_KIND, config)
    return open_workdir(out)
