"""Shared fixtures: the real SmolLM2-135M, a tiny OPT trained on the corpus, and the SOTU corpus.

Everything is cached under $DEJAVU_TRT_CACHE (default ~/.cache/dejavu_trt), so only the first
test session pays for the GGUF conversion (~30 s) and the tiny-OPT training (~2-3 min).
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Batch 1's timed step choice times afresh in every test; tests of its cache point it at a temporary file.
os.environ.setdefault("DEJAVU_STEP_CHOICE_CACHE", "0")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (LLaMA family), fp32 on CPU."""
    from dejavu_trt.models import load_model
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_opt_dir():
    """Folder of a 4-layer OPT trained briefly on SOTU (ReLU MLP with real activation sparsity)."""
    from dejavu_trt.models.tiny_opt import train_tiny_opt
    return train_tiny_opt(progress=False)


@pytest.fixture(scope="session")
def tiny_opt(tiny_opt_dir):
    from dejavu_trt.models import load_model
    return load_model(str(tiny_opt_dir))


@pytest.fixture(scope="session")
def sotu_docs():
    from dejavu_trt.data.corpus import load_documents
    return load_documents("sotu")


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process: returns (exit_code, stdout, stderr)."""
    from dejavu_trt.cli import main

    def run(*args: str):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


# --- calibrated + trained work dirs (calibration/predictors engineer) ------------------------------
# Built once and cached under $DEJAVU_TRT_CACHE/test-workdirs, keyed by a hash of the code that
# produces them, so a code change rebuilds them. Treat them as read-only: copy one before editing it.
SMOLLM2_TEST_TOKENS = 8192
TINY_OPT_TEST_TOKENS = 4096


def _code_key(*extra) -> str:
    import hashlib
    from pathlib import Path

    import dejavu_trt
    root = Path(dejavu_trt.__file__).parent
    h = hashlib.sha256(repr(extra).encode())
    for sub in ("calibrate", "predictors", "models", "data", "ops"):
        for p in sorted((root / sub).glob("*.py")):
            h.update(p.name.encode() + p.read_bytes())
    for name in ("artifacts.py", "__init__.py"):
        h.update((root / name).read_bytes())
    return h.hexdigest()[:12]


def _trained_workdir(name: str, model: str, tokens: int):
    """Calibrate `model` on SOTU and train predictors, once per code version; returns the dir."""
    import shutil
    import time

    from dejavu_trt.calibrate import calibrate, open_workdir
    from dejavu_trt.errors import ArtifactError
    from dejavu_trt.paths import cache_dir
    from dejavu_trt.predictors import PREDICTORS_FILE
    from dejavu_trt.predictors.training import train_workdir

    base = cache_dir() / "test-workdirs"
    path = base / f"{name}-{_code_key(model, tokens)}"
    try:
        wd = open_workdir(path)
        if PREDICTORS_FILE in wd.manifest["files"]:
            return path
    except ArtifactError:
        pass
    if base.is_dir():  # drop copies built by older code (they are large), unless another session may use them
        for old in base.glob(f"{name}-*"):
            if old != path and time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
    # Build under a private name and rename into place, so concurrent test sessions never replace
    # a copy another session is reading: the first to finish wins, the others drop theirs.
    mine = base / f".{path.name}-{os.getpid()}"
    shutil.rmtree(mine, ignore_errors=True)
    try:
        calibrate(model, "sotu", tokens, mine, progress=False)
        train_workdir(mine, progress=False)
        os.rename(mine, path)
    except OSError:
        if not (path / PREDICTORS_FILE).is_file():
            raise
    finally:
        shutil.rmtree(mine, ignore_errors=True)
    return path


@pytest.fixture(scope="session")
def smollm2_workdir():
    """Work dir of SmolLM2-135M calibrated on 8192 SOTU tokens (+2048 validation) with trained
    predictors (predictors.safetensors, predictors_report.json). Read-only."""
    return _trained_workdir("smollm2", "smollm2-135m", SMOLLM2_TEST_TOKENS)


@pytest.fixture(scope="session")
def tiny_opt_workdir(tiny_opt_dir):
    """Work dir of the tiny OPT calibrated on 4096 SOTU tokens with trained predictors. Read-only."""
    return _trained_workdir("tiny-opt", str(tiny_opt_dir), TINY_OPT_TEST_TOKENS)
