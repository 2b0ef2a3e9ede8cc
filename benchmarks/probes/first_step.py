"""What batch 1's timed step choice costs once: wall time of an executor's first decode step (capture, and for
auto the other candidates' captures and timed replays) against an executor that finds the choice in the
machine's cache (runtime/choice_cache.py; capture of that variant only) and one pinned to it (capture only).

Random OPT shapes of 40 layers, 25% of MLP neurons and 20% of heads kept, kv active, a 64-token prompt; two
rounds of the three kinds in one process, the cache a temporary file emptied before each round's first
executor. Prints one JSON line per executor.

    python benchmarks/probes/first_step.py --hidden 5120 2048
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_e2e import random_opt, weights_from_hf  # noqa: E402

from dejavu_trt.runtime.executor import Executor  # noqa: E402


def first_step_ms(w, **kw) -> tuple[float, Executor]:
    ex = Executor(w, ops="kernels", batch=1, max_context=128, **kw)
    ex.prefill(torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ex.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, ex


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[5120])
    args = ap.parse_args()
    cache = os.path.join(tempfile.mkdtemp(), "step_choice.json")
    os.environ["DEJAVU_STEP_CHOICE_CACHE"] = cache
    for d in args.hidden:
        w = weights_from_hf(random_opt(40, hidden=d), 0.25, 0.2, max_context=128, kv_policy="active")
        for _ in range(2):
            if os.path.exists(cache):
                os.remove(cache)
            for kind in ("auto", "auto, cached"):
                ms, ex = first_step_ms(w)
                print(json.dumps({"hidden": d, "executor": kind, "first_step_ms": round(ms, 1),
                                  "choice": ex.step_choice}), flush=True)
                kept, slack = ex.fold_norms, ex.mlp_grid_slack
                del ex
            ms, ex = first_step_ms(w, fold_norms=kept, mlp_grid_slack=slack)
            print(json.dumps({"hidden": d, "executor": f"pinned fold={list(kept)} slack={slack}",
                              "first_step_ms": round(ms, 1)}), flush=True)
            del ex
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
