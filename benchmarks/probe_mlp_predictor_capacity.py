"""Empirical capacity ceiling: how well can a *large learned nonlinear* predictor pick SmolLM2's MLP half?

For layers 1/5/15/25, trains on the work dir's calibration records (last 1024 tokens = 4 windows held
out for early stopping) and prints top-50% recall (k=768 of 1536) on its validation records for:
  (a) lookahead: rmsnorm(h_{l-1}) -> Linear(576,2048) -> GELU -> Linear(2048,1536), Adam + BCE
      against the true top-50% labels (layer 1 reads the embeddings, predictors.model.input_index);
  (b) the same network from the layer's own pre-attention input h_l (non-lookahead);
  (c) the work dir's saved low-rank predictor (LookaheadPredictors.mlp_scores) on the same tokens;
  (d) SwiGLU-form |silu(W_g x + b_g)(W_u x + b_u)|, x = mlp_norm(h_{l-1}), initialised from layer
      l's own weights (= the exact-activity heuristic of probe_mlp_lookahead.py) and fine-tuned with a
      per-token-centred BCE; (e) the same from h_l. (d/e bring the right inductive bias, which (a/b) lack.)
CPU, float32, seeds fixed, ~20 min. Usage: python benchmarks/probe_mlp_predictor_capacity.py [WORKDIR]
(default: the smollm2-* test work dir with the most calibration tokens, ties: the newest).

Measured 2026-12-02, work dir smollm2-cd7296bc3c5c (8192 calibration SOTU tokens, 7168 trained on +
1024 held out; 2048 validation tokens), validation recall at 50% kept:

    layer | (a) MLP h_{l-1} | (b) MLP h_l | (c) saved | (d) SwiGLU h_{l-1} | (e) SwiGLU h_l
       1  |      0.715      |    0.725    |   0.646   |       0.567        |     0.694
       5  |      0.698      |    0.704    |   0.643   |       0.692        |     0.845
      15  |      0.685      |    0.691    |   0.667   |       0.711        |     0.829
      25  |      0.736      |    0.739    |   0.701   |       0.782        |     0.909
    ((a), (b), (e) at layer 1 stopped at the 30-epoch cap, still rising slowly; 13 min in all.)

(a) has 4.33M parameters per layer = 122% of a dense layer's MLP+attention bytes (target <= 2%);
(d) 1.77M = 50%. At layer 5, regression to per-token standardised log-activity (MSE) and a listwise
softmax loss gave 0.698 / 0.696 vs BCE's 0.698 (exploratory runs), and dropout 0.5 + weight decay 0.1 gave 0.699;
a learning curve of (a) at layer 5 (1792 / 3584 / 7168 training tokens: 0.659 / 0.680 / 0.698) still
rises ~0.02 per doubling of data, so these are ceilings *at this calibration size*, not asymptotes.
Conclusion: from the lookahead input the best learned predictor reaches 0.70-0.78 (0.12-0.20 below
the 0.9 target) while spending 50-122% of a dense layer, vs 0.64-0.70 for the saved rank-64 ones.
A generic MLP from the own input h_l does little better (b ~ a), yet the SwiGLU form (e) reaches
0.83-0.91 at layers 5-25 from h_l: what the lookahead lacks is layer l-1's update to the residual
stream (h_l - h_{l-1}), and the generic MLP lacks the SwiGLU inductive bias on ~7k training tokens.
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from dejavu_trt.calibrate.workdir import open_workdir
from dejavu_trt.models import load_model
from dejavu_trt.predictors.metrics import kept_count, topk_recall
from dejavu_trt.predictors.model import LookaheadPredictors, input_index
from dejavu_trt.predictors.training import dense_layer_bytes, rms_normalize, topk_recall_mask

torch.set_num_threads(1)
LAYERS, HOLD, BATCH, MAX_EPOCHS, PATIENCE = [1, 5, 15, 25], 1024, 256, 30, 3

if len(sys.argv) > 1:
    wdp = Path(sys.argv[1])
else:
    cands = (Path.home() / ".cache/dejavu_trt/test-workdirs").glob("smollm2-*")
    wdp = max(cands, key=lambda p: (open_workdir(p).config["splits"]["calibration"]["tokens"],
                                    (p / "manifest.json").stat().st_mtime))  # ties: the newest
wd = open_workdir(wdp)
cal, val = wd.records("calibration"), wd.records("validation")
dims, U = wd.dims, wd.config["num_units"]
K = kept_count(0.5, U)
saved = LookaheadPredictors.load(wdp)
ad = load_model("smollm2-135m").adapter
print(f"work dir {wdp}: {cal.tokens().numel()} calibration tokens ({cal.tokens().numel() - HOLD} trained on, "
      f"{HOLD} held out), {val.tokens().numel()} validation tokens; k={K} of {U}", flush=True)


class SwiGLUScore(nn.Module):
    """log|silu(W_g x + b_g)(W_u x + b_u)|, x = rmsnorm(h) * w_norm; initialised from layer l's MLP."""

    def __init__(self, l):
        super().__init__()
        w, norm = ad.mlp_weights(l), ad.mlp_norm(l)
        self.nw = nn.Parameter(norm.weight.detach().float().clone())
        self.eps = float(getattr(norm, "variance_epsilon", 1e-5))
        self.wg, self.wu = nn.Parameter(w.w_gate.float().clone()), nn.Parameter(w.w_up.float().clone())
        self.bg, self.bu = nn.Parameter(torch.zeros(U)), nn.Parameter(torch.zeros(U))
        self.scale = nn.Parameter(torch.tensor(1.0))  # BCE temperature

    def forward(self, h):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.nw
        return torch.log((F.silu(x @ self.wg.T + self.bg) * (x @ self.wu.T + self.bu)).abs() + 1e-6)


def mlp_net():
    return nn.Sequential(nn.Linear(dims["hidden_size"], 2048), nn.GELU(), nn.Linear(2048, U))


def train(net, xc, yc, xv, yv, lr, centred):
    """Adam on BCE vs the top-50% labels; early stopping on the held-out calibration slice."""
    xt, yt, xh, yh = xc[:-HOLD], yc[:-HOLD], xc[-HOLD:], yc[-HOLD:]
    labels = topk_recall_mask(yt, K)
    rec = lambda x, y: topk_recall(net(x), y, K).mean().item()  # noqa: E731
    opt, gen = torch.optim.Adam(net.parameters(), lr=lr), torch.Generator().manual_seed(0)
    with torch.no_grad():
        best, best_val, stale = rec(xh, yh), rec(xv, yv), 0
    for epoch in range(MAX_EPOCHS):
        perm = torch.randperm(xt.shape[0], generator=gen)
        for i in range(0, len(perm), BATCH):
            r = perm[i:i + BATCH]
            s = net(xt[r])
            if centred:  # SwiGLU scores have no free offset: centre each token on its k-th score
                s = (s - s.detach().topk(K, -1).values[..., -1:]) * net.scale
            loss = F.binary_cross_entropy_with_logits(s, labels[r])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            r_hold = rec(xh, yh)
            if r_hold > best + 1e-4:
                best, best_val, stale = r_hold, rec(xv, yv), 0
            elif (stale := stale + 1) >= PATIENCE:
                break
    return best_val, epoch + 1


t0 = time.time()
n_a = sum(p.numel() for p in mlp_net().parameters())
n_d = sum(p.numel() for p in SwiGLUScore(LAYERS[0]).parameters())
dense = dense_layer_bytes(dims, 2)
print(f"(a) params {n_a} = {n_a * 2 / dense:.1%} of dense layer bytes (fp16); (d) {n_d} = {n_d * 2 / dense:.1%}")
print("layer | (a) MLP h_{l-1} | (b) MLP h_l | (c) saved | (d) SwiGLU h_{l-1} | (e) SwiGLU h_l", flush=True)
for l in LAYERS:
    y_c, y_v = cal.mlp(l).float(), val.mlp(l).float()
    row, ep = {}, {}
    for tag, src in [("a", input_index(l)), ("b", l)]:
        hc, hv = cal.hidden(src).float(), val.hidden(src).float()
        torch.manual_seed(0)
        row[tag], ep[tag] = train(mlp_net(), rms_normalize(hc), y_c, rms_normalize(hv), y_v, 1e-3, False)
        torch.manual_seed(0)
        t = {"a": "d", "b": "e"}[tag]
        row[t], ep[t] = train(SwiGLUScore(l), hc, y_c, hv, y_v, 1e-3, True)
        if tag == "a":
            with torch.no_grad():
                row["c"] = topk_recall(saved.mlp_scores(l, hv), y_v, K).mean().item()
    print(f"  {l:2d}  |      {row['a']:.3f}      |    {row['b']:.3f}    |   {row['c']:.3f}   |"
          f"       {row['d']:.3f}        |     {row['e']:.3f}      epochs {ep}  {time.time() - t0:.0f}s", flush=True)
