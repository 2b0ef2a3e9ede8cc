"""End-to-end decode benchmarks on one GPU (see benchmarks/RESULTS.md for recorded runs).

(a) a real engine package (e.g. SmolLM2 built with `dejavu-trt build`): dense vs sparse time between
    tokens, with the validation perplexities recorded in the package at build time;
(b) the OPT-13B shape (d=5120, ffn=20480, 40 layers, 40 heads) with random weights and random
    predictors, speed only, all in one process: the dense executor (cuBLAS, CUDA graph), the sparse
    executor at 25% MLP / 20% heads kept (kernels, else the torch fallback), HF transformers eager
    generate, ablations (predictor side stream vs same stream, CUDA graph on/off) and batch 1/4/16.

    python benchmarks/bench_e2e.py --opt13b --json-out results.json
    python benchmarks/bench_e2e.py --engine engines/smollm2
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dejavu_trt.runtime.bench import copy_bandwidth_gbs, time_mode  # noqa: E402

OPT13B = dict(hidden_size=5120, ffn_dim=20480, num_hidden_layers=40, num_attention_heads=40, vocab_size=50272,
              max_position_embeddings=2048, word_embed_proj_dim=5120, do_layer_norm_before=True,
              activation_function="relu", enable_bias=True)


def log(msg: str) -> None:
    print(msg, flush=True)


def opt_shape(hidden: int) -> dict:
    """OPT-13B's config with another hidden size: ffn 4d and head_dim 128, as across the OPT family."""
    if hidden % 128:
        raise SystemExit(f"bench_e2e: --hidden {hidden} is not a multiple of 128 (head_dim 128)")
    return {**OPT13B, "hidden_size": hidden, "word_embed_proj_dim": hidden, "ffn_dim": 4 * hidden,
            "num_attention_heads": hidden // 128}


def random_opt(layers: int, device="cuda", hidden: int = OPT13B["hidden_size"]):
    from transformers import OPTConfig, OPTForCausalLM
    cfg = OPTConfig(**{**opt_shape(hidden), "num_hidden_layers": layers})
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = OPTForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def weights_from_hf(model, mlp_kept: float, heads_kept: float, rank=(64, 32), max_context=256, kv_policy="dense"):
    from dejavu_trt.models.adapters import adapter_for
    from dejavu_trt.runtime.decoder import DecoderWeights
    from dejavu_trt.runtime.package import EngineConfig, engine_weights
    ad = adapter_for(model)
    dims = ad.dims()
    w, extra = engine_weights(ad)
    L, dev = dims.num_layers, w["embed_tokens"].device
    g = torch.Generator(device=dev).manual_seed(1)
    preds = {}
    for l in range(L):
        preds[f"layers.{l}.mlp_a"] = torch.randn(dims.hidden_size, rank[0], generator=g, device=dev, dtype=torch.float16) * 0.05
        preds[f"layers.{l}.mlp_b"] = torch.randn(rank[0], dims.intermediate_size, generator=g, device=dev, dtype=torch.float16)
        preds[f"layers.{l}.head_a"] = torch.randn(dims.hidden_size, rank[1], generator=g, device=dev, dtype=torch.float16) * 0.05
        preds[f"layers.{l}.head_b"] = torch.randn(rank[1], dims.num_heads, generator=g, device=dev, dtype=torch.float16)
    cfg = EngineConfig("opt-13b-shape-random", dims.to_dict(), "fp16",
                       [max(1, round(mlp_kept * dims.intermediate_size))] * L, [max(1, round(heads_kept * dims.num_heads))] * L,
                       kv_policy=kv_policy, max_context=max_context, attention_scale=extra["attention_scale"],
                       position_offset=extra["position_offset"])
    return DecoderWeights.from_tensors(cfg, w, preds, dev, torch.float16, max_context)


def hf_eager_ms(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    """HF transformers eager generate, greedy: ms per decoded token (prefill excluded by differencing)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=1)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    run(4)
    t_short, t_long = run(1), run(1 + new_tokens)
    return (t_long - t_short) / new_tokens * 1e3


def row(name, r, copy_bw):
    if r.get("fold_norms"):
        name += f" [{'+'.join(r['fold_norms'])} norm folded]"
    if r.get("step_choice"):  # batch 1's timed choice (executor): what each candidate measured at capture
        c = r["step_choice"]
        name += (f" [auto{' (cached)' if c.get('cached') else ''}: {c['chosen']} {c['ms_per_step']}"
                 + (f"; {c['reason']}]" if c.get("reason") else "]"))
    return {"config": name, "batch": r["batch"], "ops": r["ops"], "side_stream": r["side_stream"],
            "cuda_graph": r["cuda_graph"], "fold_norms": r.get("fold_norms", False), "tbt_ms_p50": round(r["tbt_ms_p50"], 3), "tbt_ms_p99": round(r["tbt_ms_p99"], 3),
            "tbt_ms_mean": round(r["tbt_ms_mean"], 3), "tokens_per_s": round(r["tokens_per_s"], 1),
            "gb_per_step": round(r["bytes_per_step"] / 1e9, 3), "achieved_gb_s": round(r["achieved_gb_s"], 1),
            "copy_gb_s": round(copy_bw, 1) if copy_bw else None}


def fixed_index_ops(recompute: bool = False):
    """Kernel ops whose predictor returns the indices of its first call per layer: the step time without
    any prediction work, to measure what the predictor costs the step. recompute: the predictor still runs
    every step (same kernels, same side stream) and its result is dropped; with the joins deferred
    (defer_joins) the step then does the predictor's work and keeps its fork edges, but no kernel waits."""
    from dejavu_trt.runtime.ops import KernelOps

    class FixedIndexOps(KernelOps):
        name = ("kernels, predictor run but its first indices used" if recompute
                else "kernels, fixed indices (no predictor)")

        def __init__(self):
            super().__init__()
            self.cache = {}

        def predictor(self, h, lw, kept_units, kept_heads):
            key = id(lw)
            if recompute or key not in self.cache:
                self.cache.setdefault(key, super().predictor(h, lw, kept_units, kept_heads))
            return self.cache[key]
    return FixedIndexOps()


def defer_joins(ex) -> None:
    """Timing only: the decoder's per-layer join of the predictor stream (wait_event before each layer) is
    moved to the end of the step, so the graph keeps the fork edges but no layer waits for its predictor.
    Only correct with ops whose indices do not come from this step's predictor (the fixed-index ops)."""
    dec = ex.decoder
    launch, lm_head, pending = dec._launch_predictor, dec.lm_head, []

    def launch_without_join(layer, h, idx):
        ev = launch(layer, h, idx)
        if ev is not None:
            pending.append(ev)
        return None

    def lm_head_after_joins(h):
        for ev in pending:
            torch.cuda.current_stream().wait_event(ev)
        pending.clear()
        return lm_head(h)
    dec._launch_predictor, dec.lm_head = launch_without_join, lm_head_after_joins


def predictor_only(w, ops: str, reps: int = 20) -> dict:
    """Time the 40 predictor calls of one decode step alone (CUDA graph), to see if the side stream keeps up."""
    from dejavu_trt.runtime.ops import make_ops
    o = make_ops(ops)
    h = torch.randn(1, w.dims.hidden_size, device="cuda", dtype=w.dtype)
    cfg = w.config

    def body():
        for l, lw in enumerate(w.layers):
            o.predictor(h, lw, cfg.mlp_kept_units[l], cfg.heads_kept[l])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b) / reps
    return {"config": f"predictors only ({ops}), {len(w.layers)} layers", "batch": 1, "tbt_ms_mean": round(ms, 3),
            "us_per_layer": round(ms * 1e3 / len(w.layers), 1)}


def bench_opt13b(args) -> list[dict]:
    copy_bw = copy_bandwidth_gbs("cuda")
    log(f"device {torch.cuda.get_device_name()}, copy bandwidth (read+write) {copy_bw:.0f} GB/s")
    t0 = time.perf_counter()
    model = random_opt(args.layers, hidden=args.hidden)
    shape = "OPT-13B" if args.hidden == OPT13B["hidden_size"] else f"OPT d={args.hidden}"
    log(f"random {shape}-shape model ({args.layers} layers, d={args.hidden}, ffn={4 * args.hidden}, "
        f"{args.hidden // 128} heads) on GPU in {time.perf_counter() - t0:.1f}s")
    rows = []
    kw = dict(steps=args.steps, warmup=args.warmup, prompt_len=args.prompt_len)
    T = args.prompt_len + args.warmup + args.steps + 4
    w_dense_kv = weights_from_hf(model, 0.25, 0.2, max_context=T, kv_policy="dense")
    w_active = weights_from_hf(model, 0.25, 0.2, max_context=T, kv_policy="active")

    def measure(name, w, **k):
        try:
            r = time_mode(w, max_context=T, **kw, **k)
        except Exception as e:  # noqa: BLE001 - record and keep going: one failing config must not lose the rest
            log(f"{name}: FAILED {e.__class__.__name__}: {str(e)[:300]}")
            return
        rows.append({**row(name, r, copy_bw), "hidden": args.hidden})
        log(json.dumps(rows[-1]))
        torch.cuda.empty_cache()

    for b in args.batches:
        measure("dense (cuBLAS, CUDA graph)", w_dense_kv, dense=True, batch=b)
        if not args.core:
            measure("sparse 25%/20%, kv dense", w_dense_kv, dense=False, batch=b, ops=args.ops)
        measure("sparse 25%/20%, kv active", w_active, dense=False, batch=b, ops=args.ops)
        if args.core and args.ops != "torch":  # A/B of the norm folding against the default, alternating:
            # batch 1 chooses by timing by default (so both pinned arms run), batch 2-4 folds mlp_norm
            others = [(), ("mlp",)] if b == 1 else [()]
            for _ in range(2):
                for other in others:
                    measure("sparse 25%/20%, kv active" + ("" if other else ", norms unfolded"), w_active,
                            dense=False, batch=b, ops=args.ops, fold_norms=other)
                measure("sparse 25%/20%, kv active", w_active, dense=False, batch=b, ops=args.ops)
            if b == 1:  # the same A/B without the predictor (fixed indices, one stream: the pure chain)
                for fold in ((), ("mlp",)):
                    measure("ablation: sparse kv active, fixed indices, one stream", w_active, dense=False, batch=1,
                            ops=fixed_index_ops(), side_stream=False, fold_norms=fold)
    if args.core:
        return rows
    measure("ablation: sparse kv active, same stream", w_active, dense=False, batch=1, ops=args.ops, side_stream=False)
    if args.ops != "torch":
        # batch 1's default chooses the fold by timing: the ablations pin both (the row labels say which)
        for fold in ((), ("mlp",)):
            measure("ablation: sparse kv active" + ("" if fold else ", norms unfolded"), w_active, dense=False,
                    batch=1, ops=args.ops, fold_norms=fold)
        for fold in ((), ("mlp",)):
            measure("ablation: sparse kv active, predictor stream at normal priority", w_active, dense=False,
                    batch=1, ops=args.ops, fold_norms=fold, predictor_priority="normal")
    if args.ops != "torch":
        # pinned unfolded, like the rows of sessions 9-13 they are compared with
        measure("ablation: sparse kv active, fixed indices (no predictor)", w_active, dense=False, batch=1,
                ops=fixed_index_ops(), fold_norms=False)
        # no side stream either: the graph has no cross-stream edges at all (the pure kernel chain)
        for fold in (False, ("mlp",)):
            measure("ablation: sparse kv active, fixed indices, one stream", w_active, dense=False, batch=1,
                    ops=fixed_index_ops(), side_stream=False, fold_norms=fold)
        # what the per-layer joins cost: the same predictor work and fork edges, joined once per step
        for name, recompute in (("fixed indices, joins deferred to the step's end", False),
                                ("predictor run but unused, joins deferred to the step's end", True)):
            from dejavu_trt.runtime.executor import Executor
            # unfolded, as the fixed-index rows above pin it (defer_joins patches this executor's decoder)
            ex = Executor(w_active, dense=False, ops=fixed_index_ops(recompute), batch=1, max_context=T,
                          side_stream=True, cuda_graph=True, fold_norms=False)
            defer_joins(ex)
            measure(f"ablation: sparse kv active, {name}", w_active, dense=False, batch=1, executor=ex)
            del ex
    measure("ablation: sparse kv active, no CUDA graph", w_active, dense=False, batch=1, ops=args.ops, cuda_graph=False)
    measure("ablation: dense, no CUDA graph", w_dense_kv, dense=True, batch=1, cuda_graph=False)
    if args.ops != "torch":
        measure("ablation: sparse kv active, torch fallback ops", w_active, dense=False, batch=1, ops="torch")
        measure("ablation: sparse kv active, kernels + torch predictor", w_active, dense=False, batch=1,
                ops="kernels+torch-predictor")
        for ops in ("kernels", "torch"):
            rows.append(predictor_only(w_active, ops))
            log(json.dumps(rows[-1]))
    del w_dense_kv, w_active
    gc.collect()
    torch.cuda.empty_cache()
    for b in args.hf_batches:
        try:
            ms = hf_eager_ms(model, b, args.prompt_len, args.hf_tokens)
            rows.append({"config": "HF transformers eager generate", "batch": b, "tbt_ms_mean": round(ms, 3),
                         "tokens_per_s": round(b * 1e3 / ms, 1)})
            log(json.dumps(rows[-1]))
        except Exception as e:  # noqa: BLE001
            log(f"HF eager batch {b}: FAILED {e.__class__.__name__}: {str(e)[:300]}")
    return rows


SWEEP = ((0.0, 0.0), (0.05, 0.05), (0.1, 0.1), (0.25, 0.2), (0.5, 0.5), (1.0, 1.0))  # (MLP, heads) kept


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def sweep_kept(args) -> list[dict]:
    """Step time against bytes moved, B=1, kv active, from (almost) nothing kept to everything kept: the
    intercept of the fitted line is the step's fixed cost (launch chain, ramps and tails of every kernel,
    LM head), its slope the marginal bandwidth. Kept 0.0 means one neuron and one head per layer."""
    import dataclasses
    copy_bw = copy_bandwidth_gbs("cuda")
    log(f"device {torch.cuda.get_device_name()}, copy bandwidth (read+write) {copy_bw:.0f} GB/s")
    model = random_opt(args.layers)
    T = args.prompt_len + args.warmup + args.steps + 4
    w = weights_from_hf(model, 0.25, 0.2, max_context=T, kv_policy="active")
    dims, L = w.dims, w.dims.num_layers
    kw = dict(steps=args.steps, warmup=args.warmup, prompt_len=args.prompt_len, max_context=T, dense=False, batch=1)
    rows, fits = [], {}
    # (name, ops factory, executor options)
    variants = (("predictor on the side stream", lambda: args.ops, {}),
                ("fixed indices, one stream", fixed_index_ops, {"side_stream": False}))
    for mlp_kept, heads_kept in SWEEP:
        units = max(1, round(mlp_kept * dims.intermediate_size / w.config.block_size))
        heads = max(1, round(heads_kept * dims.num_heads))
        cfg = dataclasses.replace(w.config, mlp_kept_units=[units] * L, heads_kept=[heads] * L)
        wk = dataclasses.replace(w, config=cfg)
        for name, make_ops, extra in variants:
            r = time_mode(wk, ops=make_ops(), **kw, **extra)
            rows.append({**row(f"sweep: {units} neurons, {heads} heads, {name}", r, copy_bw),
                         "variant": name, "mlp_units": units, "heads": heads})
            log(json.dumps(rows[-1]))
            fits.setdefault(name, []).append((r["bytes_per_step"] / 1e9, r["tbt_ms_p50"]))
            torch.cuda.empty_cache()
    for name, pts in fits.items():
        a, b = fit_line([x for x, _ in pts], [y for _, y in pts])
        fit = {"config": f"sweep fit ({name}): ms = a + GB / bw", "fixed_ms_per_step": round(a, 3),
               "fixed_us_per_layer": round(a * 1e3 / L, 1), "marginal_gb_s": round(1.0 / b * 1e3, 1),
               "copy_gb_s": round(copy_bw, 1)}
        rows.append(fit)
        log(json.dumps(fit))
    return rows


def profile_step(args) -> list[dict]:
    """Per-kernel device time of eager sparse decode steps (torch.profiler), summed per step: shows which
    launches the critical path is made of. Eager, so launch gaps are not representative; durations are."""
    from torch.profiler import ProfilerActivity, profile

    from dejavu_trt.runtime.executor import Executor
    model = random_opt(args.layers, hidden=args.hidden)
    steps = 4
    T = args.prompt_len + 2 * steps + 8
    w = weights_from_hf(model, *args.profile_kept, max_context=T, kv_policy="active")
    del model
    ex = Executor(w, dense=False, ops=args.ops, batch=1, max_context=T, side_stream=True, cuda_graph=False)
    ex.prefill(torch.randint(0, w.dims.vocab_size, (1, args.prompt_len)))
    for _ in range(steps):
        ex.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            ex.step()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            agg.setdefault(e.name[:90], []).append(e.device_time)
    rows = [{"kernel": k, "calls_per_step": len(v) / steps, "us_per_call": round(sum(v) / len(v), 2),
             "us_per_step": round(sum(v) / steps, 1)} for k, v in agg.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    log(f"per-kernel device time, eager sparse decode (kv active, B=1, {args.layers} layers, kept MLP/heads "
        f"{args.profile_kept[0]}/{args.profile_kept[1]}), mean of {steps} steps")
    for r in rows[:25]:
        log(f"{r['us_per_step']:9.1f} us/step {r['calls_per_step']:6.1f} calls {r['us_per_call']:8.2f} us  {r['kernel']}")
    return rows


def bench_engine_dir(args) -> dict:
    from dejavu_trt.runtime.bench import bench_engine
    from dejavu_trt.runtime.engine import Engine
    eng = Engine.load(args.engine, ops=args.ops, max_context=args.prompt_len + args.warmup + args.steps + 4)
    res = bench_engine(eng.weights, batch=1, steps=args.steps, warmup=args.warmup, prompt_len=args.prompt_len, ops=args.ops)
    res["validation_ppl"] = {k: eng.config.build.get(k) for k in ("dense_ppl", "sparse_ppl")}
    log(json.dumps(res, indent=2))
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt13b", action="store_true", help="run (b), the OPT-13B-shape speed benchmark")
    p.add_argument("--engine", help="run (a) on this engine package")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--hidden", type=int, default=OPT13B["hidden_size"],
                   help="with --opt13b: another hidden size d (ffn 4d, d/128 heads), e.g. for the fold A/B across shapes")
    p.add_argument("--ops", default="auto", help="sparse op backend: auto, kernels, torch")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--hf-batches", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--hf-tokens", type=int, default=32)
    p.add_argument("--profile-step", action="store_true",
                   help="per-kernel device times of eager OPT-13B-shape sparse decode steps (torch.profiler)")
    p.add_argument("--profile-kept", type=float, nargs=2, default=(0.25, 0.2), metavar=("MLP", "HEADS"),
                   help="kept fractions for --profile-step (0 keeps one neuron and one head per layer)")
    p.add_argument("--core", action="store_true",
                   help="with --opt13b: only dense and sparse (kv active) per batch; no ablations, no HF eager")
    p.add_argument("--sweep", action="store_true",
                   help="OPT-13B shape, B=1: step time from ~0 to 100%% kept, and the fitted fixed cost per step")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_e2e: no CUDA device (torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.engine:
        out["engine"] = bench_engine_dir(args)
    if args.profile_step:
        out["profile_step"] = profile_step(args)
    if args.opt13b:
        out["opt13b"] = bench_opt13b(args)
    if args.sweep:
        out["sweep"] = sweep_kept(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
