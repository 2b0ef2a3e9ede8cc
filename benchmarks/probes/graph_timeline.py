"""Where the CUDA-graph decode step's time goes: a kernel timeline of graph replays (torch.profiler / CUPTI).

The per-kernel profiles of bench_e2e.py (--profile-step) are eager, so they show each kernel's own duration
but not what it adds to the step inside the graph, where programmatic dependent launch starts kernels early
and the predictor runs on its side stream. This probe replays the OPT-13B-shape batch-1 sparse step (the
executor's timed choice, as bench_e2e.py runs it) under the profiler and reads every kernel's start and end.

On the main stream each kernel waits for the one before, so the step is a chain of kernel ends; a kernel's
**share** of the step is its end minus the previous main-stream kernel's end. The table sums the shares per
kernel name (they add up to the step). For the side stream it reports each predictor's span and whether
the main stream reached the join before the predictor ended (then the join stalled the chain). Layer 0's
predictor runs inline on the main stream, but its kernels are told apart by name like the side stream's, so
its time shows in the share of the main-stream kernel after it (place `pre.1`, layer 0's norm). The first
kernel's share includes the gap across the step boundary, which the profiler itself can lengthen (compare
the trace's step with the unprofiled one).

    python benchmarks/probes/graph_timeline.py [--hidden 5120] [--steps 8] [--json-out timeline.json]
"""
from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_e2e import random_opt, weights_from_hf  # noqa: E402

from dejavu_trt.runtime.executor import Executor  # noqa: E402

PREDICTOR_KERNELS = ("u_kernel", "scores_kernel", "topk_kernel", "topk_r8_kernel")


def short_name(name: str) -> str:
    """'void (anonymous namespace)::mlp_bulk_kernel<__half, 1, 2>(...)' -> 'mlp_bulk_kernel'."""
    name = name.replace("(anonymous namespace)::", "").replace("void ", "", 1)
    head = re.split(r"[<(]", name, maxsplit=1)[0]
    return head.split("::")[-1].strip() or name[:40]


def kernel_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        trace = json.load(f)
    out = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X":
            out.append({"name": short_name(e["name"]) if cat == "kernel" else cat, "ts": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                        "stream": e.get("args", {}).get("stream", e.get("tid"))})
    out.sort(key=lambda k: k["ts"])
    return out


def analyse(kernels: list[dict], steps: int, marker: str = "qkv_rows_kernel") -> dict:
    # Kernels replayed from a graph are not reported on the streams they were captured on, so the chains are
    # told apart by name: the predictor's kernels (layer 0's runs inline, the rest on the side stream) and
    # everything else, the main chain.
    main = [k for k in kernels if k["name"] not in PREDICTOR_KERNELS]
    side_ks = [k for k in kernels if k["name"] in PREDICTOR_KERNELS]
    if len(main) % steps:
        raise SystemExit(f"{len(main)} main-stream kernels do not split into {steps} steps")
    per_step = len(main) // steps
    share: dict[str, list[float]] = defaultdict(list)
    dur: dict[str, list[float]] = defaultdict(list)
    early: dict[str, list[float]] = defaultdict(list)  # how long before its predecessor's end it was resident
    by_place: dict[str, list[float]] = defaultdict(list)
    step_ms = []
    for s in range(1, steps):  # step 0's first kernel has no predecessor in the trace
        chain = main[s * per_step:(s + 1) * per_step]
        prev_end = main[s * per_step - 1]["end"]
        step_ms.append((chain[-1]["end"] - prev_end) / 1e3)
        pos, layer = 0, -1  # "layer.pos name": the kernel's place from one marker (a layer's start) to the next
        for k in chain:
            if k["name"] == marker:
                pos, layer = 0, layer + 1
            key = f"{'L' if layer >= 0 else 'pre'}.{pos} {k['name']}"
            pos += 1
            for name in (k["name"], key):
                table = share if name == k["name"] else by_place
                table[name].append(k["end"] - prev_end)
            dur[k["name"]].append(k["end"] - k["ts"])
            early[k["name"]].append(prev_end - k["ts"])
            prev_end = k["end"]
    n = steps - 1
    rows = [{"kernel": name, "calls_per_step": len(v) / n, "share_us_per_step": round(sum(v) / n, 1),
             "share_us_per_call": round(statistics.fmean(v), 2), "dur_us_per_call": round(statistics.fmean(dur[name]), 2),
             "early_us_per_call": round(statistics.fmean(early[name]), 2)}
            for name, v in share.items()]
    rows.sort(key=lambda r: -r["share_us_per_step"])
    places = [{"place": k, "calls_per_step": len(v) / n, "share_us_per_call": round(statistics.fmean(v), 2),
               "share_us_p90": round(sorted(v)[int(0.9 * (len(v) - 1))], 2)} for k, v in by_place.items()]
    # the side stream: one predictor = u_kernel .. the next topk; the main kernel that starts first after it
    pred = []
    ks = side_ks
    i = 0
    while i < len(ks):
        if ks[i]["name"] != "u_kernel":
            i += 1
            continue
        j = i
        while j < len(ks) and not ks[j]["name"].startswith("topk"):
            j += 1
        if j == len(ks):
            break
        pred.append((ks[i]["ts"], ks[j]["end"]))
        i = j + 1
    spans = [e - b for b, e in pred]
    # the join (heuristic): the first main-stream kernel that starts after the predictor's end. When its
    # predecessor had already ended, nothing but the join kept it from starting (programmatic dependent launch
    # makes main-stream kernels resident before their predecessor ends), so the gap is a stall.
    stalls = []
    starts = [k["ts"] for k in main]
    step0_end = main[per_step - 1]["end"]  # like the shares, the stalls count steps 1..steps-1
    for b, e in pred:
        if e <= step0_end:
            continue
        j = bisect.bisect_left(starts, e)
        if 0 < j < len(main) and main[j - 1]["end"] < e:
            stalls.append(main[j]["ts"] - main[j - 1]["end"])
    return {"kernels_per_step": per_step, "step_ms_in_trace": [round(x, 4) for x in step_ms], "rows": rows,
            "places": places,
            "predictor_span_us": round(statistics.fmean(spans), 2) if spans else None,
            "predictors": len(pred), "predictor_stall_us_per_step": round(sum(stalls) / max(1, n), 1) if stalls else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    T = 64 + 3 * args.steps + 32
    w = weights_from_hf(random_opt(args.layers, hidden=args.hidden), 0.25, 0.2, max_context=T, kv_policy="active")
    ex = Executor(w, ops="kernels", batch=1, max_context=T)
    ex.prefill(torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0)))
    ex.step()  # capture and the timed choice
    plain = ex.timed_steps(args.steps)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ex.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    kernels = kernel_events(path)
    if not kernels:
        raise SystemExit("the profiler recorded no kernels of the graph replays (CUPTI did not trace graph nodes)")
    res = analyse(kernels, args.steps)
    res.update(hidden=args.hidden, choice=ex.step_choice, step_ms_unprofiled_p50=round(statistics.median(plain), 4))
    print(f"timeline d={args.hidden}: step {statistics.median(res['step_ms_in_trace']):.3f} ms in the trace, "
          f"{res['step_ms_unprofiled_p50']:.3f} ms unprofiled; {res['kernels_per_step']} main-stream kernels per step; "
          f"choice {ex.step_choice.get('chosen')}")
    print(f"timeline predictors: {res['predictors']} traced, span {res['predictor_span_us']} us each, "
          f"join stall {res['predictor_stall_us_per_step']} us per step")
    for r in res["rows"]:
        print(f"timeline {r['kernel']:<28} {r['calls_per_step']:5.1f}/step  share {r['share_us_per_call']:7.2f} us/call "
              f"{r['share_us_per_step']:8.1f} us/step   own {r['dur_us_per_call']:7.2f} us/call  "
              f"resident early {r['early_us_per_call']:6.2f} us")
    for r in res["places"]:  # the per-layer pattern (markers start a layer), and once per step: the step's ends
        print(f"timeline place {r['place']:<30} {r['calls_per_step']:5.1f}/step  share {r['share_us_per_call']:7.2f} us "
              f"(p90 {r['share_us_p90']:.2f})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
