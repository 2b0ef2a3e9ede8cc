"""The MLP timeline probe's arithmetic (benchmarks/probes/mlp_trace.py) on a synthetic trace: each call's stamps
are measured from the previous call's reduction end, stale ring slots are ignored, medians over the calls.
(The probe itself needs a -DDJV_TRACE build and an sm_90 GPU; this checks what it computes from the records.)"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
import mlp_trace  # noqa: E402

EVENTS, CTAS, RING = 6, 16, 8
BULK_GRID, REDUCE_GRID = 5, 3


def _trace(ncalls, period, jitter=0):
    """Calls of a fixed period; call i's stamps at fixed offsets from call i-1's reduction end (the last of
    its CTAs), the bulk CTAs' last neuron spread by 100 ns per CTA; `jitter` ns added to odd calls."""
    buf = np.zeros((2, CTAS, RING), dtype=mlp_trace.record_dtype(EVENTS))
    t0 = 10_000_000
    for i in range(ncalls):
        prev_end = t0 + i * period + (jitter if i % 2 else 0)
        for c in range(BULK_GRID):
            r = buf[mlp_trace.BULK, c, i % RING]
            r["t"] = [prev_end - 1000 + 10 * c, prev_end + 800, prev_end - 500, prev_end + 2000,
                      prev_end + 30_000 + 100 * c, prev_end + 30_500 + 100 * c]
            r["launch"], r["grid"], r["smid"], r["items"] = i, BULK_GRID, c, 12 + (c % 2)
        end = t0 + (i + 1) * period + (jitter if (i + 1) % 2 else 0)
        for c in range(REDUCE_GRID):
            r = buf[mlp_trace.REDUCE, c, i % RING]
            r["t"] = [prev_end + 31_000, prev_end + 31_400 + 100 * c, 0, 0, prev_end + 33_000, end - 200 * c]
            r["launch"], r["grid"], r["smid"], r["items"] = i, REDUCE_GRID, c, 5
    return buf


def test_offsets_from_the_previous_call_end():
    period = 40_000
    med, n = mlp_trace.analyse(_trace(RING, period), RING)
    assert n == RING - 3  # calls 2 .. ncalls-2
    assert med["bulk_ctas"] == BULK_GRID and med["reduce_ctas"] == REDUCE_GRID
    assert med["start_first"] == -1000 and med["start_last"] == -1000 + 10 * (BULK_GRID - 1)
    assert med["wait_returned_median"] == 800 and med["table_ready_median"] == -500
    assert med["first_rows_median"] == 2000
    assert med["last_neuron_first"] == 30_000 and med["last_neuron_last"] == 30_000 + 100 * (BULK_GRID - 1)
    assert med["last_neuron_median"] == 30_000 + 100 * (BULK_GRID // 2)
    assert med["partials_stored_last"] == 30_500 + 100 * (BULK_GRID - 1)
    assert med["reduce_wait_returned_first"] == 31_400 and med["reduce_wait_returned_median"] == 31_500
    assert med["reduce_end_last"] == period  # the call's whole time, end to end
    assert (med["items_min"], med["items_max"]) == (12, 13)


def test_medians_over_calls():
    period, jitter = 40_000, 3_000
    med, _ = mlp_trace.analyse(_trace(RING, period, jitter), RING)
    # periods alternate period - jitter / period + jitter over the analysed calls 2..6: +j, -j, +j, -j, +j
    assert med["reduce_end_last"] == period + jitter


def test_stale_ring_slots_are_skipped():
    buf = _trace(RING, 40_000)
    buf[mlp_trace.BULK, 0, 3]["launch"] = 3 + RING  # a later launch overwrote this CTA's slot
    rec = mlp_trace.per_call(buf, mlp_trace.BULK, 3)
    assert len(rec) == BULK_GRID - 1 and 0 not in set(rec["smid"].tolist())
    assert len(mlp_trace.per_call(buf, mlp_trace.BULK, 3 + RING)) == 1


def test_resolution():
    buf = _trace(RING, 40_000)
    assert mlp_trace.stamp_resolution(buf) == 10  # the bulk CTAs' starts are 10 ns apart


def test_chain_of_kernels():
    """analyse_chain: every kernel's stamps from the previous call's end (the chain's last kernel), unset
    stamps left out."""
    period = 30_000
    buf = np.zeros((5, CTAS, RING), dtype=mlp_trace.record_dtype(EVENTS))
    t0 = 5_000_000
    offsets = {mlp_trace.QKV: (-800, 400, 9_000), mlp_trace.ATTN_CORE: (-300, 9_400, 16_000),
               mlp_trace.OUT_PROJ: (2_000, 16_500, 24_000), mlp_trace.REDUCE: (20_000, 24_600, period)}
    for i in range(RING):
        prev_end = t0 + i * period
        for kind, (start, wait, end) in offsets.items():
            for c in range(3):
                r = buf[kind, c, i % RING]
                r["t"] = [prev_end + start + c, prev_end + wait if kind != mlp_trace.QKV else 0, 0,
                          0, prev_end + end - 500 + 100 * c if kind != mlp_trace.REDUCE else 0,
                          prev_end + end - 200 * c if kind == mlp_trace.REDUCE else prev_end + end - 500 + 100 * c]
                r["launch"], r["grid"] = i, 3
    med, n = mlp_trace.analyse_chain(buf, mlp_trace.ATTN_CHAIN, RING)
    assert n == RING - 3
    assert med["reduce"]["end_last"] == period and med["reduce"]["wait_returned_median"] == 24_600
    assert med["qkv"]["start_first"] == -800 and "wait_returned_median" not in med["qkv"]
    assert med["attn_core"]["end_median"] == 16_000 - 400 and med["attn_core"]["end_last"] == 16_000 - 300
    assert med["out_proj"]["wait_returned_median"] == 16_500 and med["out_proj"]["ctas"] == 3
    assert "stamp4_median" in med["out_proj"] and "stamp4_median" not in med["reduce"]
