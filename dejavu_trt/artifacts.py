"""Atomic artifact writing, manifests with checksums, and checked loading.

Every artifact directory (work dir, export, engine package) carries a `manifest.json`:

    {"tool": "dejavu-trt", "tool_version": ..., "format_version": ..., "kind": "workdir",
     "created": ..., "versions": {"torch": ..., ...}, "config": {...},
     "files": {"predictors.safetensors": {"sha256": ..., "bytes": ...}, ...}}

Files are written to a temporary name and renamed into place, so an interrupted run leaves either
the old file or the new one, never half of one. A stage that fails leaves no partial files.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from . import ARTIFACT_FORMAT_VERSION, __version__
from .errors import ArtifactError

MANIFEST = "manifest.json"
TOOL = "dejavu-trt"
_VERSIONED_PACKAGES = ("torch", "transformers", "onnx", "onnxruntime", "onnx-graphsurgeon",
                       "polygraphy", "safetensors", "numpy")


def library_versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _tmp_sibling(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a directory under a temporary name; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_manifest(directory: str | Path, kind: str, config: dict, extra: dict | None = None) -> dict:
    """Manifest for every regular file below `directory` (except the manifest itself)."""
    directory = Path(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith("."):
            rel = p.relative_to(directory).as_posix()
            files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = {
        "tool": TOOL,
        "tool_version": __version__,
        "format_version": ARTIFACT_FORMAT_VERSION,
        "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "config": config,
        "files": files,
    }
    if extra:
        manifest.update(extra)
    return manifest


def write_manifest(directory: str | Path, kind: str, config: dict, extra: dict | None = None) -> dict:
    manifest = build_manifest(directory, kind, config, extra)
    atomic_write_json(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: str | Path, kind: str, verify: bool = True) -> dict:
    """Load and check a manifest: tool, kind, format version and (optionally) every checksum."""
    directory = Path(directory)
    mpath = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory} does not exist or is not a directory (expected a dejavu-trt {kind})")
    if not mpath.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST}: it is not a dejavu-trt {kind}, or it was not finished")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{mpath} is corrupt ({e.__class__.__name__}); rebuild the {kind}") from None
    if not isinstance(manifest, dict) or manifest.get("tool") != TOOL:
        raise ArtifactError(f"{mpath} was not written by {TOOL}")
    if manifest.get("kind") != kind:
        raise ArtifactError(f"{directory} is a {manifest.get('kind')!r}, expected a {kind!r}")
    if manifest.get("format_version") != ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(
            f"{directory} was written by dejavu-trt {manifest.get('tool_version')} with format version "
            f"{manifest.get('format_version')}; this is dejavu-trt {__version__} (format {ARTIFACT_FORMAT_VERSION}): "
            f"rebuild it with this version")
    if verify:
        verify_files(directory, manifest)
    return manifest


def verify_files(directory: str | Path, manifest: dict, names: list[str] | None = None) -> None:
    directory = Path(directory)
    files = manifest.get("files", {})
    for rel in names if names is not None else files:
        entry = files.get(rel)
        p = directory / rel
        if entry is None:
            raise ArtifactError(f"{p} is not listed in {directory / MANIFEST}")
        if not p.is_file():
            raise ArtifactError(f"{p} is missing (listed in {directory / MANIFEST})")
        if p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
            raise ArtifactError(f"checksum mismatch for {p}: the file changed after it was written; rebuild it")


def save_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Atomic safetensors write (contiguous CPU copies; metadata values must be strings)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"tool": TOOL, **(metadata or {})})


def load_safetensors(path: str | Path, expect_format: str | None = None) -> tuple[dict, dict]:
    """Load tensors and metadata; a corrupt or foreign file gives an ArtifactError."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for bad headers
        raise ArtifactError(f"{path} is not a readable safetensors file ({e.__class__.__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'corrupt'})") from None
    if meta.get("tool") != TOOL:
        raise ArtifactError(f"{path} was not written by {TOOL} (foreign safetensors file)")
    if expect_format is not None and meta.get("format") != expect_format:
        raise ArtifactError(f"{path} holds {meta.get('format')!r}, expected {expect_format!r}")
    return tensors, meta
