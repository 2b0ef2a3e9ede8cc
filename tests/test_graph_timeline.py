"""The graph-timeline probe's arithmetic (benchmarks/probes/graph_timeline.py) on synthetic kernel traces:
shares add up to the step, the layer pattern is found from its marker, predictors and join stalls are counted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
import graph_timeline  # noqa: E402

LAYER = [("norm_kernel", 3.0), ("qkv_rows_kernel", 10.0), ("attn_kernel", 7.0), ("rows_reduce_kernel", 2.0),
         ("mlp_bulk_kernel", 30.0), ("rows_reduce_kernel", 3.0)]


def _trace(steps=3, layers=2, predictor_late=0.0):
    """Main-stream kernels resident 1 us before their predecessor ends (as with programmatic dependent
    launch), on one reported stream; one predictor per layer beside them, ending `predictor_late` us after
    the layer's last kernel."""
    ks, t = [], 0.0
    joined = False  # the next main-stream kernel waited for a late predictor: it starts after the join
    for _ in range(steps):
        ks.append({"name": "embedding_kernel", "ts": t, "end": t + 2.0, "stream": 7})
        t += 2.0
        for _ in range(layers):
            start = t
            for name, d in LAYER:
                ks.append({"name": name, "ts": t if joined else t - 1.0, "end": t + d, "stream": 7})
                t += d
                joined = False
            b = start
            for name, d in (("u_kernel", 9.0), ("scores_kernel", 4.0)):
                ks.append({"name": name, "ts": b, "end": b + d, "stream": 7})
                b += d
            ks.append({"name": "topk_kernel", "ts": b, "end": t + predictor_late, "stream": 7})
            if predictor_late:
                t += predictor_late + 0.5
                joined = True
    ks.sort(key=lambda k: k["ts"])
    return ks


def test_shares_add_up_to_the_step():
    res = graph_timeline.analyse(_trace(), steps=3)
    layer = sum(d for _, d in LAYER)
    assert res["kernels_per_step"] == 1 + 2 * len(LAYER)
    assert res["step_ms_in_trace"] == [pytest.approx((2.0 + 2 * layer) / 1e3)] * 2
    rows = {r["kernel"]: r for r in res["rows"]}
    assert rows["mlp_bulk_kernel"]["share_us_per_call"] == pytest.approx(30.0)
    assert rows["rows_reduce_kernel"]["calls_per_step"] == 4  # two per layer
    assert rows["qkv_rows_kernel"]["early_us_per_call"] == pytest.approx(1.0)
    assert sum(r["share_us_per_step"] for r in res["rows"]) == pytest.approx(2.0 + 2 * layer)
    assert "u_kernel" not in rows  # the predictor's kernels are not part of the main chain


def test_places_follow_the_layer_marker():
    res = graph_timeline.analyse(_trace(), steps=3)
    places = {p["place"]: p for p in res["places"]}
    # a layer starts at its QKV kernel, so the next layer's norm closes the one before
    assert places["L.0 qkv_rows_kernel"]["share_us_per_call"] == pytest.approx(10.0)
    assert places["L.2 rows_reduce_kernel"]["share_us_per_call"] == pytest.approx(2.0)
    assert places["L.4 rows_reduce_kernel"]["share_us_per_call"] == pytest.approx(3.0)
    assert places["L.5 norm_kernel"]["calls_per_step"] == 1  # between layer 0 and layer 1
    assert places["pre.1 norm_kernel"]["calls_per_step"] == 1


def test_predictors_and_join_stalls():
    res = graph_timeline.analyse(_trace(), steps=3)
    assert res["predictors"] == 6 and res["predictor_stall_us_per_step"] == 0.0
    late = graph_timeline.analyse(_trace(predictor_late=4.0), steps=3)
    assert late["predictors"] == 6
    # each predictor ends 4 us after its layer and the next kernel starts 0.5 us after it: a 4.5 us stall.
    # The analysed span is steps 1 and 2 (from step 0's last kernel end): it holds the stalls after step 0's
    # last predictor and after steps 1-2's, except the trace's last one, which has no kernel after it.
    assert late["predictor_stall_us_per_step"] == pytest.approx(4 * 4.5 / 2)


def test_uneven_steps_are_refused():
    ks = _trace()
    last_main = max((k for k in ks if k["name"] not in graph_timeline.PREDICTOR_KERNELS), key=lambda k: k["ts"])
    ks.remove(last_main)
    with pytest.raises(SystemExit, match="do not split"):
        graph_timeline.analyse(ks, steps=3)


def test_kernel_names_and_trace_parsing(tmp_path):
    assert graph_timeline.short_name("void (anonymous namespace)::qkv_rows_kernel<__half, 1, 3>(__half const*)") \
        == "qkv_rows_kernel"
    assert graph_timeline.short_name("void djv::rows_reduce_kernel<__half>(float const*)") == "rows_reduce_kernel"
    trace = {"traceEvents": [
        {"cat": "kernel", "ph": "X", "name": "void (anonymous namespace)::attn_kernel<__half, 128, 1>(int)",
         "ts": 10.0, "dur": 5.0, "args": {"stream": 7}},
        {"cat": "gpu_memcpy", "ph": "X", "name": "Memcpy DtoD", "ts": 2.0, "dur": 1.0, "args": {"stream": 7}},
        {"cat": "cuda_runtime", "ph": "X", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 1.0},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    ks = graph_timeline.kernel_events(str(path))
    assert [(k["name"], k["ts"], k["end"]) for k in ks] == [("gpu_memcpy", 2.0, 3.0), ("attn_kernel", 10.0, 15.0)]
