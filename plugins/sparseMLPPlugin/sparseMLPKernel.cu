// DejaVuSparseMLP kernels (docs/ops.md): up projection + activation, then down projection.
//  Batch <= 4 (djv_rows.cuh, CUDA cores): mlp_rows_up_kernel, one warp per active neuron row at a time
//     (warp stream-K over 512-byte chunks), then djv::rows_down_kernel + rows_reduce_kernel.
//  Batch 5-16 (djv_device.cuh, tensor cores): mlp_up_kernel, 16 active neurons per CTA (x split of d),
//     then djv::down_kernel.
// Both write the activations a[16][Mpad] in the I/O dtype between the two steps. Every active weight byte
// is loaded once (16-byte, L1-bypassing loads); inactive rows are never touched.
//  Batch <= 4 on sm_90 (d <= 16384 at batch 1, 8192 at 2, 4096 at 3-4): mlp_bulk_kernel does up, activation and down in one pass, streaming
//     whole rows through shared memory with bulk copies (djv_bulk.cuh); the activations stay on chip.
// (A bulk-copy QKV kernel and output projection were tried for attention and measured no faster there.)
#include <stdlib.h>
#include <string.h>
#include "dejavu_kernels.h"
#include "djv_bulk.cuh"
#include "djv_rows.cuh"
#include "djv_trace.cuh"

namespace {
using namespace djv;

template <int ACT> __device__ __forceinline__ float activate(float u) {
    if (ACT == DJV_RELU) return fmaxf(u, 0.f);
    return 0.5f * u * (1.f + erff(u * 0.70710678118654752f));  // exact (erf) GELU
}

// ---------------------------------------------------------------------------------------------
// Batch <= 4 on sm_90: the whole MLP in one pass. CTA c owns active positions c, c + ctas, ... Thread 0
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

// The folded-norm extras of djv_sparse_mlp_folded (djv_stats.cuh); all null/zero for djv_sparse_mlp.
struct Fold {
    const float2* x_stats;
    int rms;
    float eps;
    float2* y_stats;
};

struct BulkPlan {
    int vpt, threads, stages, ctas, per, rem, strided, l2_normal, early;
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
    static const int per_sm_cap = env_int("DJV_MLP_PER_SM", 1, 4, 0);  // A/B runs only: fewer CTAs per SM
    if (per_sm_cap && per_sm > per_sm_cap) per_sm = per_sm_cap;
    const size_t cap = (size_t)smem_optin() < kBulkSmPerSm / per_sm ? (size_t)smem_optin() : kBulkSmPerSm / per_sm;
    // Grid slack (djv_set_mlp_grid_slack): sized for k fewer SMs, so that it fits beside the predictor's CTAs
    const int slots = per_sm * (sm_count() - mlp_grid_slack());
    const int ctas = M < slots ? M : slots;
    const size_t head = kBulkHeader + bulk_table_bytes(M / ctas + 1);
    if (cap < head + 2 * stage) return p;
    p.stages = (int)((cap - head) / stage);
    if (p.stages > kBulkMaxStages) p.stages = kBulkMaxStages;
    p.smem = head + (size_t)p.stages * stage;
    p.ctas = ctas;
    p.per = M / p.ctas;
    p.rem = M % p.ctas;
    // Round-robin positions measured 0.4% faster end to end than a contiguous run per CTA (benchmarks/RESULTS.md,
    // session 16); DJV_MLP_STRIDED=0 gives the contiguous runs, for A/B runs.
    static const int strided = env_int("DJV_MLP_STRIDED", 0, 1, 1);
    p.strided = strided;
    // DJV_MLP_L2_NORMAL=1: the rows' bulk loads at L2's default priority instead of evict-first (A/B runs: does
    // an L2-resident row make the kernel faster? benchmarks/probes/mlp_l2.py)
    static const int l2_normal = env_int("DJV_MLP_L2_NORMAL", 0, 1, 0);
    p.l2_normal = l2_normal;
    // The row table and the first stage's copies before the wait, while the kernel before runs: that reads the
    // indices early, so only where the caller promised they are ready (djv_set_indices_ready). Measured on an
    // H100 (benchmarks/RESULTS.md, session 23). DJV_MLP_EARLY=k (stages, 0 = off) overrides it, for A/B runs.
    static const int early_env = env_int("DJV_MLP_EARLY", 0, kBulkMaxStages, -1);
    const int early = early_env >= 0 ? early_env : indices_ready();
    p.early = early < p.stages ? early : p.stages;
    return p;
}

// FOLD: x is normalised here from its row statistics (djv_stats.cuh; djv_sparse_mlp_folded).
template <typename T, int NB, int ACT, int VPT, bool FOLD>
__global__ void __launch_bounds__(kBulkMaxThreads, bulk_min_ctas(NB, VPT)) mlp_bulk_kernel(
    const T* __restrict__ x, const int32_t* __restrict__ idx, int bs, const T* __restrict__ w_gate,
    const T* __restrict__ w_up, const T* __restrict__ b_up, const T* __restrict__ w_down_t, float* __restrict__ part,
    const float2* __restrict__ x_stats, int rms, float eps, int B, int d, BulkPlan p) {
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
    const uint64_t pol = l2_weight_policy(p.l2_normal != 0);
    DJV_TRACE_DECL;  // stamps (djv_trace.cuh; a -DDJV_TRACE build only): 0 start, 1 wait returned,
    DJV_TRACE_START(0);  // 2 row table ready, 3 first rows landed, 4 last neuron done, 5 partials stored
    if (!p.early) {
        pdl_wait_primary();  // launched early (launch_pdl): x comes from the kernel before
        DJV_TRACE_MARK(1);
        pdl_launch_dependents();  // the reduction may launch now; it waits for this grid's results
    }

    auto issue = [&](int j) {  // thread 0: neuron j's rows into stage j % stages
        const int s = j % p.stages;
        const size_t row = (size_t)rowtab[j];
        T* dst = ring + (size_t)s * NSEG * d;
        mbar_expect_tx(&bars[s], NSEG * seg_bytes);
        if (NMAT == 2) bulk_load(dst, w_gate + row * d, seg_bytes, &bars[s], pol);
        bulk_load(dst + (size_t)(NMAT - 1) * d, w_up + row * d, seg_bytes, &bars[s], pol);
        bulk_load(dst + (size_t)NMAT * d, w_down_t + row * d, seg_bytes, &bars[s], pol);
    };
    // positions: a contiguous run per CTA, or (p.strided) round-robin over the CTAs, so that at any time the
    // CTAs read a narrow band of the (ascending) active list
    for (int i = tid; i < n; i += blockDim.x)
        rowtab[i] = expand_row(idx, p.strided ? (int)blockIdx.x + i * p.ctas : j0 + i, bs);
    if (tid == 0) {
        for (int s = 0; s < p.stages; ++s) mbar_init(&bars[s], 1);
        fence_barrier_init();
    }
    __syncthreads();  // row table and barrier inits visible to every thread
    DJV_TRACE_MARK(2);
    if (tid == 0)
        for (int j = 0; j < n && j < p.early; ++j) issue(j);
    if (p.early) {  // the copies above read weights only; x and the partials wait here
        pdl_wait_primary();
        DJV_TRACE_MARK(1);
        pdl_launch_dependents();
    }
    if (tid == 0)
        for (int j = p.early; j < n && j < p.stages; ++j) issue(j);

    // x in registers, columns c(v) = (v * blockDim + tid) * 8; zeros past d and for batch rows >= B.
    uint4 xr[NB][VPT];
    float xf[XF ? NB : 1][XF ? VPT : 1][8];
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
        const int c = (v * blockDim.x + tid) * 8;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            xr[b][v] = (c < d && b < B) ? ld_keep(x + (size_t)b * d + c) : zero4();
            if (XF) unpack8<T>(xr[b][v], xf[XF ? b : 0][XF ? v : 0]);
        }
    }
    if (FOLD) {  // folded norm: x <- round((x - mean) * rstd), while the first copies land
        // One warp combines the statistics (all CTAs read the same bytes: one warp each keeps the L2 hot
        // spot small) and shares (mean, rstd) through shared memory past the dot-sum slots.
        float* s_norm = red + 2 * 8 * 8;
        if (wid == nw - 1) {
            for (int b = 0; b < B && b < NB; ++b) {
                float mean, rstd;
                norm_from_stats(x_stats + (size_t)b * stats_blocks(d), d, rms, eps, mean, rstd);
                if (lane == 0) { s_norm[2 * b] = mean; s_norm[2 * b + 1] = rstd; }
            }
        }
        __syncthreads();
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (b >= B) break;
            const float mean = s_norm[2 * b], rstd = s_norm[2 * b + 1];
#pragma unroll
            for (int v = 0; v < VPT; ++v) {
                if ((v * (int)blockDim.x + tid) * 8 >= d) continue;  // padding stays zero
                float f[8];
                unpack8<T>(xr[b][v], f);
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] = (f[e] - mean) * rstd;
                xr[b][v] = make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]),
                                      pack2<T>(f[6], f[7]));
                if (XF) unpack8<T>(xr[b][v], xf[XF ? b : 0][XF ? v : 0]);
            }
        }
    }
    float acc[NB][VPT][8] = {};

    for (int j = 0; j < n; ++j) {
        const int s = j % p.stages;
        const float bias = (NMAT == 1 && b_up) ? to_f(b_up[rowtab[j]]) : 0.f;
        mbar_wait(&bars[s], (unsigned)(j / p.stages) & 1u);
        if (j == 0) DJV_TRACE_MARK(3);
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
                t = warp_sum(t);
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
    DJV_TRACE_MARK(4);
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
    DJV_TRACE_END(0, n);
#endif
}

template <typename T, int NB, int ACT, int VPT>
cudaError_t run_bulk(const BulkPlan& bp, const T* x, const int32_t* idx, int bs, const T* wg, const T* wu,
                     const T* bu, const T* wd, const T* bd, const T* res, T* y, float* part, const Fold& f, int B,
                     int d, cudaStream_t st) {
    auto* k = f.x_stats ? mlp_bulk_kernel<T, NB, ACT, VPT, true> : mlp_bulk_kernel<T, NB, ACT, VPT, false>;
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bp.smem);
    if (e != cudaSuccess) return e;
    e = launch_pdl(k, dim3(bp.ctas), dim3(bp.threads), bp.smem, st, x, idx, bs, wg, wu, bu, wd, part, f.x_stats,
                   f.rms, f.eps, B, d, bp);
    if (e != cudaSuccess) return e;
    return launch_rows_reduce<T>(part, bd, res, y, B, d, bp.ctas, st, f.y_stats);
}

template <typename T, int ACT>
cudaError_t run_bulk_any(const BulkPlan& bp, const T* x, const int32_t* idx, int bs, const T* wg,
                         const T* wu, const T* bu, const T* wd, const T* bd, const T* res, T* y, float* part,
                         const Fold& f, int B, int d, cudaStream_t st) {
#define DJV_BULK_CASE(NB_, VPT_)                                                                     \
    if (rows_nb(B) == NB_ && bp.vpt == VPT_)                                                         \
        return run_bulk<T, NB_, ACT, VPT_>(bp, x, idx, bs, wg, wu, bu, wd, bd, res, y, part, f, B, d, st);
    DJV_BULK_CASE(1, 1) DJV_BULK_CASE(1, 2) DJV_BULK_CASE(1, 4) DJV_BULK_CASE(1, 8)
    DJV_BULK_CASE(2, 1) DJV_BULK_CASE(2, 2) DJV_BULK_CASE(2, 4)
    DJV_BULK_CASE(4, 1) DJV_BULK_CASE(4, 2)
#undef DJV_BULK_CASE
    return cudaErrorInvalidConfiguration;  // plan_bulk admits only the cases above
}


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
    size_t off_act, off_up, off_down, off_xn, total;  // xn: x normalised by the fallback of a folded call
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
        p.off_xn = align_up(o + (size_t)p.bulk.ctas * B * d * 4, 256);
        p.total = align_up(p.off_xn + (size_t)B * d * esize, 256);
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
    p.off_xn = o; o = align_up(o + (size_t)B * d * esize, 256);
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
    return launch_pdl(mlp_rows_up_kernel<T, NB, ACT>, dim3(streamk_ctas(p.up)), dim3(kSkThreads), 0, st, x, idx, bs,
                      p.M, p.Mpad, wg, wu, bu, act, part, ctr, B, d, p.up);
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
            const void* w_down_t, const void* b_down, const void* residual, void* y, int B, int d, int K, int bs,
            int act, const Fold& f, void* ws, cudaStream_t st) {
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
    const T* rt = static_cast<const T*>(residual);
    cudaError_t e;
    Fold g = f;
    // Only the fused kernel normalises x itself; for the others (and with DJV_FOLD_IN_MLP=0, an A/B knob)
    // one more kernel normalises x into the workspace first.
    static const bool in_kernel = !getenv("DJV_FOLD_IN_MLP") || strcmp(getenv("DJV_FOLD_IN_MLP"), "0") != 0;
    if (f.x_stats && !(p.bulk.ctas > 0 && in_kernel)) {
        T* xn = reinterpret_cast<T*>(base + p.off_xn);
        e = launch_apply_norm<T>(xt, f.x_stats, xn, B, d, f.rms, f.eps, st);
        if (e != cudaSuccess) return (int)e;
        xt = xn;
        g.x_stats = nullptr;
    }
    if (p.bulk.ctas > 0) {
        switch (act) {
        case DJV_RELU: return (int)run_bulk_any<T, DJV_RELU>(p.bulk, xt, idx, bs, wg, wu, bu, wd, bd, rt, yt, pd, g, B, d, st);
        case DJV_GELU: return (int)run_bulk_any<T, DJV_GELU>(p.bulk, xt, idx, bs, wg, wu, bu, wd, bd, rt, yt, pd, g, B, d, st);
        default: return (int)run_bulk_any<T, DJV_SILU_GLU>(p.bulk, xt, idx, bs, wg, wu, bu, wd, bd, rt, yt, pd, g, B, d, st);
        }
    }
    switch (act) {
    case DJV_RELU: e = run_up_any<T, DJV_RELU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    case DJV_GELU: e = run_up_any<T, DJV_GELU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    default: e = run_up_any<T, DJV_SILU_GLU>(p, xt, idx, bs, wg, wu, bu, a, pu, ctr_up, B, d, st); break;
    }
    if (e != cudaSuccess) return (int)e;
    e = launch_down<T>(a, p.Mpad, idx, bs, p.M, wd, bd, rt, yt, pd, ctr_down, B, d, st, g.y_stats);
    return (int)e;
}

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

DJV_API int djv_sparse_mlp_folded(const void* x, const int32_t* idx, const void* w_gate, const void* w_up,
                                  const void* b_up, const void* w_down_t, const void* b_down, const void* residual,
                                  void* y, int B, int d, int N, int K, int block_size, int activation,
                                  const float* x_stats, int norm_kind, float norm_eps, float* y_stats, int dtype,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    if (B < 1 || B > 16 || d < 8 || d % 8 || K < 1 || block_size < 1 || (long long)K * block_size > N)
        return DJV_E_SHAPE;
    if ((x_stats || y_stats) && d > kStatCols * kStatMaxBlocks) return DJV_E_SHAPE;
    if (activation < DJV_RELU || activation > DJV_SILU_GLU || (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16) ||
        (x_stats && norm_kind != DJV_LAYERNORM && norm_kind != DJV_RMSNORM))
        return DJV_E_DTYPE;
    if (!x || !idx || !w_up || !w_down_t || !y || (activation == DJV_SILU_GLU && !w_gate)) return DJV_E_POINTER;
    if (!aligned16(x) || !aligned16(w_up) || !aligned16(w_down_t) || (w_gate && !aligned16(w_gate)) ||
        (residual && !aligned16(residual)) || !aligned16(y) || !aligned16(workspace) ||
        (x_stats && !aligned16(x_stats)) || (y_stats && !aligned16(y_stats)))
        return DJV_E_POINTER;
    if (x_stats && x_stats == y_stats) return DJV_E_POINTER;
    const MlpPlan p = plan_mlp(B, d, K, block_size, activation, 2);
    if (!workspace || workspace_bytes < p.total) return DJV_E_WORKSPACE;
    if (p.up_items + down_counters(d) > kMaxCounters) return DJV_E_SHAPE;
    const Fold f{reinterpret_cast<const float2*>(x_stats), norm_kind == DJV_RMSNORM, norm_eps,
                 reinterpret_cast<float2*>(y_stats)};
    if (dtype == DJV_FLOAT16)
        return run_mlp<__half>(x, idx, w_gate, w_up, b_up, w_down_t, b_down, residual, y, B, d, K, block_size, activation,
                               f, workspace, stream);
    return run_mlp<__nv_bfloat16>(x, idx, w_gate, w_up, b_up, w_down_t, b_down, residual, y, B, d, K, block_size,
                                  activation, f, workspace, stream);
}

DJV_API int djv_sparse_mlp(const void* x, const int32_t* idx, const void* w_gate, const void* w_up, const void* b_up,
                           const void* w_down_t, const void* b_down, const void* residual, void* y, int B, int d,
                           int N, int K,
                           int block_size, int activation, int dtype, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
    return djv_sparse_mlp_folded(x, idx, w_gate, w_up, b_up, w_down_t, b_down, residual, y, B, d, N, K, block_size,
                                 activation, nullptr, DJV_LAYERNORM, 0.f, nullptr, dtype, workspace, workspace_bytes,
                                 stream);
}

#ifdef DJV_TRACE
DJV_TRACE_ACCESSORS(mlp)  // the timeline probe's accessors (djv_trace.cuh)
#endif

}  // extern "C"
