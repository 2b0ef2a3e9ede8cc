// djv_bulk_rows.cuh - the sm_90 fused sparse MLP for batch <= 4: whole neuron rows streamed through shared
// memory with bulk copies (djv_bulk.cuh), up + activation + down in one pass.
// (A bulk-copy QKV kernel and a down-only mode for the attention output projection were tried in session 3
// and measured no faster than the djv_rows.cuh kernels at 31 MB / 10 MB, and slower at batch 4: removed.)
#pragma once
#include "dejavu_kernels.h"
#include "djv_bulk.cuh"
#include "djv_rows.cuh"

namespace djv {

template <int ACT> __device__ __forceinline__ float activate(float u) {
    if (ACT == DJV_RELU) return fmaxf(u, 0.f);
    return 0.5f * u * (1.f + erff(u * 0.70710678118654752f));  // exact (erf) GELU
}

// ---------------------------------------------------------------------------------------------
// Batch <= 4 on sm_90: the whole MLP in one pass. CTA c owns a contiguous run of active neurons. Thread 0
// streams each neuron's rows - gate (SwiGLU), up, down^T: NSEG contiguous runs of d values - into a ring of
// shared-memory stages with bulk copies; then every thread
//   (1) dots its 8*VPT columns of the up row(s) with x (held in registers), the CTA sums the dot,
//   (2) applies bias + activation (fp32, never rounded to the I/O dtype),
//   (3) adds a * (its columns of the down row) to its fp32 partial of y.
// One __syncthreads per neuron: after it, every thread is done with the previous neuron's stage, so thread 0
// refills that stage. Partials part[c][b][:] are summed in CTA order by rows_reduce_kernel (deterministic).
constexpr int kBulkMaxThreads = 256;  // few warps: the per-neuron CTA reduction stays short
constexpr int kBulkMaxStages = 8;
constexpr size_t kBulkHeader = 2048;  // mbarriers [0, 128), cross-warp dot sums [128, 2048)
constexpr size_t kBulkSmPerSm = 200 * 1024;

struct BulkPlan {
    int vpt, threads, stages, ctas, per, rem;
    size_t smem;
};

// Registers: <= 128 per thread (two CTAs of 256 per SM) while NB * VPT <= 4; the 64 fp32 partials of
// NB * VPT = 8 need more (ptxas spilled at 128), so those run one CTA of 256 per SM.
__host__ __device__ constexpr int bulk_min_ctas(int nb, int vpt) { return nb * vpt > 4 ? 1 : 2; }

// The CTA's matrix rows, looked up once in parallel (int32 each): issuing a copy right after its own index
// load would put one L2 round trip per stage on the pipeline's ramp.
__host__ __device__ inline size_t bulk_table_bytes(int rows) { return align_up((size_t)rows * 4, 128); }

// Column vectors (8 values) per thread: the smallest power of two that covers d with <= 256 threads.
inline int bulk_vpt(int d) {
    for (int v = 1; v <= 8; v *= 2)
        if (d / 8 <= kBulkMaxThreads * v) return v;
    return 0;
}

// Valid (ctas > 0) when the fused kernel applies: sm_90, batch <= 4, NB * VPT <= 8 (fp32 partials of y in
// registers), and at least two stages fit. Needs the device (SM count, shared-memory limit).
inline BulkPlan plan_bulk(int B, int d, int M, int nseg) {
    BulkPlan p{};
    p.vpt = bulk_vpt(d);
    if (!use_rows(B) || p.vpt == 0 || rows_nb(B) * p.vpt > 8 || !bulk_copy_supported()) return p;
    p.threads = (int)align_up((size_t)cdiv(d / 8, p.vpt), 32);
    const size_t stage = (size_t)nseg * d * 2;
    // As many CTAs per SM (<= 4) as keep 3 stages each and fit the registers (<= 128 per thread): CTAs on
    // one SM overlap each other's per-neuron barrier.
    int per_sm = (int)(kBulkSmPerSm / (kBulkHeader + 3 * stage));
    const int by_regs = 65536 / (p.threads * (bulk_min_ctas(rows_nb(B), p.vpt) == 2 ? 128 : 255));
    per_sm = per_sm < by_regs ? per_sm : by_regs;
    per_sm = per_sm < 1 ? 1 : (per_sm > 4 ? 4 : per_sm);
    const size_t cap = (size_t)smem_optin() < kBulkSmPerSm / per_sm ? (size_t)smem_optin() : kBulkSmPerSm / per_sm;
    const int ctas = M < per_sm * sm_count() ? M : per_sm * sm_count();
    const size_t head = kBulkHeader + bulk_table_bytes(M / ctas + 1);
    if (cap < head + 2 * stage) return p;
    p.stages = (int)((cap - head) / stage);
    if (p.stages > kBulkMaxStages) p.stages = kBulkMaxStages;
    p.smem = head + (size_t)p.stages * stage;
    p.ctas = ctas;
    p.per = M / p.ctas;
    p.rem = M % p.ctas;
    return p;
}

template <typename T, int NB, int ACT, int VPT>
__global__ void __launch_bounds__(kBulkMaxThreads, bulk_min_ctas(NB, VPT)) mlp_bulk_kernel(
    const T* __restrict__ x, int x_stride, const int32_t* __restrict__ idx, int bs, const T* __restrict__ w_gate,
    const T* __restrict__ w_up, const T* __restrict__ b_up, const T* __restrict__ w_down_t, float* __restrict__ part,
    int B, int d, BulkPlan p) {
#ifdef DJV_BULK
    constexpr int NMAT = ACT == DJV_SILU_GLU ? 2 : 1;  // up-side rows per neuron
    constexpr int NSEG = NMAT + 1;
    constexpr int NV = NMAT * NB;  // dot sums per neuron
    constexpr bool XF = NB * VPT <= 4;  // x unpacked to fp32 registers once; else unpacked per neuron
    extern __shared__ __align__(128) unsigned char smem[];
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
    float* red = reinterpret_cast<float*>(smem + 128);  // [2][8 warps][NV]
    int* rowtab = reinterpret_cast<int*>(smem + kBulkHeader);  // [p.per + 1]
    T* ring = reinterpret_cast<T*>(smem + kBulkHeader + bulk_table_bytes(p.per + 1));
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    const int j0 = blockIdx.x * p.per + min((int)blockIdx.x, p.rem);
    const int n = p.per + ((int)blockIdx.x < p.rem ? 1 : 0);
    const unsigned seg_bytes = (unsigned)d * sizeof(T);
    const uint64_t pol = l2_evict_first_policy();
    pdl_launch_dependents();  // the reduction may launch now; it waits for this grid's results

    auto issue = [&](int j) {  // thread 0: neuron j's rows into stage j % stages
        const int s = j % p.stages;
        const size_t row = (size_t)rowtab[j];
        T* dst = ring + (size_t)s * NSEG * d;
        mbar_expect_tx(&bars[s], NSEG * seg_bytes);
        if (NMAT == 2) bulk_load(dst, w_gate + row * d, seg_bytes, &bars[s], pol);
        bulk_load(dst + (size_t)(NMAT - 1) * d, w_up + row * d, seg_bytes, &bars[s], pol);
        bulk_load(dst + (size_t)NMAT * d, w_down_t + row * d, seg_bytes, &bars[s], pol);
    };
    for (int i = tid; i < n; i += blockDim.x) rowtab[i] = expand_row(idx, j0 + i, bs);
    if (tid == 0) {
        for (int s = 0; s < p.stages; ++s) mbar_init(&bars[s], 1);
        fence_barrier_init();
    }
    __syncthreads();  // row table and barrier inits visible to every thread
    if (tid == 0)
        for (int j = 0; j < n && j < p.stages; ++j) issue(j);

    // x in registers, columns c(v) = (v * blockDim + tid) * 8; zeros past d and for batch rows >= B.
    uint4 xr[NB][VPT];
    float xf[XF ? NB : 1][XF ? VPT : 1][8];
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
        const int c = (v * blockDim.x + tid) * 8;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            xr[b][v] = (c < d && b < B) ? ld_keep(x + (size_t)b * x_stride + c) : zero4();
            if (XF) unpack8<T>(xr[b][v], xf[XF ? b : 0][XF ? v : 0]);
        }
    }
    float acc[NB][VPT][8] = {};

    for (int j = 0; j < n; ++j) {
        const int s = j % p.stages;
        const float bias = (NMAT == 1 && b_up) ? to_f(b_up[rowtab[j]]) : 0.f;
        mbar_wait(&bars[s], (unsigned)(j / p.stages) & 1u);
        const T* st = ring + (size_t)s * NSEG * d;
        float dot[NMAT][NB] = {};
#pragma unroll
        for (int v = 0; v < VPT; ++v) {
            const int c = (v * blockDim.x + tid) * 8;
            if (c >= d) continue;
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
                float wf[8];
                unpack8<T>(*reinterpret_cast<const uint4*>(st + (size_t)m * d + c), wf);
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    float xt[8];
                    if (!XF) unpack8<T>(xr[b][v], xt);
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        dot[m][b] = fmaf(wf[e], XF ? xf[XF ? b : 0][XF ? v : 0][e] : xt[e], dot[m][b]);
                }
            }
        }
        // Warp sums (xor butterfly: every lane ends with the same bits), then one slot per warp.
        float* rb = red + (j & 1) * 8 * NV;  // double-buffered: neuron j+1 may write before all read j
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                float t = dot[m][b];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
                if (lane == 0) rb[wid * NV + m * NB + b] = t;
            }
        __syncthreads();
        // Every thread is past neuron j-1's down row: its stage is free.
        if (tid == 0 && j >= 1 && j - 1 + p.stages < n) {
            fence_proxy_async();
            issue(j - 1 + p.stages);
        }
        // CTA sums: each 8-lane group butterflies the <= 8 warp slots, so all threads get identical values.
        float a[NB];
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int w = lane & 7;
            float g = w < nw ? rb[w * NV + b] : 0.f;
            float u = (NMAT == 2 && w < nw) ? rb[w * NV + NB + b] : 0.f;
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) {
                g += __shfl_xor_sync(0xffffffffu, g, o);
                if (NMAT == 2) u += __shfl_xor_sync(0xffffffffu, u, o);
            }
            if (ACT == DJV_SILU_GLU) a[b] = g / (1.f + __expf(-g)) * u;
            else a[b] = activate<ACT>(g + bias);
        }
#pragma unroll
        for (int v = 0; v < VPT; ++v) {
            const int c = (v * blockDim.x + tid) * 8;
            if (c >= d) continue;
            float wf[8];
            unpack8<T>(*reinterpret_cast<const uint4*>(st + (size_t)NMAT * d + c), wf);
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[b][v][e] = fmaf(a[b], wf[e], acc[b][v][e]);
        }
    }
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
        const int c = (v * blockDim.x + tid) * 8;
        if (c >= d) continue;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (b >= B) break;
            float4* dst = reinterpret_cast<float4*>(part + ((size_t)blockIdx.x * B + b) * d + c);
            dst[0] = make_float4(acc[b][v][0], acc[b][v][1], acc[b][v][2], acc[b][v][3]);
            dst[1] = make_float4(acc[b][v][4], acc[b][v][5], acc[b][v][6], acc[b][v][7]);
        }
    }
#endif
}

template <typename T, int NB, int ACT, int VPT>
cudaError_t run_bulk(const BulkPlan& bp, const T* x, int xs, const int32_t* idx, int bs, const T* wg, const T* wu,
                     const T* bu, const T* wd, const T* bd, T* y, float* part, int B, int d, cudaStream_t st) {
    auto* k = mlp_bulk_kernel<T, NB, ACT, VPT>;
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bp.smem);
    if (e != cudaSuccess) return e;
    k<<<bp.ctas, bp.threads, bp.smem, st>>>(x, xs, idx, bs, wg, wu, bu, wd, part, B, d, bp);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    return launch_rows_reduce<T>(part, bd, y, B, d, bp.ctas, st);
}

// x_stride: the row stride of x (d for a packed [B][d]).
template <typename T, int ACT>
cudaError_t run_bulk_any(const BulkPlan& bp, const T* x, int xs, const int32_t* idx, int bs, const T* wg,
                         const T* wu, const T* bu, const T* wd, const T* bd, T* y, float* part, int B, int d,
                         cudaStream_t st) {
#define DJV_BULK_CASE(NB_, VPT_)                                                                     \
    if (rows_nb(B) == NB_ && bp.vpt == VPT_)                                                         \
        return run_bulk<T, NB_, ACT, VPT_>(bp, x, xs, idx, bs, wg, wu, bu, wd, bd, y, part, B, d, st);
    DJV_BULK_CASE(1, 1) DJV_BULK_CASE(1, 2) DJV_BULK_CASE(1, 4) DJV_BULK_CASE(1, 8)
    DJV_BULK_CASE(2, 1) DJV_BULK_CASE(2, 2) DJV_BULK_CASE(2, 4)
    DJV_BULK_CASE(4, 1) DJV_BULK_CASE(4, 2)
#undef DJV_BULK_CASE
    return cudaErrorInvalidConfiguration;  // plan_bulk admits only the cases above
}

}  // namespace djv
