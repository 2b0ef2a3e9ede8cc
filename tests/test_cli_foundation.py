"""`dejavu-trt calibrate` / `train-predictors`: the happy path on the tiny OPT, and every bad input
giving one line on stderr, exit status 2, no traceback and no partial work dir."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dejavu_trt.artifacts import save_safetensors
from dejavu_trt.calibrate.workdir import open_workdir, update_workdir_manifest
from dejavu_trt.predictors import PREDICTORS_FILE


def _one_line_error(code, out, err):
    assert code == 2, (code, out, err)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err + out


def _no_leftovers(parent, name):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_calibrate_and_train_cli(cli, tiny_opt_dir, tmp_path):
    out = tmp_path / "wd"
    code, stdout, err = cli("calibrate", tiny_opt_dir, "--tokens", 512, "--seq-len", 128, "--out", out)
    assert code == 0, err
    assert "512 calibration + 128 validation tokens" in stdout
    code, stdout, err = cli("train-predictors", out, "--rank-mlp", 16, "--rank-heads", 4, "--epochs", 1, "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["config"]["rank_mlp"] == 16 and len(report["per_layer"]) == 4
    assert 0 < report["bytes_fraction"] < 1 and 0 <= report["recall_mlp_min"] <= report["recall_mlp_mean"] <= 1
    wd = open_workdir(out, verify=True)
    assert PREDICTORS_FILE in wd.manifest["files"] and wd.manifest["predictors"]["recall_mlp_mean"] == report["recall_mlp_mean"]
    code, stdout, err = cli("train-predictors", out, "--epochs", 0)  # plain-text report
    assert code == 0 and "MLP recall at 50% kept" in stdout and "of the dense MLP+attention bytes" in stdout


@pytest.mark.parametrize("model, message", [("no-such-model", "no-such-model"), ("opt-13b", "opt-13b")])
def test_calibrate_model_errors(cli, tmp_path, model, message):
    code, out, err = cli("calibrate", model, "--tokens", 256, "--out", tmp_path / "wd")
    _one_line_error(code, out, err)
    assert message in err
    _no_leftovers(tmp_path, "wd")


def test_calibrate_corpus_too_small(cli, tiny_opt_dir, tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("Only a few words of text here. " * 40)
    code, out, err = cli("calibrate", tiny_opt_dir, "--corpus", text, "--tokens", 100000, "--out", tmp_path / "wd")
    _one_line_error(code, out, err)
    assert "--tokens" in err
    _no_leftovers(tmp_path, "wd")


def test_calibrate_refuses_foreign_out_dir(cli, tiny_opt_dir, tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    code, out, err = cli("calibrate", tiny_opt_dir, "--tokens", 256, "--out", keep)
    _one_line_error(code, out, err)
    assert (keep / "notes.txt").read_text() == "precious"


@pytest.fixture
def workdir_copy(tiny_opt_workdir, tmp_path):
    dst = tmp_path / "wd"
    shutil.copytree(tiny_opt_workdir, dst)
    return dst


def test_train_rejects_other_version(cli, workdir_copy):
    m = json.loads((workdir_copy / "manifest.json").read_text())
    m["format_version"] = 0
    (workdir_copy / "manifest.json").write_text(json.dumps(m))
    before = (workdir_copy / PREDICTORS_FILE).read_bytes()
    code, out, err = cli("train-predictors", workdir_copy)
    _one_line_error(code, out, err)
    assert "format version 0" in err and (workdir_copy / PREDICTORS_FILE).read_bytes() == before


def test_train_rejects_corrupt_records(cli, workdir_copy):
    shard = workdir_copy / open_workdir(workdir_copy).config["splits"]["calibration"]["shards"][0]
    data = bytearray(shard.read_bytes())
    data[200:216] = b"\xff" * 16
    shard.write_bytes(bytes(data))
    code, out, err = cli("train-predictors", workdir_copy)
    _one_line_error(code, out, err)
    assert "checksum" in err


def test_train_rejects_foreign_records(cli, workdir_copy):
    """A foreign safetensors file in place of a shard, even with a matching manifest checksum."""
    from safetensors.torch import save_file

    wd = open_workdir(workdir_copy)
    shard = workdir_copy / wd.config["splits"]["validation"]["shards"][0]
    save_file({"hidden.0": torch.zeros(2, 2)}, str(shard))
    update_workdir_manifest(wd, {})
    code, out, err = cli("train-predictors", workdir_copy)
    _one_line_error(code, out, err)
    assert "foreign" in err


def test_train_rejects_non_workdir(cli, tmp_path):
    code, out, err = cli("train-predictors", tmp_path)
    _one_line_error(code, out, err)
    code, out, err = cli("train-predictors", tmp_path / "absent")
    _one_line_error(code, out, err)


def test_bad_numbers(cli, tiny_opt_dir, tmp_path, workdir_copy):
    for args in (("--tokens", 0), ("--block-size", 3), ("--seq-len", 1)):
        code, out, err = cli("calibrate", tiny_opt_dir, "--out", tmp_path / "x", *map(str, args))
        _one_line_error(code, out, err)
        _no_leftovers(tmp_path, "x")
    code, out, err = cli("train-predictors", workdir_copy, "--rank-mlp", 0)
    _one_line_error(code, out, err)


def test_predictor_file_errors_are_artifact_errors(workdir_copy):
    """Corrupt / foreign predictors files (the loader every later stage uses) give ArtifactError."""
    from dejavu_trt.errors import ArtifactError
    from dejavu_trt.predictors import LookaheadPredictors

    save_safetensors(workdir_copy / PREDICTORS_FILE, {"x": torch.zeros(1)}, {"format": "something-else"})
    update_workdir_manifest(open_workdir(workdir_copy), {})
    with pytest.raises(ArtifactError):
        LookaheadPredictors.load(workdir_copy)
