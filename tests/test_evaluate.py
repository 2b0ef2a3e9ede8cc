"""`dejavu-trt evaluate`: bad inputs, the JSON/report/sparsity.json outputs, and the budget search (tiny OPT)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dejavu_trt.sparsity import SparsityPlan, evaluate_selection


def _path(workdir) -> Path:
    return Path(getattr(workdir, "path", workdir))


def _listing(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.stat().st_mtime_ns for p in sorted(d.rglob("*"))}


@pytest.fixture
def opt_dir(tiny_opt_workdir, tmp_path):
    """A private copy of the tiny OPT work dir (evaluate writes into it)."""
    dst = tmp_path / "wd"
    shutil.copytree(_path(tiny_opt_workdir), dst)
    return dst


@pytest.fixture
def small_text(tmp_path, sotu_docs):
    p = tmp_path / "speech.txt"
    p.write_text(sotu_docs[-1].text)
    return p


@pytest.mark.parametrize("args", [["--sparsity", "0"], ["--sparsity", "1.5"], ["--sparsity", "-1"],
                                  ["--head-sparsity", "0"], ["--max-ppl-increase", "0"],
                                  ["--sparsity", "0.5", "--max-ppl-increase", "0.05"], ["--tokens", "1"]])
def test_bad_options_exit_2_and_write_nothing(cli, opt_dir, args):
    before = _listing(opt_dir)
    code, out, err = cli("evaluate", opt_dir, *args)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _listing(opt_dir) == before


def test_missing_workdir_and_text(cli, tmp_path, opt_dir):
    code, _, err = cli("evaluate", tmp_path / "nope", "--sparsity", "0.5")
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    before = _listing(opt_dir)
    code, _, err = cli("evaluate", opt_dir, "--text", tmp_path / "missing.txt")
    assert code == 2 and "--text" in err and "Traceback" not in err
    assert _listing(opt_dir) == before


def test_workdir_without_predictors(cli, opt_dir):
    from dejavu_trt.calibrate.workdir import open_workdir, update_workdir_manifest

    (opt_dir / "predictors.safetensors").unlink()
    update_workdir_manifest(open_workdir(opt_dir), {})
    before = _listing(opt_dir)
    code, _, err = cli("evaluate", opt_dir, "--sparsity", "0.5")
    assert code == 2 and "train-predictors" in err and len(err.strip().splitlines()) == 1
    assert _listing(opt_dir) == before


def test_evaluate_json_report_and_plan(cli, opt_dir, small_text, tiny_opt):
    code, out, err = cli("evaluate", opt_dir, "--text", small_text, "--sparsity", "0.5", "--head-sparsity", "0.75",
                         "--tokens", "512", "--json", "--no-progress")
    assert code == 0, err
    r = json.loads(out)
    for key in ("ppl_dense", "ppl_sparse", "ppl_oracle", "recall_mlp", "recall_heads", "recall_mlp_per_layer",
                "recall_heads_per_layer", "mlp_kept_fraction", "head_kept_fraction", "bytes_per_token",
                "predictor_bytes_fraction"):
        assert key in r, key
    dims = tiny_opt.dims
    assert r["tokens"] == 512 // r["seq_len"] * (r["seq_len"] - 1)   # scored next-token predictions
    assert r["ppl_dense"] < r["ppl_oracle"] <= r["ppl_sparse"]
    assert r["mlp_kept_units"] == [dims.intermediate_size // 2] * dims.num_layers
    assert r["heads_kept"] == [3] * dims.num_layers
    assert len(r["recall_mlp_per_layer"]) == dims.num_layers and 0 < r["recall_mlp"] <= 1
    b = r["bytes_per_token"]
    assert b["sparse"] < b["dense"] and 0 < r["predictor_bytes_fraction"] < 1
    plan = SparsityPlan.load(opt_dir, dims)
    assert plan.mlp_kept_units == r["mlp_kept_units"] and plan.heads_kept == r["heads_kept"]
    md = (opt_dir / "report.md").read_text()
    assert "predictors' bytes" in md and f"{r['ppl_sparse']:.3f}" in md
    assert (opt_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from dejavu_trt.calibrate.workdir import open_workdir
    assert "sparsity.json" in open_workdir(opt_dir, verify=True).manifest["files"]
    # No flags: the saved plan is re-used; the human-readable summary names it.
    code, out, err = cli("evaluate", opt_dir, "--text", small_text, "--tokens", "256", "--no-progress")
    assert code == 0, err
    assert "--sparsity 0.5 --head-sparsity 0.75" in out and "recall" in out


def test_budget_search_meets_the_budget(cli, opt_dir, small_text, tiny_opt):
    from dejavu_trt.calibrate.workdir import open_workdir
    from dejavu_trt.predictors.model import LookaheadPredictors
    from dejavu_trt.sparsity.evaluation import validation_windows

    budget = 0.05
    code, out, err = cli("evaluate", opt_dir, "--text", small_text, "--max-ppl-increase", budget, "--tokens", "256",
                         "--budget-tokens", "256", "--json", "--no-progress")
    assert code == 0, err
    r = json.loads(out)
    plan = SparsityPlan.load(opt_dir, tiny_opt.dims)
    assert plan.source == f"budget {budget:g}" and r["budget"]["steps_taken"] > 0
    assert r["bytes_per_token"]["sparse"] < r["bytes_per_token"]["dense"]
    # Independently re-measure the chosen plan on the validation slice the search used.
    wd = open_workdir(opt_dir)
    val = validation_windows(wd, int(wd.config["seq_len"]), 256)
    preds = LookaheadPredictors.load(opt_dir)
    dense = evaluate_selection(tiny_opt.adapter, plan, "dense", val)
    pred = evaluate_selection(tiny_opt.adapter, plan, "predicted", val, preds)
    assert pred.ppl <= dense.ppl * (1 + budget) + 1e-9
