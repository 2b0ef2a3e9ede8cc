// Batch-1 head-sparse attention as one kernel per layer (sm_90, thread-block clusters). Included by
// headSparseAttentionKernel.cu inside its anonymous namespace (uses rope_at / round_to from there).
//
// Why: at batch 1 the split path runs five kernels (norm, QKV rows, attention core, output projection, its
// reduction) and each makes its own chain of dependent global-memory round trips: the QKV partials and
// their last-arrival sum, the attention splits' merge, the projection's partials. Here one cluster of C
// CTAs owns one selected head, and the cross-CTA steps go through distributed shared memory and cluster
// barriers instead of global memory:
//   1. every CTA normalises x into shared memory and computes 3*hd/C of the head's Q/K/V rows (16-byte
//      loads, one warp per 512-byte chunk, chunk partials summed in a fixed order);
//   2. cluster barrier; every CTA gathers the head's q, k, v from its peers, applies RoPE; rank 0 writes the
//      new K/V row into the cache;
//   3. every CTA runs softmax attention over its contiguous 1/C of the context (slot `pos` from the fresh
//      k, v, as the split path does) into (max, sum, o[hd]);
//   4. cluster barrier; every CTA merges the C partials in rank order (identical in all CTAs), rounds o;
//   5. every CTA multiplies o with its 1/C of the head's output-projection columns into a float partial
//      [head][d]; rows_reduce_kernel then sums the heads in order (+ bias, residual, statistics).
// Limits (else the split path runs): batch 1, H == Hkv, KV policy "active", ceil(T / C) <= kFusedMaxL.
// (headSparseAttentionKernel.cu includes <cooperative_groups.h> at file scope.)
#pragma once

namespace cg = cooperative_groups;

constexpr int kFusedThreads = 512;
constexpr int kFusedWarps = kFusedThreads / 32;
constexpr int kFusedMaxL = 4096;     // context tokens per CTA (their scores sit in shared memory)
constexpr int kFusedRed = 4096;      // floats of the reduction buffer (attention values, projection partials)

// Shared-memory layout (bytes), computed the same way on the host and in the kernel.
struct FusedLayout {
    int nch, rpc;
    size_t xs, pp, mine, full, qs, kn, vn, sc, red, opart, osum, wsm, total;
    __host__ __device__ FusedLayout(int d, int hd, int C, int Lmax) {
        nch = cdiv(d, kRowChunk);
        rpc = 3 * hd / C;
        size_t o = 0;
        xs = o;    o += align_up((size_t)d * 2, 16);           // x (normalised), I/O dtype
        pp = o;    o += align_up((size_t)rpc * nch * 4, 16);   // chunk partials of this CTA's rows
        mine = o;  o += align_up((size_t)rpc * 4, 16);         // this CTA's rows of [q k v] (read by peers)
        full = o;  o += (size_t)3 * hd * 4;                    // the head's [q k v]
        qs = o;    o += (size_t)hd * 4;
        kn = o;    o += (size_t)hd * 4;
        vn = o;    o += (size_t)hd * 4;
        sc = o;    o += align_up((size_t)Lmax * 4, 16);
        red = o;   o += (size_t)kFusedRed * 4;
        opart = o; o += align_up((size_t)(hd + 2) * 4, 16);    // o, max, sum of this CTA (read by peers)
        osum = o;  o += (size_t)hd * 4;
        wsm = o;   o += 16 * 4;
        total = o;
    }
};

__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// grid Kh * C (cluster C along x), 512 threads. part: [Kh][d] float partials of the output projection.
template <typename T, int HD, int C>
__global__ void __launch_bounds__(kFusedThreads, 1) attn_fused_kernel(
    const T* __restrict__ x, const float2* __restrict__ x_stats, int rms, float eps,
    const int32_t* __restrict__ head_idx, const int32_t* __restrict__ position, const T* __restrict__ wq,
    const T* __restrict__ wk, const T* __restrict__ wv, const T* __restrict__ bq, const T* __restrict__ bk,
    const T* __restrict__ bv, const T* __restrict__ rcos, const T* __restrict__ rsin, T* __restrict__ kc,
    T* __restrict__ vc, const T* __restrict__ wo_t, float* __restrict__ part, int H, int d, int Tlen, int rotary,
    float qscale, int kv_prefetch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(3 * HD % C == 0, "rows per CTA");
    extern __shared__ __align__(16) unsigned char fsm[];
    __shared__ float s_norm[2], s_max[kFusedWarps], s_sum[kFusedWarps];
    const FusedLayout Ly(d, HD, C, cdiv(Tlen, C));
    T* xs = reinterpret_cast<T*>(fsm + Ly.xs);
    float* pp = reinterpret_cast<float*>(fsm + Ly.pp);
    float* mine = reinterpret_cast<float*>(fsm + Ly.mine);
    float* full = reinterpret_cast<float*>(fsm + Ly.full);
    float* q_s = reinterpret_cast<float*>(fsm + Ly.qs);
    float* kn_s = reinterpret_cast<float*>(fsm + Ly.kn);
    float* vn_s = reinterpret_cast<float*>(fsm + Ly.vn);
    float* sc = reinterpret_cast<float*>(fsm + Ly.sc);
    float* red = reinterpret_cast<float*>(fsm + Ly.red);
    float* opart = reinterpret_cast<float*>(fsm + Ly.opart);
    float* osum = reinterpret_cast<float*>(fsm + Ly.osum);
    float* wsm = reinterpret_cast<float*>(fsm + Ly.wsm);
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const int p = blockIdx.x / C;  // which selected head
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int nch = Ly.nch, rpc = Ly.rpc, items = rpc * nch;

    pdl_wait_primary();       // x, x_stats come from the kernel before (and nothing is written before this)
    pdl_launch_dependents();  // the head reduction may launch; it waits for this grid
    const int h = __ldg(head_idx + p);
    const int pos = __ldg(position);
    const int Lc = cdiv(pos + 1, C);
    const int t0 = rank * Lc, t1 = min(t0 + Lc, pos + 1);
    const size_t kvbase = (size_t)h * Tlen * HD;

    // 1. Q/K/V rows. The first batch of weight loads goes out before x is staged. 16 loads in flight per
    // lane: one CTA per SM must cover the HBM latency alone (8 measured 38.8 us for the op at C = 8).
    constexpr int U = 16;
    auto wrow = [&](int i) {
        const int gr = rank * rpc + i, which = gr / HD, e = gr % HD;
        return (which == 0 ? wq : (which == 1 ? wk : wv)) + ((size_t)h * HD + e) * d;
    };
    uint4 w4[U];
    auto load_batch = [&](int j0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int it = wid + kFusedWarps * (j0 + u);
            const int i = it / nch, off = (it % nch) * kRowChunk + lane * 8;
            w4[u] = (it < items && off < d) ? ld_stream(wrow(i) + off) : zero4();
        }
    };
    load_batch(0);
    if (kv_prefetch && t1 > t0) {  // this CTA's K/V rows, into L2 while the projection runs
        constexpr int LINES = HD * (int)sizeof(T) / 128 > 0 ? HD * (int)sizeof(T) / 128 : 1;
        for (int i = tid; i < (t1 - t0) * LINES * 2; i += kFusedThreads) {
            const int t = t0 + i / (2 * LINES), ln = (i / 2) % LINES;
            const T* base = (i & 1) ? vc : kc;
            prefetch_l2(base + kvbase + (size_t)t * HD + ln * (128 / sizeof(T)));
        }
    }
    if (x_stats) {
        if (wid == 0) {
            float m, r;
            norm_from_stats(x_stats, d, rms, eps, m, r);
            if (lane == 0) { s_norm[0] = m; s_norm[1] = r; }
        }
        __syncthreads();
    }
    {
        const float mean = x_stats ? s_norm[0] : 0.f, rstd = x_stats ? s_norm[1] : 1.f;
        for (int c = tid; c < d / 8; c += kFusedThreads) {
            uint4 v = ld_keep(x + (size_t)c * 8);
            if (x_stats) {
                float f[8];
                unpack8<T>(v, f);
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] = (f[e] - mean) * rstd;
                v = make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
            }
            reinterpret_cast<uint4*>(xs)[c] = v;
        }
    }
    __syncthreads();
    for (int j0 = 0;; j0 += U) {
        float s[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int it = wid + kFusedWarps * (j0 + u);
            const int off = (it % nch) * kRowChunk + lane * 8;
            float wf[8], xf[8];
            unpack8<T>(w4[u], wf);
            unpack8<T>((it < items && off < d) ? *reinterpret_cast<const uint4*>(xs + off) : zero4(), xf);
            float a = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) a = fmaf(wf[e], xf[e], a);
            s[u] = a;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) s[u] = warp_sum(s[u]);
        if (lane == 0) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int it = wid + kFusedWarps * (j0 + u);
                if (it < items) pp[it] = s[u];
            }
        }
        if (wid + kFusedWarps * (j0 + U) >= items) break;
        load_batch(j0 + U);
    }
    __syncthreads();
    for (int i = tid; i < rpc; i += kFusedThreads) {
        float v = 0.f;
        for (int k = 0; k < nch; ++k) v += pp[i * nch + k];
        const int gr = rank * rpc + i, which = gr / HD, e = gr % HD;
        const T* bias = which == 0 ? bq : (which == 1 ? bk : bv);
        mine[i] = v + (bias ? to_f(bias[(size_t)h * HD + e]) : 0.f);
    }
    // 2. gather the head's q, k, v from the cluster
    cluster_arrive();
    cluster_wait();
    for (int t = tid; t < 3 * HD; t += kFusedThreads) full[t] = cluster.map_shared_rank(mine, t / rpc)[t % rpc];
    __syncthreads();
    for (int e = tid; e < HD; e += kFusedThreads) {
        q_s[e] = (rotary ? rope_at(full, e, HD, rcos, rsin, pos) : full[e]) * qscale;
        const float kr = rotary ? rope_at(full + HD, e, HD, rcos, rsin, pos) : full[HD + e];
        const float vr = full[2 * HD + e];
        kn_s[e] = round_to<T>(kr);
        vn_s[e] = round_to<T>(vr);
        if (rank == 0) {  // no CTA reads slot pos from the cache this step
            kc[kvbase + (size_t)pos * HD + e] = from_f<T>(kr);
            vc[kvbase + (size_t)pos * HD + e] = from_f<T>(vr);
        }
    }
    __syncthreads();

    // 3. attention over tokens [t0, t1)
    constexpr int TPR = HD / 8, RP = kFusedThreads / TPR, UNR = 4;
    static_assert(RP * HD <= kFusedRed, "attention reduction buffer");
    const int r = tid / TPR, l = tid % TPR;
    float qreg[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) qreg[e] = q_s[l * 8 + e];
    const T* kb = kc + kvbase + l * 8;
    const T* vb = vc + kvbase + l * 8;
    uint4 vpre[UNR];  // the first pass's V rows travel with its K rows
    for (int tb = t0; tb < t1; tb += UNR * RP) {
        uint4 k4[UNR];
#pragma unroll
        for (int j = 0; j < UNR; ++j) {
            const int t = tb + j * RP + r;
            const bool ld = t < t1 && t != pos;
            k4[j] = ld ? ld_stream(kb + (size_t)t * HD) : zero4();
            if (tb == t0) vpre[j] = ld ? ld_stream(vb + (size_t)t * HD) : zero4();
        }
#pragma unroll
        for (int j = 0; j < UNR; ++j) {
            const int t = tb + j * RP + r;
            float kf[8];
            if (t == pos) {
#pragma unroll
                for (int e = 0; e < 8; ++e) kf[e] = kn_s[l * 8 + e];
            } else unpack8<T>(k4[j], kf);
            float sv = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) sv = fmaf(qreg[e], kf[e], sv);
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1) sv += __shfl_xor_sync(0xffffffffu, sv, o);
            if (l == 0 && t < t1) sc[t - t0] = sv;
        }
    }
    __syncthreads();
    const int n = t1 > t0 ? t1 - t0 : 0;
    float mx = -INFINITY;
    for (int i = tid; i < n; i += kFusedThreads) mx = fmaxf(mx, sc[i]);
    mx = warp_max(mx);
    if (lane == 0) s_max[wid] = mx;
    __syncthreads();
    mx = warp_max(lane < kFusedWarps ? s_max[lane] : -INFINITY);
    float sum = 0.f;
    for (int i = tid; i < n; i += kFusedThreads) {
        const float pr = exp2f(sc[i] - mx);
        sc[i] = pr;
        sum += pr;
    }
    sum = warp_sum(sum);
    if (lane == 0) s_sum[wid] = sum;
    __syncthreads();
    sum = warp_sum(lane < kFusedWarps ? s_sum[lane] : 0.f);
    float oacc[8] = {};
    for (int tb = t0; tb < t1; tb += UNR * RP) {
        uint4 v4[UNR];
#pragma unroll
        for (int j = 0; j < UNR; ++j) {
            const int t = tb + j * RP + r;
            v4[j] = tb == t0 ? vpre[j] : ((t < t1 && t != pos) ? ld_stream(vb + (size_t)t * HD) : zero4());
        }
#pragma unroll
        for (int j = 0; j < UNR; ++j) {
            const int t = tb + j * RP + r;
            if (t >= t1) continue;
            float vf[8];
            if (t == pos) {
#pragma unroll
                for (int e = 0; e < 8; ++e) vf[e] = vn_s[l * 8 + e];
            } else unpack8<T>(v4[j], vf);
            const float pr = sc[t - t0];
#pragma unroll
            for (int e = 0; e < 8; ++e) oacc[e] = fmaf(pr, vf[e], oacc[e]);
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) red[r * HD + l * 8 + e] = oacc[e];
    __syncthreads();
    for (int e = tid; e < HD; e += kFusedThreads) {
        float s = 0.f;
        for (int rr = 0; rr < RP; ++rr) s += red[rr * HD + e];
        opart[e] = s;
    }
    if (tid == 0) { opart[HD] = mx; opart[HD + 1] = sum; }

    // 4. merge the cluster's partial softmaxes, in rank order
    cluster_arrive();
    cluster_wait();
    if (wid == 0) {
        float mk = -INFINITY, lk = 0.f;
        if (lane < C) {
            const float* pk = cluster.map_shared_rank(opart, lane);
            mk = pk[HD];
            lk = pk[HD + 1];
        }
        const float M = warp_max(lk > 0.f ? mk : -INFINITY);
        const float w = (lane < C && lk > 0.f) ? exp2f(mk - M) : 0.f;
        const float den = warp_sum(w * lk);  // > 0: the CTA holding pos has sum >= 1
        if (lane < C) wsm[lane] = w / den;
    }
    __syncthreads();
    for (int e = tid; e < HD; e += kFusedThreads) {
        float num = 0.f;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const float w = wsm[k];
            if (w != 0.f) num = fmaf(w, cluster.map_shared_rank(opart, k)[e], num);
        }
        osum[e] = round_to<T>(num);
    }
    cluster_arrive();  // done reading the peers' shared memory (the matching wait is before exit)
    __syncthreads();

    // 5. output projection: this CTA's columns of the head's rows of w_o_t
    const int NG = d / 8, GPC = cdiv(NG, C), g0 = rank * GPC;
    const int ng = NG - g0 < GPC ? NG - g0 : GPC;
    const int RS = kFusedThreads / GPC;  // row slices (host: GPC <= kFusedThreads, RS * GPC * 8 <= kFusedRed)
    const int g = tid % GPC, rs = tid / GPC;
    float acc[8] = {};
    if (rs < RS && g < ng) {
        const T* wb = wo_t + (size_t)h * HD * d + (size_t)(g0 + g) * 8;
        constexpr int UO = 16;
        for (int e0 = rs; e0 < HD; e0 += RS * UO) {
            uint4 ww[UO];
#pragma unroll
            for (int u = 0; u < UO; ++u) {
                const int e = e0 + u * RS;
                ww[u] = e < HD ? ld_stream(wb + (size_t)e * d) : zero4();
            }
#pragma unroll
            for (int u = 0; u < UO; ++u) {
                const int e = e0 + u * RS;
                if (e >= HD) break;
                float wf[8];
                unpack8<T>(ww[u], wf);
                const float ov = osum[e];
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[j] = fmaf(ov, wf[j], acc[j]);
            }
        }
    }
    if (rs < RS) {
#pragma unroll
        for (int j = 0; j < 8; ++j) red[(rs * GPC + g) * 8 + j] = acc[j];
    }
    __syncthreads();
    for (int c = tid; c < ng * 8; c += kFusedThreads) {
        const int gg = c / 8, j = c % 8;
        float s = 0.f;
        for (int rr = 0; rr < RS; ++rr) s += red[(rr * GPC + gg) * 8 + j];
        part[(size_t)p * d + (size_t)g0 * 8 + c] = s;
    }
    cluster_wait();  // no CTA leaves while a peer may still read its shared memory
#endif
}

// DJV_ATTN_FUSED=0|1 (read once): the batch-1 fused kernel off / on where it applies.
// DJV_ATTN_CLUSTER=8|16: cluster size (default 16 when the device can run such clusters, else 8).
// DJV_ATTN_KV_PREFETCH=0|1: the L2 prefetch of each CTA's K/V rows (default on).
inline bool attn_fused_on() {
    static const bool on = env_int("DJV_ATTN_FUSED", 0, 1, 0) == 1;
    return on;
}
inline int attn_kv_prefetch() {
    static const int v = env_int("DJV_ATTN_KV_PREFETCH", 0, 1, 1);
    return v;
}

template <typename T, int HD, int C>
inline cudaError_t fused_func_attrs(size_t smem) {
    cudaError_t e = cudaFuncSetAttribute(attn_fused_kernel<T, HD, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e == cudaSuccess && C > 8)
        e = cudaFuncSetAttribute(attn_fused_kernel<T, HD, C>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    return e;
}

// Whether clusters of 16 fit on this device (non-portable size), checked once with a representative layout.
inline bool cluster16_ok() {
    static const int ok = [] {
        const size_t smem = FusedLayout(8192, 128, 16, 256).total;
        if (fused_func_attrs<__half, 128, 16>(smem) != cudaSuccess) { cudaGetLastError(); return 0; }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(16);
        cfg.blockDim = dim3(kFusedThreads);
        cfg.dynamicSmemBytes = smem;
        cudaLaunchAttribute a[1];
        a[0].id = cudaLaunchAttributeClusterDimension;
        a[0].val.clusterDim.x = 16;
        a[0].val.clusterDim.y = 1;
        a[0].val.clusterDim.z = 1;
        cfg.attrs = a;
        cfg.numAttrs = 1;
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, attn_fused_kernel<__half, 128, 16>, &cfg) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        if (getenv("DJV_ATTN_DEBUG")) {
            int n8 = 0;
            cudaLaunchConfig_t c8 = cfg;
            cudaLaunchAttribute a8[1] = {a[0]};
            a8[0].val.clusterDim.x = 8;
            c8.attrs = a8;
            c8.gridDim = dim3(8);
            fused_func_attrs<__half, 128, 8>(smem);
            cudaOccupancyMaxActiveClusters(&n8, attn_fused_kernel<__half, 128, 8>, &c8);
            fprintf(stderr, "djv: fused attention: at most %d clusters of 16 and %d of 8 active\n", n, n8);
        }
        return n > 0 ? 1 : 0;
    }();
    return ok != 0;
}

// Cluster size of the fused kernel for this call, 0 when the split path runs.
inline int fused_cluster(int B, int d, int H, int Hkv, int hd, int T, int policy) {
    if (!attn_fused_on() || B != 1 || H != Hkv || policy != DJV_KV_ACTIVE || !is_sm90_or_newer()) return 0;
    static const int env_c = env_int("DJV_ATTN_CLUSTER", 8, 16, 0);
    const int C = (env_c == 8 || env_c == 16) ? env_c : (cluster16_ok() ? 16 : 8);
    if (cdiv(T, C) > kFusedMaxL) return 0;
    const int GPC = cdiv(d / 8, C);
    if (GPC > kFusedThreads || (kFusedThreads / GPC) * GPC * 8 > kFusedRed) return 0;
    if (FusedLayout(d, hd, C, cdiv(T, C)).total > (size_t)smem_optin()) return 0;
    return C;
}

template <typename T, int HD, int C>
cudaError_t launch_fused(const T* x, const float2* x_stats, int rms, float eps, const int32_t* hidx,
                         const int32_t* pos, const T* wq, const T* wk, const T* wv, const T* bq, const T* bk,
                         const T* bv, const T* rc, const T* rs, T* kc, T* vc, const T* wo_t, float* part, int H,
                         int Kh, int d, int Tlen, int rotary, float qscale, cudaStream_t st) {
    const size_t smem = FusedLayout(d, HD, C, cdiv(Tlen, C)).total;
    cudaError_t e = fused_func_attrs<T, HD, C>(smem);
    if (e != cudaSuccess) return e;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(Kh * C);
    cfg.blockDim = dim3(kFusedThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute a[2];
    a[0].id = cudaLaunchAttributeClusterDimension;
    a[0].val.clusterDim.x = C;
    a[0].val.clusterDim.y = 1;
    a[0].val.clusterDim.z = 1;
    a[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = a;
    cfg.numAttrs = pdl_enabled() ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, attn_fused_kernel<T, HD, C>, x, x_stats, rms, eps, hidx, pos, wq, wk, wv, bq, bk,
                              bv, rc, rs, kc, vc, wo_t, part, H, d, Tlen, rotary, qscale, attn_kv_prefetch());
}

template <typename T, int HD>
cudaError_t launch_fused_hd(int C, const T* x, const float2* x_stats, int rms, float eps, const int32_t* hidx,
                            const int32_t* pos, const T* wq, const T* wk, const T* wv, const T* bq, const T* bk,
                            const T* bv, const T* rc, const T* rs, T* kc, T* vc, const T* wo_t, float* part, int H,
                            int Kh, int d, int Tlen, int rotary, float qscale, cudaStream_t st) {
    if (C == 16)
        return launch_fused<T, HD, 16>(x, x_stats, rms, eps, hidx, pos, wq, wk, wv, bq, bk, bv, rc, rs, kc, vc, wo_t,
                                       part, H, Kh, d, Tlen, rotary, qscale, st);
    return launch_fused<T, HD, 8>(x, x_stats, rms, eps, hidx, pos, wq, wk, wv, bq, bk, bv, rc, rs, kc, vc, wo_t, part,
                                  H, Kh, d, Tlen, rotary, qscale, st);
}
