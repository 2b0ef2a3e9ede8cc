// DejaVuLookaheadPredictor kernels (docs/ops.md): three launches, MLP and head parts side by side
// (blockIdx.z / blockIdx.x picks the part).
//  1. u_kernel: t = h @ a. Grid (32-column groups) x (KS splits of d) x part; each CTA stages its slice of
//     h in shared memory as fp32, streams its rows of a with 16-byte loads, reduces its warps, and the
//     last CTA of each column group sums the KS partials in a fixed order (8 independent chains, so the
//     L2 loads overlap) and applies the RMS normalisation (each CTA also reduced sum(h^2) over its slice).
//  2. scores_kernel: s[n] = max_b (u[b] @ bm)[n] (fp32). CTA = 16*VEC columns, 16 row slices; u sits in
//     shared memory, every thread streams its rows of bm with 16-byte loads.
//  3. topk_kernel: one CTA of 1024 threads per part, the order-preserving keys of all scores in registers
//     (warp-contiguous index ranges). The K-th largest key is found from one histogram of the scores over
//     their [min, max] range (1024 equal-width bins): the bin holding it, then a rank selection among that
//     bin's keys. Where that does not settle it (non-finite scores, over 256 keys in the bin), by bisection
//     on the key bits, one block-wide count per bit; after the top 12 bits only the keys sharing that prefix
//     are counted (a shared candidate list). Then a compaction in index order (ballots), so indices come out ascending and ties at the
//     threshold go to the lowest indices (the ONNX TopK rule). No host sync. topk_r8_kernel (8-bit radix
//     select over shared memory) serves n > 32768 and DJV_TOPK_R8=1 A/B runs.
#include <math.h>
#include <stdlib.h>
#include "dejavu_kernels.h"
#include "djv_device.cuh"

namespace {
using namespace djv;

constexpr int kThreads = 256;
constexpr int kTopkThreads = 1024;
constexpr int kMaxB = 16;
constexpr int kCG = 32;       // columns of a per u_kernel CTA
constexpr int kMaxChunk = 256;  // rows of a (elements of d) per u_kernel CTA

struct Part {  // one predictor head (MLP or attention)
    const void* a; const void* bm; int r; int n; int k; int32_t* out;
};

template <typename T, int VEC> struct Vec;
template <typename T> struct Vec<T, 8> {
    static __device__ __forceinline__ void load(const T* p, float (&f)[8]) { unpack8<T>(ld_keep(p), f); }
};
template <typename T> struct Vec<T, 1> {  // odd row lengths (e.g. SmolLM2's 9 heads): element loads
    static __device__ __forceinline__ void load(const T* p, float (&f)[1]) { f[0] = to_f(p[0]); }
};
template <typename T> struct Vec<T, 2> {
    static __device__ __forceinline__ void load(const T* p, float (&f)[2]) {
        const uint32_t w = __ldg(reinterpret_cast<const unsigned int*>(p));
        f[0] = pair_f<T>(w, 0);
        f[1] = pair_f<T>(w, 1);
    }
};

// grid (ceil(rmax/32), KS, 2)
template <typename T, int NB, int VEC>
__global__ void __launch_bounds__(kThreads) u_kernel(const T* __restrict__ h, Part p0, Part p1, int B, int d, int KS,
                                                     int ncg, float* __restrict__ part, float* __restrict__ ssq_part,
                                                     float* __restrict__ u, unsigned* __restrict__ ctr, float eps,
                                                     int rmax) {
    constexpr int LPR = kCG / VEC, RPW = 32 / LPR, RPP = RPW * (kThreads / 32);
    const Part P = blockIdx.z == 0 ? p0 : p1;
    const int cg = blockIdx.x;
    if (P.a == nullptr || cg * kCG >= P.r) return;
    __shared__ float hs[NB][kMaxChunk];
    __shared__ float red[kThreads / 32][NB][kCG];
    __shared__ float s_ssq[kMaxB];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int chunk = cdiv(d, KS);
    const int kb = blockIdx.y * chunk, ke = min(d, kb + chunk), len = ke > kb ? ke - kb : 0;
    for (int i = tid; i < NB * kMaxChunk; i += kThreads) {
        const int b = i / kMaxChunk, k = i % kMaxChunk;
        hs[b][k] = (b < B && k < len) ? to_f(h[(size_t)b * d + kb + k]) : 0.f;
    }
    __syncthreads();
    const int lc = lane % LPR, ro = wid * RPW + lane / LPR;
    const int col = cg * kCG + lc * VEC;
    const bool cok = col < P.r;
    const T* A = static_cast<const T*>(P.a);
    float acc[NB][VEC];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[b][v] = 0.f;
#pragma unroll 4
    for (int k = ro; k < len; k += RPP) {
        float w[VEC];
        if (cok) Vec<T, VEC>::load(A + (size_t)(kb + k) * P.r + col, w);
        else {
#pragma unroll
            for (int v = 0; v < VEC; ++v) w[v] = 0.f;
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const float hv = hs[b][k];
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[b][v] = fmaf(hv, w[v], acc[b][v]);
        }
    }
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
            float x = acc[b][v];
#pragma unroll
            for (int o = LPR; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
            if (lane < LPR) red[wid][b][lane * VEC + v] = x;
        }
    // this split's sum of squares of h
    for (int b = wid; b < B; b += kThreads / 32) {
        float sq = 0.f;
        for (int k = lane; k < len; k += 32) sq = fmaf(hs[b][k], hs[b][k], sq);
        sq = warp_sum(sq);
        if (lane == 0) s_ssq[b] = sq;
    }
    __syncthreads();
    const size_t grp = (size_t)blockIdx.z * ncg + cg;
    float* my = part + (grp * KS + blockIdx.y) * kMaxB * kCG;
    for (int i = tid; i < B * kCG; i += kThreads) {
        const int b = i / kCG, c = i % kCG;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) sum += red[w][b][c];
        my[i] = sum;
    }
    if (tid < B) ssq_part[(grp * KS + blockIdx.y) * kMaxB + tid] = s_ssq[tid];
    if (!last_arrival(ctr + grp, (unsigned)KS)) return;
    __shared__ float s_rms[kMaxB];
    if (tid < B) {
        float sq = 0.f;
        for (int k = 0; k < KS; ++k) sq += __ldcg(ssq_part + (grp * KS + k) * kMaxB + tid);
        s_rms[tid] = rsqrtf(sq / d + eps);
    }
    __syncthreads();
    float* ub = u + (size_t)blockIdx.z * kMaxB * rmax;
    const float* pg = part + grp * KS * kMaxB * kCG;
    for (int i = tid; i < B * kCG; i += kThreads) {
        const int b = i / kCG, c = cg * kCG + i % kCG;
        float sv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int k = 0;
        for (; k + 8 <= KS; k += 8)
#pragma unroll
            for (int q = 0; q < 8; ++q) sv[q] += __ldcg(pg + (size_t)(k + q) * kMaxB * kCG + i);
        for (; k < KS; ++k) sv[0] += __ldcg(pg + (size_t)k * kMaxB * kCG + i);
        const float tot = ((sv[0] + sv[1]) + (sv[2] + sv[3])) + ((sv[4] + sv[5]) + (sv[6] + sv[7]));
        if (c < P.r) ub[(size_t)b * rmax + c] = tot * s_rms[b];
    }
}

// grid (ceil(nmax/(16*VEC)), 1, 2); dynamic smem NB*rmax floats (u of this part)
template <typename T, int NB, int VEC>
__global__ void __launch_bounds__(kThreads) scores_kernel(const float* __restrict__ u, Part p0, Part p1, int B,
                                                          int rmax, float* __restrict__ scores, int nmax,
                                                          float* __restrict__ scores_out) {
    constexpr int CW = 16 * VEC, RS = kThreads / 16;
    const Part P = blockIdx.z == 0 ? p0 : p1;
    if (P.a == nullptr || (int)blockIdx.x * CW >= P.n) return;
    extern __shared__ float us[];  // [NB][r]
    __shared__ float red[kThreads / 32][CW];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const float* ub = u + (size_t)blockIdx.z * kMaxB * rmax;
    for (int i = tid; i < NB * P.r; i += kThreads) {
        const int b = i / P.r, k = i % P.r;
        us[i] = b < B ? __ldcg(ub + (size_t)b * rmax + k) : 0.f;
    }
    __syncthreads();
    const int slot = tid / 16, lc = tid % 16;
    const int col = blockIdx.x * CW + lc * VEC;
    const bool cok = col < P.n;
    const T* Bm = static_cast<const T*>(P.bm);
    float acc[NB][VEC];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[b][v] = 0.f;
#pragma unroll 4
    for (int i = slot; i < P.r; i += RS) {
        float w[VEC];
        if (cok) Vec<T, VEC>::load(Bm + (size_t)i * P.n + col, w);
        else {
#pragma unroll
            for (int v = 0; v < VEC; ++v) w[v] = 0.f;
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const float uv = us[b * P.r + i];
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[b][v] = fmaf(uv, w[v], acc[b][v]);
        }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        if (b >= B) break;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
            const float x = acc[b][v] + __shfl_xor_sync(0xffffffffu, acc[b][v], 16);
            if (lane < 16) red[wid][lane * VEC + v] = x;
        }
        __syncthreads();
        if (tid < CW) {
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < kThreads / 32; ++w) sum += red[w][tid];
            mx = fmaxf(mx, sum);
        }
        __syncthreads();
    }
    if (tid < CW) {
        const int c = blockIdx.x * CW + tid;
        if (c < P.n) {
            scores[(size_t)blockIdx.z * nmax + c] = mx;
            if (blockIdx.z == 0 && scores_out) scores_out[c] = mx;
        }
    }
}

__device__ __forceinline__ uint32_t order_key(float f) {  // larger float -> larger key
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// v1 (8-bit digits, 4 passes over all keys). grid 2 (part), 1024 threads; dynamic smem nmax*4 bytes when
// keys_in_smem.
__global__ void __launch_bounds__(kTopkThreads) topk_r8_kernel(float* __restrict__ scores, Part p0, Part p1, int nmax,
                                                                int keys_in_smem) {
    const Part P = blockIdx.x == 0 ? p0 : p1;
    if (P.a == nullptr) return;
    extern __shared__ uint32_t ks_smem[];
    __shared__ unsigned hist[256];
    __shared__ unsigned s_sel[3];
    __shared__ unsigned wgt[kTopkThreads / 32], weq[kTopkThreads / 32];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    float* s = scores + (size_t)blockIdx.x * nmax;
    // keys in shared memory, or in place over the scores (each thread converts the entries it reads)
    uint32_t* keys = keys_in_smem ? ks_smem : reinterpret_cast<uint32_t*>(s);
    const int n = P.n, K = P.k;
#pragma unroll 4
    for (int i = tid; i < n; i += kTopkThreads) keys[i] = order_key(__ldcg(s + i));
    uint32_t prefix = 0, mask = 0;
    unsigned remaining = (unsigned)K;  // how many of the selected set lie in the current bucket
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += kTopkThreads) hist[i] = 0;
        __syncthreads();
#pragma unroll 4
        for (int i0 = 0; i0 < n; i0 += kTopkThreads) {
            const int i = i0 + tid;
            bool v = false;
            unsigned dig = 0x100u;
            if (i < n) {
                const uint32_t key = keys[i];
                v = (key & mask) == prefix;
                if (v) dig = (key >> shift) & 255u;
            }
            const unsigned peers = __match_any_sync(0xffffffffu, dig);
            if (v && lane == __ffs(peers) - 1) atomicAdd(&hist[dig], (unsigned)__popc(peers));
        }
        __syncthreads();
        if (wid == 0) {  // find the digit holding the remaining-th largest, scanning from the top
            unsigned cnt[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) { cnt[j] = hist[255 - (lane * 8 + j)]; tot += cnt[j]; }
            unsigned incl = tot;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            const unsigned above = incl - tot;
            if (above < remaining && incl >= remaining) {
                unsigned run = above;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (run + cnt[j] >= remaining) {
                        s_sel[0] = 255u - (unsigned)(lane * 8 + j);
                        s_sel[1] = remaining - run;
                        s_sel[2] = cnt[j];
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
        const bool whole = s_sel[2] == remaining;  // the whole bucket is selected: no finer digit needed
        __syncthreads();
        if (whole) break;
    }
    // take every masked key > prefix and the first `remaining` (in index order) masked keys == prefix
    const int per = cdiv(cdiv(n, kTopkThreads / 32), 32) * 32;
    const int wb = wid * per, we = min(n, wb + per);
    const unsigned lt = (1u << lane) - 1u;
    unsigned gtc = 0, eqc = 0;
    for (int j = wb; j < we; j += 32) {
        const int i = j + lane;
        const uint32_t key = i < we ? (keys[i] & mask) : 0u;
        gtc += __popc(__ballot_sync(0xffffffffu, i < we && key > prefix));
        eqc += __popc(__ballot_sync(0xffffffffu, i < we && key == prefix));
    }
    if (lane == 0) { wgt[wid] = gtc; weq[wid] = eqc; }
    __syncthreads();
    unsigned gt_before = 0, eq_before = 0;
    for (int w = 0; w < wid; ++w) { gt_before += wgt[w]; eq_before += weq[w]; }
    for (int j = wb; j < we; j += 32) {
        const int i = j + lane;
        const uint32_t key = i < we ? (keys[i] & mask) : 0u;
        const bool gt = i < we && key > prefix, eq = i < we && key == prefix;
        const unsigned gtm = __ballot_sync(0xffffffffu, gt), eqm = __ballot_sync(0xffffffffu, eq);
        const unsigned my_gt = gt_before + __popc(gtm & lt), my_eq = eq_before + __popc(eqm & lt);
        if (gt || (eq && my_eq < remaining)) P.out[my_gt + (my_eq < remaining ? my_eq : remaining)] = i;
        gt_before += __popc(gtm);
        eq_before += __popc(eqm);
    }
}

// ---------------------------------------------------------------------------------------------
// topk_kernel (v3): bisection on the key bits with the keys in registers. The K-th largest key T is the
// largest value with count(key >= T) >= K, built from the top bit down: one block-wide count per bit. Warp w
// holds the warp-contiguous index range [w*KPT*32, (w+1)*KPT*32) (coalesced loads), so the final compaction
// needs no reshuffle. After the top kFilterBits bits, the keys that share T's prefix (for continuous scores a
// small fraction) go to a shared candidate list and the finer bits count only those, plus the count above the
// prefix. One CTA of 1024 threads per part; n <= 32 * 1024 * KPT (larger n use topk_r8_kernel).
constexpr int kFilterBits = 12;
constexpr int kCandPerThread = 4;
constexpr int kTopkMaxKpt = 32;

// Block-wide sum of c (every thread passes its own count). Two alternating slots per warp: one barrier per
// call is enough, because a warp can only overwrite a slot after every warp has passed the barrier of the call
// that read it.
__device__ __forceinline__ unsigned block_count(unsigned c, unsigned* s_cnt, int& parity) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    c = __reduce_add_sync(0xffffffffu, c);
    if (lane == 0) s_cnt[parity * 32 + wid] = c;
    __syncthreads();
    const unsigned t = __reduce_add_sync(0xffffffffu, s_cnt[parity * 32 + lane]);
    parity ^= 1;
    return t;
}

__device__ __forceinline__ float key_float(uint32_t k) {  // inverse of order_key
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// HIST (the default; DJV_TOPK_HIST=0 for the bisection alone): before the bisection, one histogram of the keys' float values over [min, max] in
// kHistBins equal-width bins (bin(v) is non-decreasing in v, so every key of a higher bin is larger than
// every key of a lower one), a suffix scan that names the bin holding the K-th largest key, and an exact
// rank selection among that bin's keys (for continuous scores a few dozen). About eight barriers instead of
// 34. Non-finite scores, a zero or overflowing range, or more than kRankMax keys in that bin fall back to the
// bisection below, unchanged.
constexpr int kHistBins = 1024;  // one bin per thread in the scan
constexpr int kRankMax = 256;    // rank selection is O(candidates) per thread

template <int KPT, bool HIST>
__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const float* __restrict__ scores, Part p0, Part p1,
                                                            int nmax) {
    static_assert(kTopkThreads == 1024, "one count slot per warp, 32 warps");
    static_assert(kHistBins == kTopkThreads, "the suffix scan gives each thread one bin");
    const Part P = blockIdx.x == 0 ? p0 : p1;
    if (P.a == nullptr) return;
    __shared__ unsigned s_cnt[64];
    __shared__ uint32_t s_cand[kCandPerThread * kTopkThreads];
    __shared__ unsigned s_ncand, wgt[32], weq[32];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const float* s = scores + (size_t)blockIdx.x * nmax;
    const int n = P.n, K = P.k;
    const int wb = wid * KPT * 32;
    uint32_t key[KPT];  // 0 for padding: every probe value is >= 1, so padding is never counted
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
        const int i = wb + j * 32 + lane;
        key[j] = i < n ? order_key(__ldcg(s + i)) : 0u;
    }
    if (tid == 0) s_ncand = 0u;
    int parity = 0;
    uint32_t T = 0;
    int bit = 31;
    bool found = false;
    if (HIST) {
        __shared__ unsigned s_hist[kHistBins], s_wmax[32], s_wmin[32], s_sel[3], s_hn;
        __shared__ uint32_t s_T;
        s_hist[tid] = 0u;
        if (tid == 0) s_hn = 0u;
        uint32_t mx = 0u, mn = 0xFFFFFFFFu;
#pragma unroll
        for (int j = 0; j < KPT; ++j)
            if (wb + j * 32 + lane < n) { mx = max(mx, key[j]); mn = min(mn, key[j]); }
        mx = __reduce_max_sync(0xffffffffu, mx);
        mn = __reduce_min_sync(0xffffffffu, mn);
        if (lane == 0) { s_wmax[wid] = mx; s_wmin[wid] = mn; }
        __syncthreads();  // also orders the zeroed bins before the counts
        mx = __reduce_max_sync(0xffffffffu, s_wmax[lane]);
        mn = __reduce_min_sync(0xffffffffu, s_wmin[lane]);
        const float fmin = key_float(mn), range = __fsub_rn(key_float(mx), fmin);
        // keys of +inf are 0xFF800000 (NaN above), of -inf 0x007FFFFF (NaN below): all uniform in the CTA
        if (mx < 0xFF800000u && mn > 0x007FFFFFu && range >= 1e-30f && range <= 3.0e38f) {
            const float scale = (float)kHistBins / range;
            auto bin_of = [&](uint32_t k) {
                return min((int)__fmul_rn(__fsub_rn(key_float(k), fmin), scale), kHistBins - 1);
            };
#pragma unroll
            for (int j = 0; j < KPT; ++j)
                if (wb + j * 32 + lane < n) atomicAdd(&s_hist[bin_of(key[j])], 1u);
            __syncthreads();
            // thread t holds bin kHistBins-1-t: an inclusive scan over threads counts the keys in bins >= it
            const unsigned h = s_hist[kHistBins - 1 - tid];
            unsigned incl = h;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            if (lane == 31) s_cnt[wid] = incl;
            __syncthreads();
            incl += __reduce_add_sync(0xffffffffu, lane < wid ? s_cnt[lane] : 0u);
            if (incl >= (unsigned)K && incl - h < (unsigned)K) {  // exactly one thread: the K-th key's bin
                s_sel[0] = (unsigned)(kHistBins - 1 - tid);
                s_sel[1] = incl - h;  // keys in higher bins: all selected
                s_sel[2] = h;
            }
            __syncthreads();
            const int bsel = (int)s_sel[0];
            const unsigned above = s_sel[1], ncand = s_sel[2];
            if (ncand <= (unsigned)kRankMax) {
#pragma unroll
                for (int j = 0; j < KPT; ++j) {
                    const bool c = wb + j * 32 + lane < n && bin_of(key[j]) == bsel;
                    const unsigned bal = __ballot_sync(0xffffffffu, c);
                    unsigned base = 0;
                    if (lane == 0 && bal) base = atomicAdd(&s_hn, (unsigned)__popc(bal));
                    base = __shfl_sync(0xffffffffu, base, 0);
                    if (c) s_cand[base + __popc(bal & ((1u << lane) - 1u))] = key[j];
                }
                __syncthreads();
                // T is the R-th largest candidate: the candidate with fewer than R larger and at least R
                // larger-or-equal (equal candidates write the same value)
                const unsigned R = (unsigned)K - above;
                if (tid < (int)ncand) {
                    const uint32_t c = s_cand[tid];
                    unsigned gt = 0, ge = 0;
                    for (unsigned q = 0; q < ncand; ++q) {
                        const uint32_t v = s_cand[q];
                        gt += v > c;
                        ge += v >= c;
                    }
                    if (gt < R && ge >= R) s_T = c;
                }
                __syncthreads();
                T = s_T;
                found = true;
            }
        }
    }
    if (!found) {
        for (; bit >= 32 - kFilterBits; --bit) {
            const uint32_t c = T | (1u << bit);
            unsigned cnt = 0;
#pragma unroll
            for (int j = 0; j < KPT; ++j) cnt += key[j] >= c;
            if (block_count(cnt, s_cnt, parity) >= (unsigned)K) T = c;
        }
        // keys above T's prefix, and the candidates that share it
        const uint32_t pre = T >> (32 - kFilterBits);
        unsigned above = 0, ncand = 0;
#pragma unroll
        for (int j = 0; j < KPT; ++j) {
            const uint32_t kp = key[j] >> (32 - kFilterBits);
            above += kp > pre;                   // padding (key 0) has prefix 0: never above
            ncand += kp == pre && key[j] != 0u;  // ... but shares a prefix of 0
        }
        above = block_count(above, s_cnt, parity);
        ncand = block_count(ncand, s_cnt, parity);
        if (ncand <= (unsigned)(kCandPerThread * kTopkThreads)) {
#pragma unroll
            for (int j = 0; j < KPT; ++j) {
                const bool c = key[j] != 0u && (key[j] >> (32 - kFilterBits)) == pre;
                const unsigned bal = __ballot_sync(0xffffffffu, c);
                unsigned base = 0;
                if (lane == 0 && bal) base = atomicAdd(&s_ncand, (unsigned)__popc(bal));
                base = __shfl_sync(0xffffffffu, base, 0);
                if (c) s_cand[base + __popc(bal & ((1u << lane) - 1u))] = key[j];
            }
            __syncthreads();
            uint32_t ck[kCandPerThread];
#pragma unroll
            for (int m = 0; m < kCandPerThread; ++m) {
                const unsigned q = (unsigned)(m * kTopkThreads + tid);
                ck[m] = q < ncand ? s_cand[q] : 0u;
            }
            for (; bit >= 0; --bit) {
                const uint32_t c = T | (1u << bit);
                unsigned cnt = 0;
#pragma unroll
                for (int m = 0; m < kCandPerThread; ++m) cnt += ck[m] >= c;
                if (above + block_count(cnt, s_cnt, parity) >= (unsigned)K) T = c;
            }
        } else {  // many equal prefixes (e.g. ties): keep counting every key
            for (; bit >= 0; --bit) {
                const uint32_t c = T | (1u << bit);
                unsigned cnt = 0;
#pragma unroll
                for (int j = 0; j < KPT; ++j) cnt += key[j] >= c;
                if (block_count(cnt, s_cnt, parity) >= (unsigned)K) T = c;
            }
        }
    }  // !found
    // T is the K-th largest key: take every key > T and the first K - count(> T) keys == T in index order
    unsigned gtc = 0, eqc = 0;
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
        const bool valid = wb + j * 32 + lane < n;
        gtc += __popc(__ballot_sync(0xffffffffu, valid && key[j] > T));
        eqc += __popc(__ballot_sync(0xffffffffu, valid && key[j] == T));
    }
    if (lane == 0) { wgt[wid] = gtc; weq[wid] = eqc; }
    __syncthreads();
    unsigned gt_before = __reduce_add_sync(0xffffffffu, lane < wid ? wgt[lane] : 0u);
    unsigned eq_before = __reduce_add_sync(0xffffffffu, lane < wid ? weq[lane] : 0u);
    const unsigned gt_all = __reduce_add_sync(0xffffffffu, wgt[lane]);
    const unsigned remaining = (unsigned)K - gt_all;
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
        const int i = wb + j * 32 + lane;
        const bool valid = i < n;
        const bool gt = valid && key[j] > T, eq = valid && key[j] == T;
        const unsigned gtm = __ballot_sync(0xffffffffu, gt), eqm = __ballot_sync(0xffffffffu, eq);
        const unsigned my_gt = gt_before + __popc(gtm & lt), my_eq = eq_before + __popc(eqm & lt);
        if (gt || (eq && my_eq < remaining)) P.out[my_gt + (my_eq < remaining ? my_eq : remaining)] = i;
        gt_before += __popc(gtm);
        eq_before += __popc(eqm);
    }
}

// keys per thread of topk_kernel for n keys; 0 when n needs topk_r8_kernel
inline int topk_kpt(int n) {
    const int need = cdiv(n, kTopkThreads);
    if (need <= 4) return 4;
    if (need <= 12) return 12;
    if (need <= 24) return 24;
    return need <= kTopkMaxKpt ? kTopkMaxKpt : 0;
}

// DJV_TOPK_R8=1: the v1 top-k (8-bit digits, four passes over every key), for A/B measurements.
inline bool topk_r8() {
    static const bool on = getenv("DJV_TOPK_R8") != nullptr;
    return on;
}

// topk_kernel's histogram pass before the bisection; DJV_TOPK_HIST=0 turns it off (A/B measurements).
inline bool topk_hist() {
    static const bool on = !(getenv("DJV_TOPK_HIST") != nullptr && getenv("DJV_TOPK_HIST")[0] == '0');
    return on;
}

struct PredPlan {
    int rmax, nmax, ncg, KS, vec_a, vec_b, nb;
    bool keys_smem;  // topk_r8_kernel keeps the keys in shared memory
    size_t off_part, off_ssq, off_u, off_scores, total;
};

PredPlan plan_pred(int B, int d, int r_m, int Nb, int r_h, int H) {
    PredPlan p;
    p.rmax = r_m > r_h ? r_m : r_h;
    p.nmax = Nb > H ? Nb : H;
    p.ncg = cdiv(p.rmax, kCG);
    const int groups = cdiv(r_m, kCG) + (r_h > 0 ? cdiv(r_h, kCG) : 0);
    int ks = cdiv(2 * sm_count(), groups);  // ~2 CTAs per SM
    ks = ks > 64 ? 64 : ks;
    const int need = cdiv(d, kMaxChunk);
    p.KS = ks < need ? need : ks;
    if (p.KS > d) p.KS = d;
    p.nb = B <= 1 ? 1 : (B <= 4 ? 4 : (B <= 8 ? 8 : 16));
    p.vec_a = (r_m % 8 == 0 && (r_h == 0 || r_h % 8 == 0)) ? 8 : 2;
    p.vec_b = (Nb % 8 == 0 && (H == 0 || H % 8 == 0)) ? 8 : 2;
    if (r_m % 2 || r_h % 2 || Nb % 2 || H % 2) p.vec_a = p.vec_b = 1;  // a row length is odd: element loads
    const int optin = smem_optin();
    p.keys_smem = (size_t)p.nmax * 4 + 8192 <= (size_t)optin;
    size_t o = kCounterBytes;
    p.off_part = o; o = align_up(o + (size_t)2 * p.ncg * p.KS * kMaxB * kCG * 4, 256);
    p.off_ssq = o; o = align_up(o + (size_t)2 * p.ncg * p.KS * kMaxB * 4, 256);
    p.off_u = o; o = align_up(o + (size_t)2 * kMaxB * p.rmax * 4, 256);
    p.off_scores = o; o = align_up(o + (size_t)2 * p.nmax * 4, 256);
    p.total = o;
    return p;
}

template <typename T, int NB, int VA, int VB>
int launch_pred(const void* h, Part p0, Part p1, float* scores_out, int B, int d, float eps, const PredPlan& p,
                void* ws, cudaStream_t st) {
    char* base = static_cast<char*>(ws);
    unsigned* ctr = reinterpret_cast<unsigned*>(base);
    float* part = reinterpret_cast<float*>(base + p.off_part);
    float* ssq = reinterpret_cast<float*>(base + p.off_ssq);
    float* u = reinterpret_cast<float*>(base + p.off_u);
    float* sc = reinterpret_cast<float*>(base + p.off_scores);
    u_kernel<T, NB, VA><<<dim3(p.ncg, p.KS, 2), kThreads, 0, st>>>(static_cast<const T*>(h), p0, p1, B, d, p.KS, p.ncg,
                                                                     part, ssq, u, ctr, eps, p.rmax);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    const size_t usm = (size_t)NB * p.rmax * 4;
    if ((e = cudaFuncSetAttribute(scores_kernel<T, NB, VB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)usm)) !=
        cudaSuccess)
        return (int)e;
    scores_kernel<T, NB, VB><<<dim3(cdiv(p.nmax, 16 * VB), 1, 2), kThreads, usm, st>>>(u, p0, p1, B, p.rmax, sc, p.nmax,
                                                                                       scores_out);
    if ((e = cudaGetLastError()) != cudaSuccess) return (int)e;
    const int kpt = topk_kpt(p.nmax);
    if (kpt == 0 || topk_r8()) {  // v1: n > 32768, or an A/B run
        const size_t ksm = p.keys_smem ? (size_t)p.nmax * 4 : 0;
        if ((e = cudaFuncSetAttribute(topk_r8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ksm)) !=
            cudaSuccess)
            return (int)e;
        topk_r8_kernel<<<2, kTopkThreads, ksm, st>>>(sc, p0, p1, p.nmax, p.keys_smem ? 1 : 0);
        return (int)cudaGetLastError();
    }
    if (topk_hist()) {
        switch (kpt) {
        case 4: topk_kernel<4, true><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
        case 12: topk_kernel<12, true><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
        case 24: topk_kernel<24, true><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
        default: topk_kernel<kTopkMaxKpt, true><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
        }
        return (int)cudaGetLastError();
    }
    switch (kpt) {
    case 4: topk_kernel<4, false><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
    case 12: topk_kernel<12, false><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
    case 24: topk_kernel<24, false><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
    default: topk_kernel<kTopkMaxKpt, false><<<2, kTopkThreads, 0, st>>>(sc, p0, p1, p.nmax); break;
    }
    return (int)cudaGetLastError();
}

template <typename T, int NB>
int run_pred_nb(const void* h, Part p0, Part p1, float* so, int B, int d, float eps, const PredPlan& p, void* ws,
                cudaStream_t st) {
    if (p.vec_a == 1) return launch_pred<T, NB, 1, 1>(h, p0, p1, so, B, d, eps, p, ws, st);
    if (p.vec_a == 8)
        return p.vec_b == 8 ? launch_pred<T, NB, 8, 8>(h, p0, p1, so, B, d, eps, p, ws, st)
                            : launch_pred<T, NB, 8, 2>(h, p0, p1, so, B, d, eps, p, ws, st);
    return p.vec_b == 8 ? launch_pred<T, NB, 2, 8>(h, p0, p1, so, B, d, eps, p, ws, st)
                        : launch_pred<T, NB, 2, 2>(h, p0, p1, so, B, d, eps, p, ws, st);
}

template <typename T>
int run_pred(const void* h, Part p0, Part p1, float* so, int B, int d, float eps, const PredPlan& p, void* ws,
             cudaStream_t st) {
    switch (p.nb) {
    case 1: return run_pred_nb<T, 1>(h, p0, p1, so, B, d, eps, p, ws, st);
    case 4: return run_pred_nb<T, 4>(h, p0, p1, so, B, d, eps, p, ws, st);
    case 8: return run_pred_nb<T, 8>(h, p0, p1, so, B, d, eps, p, ws, st);
    default: return run_pred_nb<T, 16>(h, p0, p1, so, B, d, eps, p, ws, st);
    }
}


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
    if (B < 1 || B > kMaxB || d < 1 || r_m < 1 || r_m > 2048 || Nb < 1 || Nb > 65536 || K < 1 || K > Nb)
        return DJV_E_SHAPE;
    if (heads && (r_h < 1 || r_h > 2048 || H < 1 || H > 65536 || Kh < 1 || Kh > H))
        return DJV_E_SHAPE;
    if (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16) return DJV_E_DTYPE;
    if (!h || !mlp_a || !mlp_b || !mlp_idx || (heads && (!head_b || !head_idx))) return DJV_E_POINTER;
    if (!aligned16(workspace)) return DJV_E_POINTER;
    PredPlan p = plan_pred(B, d, r_m, Nb, heads ? r_h : 0, heads ? H : 0);
    // 16-byte loads need aligned bases (rows are aligned when the row lengths are multiples of 8)
    if (p.vec_a == 8 && (!aligned16(mlp_a) || (heads && !aligned16(head_a)))) p.vec_a = 2;
    if (p.vec_b == 8 && (!aligned16(mlp_b) || (heads && !aligned16(head_b)))) p.vec_b = 2;
    if (!workspace || workspace_bytes < p.total) return DJV_E_WORKSPACE;
    if (2 * p.ncg > kMaxCounters) return DJV_E_SHAPE;
    Part p0{mlp_a, mlp_b, r_m, Nb, K, mlp_idx};
    Part p1{heads ? head_a : nullptr, head_b, heads ? r_h : 0, heads ? H : 0, Kh, head_idx};
    if (dtype == DJV_FLOAT16) return run_pred<__half>(h, p0, p1, mlp_scores, B, d, eps, p, workspace, stream);
    return run_pred<__nv_bfloat16>(h, p0, p1, mlp_scores, B, d, eps, p, workspace, stream);
}

}  // extern "C"
