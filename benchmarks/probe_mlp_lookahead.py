"""How predictable is SmolLM2's MLP activity from the lookahead input, whatever the score form?

Scores every neuron with its *exact* SwiGLU activity |silu(W_g x)·(W_u x)|, x = mlp_norm(h), where h is
the layer's own input or the lookahead input (previous layer's), and prints top-50% recall against the
true activity on the work dir's validation records. Usage: python benchmarks/probe_mlp_lookahead.py WORKDIR

Measured 2026-12-02 (8192-token SmolLM2 work dir), layers 1/5/15/25: lookahead 0.50/0.67/0.69/0.75,
own input 0.60/0.80/0.78/0.91 (linear low-rank lookahead predictors: 0.68 mean). So the lookahead
input, not the score form, limits MLP recall on this model.
"""
import torch
from dejavu_trt.calibrate.workdir import open_workdir
from dejavu_trt.models import load_model
from dejavu_trt.predictors.metrics import topk_recall, kept_count
import sys
wdp = sys.argv[1]  # a SmolLM2 work dir (calibrate + train-predictors)
wd = open_workdir(wdp); val = wd.records("validation")
m = load_model("smollm2-135m"); ad = m.adapter
k = kept_count(0.5, 1536)
for l in [1, 5, 15, 25]:
    y = val.mlp(l).float()
    for src, name in [(l, "own input h_l"), (max(l-1,0), "lookahead h_{l-1}")]:
        h = val.hidden(src).float()
        with torch.no_grad():
            x = ad.mlp_norm(l)(h)
            w = ad.mlp_weights(l)
            s_prod = (torch.nn.functional.silu(x @ w.w_gate.T) * (x @ w.w_up.T)).abs()
            s_up = (x @ w.w_up.T).abs()
        print(l, name, "product-form recall %.3f" % topk_recall(s_prod, y, k).mean().item(),
              "| |up| recall %.3f" % topk_recall(s_up, y, k).mean().item(), flush=True)
