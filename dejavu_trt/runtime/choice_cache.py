"""A per-machine cache of batch 1's timed step choice (Executor._choose_step).

Timing the step variants costs an executor's first decode step 0.35-0.74 s (benchmarks/RESULTS.md, session 15);
every candidate computes the same model, so a cached choice can at worst be slower, never wrong. The key
covers what the timings depend on: the device, the kernel library's bytes, the model's shape and kept counts,
the context, the executor's settings, the dejavu_trt version and every DJV_* / DEJAVU_* environment setting
(the kernels' A/B knobs among them). Any change times afresh.

Where: $DEJAVU_STEP_CHOICE_CACHE, a JSON file path, or "0" to turn the cache off; default
step_choice.json in the project's cache folder ($DEJAVU_TRT_CACHE, else ~/.cache/dejavu_trt). Writes are
atomic; an unreadable file gives a warning at each read and is replaced at the next store.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path

from .. import __version__
from ..artifacts import atomic_write_json
from ..paths import cache_dir

ENV = "DEJAVU_STEP_CHOICE_CACHE"
MAX_ENTRIES = 256
_FORMAT = 1
_lib_digest: dict[str, str] = {}


def cache_path() -> Path | None:
    """The cache file, or None when $DEJAVU_STEP_CHOICE_CACHE=0."""
    env = os.environ.get(ENV)
    if env == "0":
        return None
    if env:
        return Path(env)
    return cache_dir() / "step_choice.json"


def file_digest(path: Path) -> str:
    """sha256 of a file, once per process per path (the kernel library: ~30 MB)."""
    key = str(path)
    if key not in _lib_digest:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _lib_digest[key] = h.hexdigest()
    return _lib_digest[key]


def choice_key(fields: dict) -> str:
    """A stable key for the JSON-serialisable description `fields` (plus the version and the environment)."""
    env = {k: v for k, v in os.environ.items()
           if (k.startswith("DJV_") or k.startswith("DEJAVU_")) and k not in (ENV, "DEJAVU_TRT_CACHE")}
    blob = json.dumps({"format": _FORMAT, "version": __version__, "env": env, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"{path}: unreadable step-choice cache ({e}); timing afresh, it will be replaced", stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("entries"), dict):
        warnings.warn(f"{path}: not a step-choice cache of format {_FORMAT}; timing afresh, it will be replaced",
                      stacklevel=3)
        return {}
    return data["entries"]


def lookup(key: str, names) -> dict | None:
    """The cached choice for `key` if it names one of `names` (the candidates this executor can build)."""
    path = cache_path()
    if path is None:
        return None
    entry = _read(path).get(key)
    if (not isinstance(entry, dict) or entry.get("chosen") not in set(names)
            or not isinstance(entry.get("ms_per_step"), dict)):
        return None
    return entry


def store(key: str, choice: dict) -> None:
    """Record `choice` ({"chosen", "ms_per_step", ...}) under `key`; keeps the newest MAX_ENTRIES entries."""
    path = cache_path()
    if path is None:
        return
    entries = _read(path)
    entries[key] = {"chosen": choice["chosen"], "ms_per_step": choice["ms_per_step"], "stored": time.time()}
    if len(entries) > MAX_ENTRIES:
        keep = sorted(entries, key=lambda k: entries[k].get("stored", 0), reverse=True)[:MAX_ENTRIES]
        entries = {k: entries[k] for k in keep}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"format": _FORMAT, "entries": entries})
    except OSError as e:  # a read-only home must not fail the decode
        warnings.warn(f"{path}: could not store the step choice ({e})", stacklevel=2)
