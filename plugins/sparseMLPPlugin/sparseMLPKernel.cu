// DejaVuSparseMLP kernels (docs/ops.md): up projection + activation, then down projection.
//  Batch <= 4 (djv_rows.cuh, CUDA cores): mlp_rows_up_kernel, one warp per active neuron row at a time
//     (warp stream-K over 512-byte chunks), then djv::rows_down_kernel + rows_reduce_kernel.
//  Batch 5-16 (djv_device.cuh, tensor cores): mlp_up_kernel, 16 active neurons per CTA (x split of d),
//     then djv::down_kernel.
// Both write the activations a[16][Mpad] in the I/O dtype between the two steps. Every active weight byte
// is loaded once (16-byte, L1-bypassing loads); inactive rows are never touched.
//  Batch <= 4 on sm_90 (d <= 16384 at batch 1, 8192 at 2, 4096 at 3-4): mlp_bulk_kernel does up, activation and down in one pass, streaming
//     whole rows through shared memory with bulk copies (djv_bulk.cuh); the activations stay on chip.
#include "dejavu_kernels.h"
#include "djv_bulk_rows.cuh"

namespace {
using namespace djv;


constexpr int kUpThreads = 256;

template <typename T, int NT, int ACT>
__global__ void __launch_bounds__(kUpThreads) mlp_up_kernel(const T* __restrict__ x, const int32_t* __restrict__ idx,
                                                            int bs, int M, int Mpad, const T* __restrict__ w_gate,
                                                            const T* __restrict__ w_up, const T* __restrict__ b_up,
                                                            T* __restrict__ act, float* __restrict__ part,
                                                            unsigned* __restrict__ ctr, int B, int d, int ksplit) {
    constexpr int NMAT = ACT == DJV_SILU_GLU ? 2 : 1;
    constexpr int NW = kUpThreads / 32;
    __shared__ float red[NW * NMAT * 256];
    const int lane = threadIdx.x & 31, g = lane >> 2, wid = threadIdx.x >> 5;
    const int tile = blockIdx.x, ks = blockIdx.y;
    const int m0 = tile * 16 + g, m1 = m0 + 8;
    const size_t row0 = (size_t)expand_row(idx, m0 < M ? m0 : M - 1, bs);
    const size_t row1 = (size_t)expand_row(idx, m1 < M ? m1 : M - 1, bs);
    const T* mats[NMAT];
    if (NMAT == 2) { mats[0] = w_gate; mats[NMAT - 1] = w_up; } else { mats[0] = w_up; }
    const T* r0[NMAT];
    const T* r1[NMAT];
#pragma unroll
    for (int m = 0; m < NMAT; ++m) { r0[m] = mats[m] + row0 * d; r1[m] = mats[m] + row1 * d; }

    const int chunk = ksplit_chunk(d, ksplit);
    const int kb = ks * chunk, ke = min(d, kb + chunk);
    float acc[NMAT][NT][4] = {};
    tile_dot<T, NT, NMAT, 4>(r0, r1, x, B, d, kb, ke, wid, NW, acc);
    cta_reduce_tile<NT, NMAT>(acc, red, NW);  // red[m*256 + row*16 + batch]

    if (ksplit > 1) {
        float* my = part + ((size_t)tile * ksplit + ks) * NMAT * 256;
        for (int i = threadIdx.x; i < NMAT * 256; i += blockDim.x) my[i] = red[i];
        if (!last_arrival(ctr + tile, (unsigned)ksplit)) return;
        for (int i = threadIdx.x; i < NMAT * 256; i += blockDim.x) {
            float s = 0.f;
            for (int k = 0; k < ksplit; ++k) s += __ldcg(part + ((size_t)tile * ksplit + k) * NMAT * 256 + i);
            red[i] = s;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        const int row = i >> 4, b = i & 15, m = tile * 16 + row;
        float v = 0.f;  // padded neurons and batch rows: exactly zero so they contribute nothing
        if (m < M && b < B) {
            if (ACT == DJV_SILU_GLU) {
                const float gt = red[i], up = red[256 + i];
                v = gt / (1.f + __expf(-gt)) * up;
            } else {
                const float bias = b_up ? to_f(b_up[expand_row(idx, m, bs)]) : 0.f;
                v = activate<ACT>(red[i] + bias);
            }
        }
        act[(size_t)b * Mpad + m] = from_f<T>(v);
    }
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
    int M, Mpad, tiles, up_items, ksplit;
    BulkPlan bulk;  // fused batch <= 4 kernel on sm_90, when bulk.ctas > 0
    StreamK up;  // batch <= 4
    size_t off_act, off_up, off_down, total;
};

MlpPlan plan_mlp(int B, int d, int K, int bs, int act, size_t esize) {
    MlpPlan p{};
    p.ksplit = 1;
    p.M = K * bs;
    p.Mpad = (int)align_up((size_t)p.M, 16);
    p.tiles = p.Mpad / 16;
    const int nmat = act == DJV_SILU_GLU ? 2 : 1;
    p.bulk = plan_bulk(B, d, p.M, nmat + 1);
    size_t up_floats;
    if (p.bulk.ctas > 0) {
        p.up_items = 0;
        size_t o = kCounterBytes;
        p.off_act = p.off_up = p.off_down = o;
        p.total = align_up(o + (size_t)p.bulk.ctas * B * d * 4, 256);
        return p;
    }
    if (use_rows(B)) {
        p.up_items = p.M;
        p.up = plan_rows(p.M, d);
        up_floats = rows_part_floats(p.up, p.M, rows_nb(B), nmat);
    } else {
        p.up_items = p.tiles;
        p.ksplit = tile_ksplit(p.tiles, d);
        up_floats = p.ksplit > 1 ? (size_t)p.tiles * p.ksplit * nmat * 256 : 0;
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
    dim3 grid(p.tiles, p.ksplit);
    mlp_up_kernel<T, NT, ACT><<<grid, kUpThreads, 0, st>>>(x, idx, bs, p.M, p.Mpad, wg, wu, bu, act, part, ctr, B, d,
                                                            p.ksplit);
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
    const T* bd = act == DJV_SILU_GLU ? nullptr : static_cast<const T*>(b_down);
    const T* wd = static_cast<const T*>(w_down_t);
    T* yt = static_cast<T*>(y);
    if (p.bulk.ctas > 0) {
        switch (act) {
        case DJV_RELU: return (int)run_bulk_any<T, DJV_RELU>(p.bulk, xt, d, idx, bs, wg, wu, bu, wd, bd, yt, pd, B, d, st);
        case DJV_GELU: return (int)run_bulk_any<T, DJV_GELU>(p.bulk, xt, d, idx, bs, wg, wu, bu, wd, bd, yt, pd, B, d, st);
        default: return (int)run_bulk_any<T, DJV_SILU_GLU>(p.bulk, xt, d, idx, bs, wg, wu, bu, wd, bd, yt, pd, B, d, st);
        }
    }
    cudaError_t e;
    switch (act) {
    case DJV_RELU: e = run_up_any<T, DJV_RELU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    case DJV_GELU: e = run_up_any<T, DJV_GELU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    default: e = run_up_any<T, DJV_SILU_GLU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    }
    if (e != cudaSuccess) return (int)e;
    e = launch_down<T>(a, p.Mpad, idx, bs, p.M, wd, bd, yt, pd, ctr_down, B, d, st);
    return (int)e;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" {

DJV_API size_t djv_sparse_mlp_workspace_size(int B, int d, int N, int K, int block_size, int activation) {
    (void)N;
    if (B < 1 || d < 8 || K < 1 || block_size < 1) return 0;
    // Batch <= 4 and batch > 4 use different kernels and scratch, so the need is not monotonic in B: take the
    // largest over 1..B, so that a workspace sized for a maximum batch (TensorRT) serves every smaller one.
    size_t need = 0;
    for (int b = 1; b <= B && b <= 16; ++b) {
        const size_t t = plan_mlp(b, d, K, block_size, activation, 2).total;
        need = t > need ? t : need;
    }
    return need;
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
