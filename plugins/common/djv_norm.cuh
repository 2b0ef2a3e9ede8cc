// djv_norm.cuh - one CTA normalises one row (LayerNorm, or RMSNorm rounded as HF's LlamaRMSNorm), the row
// held in registers: used by the norm kernel (djv_norm.cu) and, fused, by the last CTA of the partial-sum
// reduction that produces the row (djv_rows.cuh), so a decode layer needs no separate norm launch.
#pragma once
#include "dejavu_kernels.h"
#include "djv_bulk.cuh"

namespace djv {

// Sum over the CTA (every thread gets it). `slots` holds one float per warp; callers pass separate arrays
// for consecutive sums, so a single barrier per sum suffices.
__device__ __forceinline__ float block_sum(float v, float* slots) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) slots[wid] = v;
    __syncthreads();
    return warp_sum(lane < nw ? slots[lane] : 0.f);
}

// y = norm(x) for one row of d values; the CTA's threads own 8-element vectors j * blockDim + tid, VPT each
// (VPT * blockDim * 8 >= d). y may be x (every thread reads its elements before it writes them). L2ONLY reads
// x through L2 (other CTAs of the same grid wrote it). s1, s2: 32 floats of shared memory each.
template <typename T, int VPT, bool L2ONLY>
__device__ __forceinline__ void norm_row(const T* x, const T* __restrict__ w, const T* __restrict__ b, T* y, int d,
                                         int rms, float eps, float* s1, float* s2) {
    const int nv = d / 8;
    float v[VPT][8];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int c = (j * blockDim.x + threadIdx.x);
        if (c < nv) {
            const uint4* p = reinterpret_cast<const uint4*>(x + c * 8);
            unpack8<T>(L2ONLY ? __ldcg(p) : *p, v[j]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[j][e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += rms ? v[j][e] * v[j][e] : v[j][e];
    }
    const float inv_d = 1.f / (float)d;
    float mean = 0.f, rstd;
    if (rms) {
        rstd = rsqrtf(block_sum(sum, s1) * inv_d + eps);
    } else {
        mean = block_sum(sum, s1) * inv_d;
        float sq = 0.f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            if (j * blockDim.x + threadIdx.x >= nv) continue;
#pragma unroll
            for (int e = 0; e < 8; ++e) { const float t = v[j][e] - mean; sq = fmaf(t, t, sq); }
        }
        rstd = rsqrtf(block_sum(sq, s2) * inv_d + eps);
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int c = (j * blockDim.x + threadIdx.x);
        if (c >= nv) continue;
        float wv[8], bv[8], o[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(w + c * 8), wv);
        if (b) unpack8<T>(*reinterpret_cast<const uint4*>(b + c * 8), bv);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            if (rms) o[e] = to_f(from_f<T>(v[j][e] * rstd)) * wv[e];  // HF: round, then scale in the I/O dtype
            else o[e] = fmaf((v[j][e] - mean) * rstd, wv[e], b ? bv[e] : 0.f);
        }
        *reinterpret_cast<uint4*>(y + c * 8) =
            make_uint4(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]), pack2<T>(o[4], o[5]), pack2<T>(o[6], o[7]));
    }
}

// A norm applied to the output rows of an op (the next layer's input norm): out[b] = norm(y[b]).
// ctr: B counters (zero, re-armed by the kernels) for the fused form; w == nullptr means none.
template <typename T> struct PostNorm {
    const T* w;
    const T* b;
    T* out;
    unsigned* ctr;
    int rms;
    float eps;
};

// The C ABI's djv_post_norm for the kernels, with its counters (ctr: B of them in the op's counter region).
template <typename T> inline PostNorm<T> post_norm_of(const djv_post_norm* p, unsigned* ctr) {
    PostNorm<T> pn{};
    if (!p) return pn;
    pn.w = static_cast<const T*>(p->weight);
    pn.b = static_cast<const T*>(p->bias);
    pn.out = static_cast<T*>(p->out);
    pn.ctr = ctr;
    pn.rms = p->kind == DJV_RMSNORM;
    pn.eps = p->eps;
    return pn;
}

constexpr int kNormMaxThreads = 1024;

// Argument check of an optional post_norm on an op writing y [B, d]: DJV_OK or a DJV_E* status.
inline int check_post_norm(const djv_post_norm* p, const void* y, int d) {
    if (!p) return DJV_OK;
    if (d > 8 * 2 * kNormMaxThreads) return DJV_E_SHAPE;
    if (p->kind != DJV_LAYERNORM && p->kind != DJV_RMSNORM) return DJV_E_DTYPE;
    auto al = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; };
    if (!p->weight || !p->out || p->out == y || (p->kind == DJV_RMSNORM && p->bias)) return DJV_E_POINTER;
    if (!al(p->weight) || !al(p->out) || (p->bias && !al(p->bias))) return DJV_E_POINTER;
    return DJV_OK;
}

template <typename T, int VPT>
__global__ void __launch_bounds__(kNormMaxThreads) norm_kernel(const T* x, const T* __restrict__ w,
                                                               const T* __restrict__ b, T* y, int d,
                                                               int rms, float eps) {
    __shared__ float s1[32], s2[32];
    pdl_wait_primary();  // launched early (launch_pdl): x comes from the kernel before
    pdl_launch_dependents();
    norm_row<T, VPT, false>(x + (size_t)blockIdx.x * d, w, b, y + (size_t)blockIdx.x * d, d, rms, eps, s1, s2);
}

// The standalone norm: one CTA per row, one 8-element vector per thread up to 1024 threads (d <= 16384).
template <typename T>
inline cudaError_t launch_norm(const T* x, const T* w, const T* b, T* y, int rows, int d, int rms, float eps,
                               cudaStream_t st) {
    const int nv = d / 8;
    const int threads = nv <= kNormMaxThreads ? cdiv(nv, 32) * 32 : kNormMaxThreads;
    const int vpt = cdiv(nv, threads);
    auto go = [&](auto kern) { return launch_pdl(kern, dim3(rows), dim3(threads), 0, st, x, w, b, y, d, rms, eps); };
    return vpt == 1 ? go(norm_kernel<T, 1>) : go(norm_kernel<T, 2>);
}

}  // namespace djv
