"""Lookahead predictors: the op contract's scores, the file format, and recall on real records."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from dejavu_trt.artifacts import save_safetensors
from dejavu_trt.calibrate import open_workdir
from dejavu_trt.errors import ArtifactError
from dejavu_trt.ops.reference import lookahead_predictor, predictor_scores
from dejavu_trt.predictors import PREDICTORS_FILE, LookaheadPredictors, input_index, kept_count, topk_recall


def _validation_recall(workdir, preds=None):
    """Per-layer recall on the validation records, recomputed from the saved predictors."""
    return _validation_recall_cached(str(workdir)) if preds is None else _recompute_recall(workdir, preds)


@functools.lru_cache(maxsize=4)
def _validation_recall_cached(workdir: str):
    return _recompute_recall(workdir, LookaheadPredictors.load(workdir))


def _recompute_recall(workdir, preds):
    wd = open_workdir(workdir)
    rec = wd.records("validation")
    L, H = wd.dims["num_layers"], wd.dims["num_heads"]
    k_mlp, k_heads = kept_count(0.5, wd.config["num_units"]), kept_count(6 / 9, H)
    mlp, heads = [], []
    for l in range(L):
        h = rec.hidden(input_index(l)).float()
        mlp.append(topk_recall(preds.mlp_scores(l, h), rec.mlp(l).float(), k_mlp).mean().item())
        heads.append(topk_recall(preds.head_scores(l, h), rec.heads(l), k_heads).mean().item())
    return mlp, heads


def test_input_index_is_lookahead():
    assert [input_index(l) for l in range(4)] == [0, 0, 1, 2]
    assert LookaheadPredictors.input_index(5) == 4


def test_scores_are_the_contract_op(tiny_opt_workdir):
    preds = LookaheadPredictors.load(tiny_opt_workdir)
    torch.manual_seed(0)
    h = torch.randn(5, preds.mlp_a[0].shape[0]) * 3
    for l in range(preds.num_layers):
        torch.testing.assert_close(preds.mlp_scores(l, h), predictor_scores(h, preds.mlp_a[l], preds.mlp_b[l]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(preds.head_scores(l, h), predictor_scores(h, preds.head_a[l], preds.head_b[l]),
                                   rtol=0, atol=0)
        mi, hi = preds.select(l, h, 7, 2)
        ri, rh = lookahead_predictor(h, preds.mlp_a[l], preds.mlp_b[l], preds.head_a[l], preds.head_b[l], 7, 2)
        assert torch.equal(mi, ri) and torch.equal(hi, rh) and mi.dtype == torch.int32


def test_file_layout_and_roundtrip(tiny_opt_workdir, tmp_path):
    from safetensors import safe_open

    wd = open_workdir(tiny_opt_workdir, verify=True)
    d, N, H = (wd.dims[k] for k in ("hidden_size", "intermediate_size", "num_heads"))
    with safe_open(str(tiny_opt_workdir / PREDICTORS_FILE), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "dejavu-predictors" and meta["num_layers"] == str(wd.dims["num_layers"])
        assert meta["model_fingerprint"] == wd.config["model"]["fingerprint"] and meta["block_size"] == "1"
        r_m, r_h = int(meta["rank_mlp"]), int(meta["rank_heads"])
        assert f.get_slice("layers.0.mlp_a").get_shape() == [d, r_m]
        assert f.get_slice("layers.0.mlp_b").get_shape() == [r_m, N]
        assert f.get_slice("layers.3.head_a").get_shape() == [d, r_h]
        assert f.get_slice("layers.3.head_b").get_shape() == [r_h, H]
    preds = LookaheadPredictors.load(tiny_opt_workdir)
    preds.save(tmp_path / "p.safetensors")
    again = LookaheadPredictors.load(tmp_path / "p.safetensors", expect_fingerprint=preds.fingerprint)
    assert all(torch.equal(x, y) for x, y in zip(preds.mlp_b, again.mlp_b))
    assert again.info == preds.info and "recall_mlp_mean" in again.info


def test_bad_predictor_files(tiny_opt_workdir, tmp_path):
    good = tiny_opt_workdir / PREDICTORS_FILE
    corrupt = tmp_path / "corrupt.safetensors"
    data = good.read_bytes()
    corrupt.write_bytes(data[:100] + b"\xff" * 64 + data[164:])
    with pytest.raises(ArtifactError, match="safetensors|incomplete"):
        LookaheadPredictors.load(corrupt)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError):
        LookaheadPredictors.load(truncated)
    from safetensors.torch import save_file
    foreign = tmp_path / "foreign.safetensors"
    save_file({"layers.0.mlp_a": torch.zeros(2, 2)}, str(foreign))
    with pytest.raises(ArtifactError, match="foreign"):
        LookaheadPredictors.load(foreign)
    other = tmp_path / "other-format.safetensors"
    save_safetensors(other, {"x": torch.zeros(1)}, {"format": "dejavu-calibration-records"})
    with pytest.raises(ArtifactError, match="expected 'dejavu-predictors'"):
        LookaheadPredictors.load(other)
    with pytest.raises(ArtifactError, match="another model"):
        LookaheadPredictors.load(good, expect_fingerprint="0123456789abcdef")


def test_workdir_checks(tiny_opt_workdir, tmp_path):
    wd = tmp_path / "wd"
    shutil.copytree(tiny_opt_workdir, wd)
    (wd / PREDICTORS_FILE).write_bytes((wd / PREDICTORS_FILE).read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ArtifactError, match="checksum"):
        LookaheadPredictors.load(wd)
    manifest = json.loads((wd / "manifest.json").read_text())
    manifest["format_version"] = 999
    (wd / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version 999"):
        LookaheadPredictors.load(wd)


def test_tiny_opt_recall(tiny_opt_workdir):
    """ReLU OPT: the report matches a recomputation, and lookahead beats chance clearly."""
    preds = LookaheadPredictors.load(tiny_opt_workdir)
    report = json.loads((tiny_opt_workdir / "predictors_report.json").read_text())
    mlp, heads = _validation_recall(tiny_opt_workdir, preds)
    assert [round(r, 3) for r in mlp] == pytest.approx([p["recall_mlp"] for p in report["per_layer"]], abs=2e-3)
    assert [round(r, 3) for r in heads] == pytest.approx([p["recall_heads"] for p in report["per_layer"]], abs=2e-3)
    assert min(mlp) > 0.6 and min(heads) > 0.5


def test_smollm2_recall(smollm2_workdir):
    """SmolLM2 validation windows: the stored report matches a recomputation from the saved
    predictors, and lookahead beats the best static choice (top-k by mean calibration activity)
    on every layer. Measured at 8192 calibration tokens: MLP recall at 50% mean 0.68, min 0.64;
    heads at 6/9 mean 0.90 (see test_smollm2_recall_acceptance for the 0.9 MLP target)."""
    mlp, heads = _validation_recall(smollm2_workdir)
    report = json.loads((smollm2_workdir / "predictors_report.json").read_text())
    assert sum(mlp) / len(mlp) == pytest.approx(report["recall_mlp_mean"], abs=2e-3)
    assert sum(heads) / len(heads) == pytest.approx(report["recall_heads_mean"], abs=2e-3)
    wd = open_workdir(smollm2_workdir)
    cal, val = wd.records("calibration"), wd.records("validation")
    k = kept_count(0.5, wd.config["num_units"])
    for l, r in enumerate(mlp):
        yv = val.mlp(l).float()
        static = topk_recall(cal.mlp(l).float().mean(0).expand_as(yv), yv, k).mean().item()
        assert r > static + 0.02, (l, r, static)
    assert sum(mlp) / len(mlp) >= 0.66 and min(mlp) >= 0.6
    assert sum(heads) / len(heads) >= 0.85
    assert report["mass_recall_mlp_mean"] >= 0.8


@pytest.mark.xfail(strict=True, reason="issue 2 target, not reached: a low-rank lookahead predictor "
                   "(the op contract's rmsnorm(h) @ a @ b) reaches ~0.68 mean MLP recall at 50% on "
                   "SmolLM2; a 4.3M-parameter nonlinear predictor on the same input reaches 0.69-0.74 "
                   "(benchmarks/probe_mlp_predictor_capacity.py)")
def test_smollm2_recall_acceptance(smollm2_workdir):
    """Acceptance target of issue 2: MLP recall at 50% kept (mean over layers) >= 0.9."""
    mlp, _ = _validation_recall(smollm2_workdir)
    assert sum(mlp) / len(mlp) >= 0.9, f"MLP recall at 50% kept: mean {sum(mlp) / len(mlp):.3f}, min {min(mlp):.3f}"


def test_recall_counts_ties_as_hits():
    act = torch.tensor([[3.0, 0.0, 0.0, 0.0, 0.0, 2.0]])  # top-3 = {0, 5, any zero}
    assert topk_recall(torch.tensor([[9.0, 0.0, 0.0, 0.0, 5.0, 8.0]]), act, 3).item() == 1.0
    assert topk_recall(torch.tensor([[0.0, 9.0, 8.0, 0.0, 0.0, 7.0]]), act, 3).item() == pytest.approx(2 / 3)
    torch.manual_seed(0)
    a, s = torch.rand(64, 40), torch.rand(64, 40)  # no ties: plain set overlap
    oracle = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(10, -1).indices, True)
    torch.testing.assert_close(topk_recall(s, a, 10), oracle.gather(-1, s.topk(10, -1).indices).float().mean(-1))


def test_reduced_rank_ridge_with_fewer_tokens_than_dims():
    """A singular Gram matrix (low-rank inputs, e.g. few calibration tokens) must not break the fit
    (it used Cholesky, which failed on SmolLM2 with --tokens 1024),
    and the rank-r result must equal the best rank-r approximation of the fitted scores z @ w."""
    from dejavu_trt.predictors.training import reduced_rank_ridge
    g = torch.Generator().manual_seed(3)
    # Inputs confined to a 4-dim subspace: the Gram matrix is singular beyond float32 jitter.
    z = torch.randn(100, 4, generator=g) @ torch.randn(4, 96, generator=g)
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True))   # the predictors' RMS-normalised inputs
    t = torch.randn(100, 30, generator=g)
    a, b = reduced_rank_ridge(z, t, rank=3, ridge=1e-6)
    assert a.shape == (96, 3) and b.shape == (3, 30) and torch.isfinite(a @ b).all()
    lam = 1e-6 * (z.T @ z).diagonal().mean()
    w = torch.linalg.solve(z.T @ z + lam * torch.eye(96), z.T @ t)
    u, s, vh = torch.linalg.svd(z @ w, full_matrices=False)
    best = (u[:, :3] * s[:3]) @ vh[:3]
    assert torch.allclose(z @ a @ b, best, atol=1e-3, rtol=1e-3)
