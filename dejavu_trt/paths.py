"""Where dejavu-trt keeps its caches (converted models, the corpus, test fixtures)."""
import os
from pathlib import Path


def cache_dir() -> Path:
    """$DEJAVU_TRT_CACHE, else ~/.cache/dejavu_trt."""
    root = os.environ.get("DEJAVU_TRT_CACHE") or Path.home() / ".cache" / "dejavu_trt"
    return Path(root).expanduser()
