"""Registry, artifacts and corpus basics."""
import json

import pytest
import torch

from dejavu_trt.artifacts import atomic_dir, load_safetensors, read_manifest, save_safetensors, write_manifest
from dejavu_trt.errors import ArtifactError, DejaVuError, check_fraction
from dejavu_trt.models.registry import resolve


def test_unknown_alias():
    with pytest.raises(DejaVuError, match="unknown model alias .gpt-17."):
        resolve("gpt-17")


def test_aliases_resolve():
    assert resolve("opt-13b").hf_id == "facebook/opt-13b"
    assert resolve("OPT-125M").family == "opt"
    assert resolve("llama-2-7b").family == "llama"
    assert resolve("smollm2-135m").source == "gguf-package"


@pytest.mark.parametrize("bad", [0, -0.1, 1.0001, 2])
def test_fraction_bounds(bad):
    with pytest.raises(DejaVuError, match=r"\(0, 1\]"):
        check_fraction("--sparsity", bad)
    assert check_fraction("--sparsity", 1.0) == 1.0


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "art"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as d:
            (d / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_manifest_roundtrip_and_tamper(tmp_path):
    target = tmp_path / "art"
    with atomic_dir(target) as d:
        save_safetensors(d / "t.safetensors", {"a": torch.arange(4.0)}, {"format": "x"})
        write_manifest(d, "workdir", {"k": 1})
    m = read_manifest(target, "workdir")
    assert m["config"] == {"k": 1} and "t.safetensors" in m["files"]
    with pytest.raises(ArtifactError, match="expected a 'engine'"):
        read_manifest(target, "engine")
    (target / "t.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        read_manifest(target, "workdir")
    with pytest.raises(ArtifactError, match="not a readable safetensors"):
        load_safetensors(target / "t.safetensors")
    mj = json.loads((target / "manifest.json").read_text())
    mj["format_version"] = 999
    (target / "manifest.json").write_text(json.dumps(mj))
    with pytest.raises(ArtifactError, match="format version 999"):
        read_manifest(target, "workdir", verify=False)


def test_foreign_safetensors(tmp_path):
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(ArtifactError, match="foreign"):
        load_safetensors(tmp_path / "f.safetensors")


def test_corpus_split_is_deterministic_and_disjoint():
    from dejavu_trt.data.corpus import split_windows
    stream = torch.arange(20 * 16 * 3)
    a, b = split_windows(stream, 16), split_windows(stream, 16)
    assert all(torch.equal(a[k], b[k]) for k in a)
    seen = torch.cat([a[k].flatten() for k in a])
    assert seen.unique().numel() == seen.numel() == stream.numel()
    assert a["calibration"].shape[0] == 42 and a["validation"].shape[0] == 9 and a["test"].shape[0] == 9


def test_corpus_too_small(tmp_path):
    from dejavu_trt.data.corpus import take_tokens
    with pytest.raises(DejaVuError, match="requested"):
        take_tokens(torch.zeros(3, 16, dtype=torch.long), 1000, "calibration", "tiny.txt")


def test_missing_corpus_path():
    from dejavu_trt.data.corpus import load_documents
    with pytest.raises(DejaVuError, match="neither 'sotu' nor an existing"):
        load_documents("/nonexistent/texts")
