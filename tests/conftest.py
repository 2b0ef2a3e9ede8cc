"""Shared fixtures: the real SmolLM2-135M, a tiny OPT trained on the corpus, and the SOTU corpus.

Everything is cached under $DEJAVU_TRT_CACHE (default ~/.cache/dejavu_trt), so only the first
test session pays for the GGUF conversion (~30 s) and the tiny-OPT training (~2-3 min).
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
