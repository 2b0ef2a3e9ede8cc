// DejaVuHeadSparseAttention decode kernels (docs/ops.md): three launches.
//  1. Q rows of the selected heads, K/V rows of the KV heads the policy writes (dense: all, active: those
//     the selected heads read), + bias -> fp32: qkv_rows_kernel (batch <= 4, coalesced rows, djv_rows.cuh)
//     or qkv_proj_kernel (batch 5-16, tensor-core GEMV as in the MLP).
//  2. attn_kernel: split-T flash decoding. One CTA per (work item, batch row, token split); a work item is
//     up to 8 selected query heads that share a KV head, so GQA groups read their K/V once. Slot
//     position[b] is taken from the fresh projection (RoPE applied, rounded to the cache dtype) rather than
//     from the cache, so the extra "writer" CTAs that store the new K/V rows need no ordering with readers.
//     The last split of each item merges the partial softmaxes in a fixed order.
//  3. djv::launch_down: output projection over the selected heads' rows of w_o_t (+ b_o).
#include <math.h>
#include "dejavu_kernels.h"
#include "djv_bulk.cuh"
#include "djv_rows.cuh"
#include "djv_trace.cuh"

namespace {
using namespace djv;

constexpr int kProjThreads = 256;
constexpr int kAttnThreads = 128;
constexpr int GMAX = 8;  // query heads per work item
constexpr int kMaxSplits = kAttnThreads * 8;  // merge weights [GMAX][nsplit] reuse ored: RP*GMAX*hd = GMAX*1024 floats

// Warp 0 helper: over p in [0, Kh), flag(p) = p == 0 || key(head_idx[p]) != key(head_idx[p-1]).
// Returns the position of the n-th flag (or -1), the next flag after it (or Kh) and the count of flags at
// positions <= upto.
struct RunInfo { int start, end, count_upto; };
template <typename KeyF>
__device__ RunInfo warp_runs(const int32_t* __restrict__ hidx, int Kh, KeyF key, int n, int upto) {
    const int lane = threadIdx.x & 31;
    int cnt = 0, start = -1, end = Kh, upto_cnt = 0;
    for (int base = 0; base < Kh; base += 32) {
        const int p = base + lane;
        bool flag = false;
        if (p < Kh) flag = (p == 0) || key(__ldg(hidx + p)) != key(__ldg(hidx + p - 1));
        const unsigned bal = __ballot_sync(0xffffffffu, flag);
        const int before = cnt + __popc(bal & ((1u << lane) - 1u));
        if (flag && before == n) start = p;
        if (flag && before == n + 1) end = p;
        upto_cnt += __popc(__ballot_sync(0xffffffffu, flag && p <= upto));
        cnt += __popc(bal);
    }
    RunInfo r;
    r.start = __reduce_max_sync(0xffffffffu, start);
    r.end = __reduce_min_sync(0xffffffffu, end);
    r.count_upto = upto_cnt;
    return r;
}

template <typename T>
__device__ __forceinline__ float rope_at(const float* u, int e, int hd, const T* rc, const T* rs, int pos) {
    const int half = hd / 2, i = e < half ? e : e - half;
    const float c = to_f(rc[(size_t)pos * half + i]), s = to_f(rs[(size_t)pos * half + i]);
    return e < half ? u[e] * c - u[e + half] * s : u[e] * c + u[e - half] * s;
}
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f(from_f<T>(v)); }

// Batch 5-16: tiles 0..qt-1 are Q rows of the selected heads; then K rows, then V rows, of the KV slots the
// policy writes.
template <typename T, int NT>
__global__ void __launch_bounds__(kProjThreads) qkv_proj_kernel(
    const T* __restrict__ x, const int32_t* __restrict__ head_idx, int Kh, int H, int Hkv, int hd, int kv_policy,
    int nslots, const T* __restrict__ wq, const T* __restrict__ wk, const T* __restrict__ wv,
    const T* __restrict__ bq, const T* __restrict__ bk, const T* __restrict__ bv, float* __restrict__ qkv, int R,
    float* __restrict__ part, unsigned* __restrict__ ctr, int B, int d, int ksplit) {
    constexpr int NW = kProjThreads / 32;
    __shared__ float red[NW * 256];
    __shared__ int s_head;
    pdl_launch_dependents();  // the attention kernel may start its KV-cache reads now
    const int lane = threadIdx.x & 31, g = lane >> 2, wid = threadIdx.x >> 5;
    const int tile = blockIdx.x, ks = blockIdx.y;
    const int qt = Kh * hd / 16, kt = nslots * hd / 16;
    const int which = tile < qt ? 0 : (tile < qt + kt ? 1 : 2);
    const int m = (tile - (which == 0 ? 0 : (which == 1 ? qt : qt + kt))) * 16;  // row within its block
    const int hs = m / hd, within = m % hd;
    if (wid == 0) {
        int head;
        if (which == 0) head = __ldg(head_idx + hs);
        else if (kv_policy == DJV_KV_DENSE) head = hs;
        else {
            const int group = H / Hkv;
            const RunInfo ri = warp_runs(head_idx, Kh, [group](int h) { return h / group; }, hs, -1);
            head = ri.start >= 0 ? __ldg(head_idx + ri.start) / group : -1;
        }
        if (lane == 0) s_head = head;
    }
    __syncthreads();
    const int head = s_head;
    if (head < 0) return;  // unused KV slot this step (uniform over the tile's splits)
    const T* W = which == 0 ? wq : (which == 1 ? wk : wv);
    const T* bias = which == 0 ? bq : (which == 1 ? bk : bv);
    const size_t rbase = (size_t)head * hd + within;
    const T* r0[1] = {W + (rbase + g) * d};
    const T* r1[1] = {W + (rbase + g + 8) * d};
    const int chunk = ksplit_chunk(d, ksplit);
    const int kb = ks * chunk, ke = min(d, kb + chunk);
    float acc[1][NT][4] = {};
    tile_dot<T, NT, 1, 4>(r0, r1, x, B, d, kb, ke, wid, NW, acc);
    cta_reduce_tile<NT, 1>(acc, red, NW);
    if (ksplit > 1) {
        float* my = part + ((size_t)tile * ksplit + ks) * 256;
        for (int i = threadIdx.x; i < 256; i += blockDim.x) my[i] = red[i];
        if (!last_arrival(ctr + tile, (unsigned)ksplit)) return;
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            float s = 0.f;
            for (int k = 0; k < ksplit; ++k) s += __ldcg(part + ((size_t)tile * ksplit + k) * 256 + i);
            red[i] = s;
        }
        __syncthreads();
    }
    const int col0 = (which == 0 ? 0 : (which == 1 ? Kh * hd : (Kh + nslots) * hd)) + m;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        const int row = i >> 4, b = i & 15;
        if (b < B) qkv[(size_t)b * R + col0 + row] = red[i] + (bias ? to_f(bias[rbase + row]) : 0.f);
    }
}

// CTAs of kSkThreads per SM the batch <= 4 QKV kernel is built for: 3 (6 loads in flight per lane, <= 85
// registers) rather than 2 (8 loads). More resident warps hide each warp's dot-product phase between its
// load batches. Measured on the H200 (benchmarks/RESULTS.md): at batch 4 3 is 4.7% faster end to end
// (session 8); at batch 1 it was faster alone but not end to end until the predictor's top-k got shorter
// (session 12: 2.838 against 2.927 ms per token). 4 CTAs was slower at every batch and is not built.
// DJV_QKV_OCC=2|3 overrides it, for A/B runs.
inline int qkv_occupancy(int /*B*/) {
    static const int env = env_int("DJV_QKV_OCC", 2, 3, 0);
    return env ? env : 3;
}
__host__ __device__ constexpr int qkv_rows_u(int occ) { return occ == 3 ? 6 : 8; }

// Whether the batch <= 4 QKV kernel issues its first weight loads before its wait, while the kernel before
// (the norm) runs. That reads head_idx early, so only where the caller promised the indices are ready
// (djv_set_indices_ready). Measured on an H100 (benchmarks/RESULTS.md, session 23). DJV_QKV_EARLY=0|1
// overrides it, for A/B runs.
inline int qkv_early_loads() {
    static const int env = env_int("DJV_QKV_EARLY", 0, 1, -1);
    return env >= 0 ? env : indices_ready();
}

// Batch <= 4: the same rows, one warp per projection row at a time (512 contiguous bytes per load).
template <typename T, int NB, int OCC>
__global__ void __launch_bounds__(kSkThreads, OCC) qkv_rows_kernel(
    const T* __restrict__ x, const int32_t* __restrict__ head_idx, int Kh, int H, int Hkv, int hd, int kv_policy,
    int nslots, const T* __restrict__ wq, const T* __restrict__ wk, const T* __restrict__ wv,
    const T* __restrict__ bq, const T* __restrict__ bk, const T* __restrict__ bv, float* __restrict__ qkv, int R,
    float* __restrict__ part, unsigned* __restrict__ ctr, int B, int d, StreamK sk, int early) {
    // Launched early (launch_pdl): streamk_rows waits for the kernel before (x), then lets the attention
    // kernel launch and start its KV-cache reads. early: each warp's first weight loads go out before the
    // wait (qkv_early_loads).
    DJV_TRACE_DECL;  // a -DDJV_TRACE build only (djv_trace.cuh): 0 start, 5 end
    DJV_TRACE_START(2);
    const int lane = threadIdx.x & 31;
    const int qr = Kh * hd, kr = nslots * hd;
    auto which_of = [&](int item) { return item < qr ? 0 : (item < qr + kr ? 1 : 2); };
    auto row_of = [&](int item, int which, int& head) {  // head -1: a KV slot unused this step
        const int m = item - (which == 0 ? 0 : (which == 1 ? qr : qr + kr));
        const int hs = m / hd;
        if (which == 0) head = __ldg(head_idx + hs);
        else if (kv_policy == DJV_KV_DENSE) head = hs;
        else {
            const int group = H / Hkv;
            const RunInfo ri = warp_runs(head_idx, Kh, [group](int h) { return h / group; }, hs, -1);
            head = ri.start >= 0 ? (int)__ldg(head_idx + ri.start) / group : -1;
        }
        return (size_t)head * hd + m % hd;
    };
    auto rows = [&](int item, const T* (&r)[1]) {
        const int which = which_of(item);
        int head;
        const size_t row = row_of(item, which, head);
        if (head < 0) return false;
        r[0] = (which == 0 ? wq : (which == 1 ? wk : wv)) + row * d;
        return true;
    };
    auto epi = [&](int item, const float (&v)[1][NB]) {
        const int which = which_of(item);
        int head;
        const size_t row = row_of(item, which, head);
        const T* bias = which == 0 ? bq : (which == 1 ? bk : bv);
        if (lane != 0) return;
        const float bb = bias ? to_f(bias[row]) : 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b)
            if (b < B) qkv[(size_t)b * R + item] = v[0][b] + bb;
    };
    streamk_rows<T, NB, 1, qkv_rows_u(OCC)>(x, B, d, part, ctr, sk, rows, epi, early != 0);
    DJV_TRACE_END(2, 0);
}

// GM: query heads held in registers per work item (1 when every KV head serves one query head, else GMAX).
template <typename T, int HD, int GM>
__global__ void __launch_bounds__(kAttnThreads) attn_kernel(
    const float* __restrict__ qkv, int R, const int32_t* __restrict__ head_idx, const int32_t* __restrict__ position,
    const T* __restrict__ rcos, const T* __restrict__ rsin, T* __restrict__ kc, T* __restrict__ vc,
    float* __restrict__ part, unsigned* __restrict__ ctr, T* __restrict__ o_act, int H, int Hkv, int Kh, int Tlen,
    int rotary, float qscale, int kv_policy, int nslots, int L, int nsplit, int merge_here) {
    constexpr int TPR = HD / 8, RP = kAttnThreads / TPR, PSTRIDE = HD + 2;
    extern __shared__ float sm[];
    float* q_s = sm;                 // [GMAX][HD] (pre-scaled by scale*log2(e))
    float* kn_s = q_s + GMAX * HD;   // [HD] new key at slot pos (roped, rounded to T)
    float* vn_s = kn_s + HD;         // [HD]
    float* sc = vn_s + HD;           // [GMAX][L] scores, then probabilities
    float* ored = sc + GMAX * L;     // [RP][GMAX][HD]
    __shared__ int s_info[4];
    __shared__ float s_m[GMAX], s_l[GMAX];
    DJV_TRACE_DECL;  // a -DDJV_TRACE build only (djv_trace.cuh), work items with tokens: 0 start, 1 wait
    DJV_TRACE_START(3);  // returned, 2 q ready, 4 and 5 partial written
    const int x = blockIdx.x, b = blockIdx.y, z = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int group = H / Hkv;
    const int pos = __ldg(position + b);
    const float* qkv_b = qkv + (size_t)b * R;

    if (x >= Kh) {  // writer of KV slot x-Kh: the cache gets K (after RoPE) and V at slot pos
        const int slot = x - Kh;
        if (z != 0 || slot >= nslots) return;
        if (wid == 0) {
            int kv = slot;
            if (kv_policy == DJV_KV_ACTIVE) {
                const RunInfo ri = warp_runs(head_idx, Kh, [group](int h) { return h / group; }, slot, -1);
                kv = ri.start >= 0 ? __ldg(head_idx + ri.start) / group : -1;
            }
            if (lane == 0) s_info[0] = kv;
        }
        __syncthreads();
        const int kv = s_info[0];
        if (kv < 0) return;
        pdl_wait_primary();  // the new K/V come from the projection kernel
        pdl_launch_dependents();
        const float* kr = qkv_b + (size_t)Kh * HD + (size_t)slot * HD;
        const float* vr = kr + (size_t)nslots * HD;
        const size_t off = (((size_t)b * Hkv + kv) * Tlen + pos) * HD;
        for (int e = tid; e < HD; e += blockDim.x) {
            kc[off + e] = from_f<T>(rotary ? rope_at(kr, e, HD, rcos, rsin, pos) : kr[e]);
            vc[off + e] = from_f<T>(vr[e]);
        }
        return;
    }

    if (wid == 0) {
        // work item x: a run of selected heads with equal (kv head, octet within the group)
        const RunInfo it = warp_runs(head_idx, Kh, [group](int h) { return ((h / group) << 8) | ((h % group) >> 3); },
                                     x, -1);
        int kv = -1, slot = -1;
        if (it.start >= 0) {
            kv = __ldg(head_idx + it.start) / group;
            if (kv_policy == DJV_KV_DENSE) slot = kv;
            else slot = warp_runs(head_idx, Kh, [group](int h) { return h / group; }, -1, it.start).count_upto - 1;
        }
        if (lane == 0) { s_info[0] = it.start; s_info[1] = it.end; s_info[2] = kv; s_info[3] = slot; }
    }
    __syncthreads();
    const int st = s_info[0];
    if (st < 0) return;  // fewer items than Kh this step (uniform over z: the counter is never touched)
    const int G = s_info[1] - st, kv = s_info[2], slot = s_info[3];
    const int t0 = z * L, t1 = min(t0 + L, pos + 1), n = t1 - t0;
    // split z's partial of head position st + g: part[((b * Kh + st + g) * nsplit + z) * PSTRIDE] (SplitParts)
    float* mypart = part + (((size_t)b * Kh + st) * nsplit + z) * PSTRIDE;
    const size_t gstride = (size_t)nsplit * PSTRIDE;

    if (n > 0) {
        const int r = tid / TPR, l = tid % TPR;
        const T* kbase = kc + ((size_t)b * Hkv + kv) * Tlen * HD + l * 8;
        const T* vbase = vc + ((size_t)b * Hkv + kv) * Tlen * HD + l * 8;
        // UNR*RP tokens per pass (64: the usual L is one pass). The first pass's K and V rows are loaded
        // before anything that needs the projection (q, the new K/V): with programmatic dependent launch
        // this runs while the QKV kernel finishes, and either way their HBM latency overlaps the q setup.
        constexpr int UNR = 8;
        uint4 kpre[UNR], vpre[UNR];
#pragma unroll
        for (int j = 0; j < UNR; ++j) {
            const int t = t0 + j * RP + r;
            kpre[j] = (t < t1 && t != pos) ? ld_stream(kbase + (size_t)t * HD) : zero4();
            vpre[j] = (t < t1 && t != pos) ? ld_stream(vbase + (size_t)t * HD) : zero4();
        }
        pdl_wait_primary();
        DJV_TRACE_MARK(1);
        pdl_launch_dependents();  // the output projection may launch (it waits for this grid)
        for (int i = tid; i < G * HD; i += blockDim.x) {
            const int g = i / HD, e = i % HD;
            const float* qr = qkv_b + (size_t)(st + g) * HD;
            q_s[g * HD + e] = (rotary ? rope_at(qr, e, HD, rcos, rsin, pos) : qr[e]) * qscale;
        }
        if (pos >= t0 && pos < t1) {
            const float* kr = qkv_b + (size_t)Kh * HD + (size_t)slot * HD;
            const float* vr = kr + (size_t)nslots * HD;
            for (int e = tid; e < HD; e += blockDim.x) {
                kn_s[e] = round_to<T>(rotary ? rope_at(kr, e, HD, rcos, rsin, pos) : kr[e]);
                vn_s[e] = round_to<T>(vr[e]);
            }
        }
        __syncthreads();
        DJV_TRACE_MARK(2);
        float qreg[GM][8];
#pragma unroll
        for (int g = 0; g < GM; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) qreg[g][e] = g < G ? q_s[g * HD + l * 8 + e] : 0.f;
        for (int tb = t0; tb < t1; tb += UNR * RP) {
            uint4 kv4[UNR];
#pragma unroll
            for (int j = 0; j < UNR; ++j) {
                const int t = tb + j * RP + r;
                kv4[j] = tb == t0 ? kpre[j] : ((t < t1 && t != pos) ? ld_stream(kbase + (size_t)t * HD) : zero4());
            }
#pragma unroll
            for (int j = 0; j < UNR; ++j) {
                const int t = tb + j * RP + r;
                float kf[8];
                if (t == pos) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) kf[e] = kn_s[l * 8 + e];
                } else unpack8<T>(kv4[j], kf);
#pragma unroll
                for (int g = 0; g < GM; ++g) {
                    if (g >= G) break;
                    float s = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) s = fmaf(qreg[g][e], kf[e], s);
#pragma unroll
                    for (int o = TPR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                    if (l == 0 && t < t1) sc[g * L + (t - t0)] = s;
                }
            }
        }
        __syncthreads();
        for (int g = wid; g < G; g += kAttnThreads / 32) {
            float mx = -INFINITY;
            for (int i = lane; i < n; i += 32) mx = fmaxf(mx, sc[g * L + i]);
            mx = warp_max(mx);
            float sum = 0.f;
            for (int i = lane; i < n; i += 32) {
                const float p = exp2f(sc[g * L + i] - mx);
                sc[g * L + i] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) { s_m[g] = mx; s_l[g] = sum; }
        }
        __syncthreads();
        float oacc[GM][8];
#pragma unroll
        for (int g = 0; g < GM; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) oacc[g][e] = 0.f;
        for (int tb = t0; tb < t1; tb += UNR * RP) {
            uint4 vv4[UNR];
#pragma unroll
            for (int j = 0; j < UNR; ++j) {
                const int t = tb + j * RP + r;
                vv4[j] = tb == t0 ? vpre[j] : ((t < t1 && t != pos) ? ld_stream(vbase + (size_t)t * HD) : zero4());
            }
#pragma unroll
            for (int j = 0; j < UNR; ++j) {
                const int t = tb + j * RP + r;
                if (t >= t1) continue;
                float vf[8];
                if (t == pos) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) vf[e] = vn_s[l * 8 + e];
                } else unpack8<T>(vv4[j], vf);
#pragma unroll
                for (int g = 0; g < GM; ++g) {
                    if (g >= G) break;
                    const float p = sc[g * L + (t - t0)];
#pragma unroll
                    for (int e = 0; e < 8; ++e) oacc[g][e] = fmaf(p, vf[e], oacc[g][e]);
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GM; ++g) {
            if (g >= G) break;
#pragma unroll
            for (int e = 0; e < 8; ++e) ored[((size_t)r * GMAX + g) * HD + l * 8 + e] = oacc[g][e];
        }
        __syncthreads();
        for (int i = tid; i < G * HD; i += blockDim.x) {
            const int g = i / HD, e = i % HD;
            float s = 0.f;
            for (int rr = 0; rr < RP; ++rr) s += ored[((size_t)rr * GMAX + g) * HD + e];
            mypart[g * gstride + 2 + e] = s;
        }
        if (tid < G) { mypart[tid * gstride] = s_m[tid]; mypart[tid * gstride + 1] = s_l[tid]; }
        DJV_TRACE_MARK(4);
        // Recorded here, not after a merge: which CTA merges varies by call, and a CTA must record every
        // call or none (djv_trace.cuh's launch counters).
        DJV_TRACE_END(3, n);
    } else {  // split past position[b]: an empty partial (skipped when merging)
        pdl_wait_primary();  // no writes before the wait (djv_bulk.cuh)
        pdl_launch_dependents();
        if (tid < G) {
            mypart[tid * gstride] = -INFINITY;
            mypart[tid * gstride + 1] = 0.f;
        }
    }
    if (!merge_here) return;  // the output projection merges the splits as it loads them (djv_rows.cuh)
    if (!last_arrival(ctr + (size_t)b * Kh + x, (unsigned)nsplit)) return;
    // Merge the splits' partial softmaxes. Each split's weight exp2(m_k - M) / den is computed once per head
    // (warp g, lanes over splits) into shared memory, so the per-element sums below are independent loads
    // that pipeline, instead of a chain of L2 round trips per split. ored is free now: nsplit <= kMaxSplits.
    const float* pb = part + ((size_t)b * Kh + st) * nsplit * PSTRIDE;  // head position st + g at g * gstride
    float* wsp = ored;  // [GMAX][nsplit]
    for (int g = wid; g < G; g += kAttnThreads / 32) {
        float M = -INFINITY;
        for (int k = lane; k < nsplit; k += 32) {
            const float* pz = pb + g * gstride + (size_t)k * PSTRIDE;
            const float mk = __ldcg(pz), lk = __ldcg(pz + 1);
            wsp[g * nsplit + k] = lk > 0.f ? mk : -INFINITY;
            if (lk > 0.f) M = fmaxf(M, mk);
        }
        M = warp_max(M);
        float den = 0.f;
        for (int k = lane; k < nsplit; k += 32) {
            const float mk = wsp[g * nsplit + k];
            const float w = mk == -INFINITY ? 0.f : exp2f(mk - M);
            den += w * __ldcg(pb + g * gstride + (size_t)k * PSTRIDE + 1);
            wsp[g * nsplit + k] = w;
        }
        den = warp_sum(den);
        const float inv = 1.f / den;  // den > 0: the split holding position[b] always has l > 0
        for (int k = lane; k < nsplit; k += 32) wsp[g * nsplit + k] *= inv;
    }
    __syncthreads();
    const int Mo = Kh * HD;
    for (int i = tid; i < G * HD; i += blockDim.x) {
        const int g = i / HD, e = i % HD;
        float num = 0.f;
#pragma unroll 8
        for (int k = 0; k < nsplit; ++k) {  // empty splits (w = 0) wrote no values: never read them
            const float w = wsp[g * nsplit + k];
            num = fmaf(w, w != 0.f ? __ldcg(pb + g * gstride + (size_t)k * PSTRIDE + 2 + e) : 0.f, num);
        }
        o_act[(size_t)b * Mo + (size_t)(st + g) * HD + e] = from_f<T>(num);
    }
}

// Batch <= 4 with at most 32 splits: the output projection merges the splits' partial softmaxes as it loads
// them (SplitParts, djv_rows.cuh), 32 / (8 x batch rows) lanes per (row, batch row) looping over the
// splits; past 32 splits those loops would outlast the attention core's own merge, whose lanes cover the
// splits. DJV_ATTN_MERGE_DOWN=0: always merge in the attention core (for A/B runs).
inline bool merge_in_projection(int B, int nsplit) {
    static const int on = env_int("DJV_ATTN_MERGE_DOWN", 0, 1, 1);
    return on && use_rows(B) && nsplit <= 32;
}

struct AttnPlan {
    int nslots, R, tiles, proj_items, ksplit, L, nsplit, Mo;
    StreamK proj;  // batch <= 4
    size_t smem, off_qkv, off_pproj, off_pattn, off_o, off_pdown, off_xn, total;
    int ctr_attn, ctr_down, ctr_total;
};

AttnPlan plan_attn(int B, int d, int H, int Hkv, int hd, int Kh, int T, int policy, size_t esize) {
    AttnPlan p{};
    p.nslots = policy == DJV_KV_DENSE ? Hkv : (Hkv < Kh ? Hkv : Kh);
    p.R = (Kh + 2 * p.nslots) * hd;
    p.tiles = p.R / 16;
    p.ksplit = use_rows(B) ? 1 : tile_ksplit(p.tiles, d);
    if (use_rows(B)) p.proj = plan_rows(p.R, d, qkv_occupancy(B) * (kSkThreads / 32));
    p.proj_items = use_rows(B) ? p.R : p.tiles;
    const int want = cdiv(kTargetCtas, Kh * B);
    int L = (int)align_up((size_t)cdiv(T, want), 32);
    L = L < 64 ? 64 : (L > 1024 ? 1024 : L);
    p.L = L;
    p.nsplit = cdiv(T, L);  // <= kMaxSplits up to T = 2^20 (L <= 1024); checked at the entry point
    p.Mo = Kh * hd;
    const int RP = kAttnThreads / (hd / 8);
    p.smem = (size_t)(GMAX * hd + 2 * hd + GMAX * L + RP * GMAX * hd) * sizeof(float);
    p.ctr_attn = p.proj_items;
    p.ctr_down = p.ctr_attn + B * Kh;
    p.ctr_total = p.ctr_down + down_counters(d);
    size_t o = kCounterBytes;
    p.off_qkv = o; o = align_up(o + (size_t)B * p.R * 4, 256);
    p.off_pproj = o; o = align_up(o + (use_rows(B) ? rows_part_floats(p.proj, p.R, rows_nb(B), 1)
                                                  : (p.ksplit > 1 ? (size_t)p.tiles * p.ksplit * 256 : 0)) * 4, 256);
    p.off_pattn = o; o = align_up(o + (size_t)B * Kh * p.nsplit * GMAX * (hd + 2) * 4, 256);
    p.off_o = o; o = align_up(o + (size_t)16 * p.Mo * esize, 256);
    p.off_pdown = o; o = align_up(o + down_part_floats(B, d, p.Mo, p.Mo) * 4, 256);
    p.off_xn = o; o = align_up(o + (size_t)B * d * esize, 256);  // x normalised, for a folded call
    p.total = o;
    return p;
}

template <typename T, int HD, int GM>
cudaError_t launch_attn_g(const AttnPlan& p, const float* qkv, const int32_t* hidx, const int32_t* pos, const T* rc,
                        const T* rs, T* kc, T* vc, float* part, unsigned* ctr, T* o_act, int B, int H, int Hkv, int Kh,
                        int Tlen, int rotary, float qscale, int policy, int merge_here, cudaStream_t st) {
    cudaError_t e = cudaFuncSetAttribute(attn_kernel<T, HD, GM>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem);
    if (e != cudaSuccess) return e;
    dim3 grid(Kh + p.nslots, B, p.nsplit);
    // Programmatic dependent launch: the KV-cache reads overlap the tail of the QKV projection.
    return launch_pdl(attn_kernel<T, HD, GM>, grid, dim3(kAttnThreads), p.smem, st, qkv, p.R, hidx, pos, rc, rs, kc, vc,
                      part, ctr, o_act, H, Hkv, Kh, Tlen, rotary, qscale, policy, p.nslots, p.L, p.nsplit, merge_here);
}

template <typename T, int HD>
cudaError_t launch_attn(const AttnPlan& p, const float* qkv, const int32_t* hidx, const int32_t* pos, const T* rc,
                        const T* rs, T* kc, T* vc, float* part, unsigned* ctr, T* o_act, int B, int H, int Hkv, int Kh,
                        int Tlen, int rotary, float qscale, int policy, int merge_here, cudaStream_t st) {
    if (H == Hkv)
        return launch_attn_g<T, HD, 1>(p, qkv, hidx, pos, rc, rs, kc, vc, part, ctr, o_act, B, H, Hkv, Kh, Tlen, rotary,
                                       qscale, policy, merge_here, st);
    return launch_attn_g<T, HD, GMAX>(p, qkv, hidx, pos, rc, rs, kc, vc, part, ctr, o_act, B, H, Hkv, Kh, Tlen, rotary,
                                      qscale, policy, merge_here, st);
}

template <typename T>
int run_attn(const void* x, const int32_t* hidx, const int32_t* pos, const void* wq, const void* wk, const void* wv,
             const void* wo, const void* bq, const void* bk, const void* bv, const void* bo, const void* rc,
             const void* rs, void* kc, void* vc, const void* residual, void* y, int B, int d, int H, int Hkv, int hd,
             int Kh, int Tlen, int rotary, float scale, int policy, const float2* x_stats, int rms, float eps,
             float2* y_stats, void* ws, cudaStream_t st) {
    const AttnPlan p = plan_attn(B, d, H, Hkv, hd, Kh, Tlen, policy, sizeof(T));
    char* base = static_cast<char*>(ws);
    unsigned* ctr = reinterpret_cast<unsigned*>(base);
    float* qkv = reinterpret_cast<float*>(base + p.off_qkv);
    float* pproj = reinterpret_cast<float*>(base + p.off_pproj);
    float* pattn = reinterpret_cast<float*>(base + p.off_pattn);
    T* o_act = reinterpret_cast<T*>(base + p.off_o);
    float* pdown = reinterpret_cast<float*>(base + p.off_pdown);
    cudaError_t e = cudaSuccess;
    if (x_stats) {  // folded norm: the projections read x as given, so normalise it into the workspace first
        T* xn = reinterpret_cast<T*>(base + p.off_xn);
        e = launch_apply_norm<T>(static_cast<const T*>(x), x_stats, xn, B, d, rms, eps, st);
        if (e != cudaSuccess) return (int)e;
        x = xn;
    }
#define DJV_PROJ(NT)                                                                                                   \
    qkv_proj_kernel<T, NT><<<dim3(p.tiles, p.ksplit), kProjThreads, 0, st>>>(                                        \
        static_cast<const T*>(x), hidx, Kh, H, Hkv, hd, policy, p.nslots, static_cast<const T*>(wq),                  \
        static_cast<const T*>(wk), static_cast<const T*>(wv), static_cast<const T*>(bq), static_cast<const T*>(bk),   \
        static_cast<const T*>(bv), qkv, p.R, pproj, ctr, B, d, p.ksplit)
#define DJV_ROWS_OCC(NB, OCC)                                                                                          \
    launch_pdl(qkv_rows_kernel<T, NB, OCC>, dim3(streamk_ctas(p.proj)), dim3(kSkThreads), 0, st,                      \
        static_cast<const T*>(x), hidx, Kh, H, Hkv, hd, policy, p.nslots, static_cast<const T*>(wq),                  \
        static_cast<const T*>(wk), static_cast<const T*>(wv), static_cast<const T*>(bq), static_cast<const T*>(bk),   \
        static_cast<const T*>(bv), qkv, p.R, pproj, ctr, B, d, p.proj, qkv_early_loads())
#define DJV_ROWS(NB) (qkv_occupancy(B) == 3 ? DJV_ROWS_OCC(NB, 3) : DJV_ROWS_OCC(NB, 2))
    if (!use_rows(B)) {
        if (B > 8) DJV_PROJ(2); else DJV_PROJ(1);
    } else if (rows_nb(B) == 1) e = DJV_ROWS(1);
    else if (rows_nb(B) == 2) e = DJV_ROWS(2);
    else e = DJV_ROWS(4);
#undef DJV_PROJ
#undef DJV_ROWS
#undef DJV_ROWS_OCC
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    const float qscale = scale * 1.4426950408889634f;  // softmax in base 2
    const bool merge_down = merge_in_projection(B, p.nsplit);
    const int mh = merge_down ? 0 : 1;
    const T* rct = static_cast<const T*>(rc);
    const T* rst = static_cast<const T*>(rs);
    T* kct = static_cast<T*>(kc);
    T* vct = static_cast<T*>(vc);
    switch (hd) {
    case 64: e = launch_attn<T, 64>(p, qkv, hidx, pos, rct, rst, kct, vct, pattn, ctr + p.ctr_attn, o_act, B, H, Hkv, Kh,
                                    Tlen, rotary, qscale, policy, mh, st); break;
    case 128: e = launch_attn<T, 128>(p, qkv, hidx, pos, rct, rst, kct, vct, pattn, ctr + p.ctr_attn, o_act, B, H, Hkv,
                                      Kh, Tlen, rotary, qscale, policy, mh, st); break;
    default: e = launch_attn<T, 256>(p, qkv, hidx, pos, rct, rst, kct, vct, pattn, ctr + p.ctr_attn, o_act, B, H, Hkv,
                                     Kh, Tlen, rotary, qscale, policy, mh, st); break;
    }
    if (e != cudaSuccess) return (int)e;
    const SplitParts sp{pattn, p.nsplit, Kh, hd};
    e = launch_down<T>(o_act, p.Mo, hidx, hd, p.Mo, static_cast<const T*>(wo), static_cast<const T*>(bo),
                       static_cast<const T*>(residual), static_cast<T*>(y), pdown, ctr + p.ctr_down, B, d, st, y_stats,
                       merge_down ? &sp : nullptr);
    return (int)e;
}

}  // namespace

extern "C" {

DJV_API size_t djv_head_attention_workspace_size(int B, int d, int H, int Hkv, int hd, int Kh, int T, int kv_policy) {
    if (B < 1 || d < 8 || H < 1 || Hkv < 1 || hd < 16 || Kh < 1 || T < 1) return 0;
    size_t need = 0;  // the largest over 1..B (not monotonic in B; see djv_sparse_mlp_workspace_size)
    for (int b = 1; b <= B && b <= 16; ++b) {
        const size_t t = plan_attn(b, d, H, Hkv, hd, Kh, T, kv_policy, 2).total;
        need = t > need ? t : need;
    }
    return need;
}

DJV_API int djv_head_sparse_attention_folded(const void* x, const int32_t* head_idx, const int32_t* position,
                                             const void* w_q, const void* w_k, const void* w_v, const void* w_o_t,
                                             const void* b_q, const void* b_k, const void* b_v, const void* b_o,
                                             const void* rope_cos, const void* rope_sin, void* k_cache, void* v_cache,
                                             const void* residual, void* y, int B, int d, int H, int Hkv, int hd,
                                             int Kh, int T, int rotary, float scale, int kv_policy,
                                             const float* x_stats, int norm_kind, float norm_eps, float* y_stats,
                                             int dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    if (B < 1 || B > 16 || d < 8 || d % 8 || H < 1 || Hkv < 1 || H % Hkv || Kh < 1 || Kh > H || T < 1)
        return DJV_E_SHAPE;
    if (hd != 64 && hd != 128 && hd != 256) return DJV_E_SHAPE;
    if ((x_stats || y_stats) && d > kStatCols * kStatMaxBlocks) return DJV_E_SHAPE;
    if ((dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16) || (kv_policy != DJV_KV_DENSE && kv_policy != DJV_KV_ACTIVE) ||
        (x_stats && norm_kind != DJV_LAYERNORM && norm_kind != DJV_RMSNORM))
        return DJV_E_DTYPE;
    if (!x || !head_idx || !position || !w_q || !w_k || !w_v || !w_o_t || !k_cache || !v_cache || !y ||
        (rotary && (!rope_cos || !rope_sin)))
        return DJV_E_POINTER;
    if (!aligned16(x) || !aligned16(w_q) || !aligned16(w_k) || !aligned16(w_v) || !aligned16(w_o_t) ||
        !aligned16(k_cache) || !aligned16(v_cache) || !aligned16(workspace) || !aligned16(y) ||
        (residual && !aligned16(residual)) || (x_stats && !aligned16(x_stats)) || (y_stats && !aligned16(y_stats)))
        return DJV_E_POINTER;
    if (x_stats && x_stats == y_stats) return DJV_E_POINTER;
    const AttnPlan p = plan_attn(B, d, H, Hkv, hd, Kh, T, kv_policy, 2);
    if (!workspace || workspace_bytes < p.total) return DJV_E_WORKSPACE;
    if (p.ctr_total > kMaxCounters || p.nsplit > kMaxSplits) return DJV_E_SHAPE;
    const float2* xs = reinterpret_cast<const float2*>(x_stats);
    float2* ys = reinterpret_cast<float2*>(y_stats);
    const int rms = norm_kind == DJV_RMSNORM;
    if (dtype == DJV_FLOAT16)
        return run_attn<__half>(x, head_idx, position, w_q, w_k, w_v, w_o_t, b_q, b_k, b_v, b_o, rope_cos, rope_sin,
                                k_cache, v_cache, residual, y, B, d, H, Hkv, hd, Kh, T, rotary, scale, kv_policy, xs, rms,
                                norm_eps, ys, workspace, stream);
    return run_attn<__nv_bfloat16>(x, head_idx, position, w_q, w_k, w_v, w_o_t, b_q, b_k, b_v, b_o, rope_cos,
                                   rope_sin, k_cache, v_cache, residual, y, B, d, H, Hkv, hd, Kh, T, rotary, scale,
                                   kv_policy, xs, rms, norm_eps, ys, workspace, stream);
}

DJV_API int djv_head_sparse_attention(const void* x, const int32_t* head_idx, const int32_t* position,
                                      const void* w_q, const void* w_k, const void* w_v, const void* w_o_t,
                                      const void* b_q, const void* b_k, const void* b_v, const void* b_o,
                                      const void* rope_cos, const void* rope_sin, void* k_cache, void* v_cache,
                                      const void* residual, void* y, int B, int d, int H, int Hkv, int hd, int Kh, int T, int rotary,
                                      float scale, int kv_policy, int dtype, void* workspace,
                                      size_t workspace_bytes, cudaStream_t stream) {
    return djv_head_sparse_attention_folded(x, head_idx, position, w_q, w_k, w_v, w_o_t, b_q, b_k, b_v, b_o, rope_cos,
                                            rope_sin, k_cache, v_cache, residual, y, B, d, H, Hkv, hd, Kh, T, rotary,
                                            scale, kv_policy, nullptr, DJV_LAYERNORM, 0.f, nullptr, dtype, workspace,
                                            workspace_bytes, stream);
}

#ifdef DJV_TRACE
DJV_TRACE_ACCESSORS(attn)  // the timeline probe's accessors (djv_trace.cuh)
#endif

}  // extern "C"
