// djv_stats.cuh - row statistics in 64-column blocks, so that a norm can be folded into the op after it.
//
// Why: a LayerNorm/RMSNorm between two ops needs the whole row's mean and variance, a grid-wide dependency.
// As its own kernel it costs ~2.7 us per call at batch 1 (one 10 KB row); computed by every CTA of the op
// after it, a CTA-wide two-pass reduction plus the weight and bias reads sit ahead of each CTA's first dot
// product (both measured slower end to end, benchmarks/RESULTS.md sessions 5 and 6). Here the kernel that
// writes the row (the partial-sum reduction, one CTA per 64 columns) also writes each block's (mean, M2),
// and every warp of the consumer combines the <= 256 blocks itself (Chan's parallel variance; no barrier).
// The norm's weight and bias are folded into the consumer's weights by the caller, so the consumer only
// needs (x - mean) * rstd.
#pragma once
#include "djv_bulk.cuh"
#include "djv_device.cuh"

namespace djv {

constexpr int kStatCols = 64;
constexpr int kStatMaxBlocks = 256;  // d <= 16384
// Blocks per row, and the row stride in pairs (even: a row starts 16-byte aligned and is read as float4).
__host__ __device__ inline int stats_real_blocks(int d) { return (d + kStatCols - 1) / kStatCols; }
__host__ __device__ inline int stats_blocks(int d) { return (stats_real_blocks(d) + 1) & ~1; }

template <typename T> __device__ __forceinline__ float round_io(float v) { return to_f(from_f<T>(v)); }

// Warp-collective (all 32 lanes, uniform arguments): the block statistics of one row -> (mean, rstd) of
// the norm. RMSNorm: mean = 0, rstd = rsqrt(mean(x^2) + eps). Every consumer CTA reads the same few
// hundred bytes, so callers use one warp per CTA (an L2 hot spot otherwise) and 16-byte loads.
__device__ __forceinline__ void norm_from_stats(const float2* __restrict__ st, int d, int rms, float eps,
                                                float& mean, float& rstd) {
    constexpr int J = kStatMaxBlocks / 64;  // float4 (two blocks) per lane
    const int lane = threadIdx.x & 31, nblk = stats_real_blocks(d);
    float4 r[J];
    float s = 0.f, q = 0.f;
    auto n_of = [&](int k) { return k < nblk ? (float)min(kStatCols, d - k * kStatCols) : 0.f; };
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int k = 2 * (lane + 32 * j);
        r[j] = k < nblk ? __ldcg(reinterpret_cast<const float4*>(st + k)) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float n0 = n_of(k), n1 = n_of(k + 1);  // n = 0: a padding pair, never written
        s += n0 * r[j].x + (n1 > 0.f ? n1 * r[j].z : 0.f);
        q += rms ? n0 * r[j].x * r[j].x + r[j].y + (n1 > 0.f ? n1 * r[j].z * r[j].z + r[j].w : 0.f)
                 : r[j].y + (n1 > 0.f ? r[j].w : 0.f);
    }
    const float inv_d = 1.f / (float)d;
    if (rms) {
        mean = 0.f;
        rstd = rsqrtf(warp_sum(q) * inv_d + eps);
        return;
    }
    mean = warp_sum(s) * inv_d;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int k = 2 * (lane + 32 * j);
        const float n0 = n_of(k), n1 = n_of(k + 1), t0 = r[j].x - mean, t1 = r[j].z - mean;
        q += n0 * t0 * t0 + (n1 > 0.f ? n1 * t1 * t1 : 0.f);
    }
    rstd = rsqrtf(warp_sum(q) * inv_d + eps);
}

// Warp-collective: lane l holds n_l valid values v[0..n_l) of one 64-column block (the others contribute
// nothing); lane 0 stores the block's (mean, M2). n = total valid values of the block.
template <int NV>
__device__ __forceinline__ void store_block_stats(const float (&v)[NV], int nvalid, int n, float2* out) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < NV; ++e) s += e < nvalid ? v[e] : 0.f;
    const float mean = warp_sum(s) / (float)n;
    float q = 0.f;
#pragma unroll
    for (int e = 0; e < NV; ++e) {
        const float t = v[e] - mean;
        q += e < nvalid ? t * t : 0.f;
    }
    q = warp_sum(q);
    if ((threadIdx.x & 31) == 0) *out = make_float2(mean, q);
}

// stats[r][j] of z [rows, d]: one warp per (block j, row r), lanes 0-7 each read 8 values.
template <typename T>
__global__ void __launch_bounds__(32) row_stats_kernel(const T* __restrict__ z, float2* __restrict__ stats, int d) {
    pdl_wait_primary();  // launched early (launch_pdl): z comes from the kernel before
    pdl_launch_dependents();
    const int j = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const int col = j * kStatCols + lane * 8;
    float v[8] = {};
    const bool ok = lane < 8 && col < d;  // d % 8 == 0
    if (ok) unpack8<T>(*reinterpret_cast<const uint4*>(z + (size_t)r * d + col), v);
    store_block_stats<8>(v, ok ? 8 : 0, min(kStatCols, d - j * kStatCols), stats + (size_t)r * stats_blocks(d) + j);
}

template <typename T>
inline cudaError_t launch_row_stats(const T* z, float2* stats, int rows, int d, cudaStream_t st) {
    return launch_pdl(row_stats_kernel<T>, dim3(stats_real_blocks(d), rows), dim3(32), 0, st, z, stats, d);
}

// y = round((x - mean) * rstd) from x's block statistics: the fallback for kernels that do not normalise
// their input themselves. grid = (column groups of 2048, rows); every warp combines the statistics.
constexpr int kApplyNormThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kApplyNormThreads) apply_norm_kernel(const T* __restrict__ x,
                                                                       const float2* __restrict__ stats,
                                                                       T* __restrict__ y, int d, int rms, float eps) {
    __shared__ float s_norm[2];
    pdl_wait_primary();
    pdl_launch_dependents();
    const int r = blockIdx.y;
    if (threadIdx.x < 32) {
        float m, rs;
        norm_from_stats(stats + (size_t)r * stats_blocks(d), d, rms, eps, m, rs);
        if (threadIdx.x == 0) { s_norm[0] = m; s_norm[1] = rs; }
    }
    __syncthreads();
    const float mean = s_norm[0], rstd = s_norm[1];
    const int col = (blockIdx.x * kApplyNormThreads + threadIdx.x) * 8;
    if (col >= d) return;
    float v[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(x + (size_t)r * d + col), v);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = (v[e] - mean) * rstd;
    *reinterpret_cast<uint4*>(y + (size_t)r * d + col) =
        make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
}

template <typename T>
inline cudaError_t launch_apply_norm(const T* x, const float2* stats, T* y, int rows, int d, int rms, float eps,
                                     cudaStream_t st) {
    return launch_pdl(apply_norm_kernel<T>, dim3(cdiv(d, 8 * kApplyNormThreads), rows), dim3(kApplyNormThreads), 0,
                      st, x, stats, y, d, rms, eps);
}

}  // namespace djv
