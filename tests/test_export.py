"""Export: the canonical decode module and the dense ONNX decode graph against the HF models."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dejavu_trt.export import DecodeModel, io_names
from dejavu_trt.export.stage import export_decode
from dejavu_trt.export.testing import ort_decode

TEXT = ("Mr. Speaker, Mr. Vice President, members of Congress, my fellow Americans: the state of our union "
        "is strong, and tonight we look ahead to the work of the coming year together.")
STEPS = 8


def text_tokens(tokenizer, rows: int, steps: int = STEPS) -> torch.Tensor:
    ids = tokenizer(TEXT)["input_ids"]
    return torch.tensor([ids[r * 3: r * 3 + steps] for r in range(rows)])


def hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def rel_to_range(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def smollm2_full_export(smollm2, tmp_path_factory):
    """The real SmolLM2-135M, all 30 layers, T = 64."""
    return export_decode("smollm2-135m", tmp_path_factory.mktemp("exp") / "smollm2", max_context=64, loaded=smollm2)


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_torch_decode_module_matches_hf(family, request):
    lm = request.getfixturevalue("tiny_opt" if family == "opt" else "smollm2")
    tokens = text_tokens(lm.tokenizer, rows=2)
    ref = hf_logits(lm.model, tokens)
    dm = DecodeModel.from_adapter(lm.adapter, max_context=32)
    cache = dm.new_cache(2)
    for t in range(STEPS):
        logits = dm.step(tokens[:, t], torch.full((2,), t, dtype=torch.int32), cache)
        assert rel_to_range(logits, ref[:, t]) < 1e-4, t
    assert int(cache.keys[0][:, :, STEPS:].abs().sum()) == 0  # slots past the position stay untouched


def test_smollm2_full_onnx_decode_matches_hf(smollm2, smollm2_full_export):
    """Acceptance: the dense decode graph of the real model, multi-step with its cache, vs HF forward (fp32)."""
    path = smollm2_full_export
    onnx.checker.check_model(str(path), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = DecodeModel.from_adapter(smollm2.adapter, 64).cfg
    tokens = text_tokens(smollm2.tokenizer, rows=2)
    ref = hf_logits(smollm2.model, tokens)
    steps = ort_decode(sess, cfg, tokens)
    errs = [rel_to_range(lg, ref[:, t]) for t, lg in enumerate(steps)]
    assert max(errs) < 1e-4, errs
    # Greedy choices agree everywhere.
    assert all((lg.argmax(-1) == ref[:, t].argmax(-1).numpy()).all() for t, lg in enumerate(steps))


def test_tiny_opt_onnx_decode_matches_hf(tiny_opt, tmp_path):
    path = export_decode(str(tiny_opt.folder), tmp_path / "opt", max_context=32, loaded=tiny_opt)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = DecodeModel.from_adapter(tiny_opt.adapter, 32).cfg
    for rows in (1, 3):  # the batch dimension is dynamic
        tokens = text_tokens(tiny_opt.tokenizer, rows=rows)
        ref = hf_logits(tiny_opt.model, tokens)
        for t, lg in enumerate(ort_decode(sess, cfg, tokens)):
            assert rel_to_range(lg, ref[:, t]) < 1e-5, (rows, t)


def test_graph_io_and_stable_names(smollm2_full_export):
    m = onnx.load(str(smollm2_full_export), load_external_data=False)
    io = io_names(30)
    assert [i.name for i in m.graph.input] == io["inputs"]
    assert [o.name for o in m.graph.output] == io["outputs"]
    ids, pos, k0 = m.graph.input[0], m.graph.input[1], m.graph.input[2]
    assert ids.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert pos.type.tensor_type.elem_type == onnx.TensorProto.INT32
    dims = [d.dim_param or d.dim_value for d in k0.type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 64, 64]  # [B, Hkv, T, hd]: batch dynamic, T fixed
    scopes = {n.name.rsplit("/", 1)[0] for n in m.graph.node}
    for i in range(30):
        assert {f"layers.{i}.mlp", f"layers.{i}.attn", f"layers.{i}.attn_norm", f"layers.{i}.mlp_norm"} <= scopes
    # Each cache is written by exactly one ScatterElements (functional in ONNX; aliased by TensorRT).
    writers = {o: n.op_type for n in m.graph.node for o in n.output}
    assert all(writers[f"present_{kv}.{i}"] == "ScatterElements" for i in range(30) for kv in ("key", "value"))


def test_export_bad_inputs(cli, tmp_path):
    code, _, err = cli("export", "no-such-model-alias", "--out", tmp_path / "x")
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1
    code, _, err = cli("export", "smollm2-135m", "--out", tmp_path / "y", "--layers", "0")
    assert code == 2 and "--layers" in err
    code, _, err = cli("export", "smollm2-135m", "--out", tmp_path / "z", "--max-context", "1")
    assert code == 2 and "--max-context" in err
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()
