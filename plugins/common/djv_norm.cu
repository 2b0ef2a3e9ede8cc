// Row normalisation for the CUDA executor (not a plugin: in the ONNX graph the norms are standard ops that
// TensorRT fuses itself). At batch 1 the decode step's LayerNorm is one 10 KB row; torch's kernel spends
// ~10 us on it (profiled, H200), longer than the head-sparse attention core. One CTA per row, the row held in
// registers (16-byte loads), two-pass variance, one rounding for LayerNorm; RMSNorm rounds as HF's
// LlamaRMSNorm does (normalise in fp32, round, then scale in the I/O dtype).
#include "dejavu_kernels.h"
#include "djv_bulk.cuh"
#include "djv_stats.cuh"

namespace {
using namespace djv;

constexpr int kNormMaxThreads = 1024;

// Sum over the CTA (every thread gets it). `slots` holds one float per warp; callers pass separate arrays
// for consecutive sums, so a single barrier per sum suffices.
__device__ __forceinline__ float block_sum(float v, float* slots) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) slots[wid] = v;
    __syncthreads();
    return warp_sum(lane < nw ? slots[lane] : 0.f);
}

// grid = rows; each thread owns up to VPT 8-element vectors of the row (y may be x: each thread reads its
// own elements into registers before writing them)
template <typename T, int VPT>
__global__ void __launch_bounds__(kNormMaxThreads) norm_kernel(const T* x, const T* __restrict__ w,
                                                               const T* __restrict__ b, T* y, int d,
                                                               int rms, float eps) {
    __shared__ float s1[32], s2[32];
    pdl_wait_primary();  // launched early (launch_pdl): x comes from the kernel before
    pdl_launch_dependents();
    const int nv = d / 8;
    const T* xr = x + (size_t)blockIdx.x * d;
    float v[VPT][8];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int c = (j * blockDim.x + threadIdx.x);
        if (c < nv) unpack8<T>(*reinterpret_cast<const uint4*>(xr + c * 8), v[j]);
        else {
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
        *reinterpret_cast<uint4*>(y + (size_t)blockIdx.x * d + c * 8) =
            make_uint4(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]), pack2<T>(o[4], o[5]), pack2<T>(o[6], o[7]));
    }
}

template <typename T>
int run_norm(const void* x, const void* w, const void* b, void* y, int rows, int d, int rms, float eps,
             cudaStream_t st) {
    const int nv = d / 8;
    const int threads = nv <= kNormMaxThreads ? cdiv(nv, 32) * 32 : kNormMaxThreads;
    const int vpt = cdiv(nv, threads);
    auto args = [&](auto kern) {
        return launch_pdl(kern, dim3(rows), dim3(threads), 0, st, static_cast<const T*>(x), static_cast<const T*>(w),
                          static_cast<const T*>(b), static_cast<T*>(y), d, rms, eps);
    };
    return (int)(vpt == 1 ? args(norm_kernel<T, 1>) : args(norm_kernel<T, 2>));
}

}  // namespace

extern "C" DJV_API int djv_norm(const void* x, const void* weight, const void* bias, void* y, int rows, int d,
                                int kind, float eps, int dtype, cudaStream_t stream) {
    if (rows < 1 || d < 8 || d % 8 || d > 8 * 2 * kNormMaxThreads) return DJV_E_SHAPE;
    if ((kind != DJV_LAYERNORM && kind != DJV_RMSNORM) || (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16))
        return DJV_E_DTYPE;
    if (!x || !weight || !y || (kind == DJV_RMSNORM && bias)) return DJV_E_POINTER;
    if (!aligned16(x) || !aligned16(weight) || !aligned16(y) || (bias && !aligned16(bias))) return DJV_E_POINTER;
    const int rms = kind == DJV_RMSNORM;
    if (dtype == DJV_FLOAT16) return run_norm<__half>(x, weight, bias, y, rows, d, rms, eps, stream);
    return run_norm<__nv_bfloat16>(x, weight, bias, y, rows, d, rms, eps, stream);
}

extern "C" DJV_API int djv_stats_blocks(int d) { return d < 1 ? 0 : djv::stats_blocks(d); }

extern "C" DJV_API int djv_row_stats(const void* z, float* stats, int rows, int d, int dtype, cudaStream_t stream) {
    if (rows < 1 || d < 8 || d % 8 || d > djv::kStatCols * djv::kStatMaxBlocks) return DJV_E_SHAPE;
    if (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16) return DJV_E_DTYPE;
    if (!z || !stats || !aligned16(z) || !aligned16(stats)) return DJV_E_POINTER;
    float2* st = reinterpret_cast<float2*>(stats);
    if (dtype == DJV_FLOAT16) return (int)djv::launch_row_stats(static_cast<const __half*>(z), st, rows, d, stream);
    return (int)djv::launch_row_stats(static_cast<const __nv_bfloat16*>(z), st, rows, d, stream);
}
