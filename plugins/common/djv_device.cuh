// djv_device.cuh - device building blocks shared by the dejavu kernels.
//
// The sparse GEMVs run on the tensor cores (mma.sync m16n8k16, fp32 accumulate) even at batch 1: the
// point is not FLOPs but that one 16-byte load per thread feeds a whole fragment, so each active weight
// byte is loaded exactly once, straight from HBM into registers, with no shared-memory staging.
// The trick: a dot product is invariant under any permutation of its k axis (and an output axis may be
// permuted if the store follows), so we let each thread's 8 contiguous elements *be* its fragment slots.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace djv {

constexpr int kTargetCtas = 264;         // grid-size goal for the small kernels (~2 CTAs per SM of an H100/H200)
constexpr size_t kCounterBytes = 262144;  // counter region (zeroed once) at the start of every workspace
constexpr int kMaxCounters = int(kCounterBytes / 4);

__host__ __device__ inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
__host__ __device__ inline int cdiv(int a, int b) { return (a + b - 1) / b; }

template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// element i (0..1) of a packed pair, as float
template <typename T> __device__ __forceinline__ float pair_f(uint32_t w, int i) {
    uint16_t bits = i ? uint16_t(w >> 16) : uint16_t(w & 0xffffu);
    T v;
    *reinterpret_cast<uint16_t*>(&v) = bits;
    return to_f(v);
}
template <typename T> __device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
    f[0] = pair_f<T>(u.x, 0); f[1] = pair_f<T>(u.x, 1); f[2] = pair_f<T>(u.y, 0); f[3] = pair_f<T>(u.y, 1);
    f[4] = pair_f<T>(u.z, 0); f[5] = pair_f<T>(u.z, 1); f[6] = pair_f<T>(u.w, 0); f[7] = pair_f<T>(u.w, 1);
}
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b) {
    T x = from_f<T>(a), y = from_f<T>(b);
    return uint32_t(*reinterpret_cast<uint16_t*>(&x)) | (uint32_t(*reinterpret_cast<uint16_t*>(&y)) << 16);
}

// Weights are read exactly once: bypass L1 so they do not evict the small reused operands.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
__device__ __forceinline__ uint4 ld_keep(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

// Row m of the active set -> matrix row, for index sets of blocks of `bs` consecutive rows.
__device__ __forceinline__ int expand_row(const int32_t* __restrict__ idx, int m, int bs) {
    return bs == 1 ? __ldg(idx + m) : __ldg(idx + m / bs) * bs + m % bs;
}

}  // namespace djv

namespace djv {

// Split-K arrival: every CTA of a group publishes its partial, the last one to arrive reduces them in a
// fixed order (deterministic) and re-arms the counter to zero for the next call / graph replay.
__device__ __forceinline__ bool last_arrival(unsigned* ctr, unsigned n) {
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned prev = atomicAdd(ctr, 1u);
        s_last = (prev == n - 1);
        if (s_last) *ctr = 0u;
    }
    __syncthreads();
    if (s_last) __threadfence();
    return s_last;
}

__device__ __forceinline__ uint32_t word_of(const uint4& u, int w) {
    return w == 0 ? u.x : (w == 1 ? u.y : (w == 2 ? u.z : u.w));
}

// ---------------------------------------------------------------------------------------------
// Warp-level stream-K. A GEMV's work is `items` output tiles x `per_item` steps of reduction; flattened
// item-major, it is dealt out to warps in contiguous runs of q steps, sized so that every warp of one
// resident wave gets the same bytes to move (no half-empty last wave, whatever the kept fraction). A warp
// usually finishes its item alone; when a run splits an item, each warp publishes its partial into the
// item's slot for it and the warp that completes the count sums the slots in a fixed order (deterministic).
struct StreamK {
    int per_item;     // steps per item
    int q;            // steps per warp
    int warps;        // warps launched (the last may get fewer steps)
    int max_slots;    // partial slots per item
    long long total;  // items * per_item
};

constexpr int kSkThreads = 256;   // 8 independent warps per CTA, 2 CTAs per SM (<= 128 registers)
constexpr int kSkWarpsPerSm = 16;

inline int sm_count();
inline StreamK plan_streamk(long long items, int per_item, int min_q) {
    StreamK k;
    k.per_item = per_item;
    k.total = items * per_item;
    const long long wmax = (long long)sm_count() * kSkWarpsPerSm;
    long long q = (k.total + wmax - 1) / wmax;
    if (q < min_q) q = min_q;
    k.q = (int)q;
    k.warps = (int)((k.total + q - 1) / q);
    k.max_slots = cdiv(per_item, k.q) + 1;
    return k;
}
inline int streamk_ctas(const StreamK& k) { return cdiv(k.warps, kSkThreads / 32); }

// Slot of warp gw's partial of `item`: warps are numbered along the flattened step axis.
__device__ __forceinline__ int sk_first_warp(const StreamK& k, int item) {
    return (int)(((long long)item * k.per_item) / k.q);
}
__device__ __forceinline__ int sk_last_warp(const StreamK& k, int item) {
    return (int)(((long long)item * k.per_item + k.per_item - 1) / k.q);
}

// Count n steps of an item as done; true in the one warp that completes it, which may then read every
// slot of the item (fenced). That warp re-arms the counter for the next call / graph replay.
__device__ __forceinline__ bool warp_publish(unsigned* ctr, unsigned n, unsigned per_item) {
    __threadfence();
    __syncwarp();
    unsigned prev = 0;
    if ((threadIdx.x & 31) == 0) {
        prev = atomicAdd(ctr, n);
        if (prev + n == per_item) *ctr = 0u;
    }
    prev = __shfl_sync(0xffffffffu, prev, 0);
    const bool last = prev + n == per_item;
    if (last) __threadfence();
    return last;
}

// ---------------------------------------------------------------------------------------------
// Stream-K row-tile GEMV: items = 16-row tiles, steps = 32 elements of d. For every tile this warp
// completes, epi(tile, acc) gets acc[mat][nt][j] = sum over all of d of W_mat[row] . x[batch], with row
// g (+8 for j >= 2) of the tile and batch nt*8 + 2c + (j & 1) (the mma accumulator layout).
// rows(tile, r0, r1) points r0/r1 at rows g and g+8 of each matrix and returns false to skip the tile
// (the choice must depend on the tile only, so that all warps sharing it skip it).
template <int NT, int NMAT> __host__ __device__ constexpr int tile_unroll() { return (NT == 1 ? 8 : 4) / NMAT; }
template <int NT, int NMAT> __host__ __device__ constexpr int tile_slot_floats() { return NMAT * NT * 4 * 32; }

template <typename T, int NT, int NMAT, typename RowsF, typename EpiF>
__device__ __forceinline__ void streamk_tiles(const T* __restrict__ x, int B, int d, float* __restrict__ part,
                                              unsigned* __restrict__ ctr, const StreamK& sk, RowsF rows, EpiF epi) {
    constexpr int U = tile_unroll<NT, NMAT>();        // 16-byte weight loads in flight: 2*U*NMAT per thread
    constexpr int SLOT = tile_slot_floats<NT, NMAT>();  // a warp's partial, lane-major
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    long long s = (long long)gw * sk.q;
    const long long s_end = s + sk.q < sk.total ? s + sk.q : sk.total;
    const T* xr0 = x + (size_t)g * d;
    const T* xr1 = x + (size_t)(g + 8) * d;
    const bool xv0 = g < B, xv1 = (g + 8) < B;
    while (s < s_end) {
        const int tile = (int)(s / sk.per_item);
        const int k0 = (int)(s - (long long)tile * sk.per_item);
        const int k1 = (int)(k0 + (s_end - s) < sk.per_item ? k0 + (s_end - s) : sk.per_item);
        s += k1 - k0;
        const T* r0[NMAT];
        const T* r1[NMAT];
        if (!rows(tile, r0, r1)) continue;
        float acc[NMAT][NT][4] = {};
        for (int ks = k0; ks < k1; ks += U) {
            uint4 wa[NMAT][U], wb[NMAT][U], xa[NT][U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = (ks + u) * 32 + c * 8;
                const bool ok = ks + u < k1 && off < d;
#pragma unroll
                for (int m = 0; m < NMAT; ++m) {
                    wa[m][u] = ok ? ld_stream(r0[m] + off) : zero4();
                    wb[m][u] = ok ? ld_stream(r1[m] + off) : zero4();
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = (ks + u) * 32 + c * 8;
                const bool ok = ks + u < k1 && off < d;
                xa[0][u] = (ok && xv0) ? ld_keep(xr0 + off) : zero4();
                if (NT == 2) xa[NT - 1][u] = (ok && xv1) ? ld_keep(xr1 + off) : zero4();
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int m = 0; m < NMAT; ++m)
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        Mma<T>::run(acc[m][t], wa[m][u].x, wb[m][u].x, wa[m][u].y, wb[m][u].y, xa[t][u].x,
                                    xa[t][u].y);
                        Mma<T>::run(acc[m][t], wa[m][u].z, wb[m][u].z, wa[m][u].w, wb[m][u].w, xa[t][u].z,
                                    xa[t][u].w);
                    }
        }
        if (!(k0 == 0 && k1 == sk.per_item)) {  // split tile: publish; the completing warp sums in order
            float* slots = part + (size_t)tile * sk.max_slots * SLOT;
            float* mine = slots + (size_t)(gw - sk_first_warp(sk, tile)) * SLOT;
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int j = 0; j < 4; ++j) mine[((m * NT + t) * 4 + j) * 32 + lane] = acc[m][t][j];
            if (!warp_publish(ctr + tile, (unsigned)(k1 - k0), (unsigned)sk.per_item)) continue;
            const int nslots = sk_last_warp(sk, tile) - sk_first_warp(sk, tile) + 1;
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        float v = 0.f;
                        for (int k = 0; k < nslots; ++k)
                            v += __ldcg(slots + (size_t)k * SLOT + ((m * NT + t) * 4 + j) * 32 + lane);
                        acc[m][t][j] = v;
                    }
        }
        epi(tile, acc);
    }
}
inline StreamK plan_tiles(int tiles, int d) { return plan_streamk(tiles, cdiv(d, 32), 4); }
inline size_t tiles_part_floats(const StreamK& k, int tiles, int nt, int nmat) {
    return (size_t)tiles * k.max_slots * nmat * nt * 128;
}

// ---------------------------------------------------------------------------------------------
// Down projection over active rows: y[b, :] = sum_m act[b, m] * W[row(m), :] (+ bias).
// act is [16][Mpad] in T (row b = batch), Mpad % 16 == 0, padded entries (m >= M) are zero.
// Items = 64-column slices of y, steps = 16-row groups (warp stream-K, above). mma as
// D[b, col] = act^T[b, rows] . W[rows, col]: thread (g, c) loads 16 bytes (cols g*8..g*8+7) of rows 2c,
// 2c+1, 2c+8, 2c+9, and column t of that run is n-tile t's column g. U groups are loaded before any mma,
// so each thread keeps 4*U independent 16-byte loads in flight.
constexpr int kDownCols = 64;
constexpr int kDownU = 4;

template <typename T>
__global__ void __launch_bounds__(kSkThreads, 2) down_kernel(const T* __restrict__ act, int Mpad,
                                                             const int32_t* __restrict__ idx, int bs, int M,
                                                             const T* __restrict__ w, const T* __restrict__ bias,
                                                             T* __restrict__ y, float* __restrict__ part,
                                                             unsigned* __restrict__ ctr, int B, int d, StreamK sk) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int gw = blockIdx.x * (kSkThreads / 32) + (threadIdx.x >> 5);
    long long s = (long long)gw * sk.q;
    const long long s_end = s + sk.q < sk.total ? s + sk.q : sk.total;
    const T* arow0 = act + (size_t)g * Mpad;
    const T* arow1 = act + (size_t)(g + 8) * Mpad;
    const int slot_floats = B * kDownCols;
    while (s < s_end) {
        const int slice = (int)(s / sk.per_item);
        const int j0 = (int)(s - (long long)slice * sk.per_item);
        const int j1 = (int)(j0 + (s_end - s) < sk.per_item ? j0 + (s_end - s) : sk.per_item);
        s += j1 - j0;
        const int col = slice * kDownCols + g * 8;
        const bool colok = col < d;  // d % 8 == 0: a run is all in or all out
        float acc[8][4];
#pragma unroll
        for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
        for (int jg = j0; jg < j1; jg += kDownU) {
            uint4 wv[kDownU][4];
            uint32_t a[kDownU][4];
#pragma unroll
            for (int u = 0; u < kDownU; ++u) {
                const bool ok = jg + u < j1;
                const int jb = (jg + u) * 16;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int m = jb + 2 * c + (i & 1) + (i >> 1) * 8;
                    const int row = expand_row(idx, m < M ? m : M - 1, bs);  // padded rows: act is 0
                    wv[u][i] = (ok && colok) ? ld_stream(w + (size_t)row * d + col) : zero4();
                }
                a[u][0] = ok ? *reinterpret_cast<const uint32_t*>(arow0 + jb + 2 * c) : 0u;
                a[u][1] = ok ? *reinterpret_cast<const uint32_t*>(arow1 + jb + 2 * c) : 0u;
                a[u][2] = ok ? *reinterpret_cast<const uint32_t*>(arow0 + jb + 2 * c + 8) : 0u;
                a[u][3] = ok ? *reinterpret_cast<const uint32_t*>(arow1 + jb + 2 * c + 8) : 0u;
            }
#pragma unroll
            for (int u = 0; u < kDownU; ++u)
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    const uint32_t sel = (t & 1) ? 0x7632u : 0x5410u;
                    const uint32_t b0 = __byte_perm(word_of(wv[u][0], t >> 1), word_of(wv[u][1], t >> 1), sel);
                    const uint32_t b1 = __byte_perm(word_of(wv[u][2], t >> 1), word_of(wv[u][3], t >> 1), sel);
                    Mma<T>::run(acc[t], a[u][0], a[u][1], a[u][2], a[u][3], b0, b1);
                }
        }
        // acc[t][0/1]: batch g, slice columns 16c + t and 16c + 8 + t; acc[t][2/3]: batch g + 8.
        const int cbase = slice * kDownCols;
        if (j0 == 0 && j1 == sk.per_item) {  // whole slice in this warp: write y directly
#pragma unroll
            for (int t = 0; t < 8; ++t)
#pragma unroll
                for (int j = 0; j < 4; ++j) {  // this thread's outputs are not the columns it loaded
                    const int b = g + (j >> 1) * 8, cc = cbase + 16 * c + 8 * (j & 1) + t;
                    if (b < B && cc < d) y[(size_t)b * d + cc] = from_f<T>(acc[t][j] + (bias ? to_f(bias[cc]) : 0.f));
                }
            continue;
        }
        float* slots = part + (size_t)slice * sk.max_slots * slot_floats;
        float* mine = slots + (size_t)(gw - sk_first_warp(sk, slice)) * slot_floats;
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int b = g + (j >> 1) * 8;
                if (b < B) mine[b * kDownCols + 16 * c + 8 * (j & 1) + t] = acc[t][j];
            }
        if (!warp_publish(ctr + slice, (unsigned)(j1 - j0), (unsigned)sk.per_item)) continue;
        const int nslots = sk_last_warp(sk, slice) - sk_first_warp(sk, slice) + 1;
        for (int i = lane; i < slot_floats; i += 32) {
            const int b = i / kDownCols, cc = cbase + i % kDownCols;
            if (cc >= d) continue;
            float v = 0.f;
            for (int k = 0; k < nslots; ++k) v += __ldcg(slots + (size_t)k * slot_floats + i);
            y[(size_t)b * d + cc] = from_f<T>(v + (bias ? to_f(bias[cc]) : 0.f));
        }
    }
}

// Grids are sized from the current device's SM count, so workspace sizes must be queried on the device
// that runs the op.
inline int sm_count() {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return sms > 0 ? sms : 132;
}
// Plan of the tensor-core down projection (batch > 4) for `Mpad` active rows into d columns.
inline StreamK plan_down_mma(int d, int Mpad) { return plan_streamk(cdiv(d, kDownCols), Mpad / 16, 4); }

}  // namespace djv
