// djv_rows.cuh - coalesced GEMVs for batch <= 4 on the CUDA cores, and the batch dispatch of the shared
// down projection.
//
// Why two families: the tensor-core GEMVs (djv_device.cuh) let 4 threads share a row, so one warp load
// instruction covers only 64 bytes of each of 16 rows. Measured on the H200 (benchmarks/probes/
// read_patterns.cu), that access pattern reads HBM at 1.0-2.2 TB/s, while a warp reading 512 contiguous
// bytes of one row per instruction reaches 2.6 TB/s on a 52 MB gather and 3.7 TB/s on 210 MB. At batch <= 4
// the FMAs fit easily on the CUDA cores, so these kernels use the 512-byte pattern; batch 5-16 keeps mma.
#pragma once
#include <math.h>
#include <type_traits>
#include "djv_bulk.cuh"
#include "djv_device.cuh"
#include "djv_stats.cuh"
#include "djv_trace.cuh"

namespace djv {

constexpr int kRowChunk = 256;  // elements per 512-byte warp load (8 per lane)

// Batch rows handled by the CUDA-core kernels: 1, 2 or 4 accumulators per output.
inline int rows_nb(int B) { return B <= 1 ? 1 : (B <= 2 ? 2 : 4); }
inline bool use_rows(int B) { return B <= 4; }

// ---------------------------------------------------------------------------------------------
// Row dot products, warp stream-K: items = matrix rows (up to NMAT matrices sharing the row index),
// steps = 256-element chunks of d. epi(item, v) runs on all lanes with v[mat][b] = W_mat[row] . x[b]
// summed over all of d; rows(item, r) points r at each matrix's row, or returns false to skip the item
// (a choice that must depend on the item only).
// Kernels built on this are launched with programmatic dependent launch (djv_bulk.cuh): it starts by
// waiting for the kernel before, which writes x, then lets the next kernel launch.
// early: the warp's first batch of weight loads goes out before the wait. Only for callers whose weights and
// row indices were not written by the kernel just before (djv_bulk.cuh's rule). The callers decide: the QKV
// projection under the indices-ready promise (DJV_QKV_EARLY overrides), the output projection always
// (plan_rows_down; DJV_DOWN_EARLY=0 turns it off).
template <typename T, int NB, int NMAT, int U = 8 / NMAT, typename RowsF, typename EpiF>
__device__ __forceinline__ void streamk_rows(const T* __restrict__ x, int B, int d, float* __restrict__ part,
                                             unsigned* __restrict__ ctr, const StreamK& sk, RowsF rows, EpiF epi,
                                             bool early = false) {
    // U: independent 16-byte weight loads in flight per lane (8 by default)
    constexpr int SLOT = NMAT * NB;
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    long long s = (long long)gw * sk.q;
    const long long s_end = s + sk.q < sk.total ? s + sk.q : sk.total;
    uint4 wpre[NMAT][U];
    bool pre = false;
    if (early && s < s_end) {
        const int item = (int)(s / sk.per_item);
        const int k0 = (int)(s - (long long)item * sk.per_item);
        const int k1 = (int)(k0 + (s_end - s) < sk.per_item ? k0 + (s_end - s) : sk.per_item);
        const T* r[NMAT];
        if (rows(item, r)) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = (k0 + u) * kRowChunk + lane * 8;
                const bool ok = k0 + u < k1 && off < d;
#pragma unroll
                for (int m = 0; m < NMAT; ++m) wpre[m][u] = ok ? ld_stream(r[m] + off) : zero4();
            }
            pre = true;
        }
    }
    pdl_wait_primary();
    pdl_launch_dependents();
    while (s < s_end) {
        const int item = (int)(s / sk.per_item);
        const int k0 = (int)(s - (long long)item * sk.per_item);
        const int k1 = (int)(k0 + (s_end - s) < sk.per_item ? k0 + (s_end - s) : sk.per_item);
        s += k1 - k0;
        const T* r[NMAT];
        if (!rows(item, r)) continue;
        float acc[NMAT][NB] = {};
        for (int ks = k0; ks < k1; ks += U) {
            uint4 wv[NMAT][U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = (ks + u) * kRowChunk + lane * 8;
                const bool ok = ks + u < k1 && off < d;
#pragma unroll
                for (int m = 0; m < NMAT; ++m) wv[m][u] = pre ? wpre[m][u] : (ok ? ld_stream(r[m] + off) : zero4());
            }
            pre = false;  // the early batch was the first item's first batch
            uint4 x0[NB == 1 ? U : 1];  // batch 1: x is loaded with the weights (see rows_down_kernel)
            if (NB == 1) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int off = (ks + u) * kRowChunk + lane * 8;
                    x0[NB == 1 ? u : 0] = (ks + u < k1 && off < d) ? ld_keep(x + off) : zero4();
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = (ks + u) * kRowChunk + lane * 8;
                const bool ok = ks + u < k1 && off < d;
                float wf[NMAT][8];
#pragma unroll
                for (int m = 0; m < NMAT; ++m) unpack8<T>(wv[m][u], wf[m]);
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    float xf[8];
                    if (NB == 1) unpack8<T>(x0[NB == 1 ? u : 0], xf);
                    else unpack8<T>((ok && b < B) ? ld_keep(x + (size_t)b * d + off) : zero4(), xf);
#pragma unroll
                    for (int m = 0; m < NMAT; ++m)
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[m][b] = fmaf(wf[m][e], xf[e], acc[m][b]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
            for (int b = 0; b < NB; ++b)
                acc[m][b] = warp_sum(acc[m][b]);
        if (!(k0 == 0 && k1 == sk.per_item)) {  // split row: publish; the completing warp sums in order
            float* slots = part + (size_t)item * sk.max_slots * SLOT;
            if (lane == 0) {
                float* mine = slots + (size_t)(gw - sk_first_warp(sk, item)) * SLOT;
#pragma unroll
                for (int m = 0; m < NMAT; ++m)
#pragma unroll
                    for (int b = 0; b < NB; ++b) mine[m * NB + b] = acc[m][b];
            }
            if (!warp_publish(ctr + item, (unsigned)(k1 - k0), (unsigned)sk.per_item)) continue;
            const int nslots = sk_last_warp(sk, item) - sk_first_warp(sk, item) + 1;
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    float v = 0.f;
                    for (int k = 0; k < nslots; ++k) v += __ldcg(slots + (size_t)k * SLOT + m * NB + b);
                    acc[m][b] = v;
                }
        }
        epi(item, acc);
    }
}
inline StreamK plan_rows(int nrows, int d, int warps_per_sm = kSkWarpsPerSm) {
    return plan_streamk(nrows, cdiv(d, kRowChunk), 4, warps_per_sm);
}
inline size_t rows_part_floats(const StreamK& k, int nrows, int nb, int nmat) {
    return (size_t)nrows * k.max_slots * nmat * nb;
}

// ---------------------------------------------------------------------------------------------
// Down projection over active rows, batch <= 4: y[b, :] = sum_m act[b, m] * W[row(m), :] (+ bias).
// Work units = (chunk of R active rows, 256-column slice); unit u = chunk * S + slice, one per warp, so the
// warps of a CTA read adjacent 512-byte slices of the same rows at the same time. (Measured: 8 warps of a
// CTA reading one 512-byte slice of different rows got ~1.7 TB/s; adjacent slices of the same rows ~2.7.)
// Each warp writes its chunk's partial y (fp32) and rows_reduce_kernel sums the chunks in a fixed order.
constexpr int kRowsDownU = 8;

struct RowsDownPlan { int S, R, C, early; };
// Warps per SM the plan fills at batch 1: 24 (3 CTAs; the batch-1 kernel's 80 registers leave room), so
// chunks are 8 rows, one batch of loads per warp, where 16 warps per SM gave OPT-13B's output projection
// 10-row chunks and a second round trip for the last 2 rows (session 8: attention 31.4-31.7 against
// 34.2 us, 2.6% faster end to end). Batch 2-4 kernels use more registers and keep kSkWarpsPerSm.
// DJV_DOWN_WPS=8..24 overrides the batch-1 value, for A/B runs.
inline int rows_down_warps_per_sm() {
    static const int w = env_int("DJV_DOWN_WPS", 8, 24, 24);
    return w;
}
inline RowsDownPlan plan_rows_down(int d, int M, int B) {
    RowsDownPlan p;
    p.S = cdiv(d, kRowChunk);
    const long long want = (long long)sm_count() * (B == 1 ? rows_down_warps_per_sm() : kSkWarpsPerSm);  // one wave
    long long r = ((long long)M * p.S + want - 1) / want;
    p.R = (int)(r < 8 ? 8 : r);
    p.C = cdiv(M, p.R);
    // Each warp's first batch of weight rows is loaded before the wait, while the kernel before (the attention
    // core, the MLP's up kernel) runs: the rows and indices never come from that kernel, since the op's first
    // kernel has already waited for the indices. Measured on an H100 (benchmarks/RESULTS.md, session 23):
    // 3.2% off the OPT-13B batch-1 step. DJV_DOWN_EARLY=0 turns it off, for A/B runs.
    static const int early = env_int("DJV_DOWN_EARLY", 0, 1, 1);
    p.early = early;
    return p;
}

// The attention core's per-split partial softmaxes (headSparseAttentionKernel.cu), which the output
// projection can read in place of its activations: active row j = head position j / hd, element j % hd;
// split k of (batch row b, head position h) is part[((b * Kh + h) * nsplit + k) * (hd + 2)] = {max m,
// sum l, values[hd]} (base-2 softmax; l = 0 for a split past position[b], whose values are never written).
// Merging them where they are used takes the attention core's last-arrival merge (a fence, an atomic and
// two more L2 round trips) off the chain: the loads go out beside the weight loads.
struct SplitParts { const float* part; int nsplit, Kh, hd; };

// LPR lanes (adjacent, all 32 of the warp calling) merge one (row, batch row): lane q of the group takes
// splits q, q + LPR, ...; the group then combines its running (max, sum, value) states by shuffles. With at
// most 32 splits and 8 per lane the loads are one batch, in flight beside the weights'.
template <typename T, int LPR>
__device__ __forceinline__ float merged_row(const SplitParts& sp, bool valid, int b, int j, int q) {
    float M = -INFINITY, den = 0.f, num = 0.f;  // online softmax over this lane's splits
    if (valid) {
        const int h = j / sp.hd, e = j - h * sp.hd, stride = sp.hd + 2;
        const float* pk = sp.part + (((size_t)b * sp.Kh + h) * sp.nsplit + q) * stride;
#pragma unroll 8
        for (int k = q; k < sp.nsplit; k += LPR, pk += (size_t)LPR * stride) {
            const float m = __ldcg(pk), l = __ldcg(pk + 1), v = __ldcg(pk + 2 + e);
            if (l > 0.f) {  // a split past position[b] has l = 0 and values never written
                if (m > M) {
                    const float s = exp2f(M - m);
                    den *= s;
                    num *= s;
                    M = m;
                }
                const float w = exp2f(m - M);
                den = fmaf(w, l, den);
                num = fmaf(w, v, num);
            }
        }
    }
#pragma unroll
    for (int o = 1; o < LPR; o <<= 1) {
        const float M2 = __shfl_xor_sync(0xffffffffu, M, o), d2 = __shfl_xor_sync(0xffffffffu, den, o),
                    n2 = __shfl_xor_sync(0xffffffffu, num, o);
        const float Mn = fmaxf(M, M2);
        const float s1 = M == -INFINITY ? 0.f : exp2f(M - Mn), s2 = M2 == -INFINITY ? 0.f : exp2f(M2 - Mn);
        den = den * s1 + d2 * s2;
        num = num * s1 + n2 * s2;
        M = Mn;
    }
    return round_io<T>(num / den);  // as the merged activations were stored: rounded to T
}

template <typename T, int NB, bool MERGE = false>
__global__ void __launch_bounds__(kSkThreads, NB == 1 ? 3 : 2) rows_down_kernel(const T* __restrict__ act, int Mpad,
                                                                  const int32_t* __restrict__ idx, int bs, int M,
                                                                  const T* __restrict__ w, const T* __restrict__ bias,
                                                                  const T* residual, T* y, float* __restrict__ part,
                                                                  int B, int d, RowsDownPlan p, SplitParts sp) {
    DJV_TRACE_DECL;  // a -DDJV_TRACE build only (djv_trace.cuh), CTAs whose warp 0 has work: 0 start, 1 wait
    DJV_TRACE_START(4);  // returned, 5 partials stored
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * (kSkThreads / 32) + (threadIdx.x >> 5);
    const bool live = gw < p.C * p.S;
    const int chunk = gw / p.S, slice = gw % p.S;
    const int j0 = chunk * p.R, j1 = min(M, j0 + p.R);
    const int col = slice * kRowChunk + lane * 8;
    const bool colok = col < d;  // d % 8 == 0
    uint4 wv[kRowsDownU];
    auto load_rows = [&](int j) {
#pragma unroll
        for (int u = 0; u < kRowsDownU; ++u) {
            const bool ok = j + u < j1;
            const int row = expand_row(idx, ok ? j + u : j0, bs);
            wv[u] = (ok && colok) ? ld_stream(w + (size_t)row * d + col) : zero4();
        }
    };
    if (p.early && live) load_rows(j0);  // weights and indices: not the kernel before's output
    pdl_wait_primary();  // launched early (launch_down): act comes from the kernel before
    DJV_TRACE_MARK(1);
    pdl_launch_dependents();  // the reduction may launch now; it waits for this grid's results
    if (!live) return;
    float acc[NB][8] = {};
    for (int j = j0; j < j1; j += kRowsDownU) {
        // All loads of the batch first (weights and activations): an activation load issued after its
        // weight arrived would put one L2 round trip per row on the critical path.
        float a[kRowsDownU][NB];
        if (!(p.early && j == j0)) load_rows(j);
#pragma unroll
        for (int u = 0; u < kRowsDownU; ++u) {
            const bool ok = j + u < j1;
            if (!MERGE) {
#pragma unroll
                for (int b = 0; b < NB; ++b) a[u][b] = (ok && b < B) ? to_f(act[(size_t)b * Mpad + j + u]) : 0.f;
            }
        }
        if (MERGE) {  // lanes (b * 8 + u) * LPR + q merge (row j + u, batch row b) while the weights are in flight
            constexpr int LPR = 32 / (kRowsDownU * NB);
            static_assert(LPR >= 1 && LPR * kRowsDownU * NB == 32, "lane groups tile the warp");
            const int q = lane % LPR, u = (lane / LPR) % kRowsDownU, bb = lane / (LPR * kRowsDownU);
            const float mine = merged_row<T, LPR>(sp, j + u < j1 && bb < B, bb, j + u, q);
#pragma unroll
            for (int uu = 0; uu < kRowsDownU; ++uu)
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const float v = __shfl_sync(0xffffffffu, mine, (b * kRowsDownU + uu) * LPR);
                    a[uu][b] = (j + uu < j1 && b < B) ? v : 0.f;  // an idle group's value is 0 / 0
                }
        }
#pragma unroll
        for (int u = 0; u < kRowsDownU; ++u) {
            float wf[8];
            unpack8<T>(wv[u], wf);
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[b][e] = fmaf(a[u][b], wf[e], acc[b][e]);
        }
    }
    if (!colok) return;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        if (b >= B) break;
        if (p.C == 1) {  // one chunk: no reduction pass
            if (residual) {
                float r[8];
                unpack8<T>(*reinterpret_cast<const uint4*>(residual + (size_t)b * d + col), r);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[b][e] += r[e];
            }
            uint4 o;
            o.x = pack2<T>(acc[b][0] + (bias ? to_f(bias[col + 0]) : 0.f), acc[b][1] + (bias ? to_f(bias[col + 1]) : 0.f));
            o.y = pack2<T>(acc[b][2] + (bias ? to_f(bias[col + 2]) : 0.f), acc[b][3] + (bias ? to_f(bias[col + 3]) : 0.f));
            o.z = pack2<T>(acc[b][4] + (bias ? to_f(bias[col + 4]) : 0.f), acc[b][5] + (bias ? to_f(bias[col + 5]) : 0.f));
            o.w = pack2<T>(acc[b][6] + (bias ? to_f(bias[col + 6]) : 0.f), acc[b][7] + (bias ? to_f(bias[col + 7]) : 0.f));
            *reinterpret_cast<uint4*>(y + (size_t)b * d + col) = o;
        } else {
            float4* dst = reinterpret_cast<float4*>(part + ((size_t)chunk * B + b) * d + col);
            dst[0] = make_float4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]);
            dst[1] = make_float4(acc[b][4], acc[b][5], acc[b][6], acc[b][7]);
        }
    }
    DJV_TRACE_END(4, j1 - j0);
}

// y[b, c] = sum over chunks k (in order) of part[k, b, c] (+ bias) (+ residual). CTA: 16 float4 columns x 16
// chunk lanes, so a column's partials are read by 16 threads at once (one L2 round trip per 16 chunks).
// early: bias and residual are loaded before the launch wait, while the kernel before finishes. Safe: they
// are inputs of the op, written (if at all) before its first kernel, which waited for them before this
// kernel could launch (djv_bulk.cuh's chain rule); only the partials come from the kernel before.
constexpr int kReduceLanes = 16;
// STATS: each CTA's 64 columns are one statistics block (djv_stats.cuh) of the rounded y, into y_stats.
template <typename T, bool STATS>
__global__ void __launch_bounds__(256) rows_reduce_kernel(const float* __restrict__ part, const T* __restrict__ bias,
                                                          const T* residual, T* y, float2* __restrict__ y_stats, int B,
                                                          int d, int C, int early) {
    __shared__ float4 red[kReduceLanes][16];
    DJV_TRACE_DECL;  // a -DDJV_TRACE build only (djv_trace.cuh): 0 start, 1 wait returned, 4 partials read, 5 end
    DJV_TRACE_START(1);
    const int cl = threadIdx.x & 15, kl = threadIdx.x >> 4;
    const int b = blockIdx.y, c4 = blockIdx.x * 16 + cl;  // float4 column
    const bool ok = c4 * 4 < d;
    const bool mine = kl == 0 && ok;  // lanes 0-15 own one float4 column each
    const int col = c4 * 4;
    float4 bv = make_float4(0.f, 0.f, 0.f, 0.f), rv = bv;
    auto load_extras = [&]() {
        if (!mine) return;
        if (bias) bv = make_float4(to_f(bias[col]), to_f(bias[col + 1]), to_f(bias[col + 2]), to_f(bias[col + 3]));
        if (residual) {  // residual may be y itself: read before the write below
            const T* r = residual + (size_t)b * d + col;
            rv = make_float4(to_f(r[0]), to_f(r[1]), to_f(r[2]), to_f(r[3]));
        }
    };
    if (early) load_extras();
    pdl_wait_primary();  // launched early (launch_rows_reduce): the partials come from the kernel before
    DJV_TRACE_MARK(1);
    pdl_launch_dependents();
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (ok) {
#pragma unroll 8
        for (int k = kl; k < C; k += kReduceLanes) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(part + ((size_t)k * B + b) * d) + c4);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
    }
    if (!early) load_extras();
    DJV_TRACE_MARK(4);
    red[kl][cl] = s;
    __syncthreads();
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mine) {
        t = red[0][cl];
#pragma unroll
        for (int k = 1; k < kReduceLanes; ++k) {
            t.x += red[k][cl].x; t.y += red[k][cl].y; t.z += red[k][cl].z; t.w += red[k][cl].w;
        }
    }
    if (STATS ? threadIdx.x >= 32 : !mine) return;
    float v[4] = {};
    if (mine) {
        if (bias) { t.x += bv.x; t.y += bv.y; t.z += bv.z; t.w += bv.w; }  // y = sum + bias + residual, in
        if (residual) { t.x += rv.x; t.y += rv.y; t.z += rv.z; t.w += rv.w; }  // that order (one rounding)
        uint2 o;
        o.x = pack2<T>(t.x, t.y);
        o.y = pack2<T>(t.z, t.w);
        *reinterpret_cast<uint2*>(y + (size_t)b * d + col) = o;
        v[0] = round_io<T>(t.x); v[1] = round_io<T>(t.y); v[2] = round_io<T>(t.z); v[3] = round_io<T>(t.w);
    }
    if (STATS)  // 16 float4 columns = one 64-column statistics block
        store_block_stats<4>(v, mine ? 4 : 0, min(kStatCols, d - (int)blockIdx.x * kStatCols),
                             y_stats + (size_t)b * stats_blocks(d) + blockIdx.x);
    DJV_TRACE_END(1, C);
}

// DJV_REDUCE_EARLY=0 loads bias and residual after the launch wait instead, for A/B runs.
inline int reduce_early() {
    static const int v = env_int("DJV_REDUCE_EARLY", 0, 1, 1);
    return v;
}

template <typename T>
inline cudaError_t launch_rows_reduce(const float* part, const T* bias, const T* residual, T* y, int B, int d, int C,
                                      cudaStream_t st, float2* y_stats = nullptr) {
    static_assert(16 * 4 == kStatCols, "one reduction CTA per statistics block");
    auto k = y_stats ? rows_reduce_kernel<T, true> : rows_reduce_kernel<T, false>;
    return launch_pdl(k, dim3(cdiv(d, 64), B), dim3(256), 0, st, part, bias, residual, y, y_stats, B, d, C,
                      reduce_early());
}

// ---------------------------------------------------------------------------------------------
// The shared down projection: workspace, counters and launch, by batch size.
inline int down_counters(int d) { return cdiv(d, 128); }
inline size_t down_part_floats(int B, int d, int M, int Mpad) {
    if (use_rows(B)) return (size_t)plan_rows_down(d, M, B).C * B * d;
    const int S = down_splits(d, Mpad);
    return S > 1 ? (size_t)S * B * d : 0;
}

// act: [16][Mpad]. Batch > 4: rows >= B and padded entries (m >= M) must be zero; batch <= 4 reads rows < B
// and entries m < M only. Batch <= 4 is launched with programmatic dependent launch (djv_bulk.cuh).
// y_stats (may be null): the row statistics of y (djv_stats.cuh), from the reduction where there is one.
// sp (batch <= 4 only): the activations are the attention core's split partials, merged on load.
template <typename T>
inline cudaError_t launch_down(const T* act, int Mpad, const int32_t* idx, int bs, int M, const T* w, const T* bias,
                               const T* residual, T* y, float* part, unsigned* ctr, int B, int d, cudaStream_t st,
                               float2* y_stats = nullptr, const SplitParts* sp = nullptr) {
    if (!use_rows(B)) {
        if (sp) return cudaErrorInvalidValue;
        cudaError_t e = launch_down_mma<T>(act, Mpad, idx, bs, M, w, bias, residual, y, part, ctr, B, d, st);
        if (e != cudaSuccess || !y_stats) return e;
        return launch_row_stats<T>(y, y_stats, B, d, st);
    }
    const RowsDownPlan p = plan_rows_down(d, M, B);
    const int ctas = cdiv(p.C * p.S, kSkThreads / 32);
    const SplitParts none{nullptr, 0, 0, 0};
    auto go = [&](auto kern) {
        return launch_pdl(kern, dim3(ctas), dim3(kSkThreads), 0, st, act, Mpad, idx, bs, M, w, bias, residual, y, part,
                          B, d, p, sp ? *sp : none);
    };
    // one instantiation per (batch slots, merge the attention splits on load)
    auto go_nb = [&](auto merge) {
        constexpr bool M_ = decltype(merge)::value;
        switch (rows_nb(B)) {
        case 1: return go(rows_down_kernel<T, 1, M_>);
        case 2: return go(rows_down_kernel<T, 2, M_>);
        default: return go(rows_down_kernel<T, 4, M_>);
        }
    };
    cudaError_t e = sp ? go_nb(std::true_type{}) : go_nb(std::false_type{});
    if (e != cudaSuccess) return e;
    if (p.C > 1) return launch_rows_reduce<T>(part, bias, residual, y, B, d, p.C, st, y_stats);
    if (y_stats) return launch_row_stats<T>(y, y_stats, B, d, st);
    return cudaGetLastError();
}

}  // namespace djv
