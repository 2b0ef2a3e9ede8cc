// DejaVuLookaheadPredictor kernels (docs/ops.md): three launches, MLP and head parts side by side
// (blockIdx.z / blockIdx.x picks the part).
//  1. gemv1: u = h @ a over a split of d (column pairs per lane, warps over rows); the last CTA of each
//     column block sums the splits in order and applies the RMS normalisation (it also has every split's
//     sum of squares, since each CTA reduces the h slice it read).
//  2. gemv2: s[n] = max_b (u[b] @ bm)[n]  (fp32 scores).
//  3. topk: one CTA per part. Radix select of the K-th largest on order-preserving float keys (4 x 8-bit
//     passes), then a compaction in index order, so indices come out ascending and ties at the threshold
//     go to the lowest indices (the ONNX TopK rule). No host sync, no sort.
#include <math.h>
#include "dejavu_kernels.h"
#include "djv_device.cuh"

namespace {
using namespace djv;

constexpr int kThreads = 256;
constexpr int kTopkThreads = 1024;
constexpr int kMaxB = 16;

template <typename T> __device__ __forceinline__ void load_pair(const T* p, float& a, float& b) {
    const uint32_t w = __ldg(reinterpret_cast<const unsigned int*>(p));
    a = pair_f<T>(w, 0);
    b = pair_f<T>(w, 1);
}

struct Part {  // one predictor head (MLP or attention)
    const void* a; const void* bm; int r; int n; int k; int32_t* out;
};

// grid (ceil(rmax/64), KS, 2). CTA: 64 columns (32 lanes x 2), 8 warps stride the split's rows.
template <typename T>
__global__ void __launch_bounds__(kThreads) gemv1_kernel(const T* __restrict__ h, Part p0, Part p1, int B, int d, int KS,
                                                         float* __restrict__ part, float* __restrict__ ssq_part,
                                                         float* __restrict__ u, unsigned* __restrict__ ctr, float eps,
                                                         int rmax) {
    const Part P = blockIdx.z == 0 ? p0 : p1;
    if (P.a == nullptr || (int)blockIdx.x * 64 >= P.r) return;
    __shared__ float red[kThreads / 32][kMaxB][64];
    __shared__ float s_ssq[kMaxB];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int chunk = cdiv(d, KS);
    const int kb = blockIdx.y * chunk, ke = min(d, kb + chunk);
    const int col = blockIdx.x * 64 + 2 * lane;
    const bool cok = col < P.r;
    const T* A = static_cast<const T*>(P.a);
    float acc[kMaxB][2];
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) acc[b][0] = acc[b][1] = 0.f;
#pragma unroll 4
    for (int k = kb + wid; k < ke; k += kThreads / 32) {
        float w0 = 0.f, w1 = 0.f;
        if (cok) load_pair(A + (size_t)k * P.r + col, w0, w1);
#pragma unroll
        for (int b = 0; b < kMaxB; ++b) {
            if (b >= B) break;
            const float hv = to_f(h[(size_t)b * d + k]);
            acc[b][0] = fmaf(hv, w0, acc[b][0]);
            acc[b][1] = fmaf(hv, w1, acc[b][1]);
        }
    }
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) {
        if (b >= B) break;
        red[wid][b][2 * lane] = acc[b][0];
        red[wid][b][2 * lane + 1] = acc[b][1];
    }
    if (threadIdx.x < kMaxB) s_ssq[threadIdx.x] = 0.f;
    __syncthreads();
    // this split's sum of squares of h (every column block computes it; cheap, avoids another launch)
    for (int b = wid; b < B; b += kThreads / 32) {
        float s = 0.f;
        for (int k = kb + lane; k < ke; k += 32) { const float v = to_f(h[(size_t)b * d + k]); s = fmaf(v, v, s); }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) s_ssq[b] = s;
    }
    const size_t cb = (size_t)blockIdx.z * gridDim.x + blockIdx.x;  // column block id
    float* my = part + (cb * KS + blockIdx.y) * kMaxB * 64;
    for (int i = threadIdx.x; i < B * 64; i += kThreads) {
        const int b = i >> 6, c = i & 63;
        float s = 0.f;
        for (int w = 0; w < kThreads / 32; ++w) s += red[w][b][c];
        my[i] = s;
    }
    __syncthreads();
    if (threadIdx.x < B) ssq_part[(cb * KS + blockIdx.y) * kMaxB + threadIdx.x] = s_ssq[threadIdx.x];
    if (!last_arrival(ctr + cb, (unsigned)KS)) return;
    if (threadIdx.x < B) {
        float s = 0.f;
        for (int k = 0; k < KS; ++k) s += __ldcg(ssq_part + (cb * KS + k) * kMaxB + threadIdx.x);
        s_ssq[threadIdx.x] = rsqrtf(s / d + eps);
    }
    __syncthreads();
    float* ub = u + (size_t)blockIdx.z * kMaxB * rmax;
    for (int i = threadIdx.x; i < B * 64; i += kThreads) {
        const int b = i >> 6, c = blockIdx.x * 64 + (i & 63);
        if (c >= P.r) continue;
        float s = 0.f;
        for (int k = 0; k < KS; ++k) s += __ldcg(part + (cb * KS + k) * kMaxB * 64 + i);
        ub[(size_t)b * rmax + c] = s * s_ssq[b];
    }
}

// grid (ceil(nmax/64), 1, 2). CTA: 64 output units, 8 warps stride the r rows, reduce in smem, max over b.
template <typename T>
__global__ void __launch_bounds__(kThreads) gemv2_kernel(const float* __restrict__ u, Part p0, Part p1, int B, int rmax,
                                                         float* __restrict__ scores, int nmax) {
    const Part P = blockIdx.z == 0 ? p0 : p1;
    if (P.a == nullptr || (int)blockIdx.x * 64 >= P.n) return;
    __shared__ float red[kThreads / 32][kMaxB][64];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int col = blockIdx.x * 64 + 2 * lane;
    const bool cok = col < P.n;
    const T* Bm = static_cast<const T*>(P.bm);
    const float* ub = u + (size_t)blockIdx.z * kMaxB * rmax;
    float acc[kMaxB][2];
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) acc[b][0] = acc[b][1] = 0.f;
#pragma unroll 4
    for (int i = wid; i < P.r; i += kThreads / 32) {
        float w0 = 0.f, w1 = 0.f;
        if (cok) load_pair(Bm + (size_t)i * P.n + col, w0, w1);
#pragma unroll
        for (int b = 0; b < kMaxB; ++b) {
            if (b >= B) break;
            const float uv = __ldcg(ub + (size_t)b * rmax + i);
            acc[b][0] = fmaf(uv, w0, acc[b][0]);
            acc[b][1] = fmaf(uv, w1, acc[b][1]);
        }
    }
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) {
        if (b >= B) break;
        red[wid][b][2 * lane] = acc[b][0];
        red[wid][b][2 * lane + 1] = acc[b][1];
    }
    __syncthreads();
    if (threadIdx.x < 64) {
        const int c = blockIdx.x * 64 + threadIdx.x;
        if (c < P.n) {
            float mx = -INFINITY;
            for (int b = 0; b < B; ++b) {
                float s = 0.f;
                for (int w = 0; w < kThreads / 32; ++w) s += red[w][b][threadIdx.x];
                mx = fmaxf(mx, s);
            }
            scores[(size_t)blockIdx.z * nmax + c] = mx;
        }
    }
}

__device__ __forceinline__ uint32_t order_key(float f) {  // larger float -> larger key
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block-wide exclusive prefix of a per-thread 0/1 flag; returns the prefix, total in *total.
__device__ __forceinline__ int block_scan_flag(bool f, int* warp_sums, int* total) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const unsigned bal = __ballot_sync(0xffffffffu, f);
    if (lane == 0) warp_sums[wid] = __popc(bal);
    __syncthreads();
    int before = 0, tot = 0;
    for (int w = 0; w < nw; ++w) { const int v = warp_sums[w]; before += w < wid ? v : 0; tot += v; }
    __syncthreads();
    *total = tot;
    return before + __popc(bal & ((1u << lane) - 1u));
}

__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const float* __restrict__ scores, Part p0, Part p1,
                                                             int nmax, float* __restrict__ scores_out) {
    const Part P = blockIdx.x == 0 ? p0 : p1;
    if (P.a == nullptr) return;
    const float* s = scores + (size_t)blockIdx.x * nmax;
    const int n = P.n, K = P.k;
    __shared__ unsigned hist[256];
    __shared__ unsigned s_sel[2];
    __shared__ int warp_sums[kTopkThreads / 32];
    if (blockIdx.x == 0 && scores_out)
        for (int i = threadIdx.x; i < n; i += blockDim.x) scores_out[i] = s[i];
    uint32_t prefix = 0, mask = 0;
    unsigned remaining = (unsigned)K;  // how many of the selected set lie at or below the current prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const uint32_t key = order_key(__ldcg(s + i));
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // find the digit holding the remaining-th largest, scanning from the top
            const int lane = threadIdx.x;
            unsigned above = 0;  // count in digits above this lane's 8-digit window
            unsigned cnt[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) { cnt[j] = hist[255 - (lane * 8 + j)]; tot += cnt[j]; }
            unsigned incl = tot;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            above = incl - tot;
            if (above < remaining && incl >= remaining) {
                unsigned run = above;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (run + cnt[j] >= remaining) {
                        s_sel[0] = 255u - (unsigned)(lane * 8 + j);
                        s_sel[1] = remaining - run;
                        break;
                    }
                    run += cnt[j];
                }
            }
        }
        __syncthreads();
        prefix |= s_sel[0] << shift;
        mask |= 255u << shift;
        remaining = s_sel[1];
        __syncthreads();
    }
    // prefix = key of the K-th largest; take every key > prefix and the first `remaining` keys == prefix.
    int out_base = 0, eq_base = 0;
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const uint32_t key = i < n ? order_key(__ldcg(s + i)) : 0u;
        const bool eq = i < n && key == prefix;
        int eq_tot;
        const int eq_rank = block_scan_flag(eq, warp_sums, &eq_tot);
        const bool take = i < n && (key > prefix || (eq && (unsigned)(eq_base + eq_rank) < remaining));
        int take_tot;
        const int rank = block_scan_flag(take, warp_sums, &take_tot);
        if (take) P.out[out_base + rank] = i;
        out_base += take_tot;
        eq_base += eq_tot;
    }
}

struct PredPlan {
    int rmax, nmax, cb1, KS;
    size_t off_part, off_ssq, off_u, off_scores, total;
};

PredPlan plan_pred(int B, int d, int r_m, int Nb, int r_h, int H) {
    (void)B;
    PredPlan p;
    p.rmax = r_m > r_h ? r_m : r_h;
    p.nmax = Nb > H ? Nb : H;
    p.cb1 = cdiv(p.rmax, 64);
    int ks = cdiv(kTargetCtas, 2 * p.cb1);
    const int cap = cdiv(d, 64);
    p.KS = ks < 1 ? 1 : (ks > cap ? cap : ks);
    size_t o = kCounterBytes;
    p.off_part = o; o = align_up(o + (size_t)2 * p.cb1 * p.KS * kMaxB * 64 * 4, 256);
    p.off_ssq = o; o = align_up(o + (size_t)2 * p.cb1 * p.KS * kMaxB * 4, 256);
    p.off_u = o; o = align_up(o + (size_t)2 * kMaxB * p.rmax * 4, 256);
    p.off_scores = o; o = align_up(o + (size_t)2 * p.nmax * 4, 256);
    p.total = o;
    return p;
}

template <typename T>
int run_pred(const void* h, Part p0, Part p1, float* scores_out, int B, int d, float eps, const PredPlan& p, void* ws,
             cudaStream_t st) {
    char* base = static_cast<char*>(ws);
    unsigned* ctr = reinterpret_cast<unsigned*>(base);
    float* part = reinterpret_cast<float*>(base + p.off_part);
    float* ssq = reinterpret_cast<float*>(base + p.off_ssq);
    float* u = reinterpret_cast<float*>(base + p.off_u);
    float* sc = reinterpret_cast<float*>(base + p.off_scores);
    gemv1_kernel<T><<<dim3(p.cb1, p.KS, 2), kThreads, 0, st>>>(static_cast<const T*>(h), p0, p1, B, d, p.KS, part, ssq,
                                                                u, ctr, eps, p.rmax);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    gemv2_kernel<T><<<dim3(cdiv(p.nmax, 64), 1, 2), kThreads, 0, st>>>(u, p0, p1, B, p.rmax, sc, p.nmax);
    if ((e = cudaGetLastError()) != cudaSuccess) return (int)e;
    topk_kernel<<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax, scores_out);
    return (int)cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" {

DJV_API size_t djv_predictor_workspace_size(int B, int d, int r_m, int Nb, int r_h, int H) {
    if (B < 1 || d < 1 || r_m < 1 || Nb < 1) return 0;
    return plan_pred(B, d, r_m, Nb, r_h > 0 ? r_h : 0, H > 0 ? H : 0).total;
}

DJV_API int djv_lookahead_predictor(const void* h, const void* mlp_a, const void* mlp_b, const void* head_a,
                                    const void* head_b, int32_t* mlp_idx, int32_t* head_idx, float* mlp_scores,
                                    int B, int d, int r_m, int Nb, int K, int r_h, int H, int Kh, float eps,
                                    int dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    const bool heads = head_a != nullptr;
    if (B < 1 || B > kMaxB || d < 1 || r_m < 2 || r_m % 2 || r_m > 2048 || Nb < 2 || Nb % 2 || Nb > 65536 || K < 1 ||
        K > Nb)
        return DJV_E_SHAPE;
    if (heads && (r_h < 2 || r_h % 2 || r_h > 2048 || H < 2 || H % 2 || H > 65536 || Kh < 1 || Kh > H))
        return DJV_E_SHAPE;
    if (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16) return DJV_E_DTYPE;
    if (!h || !mlp_a || !mlp_b || !mlp_idx || (heads && (!head_b || !head_idx))) return DJV_E_POINTER;
    if (!aligned16(workspace)) return DJV_E_POINTER;
    const PredPlan p = plan_pred(B, d, r_m, Nb, heads ? r_h : 0, heads ? H : 0);
    if (!workspace || workspace_bytes < p.total) return DJV_E_WORKSPACE;
    if (2 * p.cb1 > kMaxCounters) return DJV_E_SHAPE;
    Part p0{mlp_a, mlp_b, r_m, Nb, K, mlp_idx};
    Part p1{heads ? head_a : nullptr, head_b, heads ? r_h : 0, heads ? H : 0, Kh, head_idx};
    if (dtype == DJV_FLOAT16) return run_pred<__half>(h, p0, p1, mlp_scores, B, d, eps, p, workspace, stream);
    return run_pred<__nv_bfloat16>(h, p0, p1, mlp_scores, B, d, eps, p, workspace, stream);
}

}  // extern "C"
