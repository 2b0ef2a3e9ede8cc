// DejaVuSparseMLP kernels (docs/ops.md): two launches, both warp stream-K (djv_device.cuh), so a resident
// wave of warps moves equal bytes at any kept fraction.
//  1. mlp_up_kernel: items = 16-neuron tiles, steps = 32 elements of d. Up (and gate) dot products on the
//     tensor cores, bias + activation fused by the warp that completes a tile; writes the activations
//     a[16][Mpad] in the I/O dtype.
//  2. djv::down_kernel: items = 64-column slices of y, steps = 16 active neurons of w_down_t, + b_down.
// Every active weight byte is loaded once (16-byte, L1-bypassing loads); inactive rows are never touched.
#include "dejavu_kernels.h"
#include "djv_rows.cuh"

namespace {
using namespace djv;

template <int ACT> __device__ __forceinline__ float activate(float u) {
    if (ACT == DJV_RELU) return fmaxf(u, 0.f);
    return 0.5f * u * (1.f + erff(u * 0.70710678118654752f));  // exact (erf) GELU
}

template <typename T, int NT, int ACT>
__global__ void __launch_bounds__(kSkThreads, 2) mlp_up_kernel(const T* __restrict__ x, const int32_t* __restrict__ idx,
                                                               int bs, int M, int Mpad, const T* __restrict__ w_gate,
                                                               const T* __restrict__ w_up, const T* __restrict__ b_up,
                                                               T* __restrict__ act, float* __restrict__ part,
                                                               unsigned* __restrict__ ctr, int B, int d, StreamK sk) {
    constexpr int NMAT = ACT == DJV_SILU_GLU ? 2 : 1;
    const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    auto rows = [&](int tile, const T* (&r0)[NMAT], const T* (&r1)[NMAT]) {
        const int m0 = tile * 16 + g, m1 = m0 + 8;
        const size_t row0 = (size_t)expand_row(idx, m0 < M ? m0 : M - 1, bs);  // padded rows: output is 0
        const size_t row1 = (size_t)expand_row(idx, m1 < M ? m1 : M - 1, bs);
        if (NMAT == 2) { r0[0] = w_gate + row0 * d; r1[0] = w_gate + row1 * d; }
        r0[NMAT - 1] = w_up + row0 * d; r1[NMAT - 1] = w_up + row1 * d;
        return true;
    };
    auto epi = [&](int tile, const float (&acc)[NMAT][NT][4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int mi = tile * 16 + g + (j >> 1) * 8;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int b = t * 8 + 2 * c + (j & 1);
                float v = 0.f;  // padded neurons and batch rows: exactly zero so they contribute nothing
                if (mi < M && b < B) {
                    if (ACT == DJV_SILU_GLU) {
                        const float gt = acc[0][t][j], up = acc[NMAT - 1][t][j];
                        v = gt / (1.f + __expf(-gt)) * up;
                    } else {
                        const float bias = b_up ? to_f(b_up[expand_row(idx, mi, bs)]) : 0.f;
                        v = activate<ACT>(acc[0][t][j] + bias);
                    }
                }
                act[(size_t)b * Mpad + mi] = from_f<T>(v);
            }
            if (NT == 1) act[(size_t)(8 + 2 * c + (j & 1)) * Mpad + mi] = from_f<T>(0.f);
        }
    };
    streamk_tiles<T, NT, NMAT>(x, B, d, part, ctr, sk, rows, epi);
}

// Batch <= 4: one warp per active neuron row at a time (512 contiguous bytes per load), djv_rows.cuh.
template <typename T, int NB, int ACT>
__global__ void __launch_bounds__(kSkThreads, 2) mlp_rows_up_kernel(
    const T* __restrict__ x, const int32_t* __restrict__ idx, int bs, int M, int Mpad, const T* __restrict__ w_gate,
    const T* __restrict__ w_up, const T* __restrict__ b_up, T* __restrict__ act, float* __restrict__ part,
    unsigned* __restrict__ ctr, int B, int d, StreamK sk) {
    constexpr int NMAT = ACT == DJV_SILU_GLU ? 2 : 1;
    const int lane = threadIdx.x & 31;
    auto rows = [&](int item, const T* (&r)[NMAT]) {
        const size_t row = (size_t)expand_row(idx, item, bs);
        if (NMAT == 2) r[0] = w_gate + row * d;
        r[NMAT - 1] = w_up + row * d;
        return true;
    };
    auto epi = [&](int item, const float (&v)[NMAT][NB]) {
        if (lane != 0) return;
        const float bias = (ACT != DJV_SILU_GLU && b_up) ? to_f(b_up[expand_row(idx, item, bs)]) : 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (b >= B) break;
            float a;
            if (ACT == DJV_SILU_GLU) a = v[0][b] / (1.f + __expf(-v[0][b])) * v[NMAT - 1][b];
            else a = activate<ACT>(v[0][b] + bias);
            act[(size_t)b * Mpad + item] = from_f<T>(a);
        }
    };
    streamk_rows<T, NB, NMAT>(x, B, d, part, ctr, sk, rows, epi);
}

struct MlpPlan {
    int M, Mpad, tiles, up_items;
    StreamK up;
    size_t off_act, off_up, off_down, total;
};

MlpPlan plan_mlp(int B, int d, int K, int bs, int act, size_t esize) {
    MlpPlan p;
    p.M = K * bs;
    p.Mpad = (int)align_up((size_t)p.M, 16);
    p.tiles = p.Mpad / 16;
    const int nmat = act == DJV_SILU_GLU ? 2 : 1;
    size_t up_floats;
    if (use_rows(B)) {
        p.up_items = p.M;
        p.up = plan_rows(p.M, d);
        up_floats = rows_part_floats(p.up, p.M, rows_nb(B), nmat);
    } else {
        p.up_items = p.tiles;
        p.up = plan_tiles(p.tiles, d);
        up_floats = tiles_part_floats(p.up, p.tiles, B > 8 ? 2 : 1, nmat);
    }
    size_t o = kCounterBytes;
    p.off_act = o; o = align_up(o + (size_t)16 * p.Mpad * esize, 256);
    p.off_up = o; o = align_up(o + up_floats * 4, 256);
    p.off_down = o; o = align_up(o + down_part_floats(B, d, p.M, p.Mpad) * 4, 256);
    p.total = o;
    return p;
}

template <typename T, int NT, int ACT>
cudaError_t run_up(const MlpPlan& p, const T* x, const int32_t* idx, int bs, const T* wg, const T* wu, const T* bu,
                   T* act, float* part, unsigned* ctr, int B, int d, cudaStream_t st) {
    mlp_up_kernel<T, NT, ACT><<<streamk_ctas(p.up), kSkThreads, 0, st>>>(x, idx, bs, p.M, p.Mpad, wg, wu, bu, act,
                                                                          part, ctr, B, d, p.up);
    return cudaGetLastError();
}

template <typename T, int NB, int ACT>
cudaError_t run_rows_up(const MlpPlan& p, const T* x, const int32_t* idx, int bs, const T* wg, const T* wu,
                        const T* bu, T* act, float* part, unsigned* ctr, int B, int d, cudaStream_t st) {
    mlp_rows_up_kernel<T, NB, ACT><<<streamk_ctas(p.up), kSkThreads, 0, st>>>(x, idx, bs, p.M, p.Mpad, wg, wu, bu,
                                                                               act, part, ctr, B, d, p.up);
    return cudaGetLastError();
}

template <typename T, int ACT>
cudaError_t run_up_any(const MlpPlan& p, const T* x, const int32_t* idx, int bs, const T* wg, const T* wu,
                       const T* bu, T* act, float* part, unsigned* ctr, int B, int d, cudaStream_t st) {
    if (!use_rows(B)) return B > 8 ? run_up<T, 2, ACT>(p, x, idx, bs, wg, wu, bu, act, part, ctr, B, d, st)
                                   : run_up<T, 1, ACT>(p, x, idx, bs, wg, wu, bu, act, part, ctr, B, d, st);
    switch (rows_nb(B)) {
    case 1: return run_rows_up<T, 1, ACT>(p, x, idx, bs, wg, wu, bu, act, part, ctr, B, d, st);
    case 2: return run_rows_up<T, 2, ACT>(p, x, idx, bs, wg, wu, bu, act, part, ctr, B, d, st);
    default: return run_rows_up<T, 4, ACT>(p, x, idx, bs, wg, wu, bu, act, part, ctr, B, d, st);
    }
}

template <typename T>
int run_mlp(const void* x, const int32_t* idx, const void* w_gate, const void* w_up, const void* b_up,
            const void* w_down_t, const void* b_down, void* y, int B, int d, int K, int bs, int act, void* ws,
            cudaStream_t st) {
    const MlpPlan p = plan_mlp(B, d, K, bs, act, sizeof(T));
    char* base = static_cast<char*>(ws);
    unsigned* ctr_up = reinterpret_cast<unsigned*>(base);
    unsigned* ctr_down = ctr_up + p.up_items;
    T* a = reinterpret_cast<T*>(base + p.off_act);
    float* pu = reinterpret_cast<float*>(base + p.off_up);
    float* pd = reinterpret_cast<float*>(base + p.off_down);
    const T* xt = static_cast<const T*>(x);
    const T* wg = static_cast<const T*>(w_gate);
    const T* wu = static_cast<const T*>(w_up);
    const T* bu = static_cast<const T*>(b_up);
    cudaError_t e;
    switch (act) {
    case DJV_RELU: e = run_up_any<T, DJV_RELU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    case DJV_GELU: e = run_up_any<T, DJV_GELU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    default: e = run_up_any<T, DJV_SILU_GLU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    }
    if (e != cudaSuccess) return (int)e;
    const T* bd = act == DJV_SILU_GLU ? nullptr : static_cast<const T*>(b_down);
    e = launch_down<T>(a, p.Mpad, idx, bs, p.M, static_cast<const T*>(w_down_t), bd, static_cast<T*>(y), pd, ctr_down,
                       B, d, st);
    return (int)e;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" {

DJV_API size_t djv_sparse_mlp_workspace_size(int B, int d, int N, int K, int block_size, int activation) {
    (void)N;
    if (B < 1 || d < 8 || K < 1 || block_size < 1) return 0;
    return plan_mlp(B, d, K, block_size, activation, 2).total;
}

DJV_API int djv_sparse_mlp(const void* x, const int32_t* idx, const void* w_gate, const void* w_up, const void* b_up,
                           const void* w_down_t, const void* b_down, void* y, int B, int d, int N, int K,
                           int block_size, int activation, int dtype, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
    if (B < 1 || B > 16 || d < 8 || d % 8 || K < 1 || block_size < 1 || (long long)K * block_size > N)
        return DJV_E_SHAPE;
    if (activation < DJV_RELU || activation > DJV_SILU_GLU || (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16))
        return DJV_E_DTYPE;
    if (!x || !idx || !w_up || !w_down_t || !y || (activation == DJV_SILU_GLU && !w_gate)) return DJV_E_POINTER;
    if (!aligned16(x) || !aligned16(w_up) || !aligned16(w_down_t) || (w_gate && !aligned16(w_gate)) ||
        !aligned16(workspace))
        return DJV_E_POINTER;
    const MlpPlan p = plan_mlp(B, d, K, block_size, activation, 2);
    if (!workspace || workspace_bytes < p.total) return DJV_E_WORKSPACE;
    if (p.up_items + down_counters(d) > kMaxCounters) return DJV_E_SHAPE;
    if (dtype == DJV_FLOAT16)
        return run_mlp<__half>(x, idx, w_gate, w_up, b_up, w_down_t, b_down, y, B, d, K, block_size, activation,
                               workspace, stream);
    return run_mlp<__nv_bfloat16>(x, idx, w_gate, w_up, b_up, w_down_t, b_down, y, B, d, K, block_size, activation,
                                  workspace, stream);
}

}  // extern "C"
