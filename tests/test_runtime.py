"""Engine packages, the CPU executor, bench, metrics and every bad-input error of the runtime.

Packages here are made from tiny random models built in the test (seconds), with the SmolLM2
tokenizer from the local cache; the real-model end-to-end test lives in test_build.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from dejavu_trt.errors import DejaVuError


def _tiny(family: str, vocab: int = 49152):
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                            tie_word_embeddings=True)).eval()
    return OPTForCausalLM(OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=256, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64)).eval()


def _predictors(dims, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for l in range(dims.num_layers):
        out[f"layers.{l}.mlp_a"] = torch.randn(dims.hidden_size, 8, generator=g)
        out[f"layers.{l}.mlp_b"] = torch.randn(8, dims.intermediate_size, generator=g)
        out[f"layers.{l}.head_a"] = torch.randn(dims.hidden_size, 4, generator=g)
        out[f"layers.{l}.head_b"] = torch.randn(4, dims.num_heads, generator=g)
    return out


@pytest.fixture(scope="module")
def tokenizer(smollm2):  # smollm2: converts the GGUF into the cached folder on a fresh machine
    from transformers import AutoTokenizer

    from dejavu_trt.models.loading import locate
    from dejavu_trt.models.registry import resolve
    return AutoTokenizer.from_pretrained(locate(resolve("smollm2-135m")), local_files_only=True)


def _write_package(path, family, tokenizer, plan_file=None, kept=0.5, max_context=64):
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.package import EngineConfig, write_engine_package
    model = _tiny(family)
    ad = adapter_for(model)
    dims = ad.dims()
    L = dims.num_layers
    cfg = EngineConfig("tiny-" + family, dims.to_dict(), "fp32", [int(kept * dims.intermediate_size)] * L,
                       [2] * L, max_context=max_context, eos_token_id=tokenizer.eos_token_id)
    write_engine_package(path, adapter=ad, tokenizer=tokenizer, predictors=_predictors(dims), config=cfg,
                         plan_file=plan_file)
    return model


@pytest.fixture(scope="module")
def llama_pkg(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("pkg") / "tiny-llama"
    model = _write_package(path, "llama", tokenizer)
    return path, model


# --- executor numerics ----------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "opt"])
def test_dense_executor_matches_hf(family):
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.decoder import DecoderWeights
    from dejavu_trt.runtime.executor import Executor
    from dejavu_trt.runtime.package import EngineConfig, engine_weights

    model = _tiny(family, vocab=512)
    ad = adapter_for(model)
    dims = ad.dims()
    w, extra = engine_weights(ad)
    L = dims.num_layers
    cfg = EngineConfig("t", dims.to_dict(), "fp32", [dims.intermediate_size] * L, [dims.num_heads] * L,
                       max_context=32, **extra)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    for ops in ("reference", "torch"):
        dw = DecoderWeights.from_tensors(cfg, w, _predictors(dims))
        if ops == "torch":
            dw.add_dense_layout()  # what a CUDA dense executor uses (HF-layout down/out projections)
        for dense in (True, False):  # sparse with every unit kept is dense
            ex = Executor(dw, dense=dense, ops=ops, batch=2, max_context=16)
            got = [ex.prefill(ids[:, :5])] + [ex.step(ids[:, t]).clone() for t in range(5, 9)]
            torch.testing.assert_close(torch.stack(got, 1), ref[:, 4:9], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("kv_policy", ["dense", "active"])
def test_torch_ops_match_reference_ops_sparse(family, kv_policy):
    """The graph-capturable torch backend computes exactly the op contract (in fp32, on CPU)."""
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.decoder import DecoderWeights
    from dejavu_trt.runtime.executor import Executor
    from dejavu_trt.runtime.package import EngineConfig, engine_weights

    ad = adapter_for(_tiny(family, vocab=512))
    dims = ad.dims()
    w, extra = engine_weights(ad)
    cfg = EngineConfig("t", dims.to_dict(), "fp32", [40, 17], [1, 3], kv_policy=kv_policy, max_context=32, **extra)
    dw = DecoderWeights.from_tensors(cfg, w, _predictors(dims))
    ids = torch.randint(0, 512, (3, 10), generator=torch.Generator().manual_seed(1))
    out = {}
    for ops in ("reference", "torch"):
        ex = Executor(dw, ops=ops, batch=3, max_context=16)
        out[ops] = torch.stack([ex.prefill(ids[:, :6])] + [ex.step(ids[:, t]).clone() for t in range(6, 10)])
    torch.testing.assert_close(out["torch"], out["reference"], atol=1e-4, rtol=1e-4)


def test_sparse_decode_equals_sparse_reference_model(llama_pkg):
    """Dense prefill + predicted-sparse decode equals the HF model under the sparse reference hooks."""
    from dejavu_trt.build.steps import TensorScorer
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.engine import Engine
    from dejavu_trt.sparsity.plan import SparsityPlan
    from dejavu_trt.sparsity.reference import sparse_model
    from transformers import DynamicCache

    path, model = llama_pkg
    eng = Engine.load(path)
    ids = torch.randint(0, 49152, (1, 6), generator=torch.Generator().manual_seed(2))
    ex = eng.executor(context=12)
    got = [ex.prefill(ids)] + [ex.step().clone() for _ in range(4)]
    c = eng.config
    plan = SparsityPlan(c.model_dims.intermediate_size, c.model_dims.num_heads, c.mlp_kept_units, c.heads_kept)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
        ref = [logits]
        with sparse_model(adapter_for(model), plan, "predicted", TensorScorer(eng.package.predictors)):
            for _ in range(4):
                tok = ref[-1].argmax(-1, keepdim=True)
                ref.append(model(tok, cache=cache, use_cache=True).logits[:, -1])
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-4, rtol=1e-4)


# --- CLI: generate, bench, metrics -----------------------------------------------------------------

def test_generate_streams_and_api_agrees(cli, llama_pkg):
    import dejavu_trt
    path, _ = llama_pkg
    code, out, err = cli("generate", path, "--prompt", "The state of the union", "--max-new-tokens", "6")
    assert code == 0, err
    text = dejavu_trt.Engine.load(path).generate("The state of the union", max_new_tokens=6)
    assert out == text + "\n" and text
    code, dense_out, _ = cli("generate", path, "--prompt", "The state of the union", "--max-new-tokens", "6", "--dense")
    assert code == 0


def test_bench_json_dense_vs_sparse_and_cost(cli, llama_pkg):
    path, _ = llama_pkg
    code, out, err = cli("bench", path, "--steps", "4", "--warmup", "1", "--prompt-len", "4", "--json",
                         "--gpu-hour-price", "2.5")
    assert code == 0, err
    res = json.loads(out)
    assert res["dense"]["mode"] == "dense" and res["sparse"]["mode"] == "sparse"
    assert res["sparse"]["bytes_per_step"] < res["dense"]["bytes_per_step"]
    for m in ("dense", "sparse"):
        assert res[m]["tbt_ms_p99"] >= res[m]["tbt_ms_p50"] > 0
    cost = res["cost"]
    assert cost["dense_gpu_hours_per_mtok"] == pytest.approx(1e6 / (res["dense"]["tokens_per_s"] * 3600))
    assert cost["cost_saved_per_mtok"] == pytest.approx(cost["gpu_hours_saved_per_mtok"] * 2.5)
    code, out, err = cli("bench", path, "--steps", "2", "--warmup", "0", "--prompt-len", "2")
    assert code == 0 and "hours per million tokens" in out and "speedup sparse vs dense" in out


def test_metrics_are_recorded(llama_pkg):
    from dejavu_trt.runtime.engine import Engine
    from dejavu_trt.runtime.metrics import RuntimeMetrics, predictor_recall
    path, _ = llama_pkg
    m = RuntimeMetrics(sample_every=2)
    eng = Engine.load(path)
    eng.metrics = m
    ids = list(eng.generate_ids(eng.encode("Hello there"), 6, stop_at_eos=False))
    assert len(ids) == 6
    reg = m.registry
    assert reg.get_sample_value("inference_tbt_latency_ms_count") == 5
    acc = reg.get_sample_value("dejavu_predictor_accuracy_mean_ratio")
    assert acc is not None and 0.0 <= acc <= 1.0
    assert reg.get_sample_value("dejavu_active_sparsity_percentage", {"unit": "mlp"}) == pytest.approx(50.0)
    # The recall is 1 for the true top-k and lower for a disjoint set.
    from dejavu_trt.runtime.metrics import exact_unit_magnitude
    lw = eng.weights.layers[0]
    x = torch.randn(1, 64)
    true = torch.sort(torch.topk(exact_unit_magnitude(x, lw, "silu_glu", 1), 10).indices).values
    assert predictor_recall(x, true, lw, "silu_glu", 1) == 1.0
    worst = torch.sort(torch.topk(-exact_unit_magnitude(x, lw, "silu_glu", 1), 10).indices).values
    assert predictor_recall(x, worst, lw, "silu_glu", 1) == 0.0


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_folded_norm_bytes_counts_the_copies_to_come(family):
    """What batch 1's timed fold choice checks against free memory: the bytes add_folded_norms adds, and
    nothing once the copies exist."""
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.decoder import DecoderWeights
    from dejavu_trt.runtime.package import EngineConfig, engine_weights
    ad = adapter_for(_tiny(family, vocab=512))
    dims = ad.dims()
    w, extra = engine_weights(ad)
    cfg = EngineConfig("t", dims.to_dict(), "fp32", [40, 17], [1, 3], max_context=32, **extra)
    dw = DecoderWeights.from_tensors(cfg, w, _predictors(dims))
    before = dw.nbytes
    want = dw.folded_norm_bytes(("mlp",))
    assert want > 0 and dw.folded_norm_bytes(()) == 0
    dw.add_folded_norms(("mlp",))
    assert dw.nbytes - before == want
    assert dw.folded_norm_bytes(("mlp",)) == 0


def test_fold_norms_defaults_by_batch(monkeypatch):
    """Batch 1 chooses by timing (auto), batch 2-4 folds mlp_norm, above 4 nothing folds; an explicit
    setting wins where folding applies; auto means mlp above batch 1; dense decoding and backends that
    cannot fold never fold."""
    from types import SimpleNamespace

    from dejavu_trt.runtime.executor import FOLD_AUTO, resolve_fold_norms
    monkeypatch.delenv("DEJAVU_FOLD_NORMS", raising=False)
    can, cannot = SimpleNamespace(folds_norms=True), SimpleNamespace()
    got = {b: resolve_fold_norms(None, can, dense=False, batch=b) for b in (1, 2, 4, 5, 16)}
    assert got == {1: FOLD_AUTO, 2: ("mlp",), 4: ("mlp",), 5: (), 16: ()}
    assert resolve_fold_norms(None, can, dense=True, batch=1) == ()
    assert resolve_fold_norms(None, cannot, dense=False, batch=1) == ()
    assert resolve_fold_norms(False, can, dense=False, batch=1) == ()
    monkeypatch.setenv("DEJAVU_FOLD_NORMS", "auto")
    assert resolve_fold_norms(None, can, dense=False, batch=1) == FOLD_AUTO
    assert resolve_fold_norms(None, can, dense=False, batch=3) == ("mlp",)
    assert resolve_fold_norms("auto", can, dense=False, batch=16) == ()
    monkeypatch.setenv("DEJAVU_FOLD_NORMS", "none")
    assert resolve_fold_norms(None, can, dense=False, batch=1) == ()
    monkeypatch.setenv("DEJAVU_FOLD_NORMS", "mlp")
    assert resolve_fold_norms(None, can, dense=False, batch=1) == ("mlp",)
    monkeypatch.setenv("DEJAVU_FOLD_NORMS", "all")
    assert resolve_fold_norms(None, can, dense=False, batch=3) == ("attn", "mlp")
    assert resolve_fold_norms(None, can, dense=True, batch=3) == ()
    assert resolve_fold_norms(None, cannot, dense=False, batch=3) == ()
    assert resolve_fold_norms(True, can, dense=False, batch=1) == ("attn", "mlp")


def test_costs():
    from dejavu_trt.models.adapters import ModelDims
    from dejavu_trt.runtime.costs import cost_forecast, expected_speedup, step_bytes
    dims = ModelDims("opt", 40, 5120, 20480, 40, 40, 128, 50272, 2048, "relu", "layernorm", 1e-5, None, True)
    dense = step_bytes(dims, dtype="fp16", context=0)
    assert dense.weights == (40 * (4 * 5120 * 5120 + 2 * 5120 * 20480) + 50272 * 5120) * 2
    sparse = step_bytes(dims, dtype="fp16", mlp_kept_units=[5120] * 40, heads_kept=[8] * 40, kv_policy="active",
                        context=0)
    assert sparse.weights == (40 * (4 * 8 * 128 * 5120 + 2 * 5120 * 5120) + 50272 * 5120) * 2
    assert expected_speedup(dense, sparse) > 3
    f = cost_forecast(100.0, 250.0, 3.0)
    assert f["gpu_hours_saved_per_mtok"] == pytest.approx(1e6 / 360000 - 1e6 / 900000)
    assert f["cost_saved_per_mtok"] == pytest.approx(3.0 * f["gpu_hours_saved_per_mtok"])


# --- bad input: one line, exit 2 -----------------------------------------------------------------

def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_missing_and_corrupt_package(cli, tmp_path, llama_pkg):
    code, _, err = cli("generate", tmp_path / "nope", "--prompt", "hi")
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    bad = _copy(llama_pkg[0], tmp_path / "corrupt")
    (bad / "manifest.json").write_text("{not json")
    code, _, err = cli("generate", bad, "--prompt", "hi")
    assert code == 2 and "corrupt" in err and len(err.strip().splitlines()) == 1


def test_checksum_mismatch(cli, tmp_path, llama_pkg):
    bad = _copy(llama_pkg[0], tmp_path / "tampered")
    data = bytearray((bad / "weights.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "weights.safetensors").write_bytes(bytes(data))
    code, _, err = cli("generate", bad, "--prompt", "hi")
    assert code == 2 and "checksum mismatch" in err


def test_op_contract_mismatch(cli, tmp_path, llama_pkg):
    bad = _copy(llama_pkg[0], tmp_path / "old")
    m = json.loads((bad / "manifest.json").read_text())
    m["op_contract_version"] = "0"
    (bad / "manifest.json").write_text(json.dumps(m))
    code, _, err = cli("generate", bad, "--prompt", "hi")
    assert code == 2 and "op contract version '0'" in err


def test_plan_without_plugin_library(cli, tmp_path, tokenizer, monkeypatch):
    fake_plan = tmp_path / "engine.plan"
    fake_plan.write_bytes(b"not really a plan")
    path = tmp_path / "with-plan"
    _write_package(path, "llama", tokenizer, plan_file=fake_plan)
    absent = tmp_path / "absent" / "libdejavu_trt_plugins.so"
    monkeypatch.setenv("DEJAVU_PLUGIN_LIBRARY", str(absent))
    code, _, err = cli("generate", path, "--prompt", "hi", "--plan")
    assert code == 2 and "plugin library libdejavu_trt_plugins.so" in err and str(absent) in err


def test_plugin_library_is_the_trt_adapter_library(tmp_path, monkeypatch):
    """TensorRT needs the library with the plugin creators; the kernels library beside it does not count."""
    from dejavu_trt.runtime.package import plugin_library
    kernels = tmp_path / "libdejavu_kernels.so"
    kernels.write_bytes(b"")
    monkeypatch.delenv("DEJAVU_PLUGIN_LIBRARY", raising=False)
    monkeypatch.setenv("DEJAVU_KERNELS_LIB", str(kernels))
    assert plugin_library() is None
    (tmp_path / "libdejavu_trt_plugins.so").write_bytes(b"")
    assert plugin_library() == tmp_path / "libdejavu_trt_plugins.so"


def test_prompt_longer_than_context(cli, llama_pkg):
    code, _, err = cli("generate", llama_pkg[0], "--prompt", "word " * 80)
    assert code == 2 and "context holds 64" in err
    code, _, err = cli("generate", llama_pkg[0], "--prompt", "a b c d e f g h", "--max-context", "4")
    assert code == 2 and "context holds 4" in err


def test_batch_above_maximum(cli, llama_pkg):
    code, _, err = cli("bench", llama_pkg[0], "--batch", "17", "--steps", "1")
    assert code == 2 and "--batch 17" in err and "1..16" in err


def test_out_of_memory_reports_sizes(cli, llama_pkg, monkeypatch):
    import dejavu_trt.runtime.executor as executor

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    monkeypatch.setattr(executor.torch, "zeros", oom)
    code, _, err = cli("generate", llama_pkg[0], "--prompt", "hi")
    monkeypatch.undo()
    assert code == 2
    assert "out of memory allocating the KV cache (1, 2, " in err and "GiB" in err and "batch 1 x context" in err


def test_metrics_port_serves_prometheus_text(llama_pkg):
    import socket
    import urllib.request

    from dejavu_trt.runtime.engine import Engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eng = Engine.load(llama_pkg[0], metrics_port=port)
    eng.generate("Hello", max_new_tokens=3)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in ("dejavu_predictor_accuracy_ratio", "dejavu_active_sparsity_percentage", "inference_tbt_latency_ms_bucket"):
        assert name in body


def test_mlp_grid_slack_needs_the_kernels():
    """Pinning the fused MLP's grid (Executor(mlp_grid_slack=)) only means something with the CUDA kernels;
    other backends say so instead of ignoring it."""
    from dejavu_trt.errors import DejaVuError
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.decoder import DecoderWeights
    from dejavu_trt.runtime.executor import Executor
    from dejavu_trt.runtime.package import EngineConfig, engine_weights
    ad = adapter_for(_tiny("opt", vocab=512))
    dims = ad.dims()
    w, extra = engine_weights(ad)
    cfg = EngineConfig("t", dims.to_dict(), "fp32", [40, 17], [1, 3], max_context=32, **extra)
    dw = DecoderWeights.from_tensors(cfg, w, _predictors(dims))
    for ops in ("reference", "torch"):
        with pytest.raises(DejaVuError, match="mlp_grid_slack needs the CUDA kernels"):
            Executor(dw, ops=ops, batch=1, max_context=16, mlp_grid_slack=2)
    assert Executor(dw, ops="reference", batch=1, max_context=16).mlp_grid_slack is None


def test_bench_names_the_timed_step_variant():
    """`dejavu-trt bench` says which step variant batch 1's timed choice kept, with what each measured."""
    from dejavu_trt.cli.runtime import step_variant_line
    assert step_variant_line({"step_choice": None}) is None
    line = step_variant_line({"step_choice": {"chosen": "mlp+slack2", "ms_per_step": {
        "none": 2.857, "mlp": 2.93, "none+slack2": 2.868, "mlp+slack2": 2.7617}}})
    assert line.startswith("sparse step: mlp_norm folded, fused MLP grid 2 SMs short")
    assert "mlp+slack2 2.762" in line and "none 2.857" in line
    line = step_variant_line({"step_choice": {"chosen": "none", "ms_per_step": {"none": 1.0},
                                              "reason": "mlp_norm not folded: copies too large"}})
    assert line.startswith("sparse step: mlp_norm unfolded (") and line.endswith("copies too large")
    assert "timed at the first decode step" in line
    line = step_variant_line({"step_choice": {"chosen": "mlp", "ms_per_step": {"none": 1.1, "mlp": 1.0},
                                              "cached": "/home/u/.cache/dejavu_trt/step_choice.json"}})
    assert "timed earlier on this machine, from /home/u/.cache/dejavu_trt/step_choice.json" in line


def test_step_refuses_token_ids_outside_the_vocabulary():
    """A token id past the vocabulary is refused before the step (the GPU embedding kernel would give NaN
    rows, torch's gather a device-side assert); ids inside it decode."""
    from dejavu_trt.errors import DejaVuError
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.decoder import DecoderWeights
    from dejavu_trt.runtime.executor import Executor
    from dejavu_trt.runtime.package import EngineConfig, engine_weights
    ad = adapter_for(_tiny("opt", vocab=512))
    dims = ad.dims()
    w, extra = engine_weights(ad)
    cfg = EngineConfig("t", dims.to_dict(), "fp32", [40, 17], [1, 3], max_context=32, **extra)
    ex = Executor(DecoderWeights.from_tensors(cfg, w, _predictors(dims)), ops="reference", batch=2, max_context=16)
    ex.prefill(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    for bad in ([0, 512], [-1, 3]):
        with pytest.raises(DejaVuError, match="outside the vocabulary of 512"):
            ex.step(torch.tensor(bad))
    assert ex.step(torch.tensor([0, 511])).shape == (2, 512)
