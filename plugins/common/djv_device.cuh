// djv_device.cuh - device building blocks shared by the dejavu kernels.
//
// The batch 5-16 sparse GEMVs run on the tensor cores (mma.sync m16n8k16, fp32 accumulate): the
// point is not FLOPs but that one 16-byte load per thread feeds a whole fragment, so each active weight
// byte is loaded exactly once, straight from HBM into registers, with no shared-memory staging.
// The trick: a dot product is invariant under any permutation of its k axis (and an output axis may be
// permuted if the store follows), so we let each thread's 8 contiguous elements *be* its fragment slots.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdlib.h>
#include <atomic>

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

// Warp-wide sum / max by xor butterflies: every lane ends with the same bits.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

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

// ---------------------------------------------------------------------------------------------
// Row-tile GEMV: acc[mat][nt] += W_mat[16 rows] . x[batch]^T over this warp's share of [kb, ke).
// Thread (g = lane/4, c = lane%4) owns rows g and g+8 and batches g, g+8 (n-tile 1). One 16-byte load
// of 8 consecutive k from row g (and g+8) feeds two mma k-steps; x is read with the same permutation.
template <typename T, int NT, int NMAT, int U>
__device__ __forceinline__ void tile_dot(const T* const (&r0)[NMAT], const T* const (&r1)[NMAT],
                                         const T* __restrict__ x, int B, int d, int kb, int ke, int wid, int nw,
                                         float (&acc)[NMAT][NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const T* xr0 = x + (size_t)g * d;
    const T* xr1 = x + (size_t)(g + 8) * d;
    const bool xv0 = g < B, xv1 = (g + 8) < B;
    for (int k0 = kb + wid * 32 * U; k0 < ke; k0 += nw * 32 * U) {
        uint4 wa[NMAT][U], wb[NMAT][U], xa[NT][U];
        if (k0 + 32 * U <= ke) {  // full chunk: no predicates, so all U*2*NMAT loads are issued back to back
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = k0 + u * 32 + c * 8;
#pragma unroll
                for (int m = 0; m < NMAT; ++m) {
                    wa[m][u] = ld_stream(r0[m] + off);
                    wb[m][u] = ld_stream(r1[m] + off);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = k0 + u * 32 + c * 8;
                xa[0][u] = xv0 ? ld_keep(xr0 + off) : zero4();
                if (NT == 2) xa[NT - 1][u] = xv1 ? ld_keep(xr1 + off) : zero4();
            }
        } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int off = k0 + u * 32 + c * 8;
                const bool ok = off < ke;
#pragma unroll
                for (int m = 0; m < NMAT; ++m) {
                    wa[m][u] = ok ? ld_stream(r0[m] + off) : zero4();
                    wb[m][u] = ok ? ld_stream(r1[m] + off) : zero4();
                }
                xa[0][u] = (ok && xv0) ? ld_keep(xr0 + off) : zero4();
                if (NT == 2) xa[NT - 1][u] = (ok && xv1) ? ld_keep(xr1 + off) : zero4();
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    Mma<T>::run(acc[m][t], wa[m][u].x, wb[m][u].x, wa[m][u].y, wb[m][u].y, xa[t][u].x, xa[t][u].y);
                    Mma<T>::run(acc[m][t], wa[m][u].z, wb[m][u].z, wa[m][u].w, wb[m][u].w, xa[t][u].z, xa[t][u].w);
                }
    }
}

// Sum a [NMAT][16 rows][16 batch] tile across the warps of the CTA (fixed order -> deterministic).
// On return red[0..NMAT*256) holds the CTA sum; needs NW*NMAT*256 floats of shared memory.
template <int NT, int NMAT>
__device__ __forceinline__ void cta_reduce_tile(const float (&acc)[NMAT][NT][4], float* red, int nw) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float* base = red + ((size_t)wid * NMAT + m) * 256;
            const int col = t * 8 + 2 * c;
            base[g * 16 + col] = acc[m][t][0];
            base[g * 16 + col + 1] = acc[m][t][1];
            base[(g + 8) * 16 + col] = acc[m][t][2];
            base[(g + 8) * 16 + col + 1] = acc[m][t][3];
        }
    if (NT == 1) {  // batches 8..15 were never computed; keep the tile well defined
#pragma unroll
        for (int m = 0; m < NMAT; ++m) {
            float* base = red + ((size_t)wid * NMAT + m) * 256;
            base[g * 16 + 8 + 2 * c] = 0.f; base[g * 16 + 9 + 2 * c] = 0.f;
            base[(g + 8) * 16 + 8 + 2 * c] = 0.f; base[(g + 8) * 16 + 9 + 2 * c] = 0.f;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NMAT * 256; i += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < nw; ++w) s += red[(size_t)w * NMAT * 256 + i];
        red[i] = s;  // only this thread touches column i of every warp slot
    }
    __syncthreads();
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
// Down projection over active rows: y[b, :] = sum_m act[b, m] * W[row(m), :] (+ bias).
// act is [16][Mpad] in T (row b = batch), Mpad % 16 == 0, padded entries (m >= M) are zero.
// Grid (ceil(d/128), S): CTA = 128 output columns x 1/S of the active rows; its warps take 16-row
// groups round-robin. mma as D[b, col] = act^T[b, rows] . W[rows, col]: thread (g, c) loads 16 bytes
// (cols g*8..g*8+7) of rows 2c, 2c+1, 2c+8, 2c+9, and column t of that run is n-tile t's column g.
template <typename T>
__global__ void __launch_bounds__(256) down_kernel(const T* __restrict__ act, int Mpad, const int32_t* __restrict__ idx,
                                                  int bs, int M, const T* __restrict__ w, const T* __restrict__ bias,
                                                  const T* residual, T* y, float* __restrict__ part,
                                                  unsigned* __restrict__ ctr, int B, int d, int S) {
    extern __shared__ float red[];  // [nw][B][128]
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, wid = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    const int col0 = blockIdx.x * 128;
    const int groups = Mpad / 16;
    const int gb = (int)((long long)blockIdx.y * groups / S), ge = (int)((long long)(blockIdx.y + 1) * groups / S);
    float acc[2][8][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int t = 0; t < 8; ++t) acc[h][t][0] = acc[h][t][1] = acc[h][t][2] = acc[h][t][3] = 0.f;

    const T* arow0 = act + (size_t)g * Mpad;
    const T* arow1 = act + (size_t)(g + 8) * Mpad;
#pragma unroll 2
    for (int jg = gb + wid; jg < ge; jg += nw) {
        const int jb = jg * 16;
        const int ms[4] = {jb + 2 * c, jb + 2 * c + 1, jb + 2 * c + 8, jb + 2 * c + 9};
        uint4 wv[2][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = expand_row(idx, ms[i] < M ? ms[i] : M - 1, bs);  // padded rows: act is 0
            const T* wr = w + (size_t)row * d;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = col0 + h * 64 + g * 8;
                wv[h][i] = col < d ? ld_stream(wr + col) : zero4();
            }
        }
        const uint32_t a0 = *reinterpret_cast<const uint32_t*>(arow0 + jb + 2 * c);
        const uint32_t a1 = *reinterpret_cast<const uint32_t*>(arow1 + jb + 2 * c);
        const uint32_t a2 = *reinterpret_cast<const uint32_t*>(arow0 + jb + 2 * c + 8);
        const uint32_t a3 = *reinterpret_cast<const uint32_t*>(arow1 + jb + 2 * c + 8);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int t = 0; t < 8; ++t) {
                const uint32_t sel = (t & 1) ? 0x7632u : 0x5410u;
                const uint32_t b0 = __byte_perm(word_of(wv[h][0], t >> 1), word_of(wv[h][1], t >> 1), sel);
                const uint32_t b1 = __byte_perm(word_of(wv[h][2], t >> 1), word_of(wv[h][3], t >> 1), sel);
                Mma<T>::run(acc[h][t], a0, a1, a2, a3, b0, b1);
            }
    }
    // acc[h][t][0/1]: batch g, column h*64 + (2c or 2c+1)*8 + t; [2/3]: batch g+8.
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int cc = h * 64 + 16 * c + t;
            if (g < B) {
                red[((size_t)wid * B + g) * 128 + cc] = acc[h][t][0];
                red[((size_t)wid * B + g) * 128 + cc + 8] = acc[h][t][1];
            }
            if (g + 8 < B) {
                red[((size_t)wid * B + g + 8) * 128 + cc] = acc[h][t][2];
                red[((size_t)wid * B + g + 8) * 128 + cc + 8] = acc[h][t][3];
            }
        }
    __syncthreads();
    for (int i = threadIdx.x; i < B * 128; i += blockDim.x) {
        const int b = i >> 7, cc = i & 127, col = col0 + cc;
        float s = 0.f;
        for (int k = 0; k < nw; ++k) s += red[((size_t)k * B + b) * 128 + cc];
        if (col < d) {
            if (S == 1)
                y[(size_t)b * d + col] = from_f<T>(s + (bias ? to_f(bias[col]) : 0.f) +
                                                   (residual ? to_f(residual[(size_t)b * d + col]) : 0.f));
            else part[((size_t)blockIdx.y * B + b) * d + col] = s;
        }
    }
    if (S == 1) return;
    if (!last_arrival(ctr + blockIdx.x, (unsigned)S)) return;
    for (int i = threadIdx.x; i < B * 128; i += blockDim.x) {
        const int b = i >> 7, col = col0 + (i & 127);
        if (col >= d) continue;
        float s = 0.f;
        for (int k = 0; k < S; ++k) s += __ldcg(part + ((size_t)k * B + b) * d + col);
        y[(size_t)b * d + col] = from_f<T>(s + (bias ? to_f(bias[col]) : 0.f) +
                                           (residual ? to_f(residual[(size_t)b * d + col]) : 0.f));
    }
}

// ---------------------------------------------------------------------------------------------
// Warp-level stream-K (used by the batch <= 4 row GEMVs, djv_rows.cuh). A GEMV's work is `items` outputs x
// `per_item` steps of reduction; flattened item-major, it is dealt out to warps in contiguous runs of q steps,
// sized so that every warp of one resident wave gets the same bytes to move (no half-empty last wave,
// whatever the kept fraction). A warp usually finishes its item alone; when a run splits an item, each warp
// publishes its partial into the item's slot for it and the warp that completes the count sums the slots in
// a fixed order (deterministic).
struct StreamK {
    int per_item;     // steps per item
    int q;            // steps per warp
    int warps;        // warps launched (the last may get fewer steps)
    int max_slots;    // partial slots per item
    long long total;  // items * per_item
};

constexpr int kSkThreads = 256;   // 8 independent warps per CTA, 2 CTAs per SM (<= 128 registers)
constexpr int kSkWarpsPerSm = 16;

// An integer A/B knob from the environment: its value when set and within [lo, hi], else `fallback`.
// Callers cache it in a function-local static (read once per process).
inline int env_int(const char* name, int lo, int hi, int fallback) {
    const char* e = getenv(name);
    const int v = e ? atoi(e) : fallback;
    return v >= lo && v <= hi ? v : fallback;
}

inline int sm_count();
// SMs the fused MLP's grid leaves free (djv_set_mlp_grid_slack); one value per library. The environment's
// start value obeys the setter's range, [0, SM count / 2], so the grid never runs out of SMs.
inline int& mlp_grid_slack() {
    static int slack = env_int("DJV_MLP_SLACK", 0, sm_count() / 2, 0);
    return slack;
}
// Whether the caller promises that the index inputs of the MLP and attention calls it enqueues were written
// at least two kernels before each call on its stream (or on a stream joined before the kernel before it):
// then their first kernels read indices and first weight rows before waiting for the kernel before
// (djv_set_indices_ready). One value per library; DJV_INDICES_READY=1 in the environment starts it on.
inline int& indices_ready() {
    static int ready = env_int("DJV_INDICES_READY", 0, 1, 0);
    return ready;
}

inline StreamK plan_streamk(long long items, int per_item, int min_q, int warps_per_sm = kSkWarpsPerSm) {
    StreamK k;
    k.per_item = per_item;
    k.total = items * per_item;
    const long long wmax = (long long)sm_count() * warps_per_sm;
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

// Host-side split choices. Both GEMV kernels run 2 CTAs of 256 threads per SM (128 registers), so a
// grid just over a multiple of 2*SMs leaves most SMs idle for a whole extra "wave": we size grids to
// fill the resident slots instead. Depends on the current device's SM count, so workspace sizes must be
// queried on the device that runs the op.
// A device attribute, looked up once per device: the plans read these on every launch and workspace query
// (eager calls, TensorRT enqueues), and they never change. `fallback` when there is no usable device.
template <cudaDeviceAttr A>
inline int device_attr(int fallback) {
    constexpr int kMaxDevices = 64;
    static std::atomic<int> cache[kMaxDevices];  // 0: not looked up yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return fallback;
    int v = cache[dev].load(std::memory_order_relaxed);
    if (v > 0) return v;
    if (cudaDeviceGetAttribute(&v, A, dev) != cudaSuccess || v <= 0) return fallback;
    cache[dev].store(v, std::memory_order_relaxed);
    return v;
}
inline int sm_count() { return device_attr<cudaDevAttrMultiProcessorCount>(132); }
// The C ABI's 16-byte alignment rule (dejavu_kernels.h), checked by every entry point.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline int smem_optin() { return device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>(48 * 1024); }
inline int resident_ctas() { return 2 * sm_count(); }
inline int down_splits(int d, int Mpad) {
    const int slices = cdiv(d, 128), groups = Mpad / 16;
    int s = resident_ctas() / slices;  // one wave, every CTA busy
    const int cap = groups / 8 > 1 ? groups / 8 : 1;  // at least one 16-row group per warp
    return s < 1 ? 1 : (s > cap ? cap : s);
}
// Split of the reduction axis for the row-tile GEMV kernels: the smallest split whose last wave is
// >= 95% full (else the best one), keeping >= 512 elements per split.
inline int tile_ksplit(int tiles, int d) {
    const int r = resident_ctas();
    const int cap = d / 512 > 1 ? (d / 512 < 8 ? d / 512 : 8) : 1;
    int best = 1;
    double best_eff = 0.0;
    for (int ks = 1; ks <= cap; ++ks) {
        if (ks > 1 && d % (ks * 1024)) continue;  // 8 warps x 128 elements per pass: keep warps balanced
        const double w = (double)tiles * ks / r;
        const double eff = w / (double)cdiv(tiles * ks, r);
        if (eff >= 0.95) return ks;
        if (eff > best_eff + 1e-9) { best_eff = eff; best = ks; }
    }
    return best;
}
__host__ __device__ inline int ksplit_chunk(int d, int ks) { return (int)align_up((size_t)cdiv(d, ks), 8); }

constexpr int kDownThreads = 256;
inline size_t down_smem(int B) { return (size_t)(kDownThreads / 32) * B * 128 * sizeof(float); }

template <typename T>
inline cudaError_t launch_down_mma(const T* act, int Mpad, const int32_t* idx, int bs, int M, const T* w, const T* bias,
                               const T* residual, T* y, float* part, unsigned* ctr, int B, int d, cudaStream_t st) {
    const int S = down_splits(d, Mpad);
    const size_t smem = down_smem(B);
    // Set on every launch: each translation unit holds its own copy of this kernel (no -rdc), so a
    // "done once" flag shared through the inline function would skip the other copies.
    cudaError_t e = cudaFuncSetAttribute(down_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
    if (e != cudaSuccess) return e;
    dim3 grid(cdiv(d, 128), S);
    down_kernel<T><<<grid, kDownThreads, smem, st>>>(act, Mpad, idx, bs, M, w, bias, residual, y, part, ctr, B, d, S);
    return cudaGetLastError();
}

}  // namespace djv
