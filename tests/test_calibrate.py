"""Calibration records: shapes, and contents equal to a direct recomputation from the model."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dejavu_trt.calibrate import ActivityRecorder, block_activity, calibrate, head_importance, open_workdir


def _first_window(wd, split="calibration"):
    return wd.records(split).tokens()[: wd.config["seq_len"]].view(1, -1)


def _capture_inputs(model, modules, ids):
    """Inputs of `modules` (name -> module) for one forward pass over ids."""
    got = {}
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: got.__setitem__(n, a[0].detach()))
               for n, m in modules.items()]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got, out


def _rows(t):
    """[b, t, x] or [b*t, x] (OPT flattens inside the MLP) -> [tokens, x]."""
    return t.reshape(-1, t.shape[-1])


def _direct_head_norms(o, w_o, H):
    """||W_o[:, h] o_h|| by the definition, one head at a time."""
    hd = o.shape[-1] // H
    return torch.stack([(o[..., h * hd:(h + 1) * hd] @ w_o[:, h * hd:(h + 1) * hd].T).norm(dim=-1)
                        for h in range(H)], -1)


def test_workdir_layout_tiny_opt(tiny_opt_workdir):
    wd = open_workdir(tiny_opt_workdir, verify=True)
    c = wd.config
    dims = c["dims"]
    assert c["model"]["fingerprint"] and c["corpus"] == "sotu" and c["block_size"] == 1
    assert c["splits"]["calibration"]["tokens"] >= c["tokens"]
    assert c["splits"]["validation"]["tokens"] >= c["tokens"] // 4
    rec = wd.records("validation")
    n = c["splits"]["validation"]["tokens"]
    for l in range(dims["num_layers"]):
        assert rec.hidden(l).shape == (n, dims["hidden_size"]) and rec.hidden(l).dtype == torch.float16
        assert rec.mlp(l).shape == (n, dims["intermediate_size"])
        assert rec.heads(l).shape == (n, dims["num_heads"])


def test_opt_activity_is_relu_fc1(tiny_opt, tiny_opt_workdir):
    """OPT records: hidden = layer inputs, mlp = ReLU(fc1·x + b) exactly (the input of fc2), heads = ||W_o,h o_h||."""
    wd = open_workdir(tiny_opt_workdir)
    ids = _first_window(wd)
    ad = tiny_opt.adapter
    L, T = ad.dims().num_layers, ids.shape[1]
    mods = {**{f"fc1.{l}": ad.mlp_input_module(l) for l in range(L)}, **{f"out.{l}": ad.attn_out(l) for l in range(L)}}
    got, out = _capture_inputs(tiny_opt.model, mods, ids)
    rec = wd.records("calibration")
    for l in range(L):
        fc1 = ad.mlp_input_module(l)
        expect = torch.relu(_rows(got[f"fc1.{l}"]) @ fc1.weight.T + fc1.bias)
        torch.testing.assert_close(rec.mlp(l)[:T].float(), expect, rtol=2e-3, atol=2e-3)
        assert (rec.mlp(l)[:T] == 0).float().mean() > 0.2  # a trained ReLU MLP is sparse
        torch.testing.assert_close(rec.hidden(l)[:T].float(), _rows(out.hidden_states[l]), rtol=2e-3, atol=2e-3)
        heads = _direct_head_norms(_rows(got[f"out.{l}"]), ad.attn_out(l).weight, ad.dims().num_heads)
        torch.testing.assert_close(rec.heads(l)[:T], heads, rtol=1e-4, atol=1e-4)


def test_llama_activity_is_abs_swiglu(smollm2, smollm2_workdir):
    """SmolLM2 records: mlp = |silu(gate·x)·(up·x)| for the first tokens, heads and hidden match too."""
    wd = open_workdir(smollm2_workdir)
    ids = _first_window(wd)[:, :64]  # causal: the first 64 tokens do not depend on the rest
    ad = smollm2.adapter
    layers = [0, 7, 29]
    mods = {**{f"mlp.{l}": ad.mlp_input_module(l) for l in layers}, **{f"out.{l}": ad.attn_out(l) for l in layers}}
    got, out = _capture_inputs(smollm2.model, mods, ids)
    rec = wd.records("calibration")
    for l in layers:
        mlp = ad.layers()[l].mlp
        x = _rows(got[f"mlp.{l}"])
        expect = (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)).abs()
        torch.testing.assert_close(rec.mlp(l)[:64].float(), expect, rtol=5e-3, atol=2e-3)
        torch.testing.assert_close(rec.hidden(l)[:64].float(), _rows(out.hidden_states[l]), rtol=5e-3, atol=5e-3)
        heads = _direct_head_norms(_rows(got[f"out.{l}"]), ad.attn_out(l).weight, ad.dims().num_heads)
        torch.testing.assert_close(rec.heads(l)[:64], heads, rtol=1e-3, atol=1e-4)


def test_block_activity_and_head_importance_units():
    a = torch.tensor([[1.0, -2.0, 3.0, -4.0]])
    assert block_activity(a, 1).tolist() == [[1.0, 2.0, 3.0, 4.0]]
    assert block_activity(a, 2).tolist() == [[3.0, 7.0]]
    assert block_activity(a, 2, "max").tolist() == [[2.0, 4.0]]
    torch.manual_seed(0)
    H, hd, d = 3, 4, 5
    w_o = torch.randn(d, H * hd)
    o = torch.randn(7, H * hd)
    gram = (w_o.T.reshape(H, hd, d) @ w_o.T.reshape(H, hd, d).transpose(1, 2))
    torch.testing.assert_close(head_importance(o, gram), _direct_head_norms(o, w_o, H), rtol=1e-5, atol=1e-5)


def test_block_records_sum_members(tiny_opt_dir, tmp_path):
    """--block-size 4 records the sum of the members' activity, for the same tokens as B=1."""
    one = calibrate(str(tiny_opt_dir), "sotu", 256, tmp_path / "b1", seq_len=128, progress=False)
    four = calibrate(str(tiny_opt_dir), "sotu", 256, tmp_path / "b4", seq_len=128, block_size=4, progress=False)
    assert four.config["num_units"] == one.dims["intermediate_size"] // 4
    for l in range(one.dims["num_layers"]):
        a1, a4 = one.records("calibration").mlp(l).float(), four.records("calibration").mlp(l).float()
        torch.testing.assert_close(a4, a1.view(a1.shape[0], -1, 4).sum(-1), rtol=2e-3, atol=2e-3)
    assert ActivityRecorder  # exported for other stages


def test_recorder_removes_hooks(tiny_opt):
    ad = tiny_opt.adapter
    before = len(ad.mlp_down(0)._forward_pre_hooks)
    with ActivityRecorder(ad):
        assert len(ad.mlp_down(0)._forward_pre_hooks) == before + 1
    assert len(ad.mlp_down(0)._forward_pre_hooks) == before
