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
constexpr size_t kCounterBytes = 65536;  // counter region at the start of every workspace
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

// ---------------------------------------------------------------------------------------------
// Per-thread cp.async pipelines. Each thread copies its own 16-byte pieces of weight rows into a private
// shared-memory ring (piece p of slot s lives at ring[(s*P + p)*blockDim.x + tid]) and later reads back
// exactly those bytes, so no barrier is needed: cp.async.wait_group orders a thread's own copies. The ring
// keeps (S-1) stages of loads in flight per thread without holding them in registers: ~160 KB per SM,
// where register-staged loads managed ~64 KB, which is not enough to cover HBM latency at full rate.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = pred ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
constexpr int kRingPieces = 24;  // 16-byte pieces per thread: 384 B, 96 KB for 256 threads (2 CTAs per SM)
constexpr size_t kRingBytes = (size_t)kRingPieces * 16 * 256;

// ---------------------------------------------------------------------------------------------
// Row-tile GEMV: acc[mat][nt] += W_mat[16 rows] . x[batch]^T over [kb, ke), all warps of the CTA.
// Thread (g = lane/4, c = lane%4) owns rows g and g+8 and batches g, g+8 (n-tile 1). One 16-byte piece
// of 8 consecutive k from row g (and g+8) feeds two mma k-steps; x is read with the same permutation.
// The range is cut into 32-element sub-chunks dealt round-robin to the warps (so warps stay balanced
// to within one sub-chunk for any range length); a stage is U sub-chunks per warp.
template <typename T, int NT, int NMAT>
__device__ __forceinline__ void tile_dot(const T* const (&r0)[NMAT], const T* const (&r1)[NMAT],
                                         const T* __restrict__ x, int B, int d, int kb, int ke, int wid, int nw,
                                         float (&acc)[NMAT][NT][4], uint4* ring) {
    constexpr int U = NMAT == 1 ? 2 : 1;
    constexpr int P = NMAT * 2 * U;     // pieces per stage
    constexpr int S = kRingPieces / P;  // stages in the ring
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int nth = blockDim.x, tid = threadIdx.x;
    const T* xr0 = x + (size_t)g * d;
    const T* xr1 = x + (size_t)(g + 8) * d;
    const bool xv0 = g < B, xv1 = (g + 8) < B;
    const int nsub = cdiv(ke - kb, 32);
    const int nst = cdiv(nsub, nw * U);  // stages, the same for every warp
    auto off_of = [&](int j, int u) { return kb + ((j * U + u) * nw + wid) * 32 + c * 8; };
    auto issue = [&](int j) {
        const int slot = j % S;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int off = off_of(j, u);
            const bool ok = j < nst && off < ke;
            const int o = ok ? off : 0;
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
                cp_async16(ring + ((size_t)(slot * P + (m * 2 + 0) * U + u) * nth + tid), r0[m] + o, ok);
                cp_async16(ring + ((size_t)(slot * P + (m * 2 + 1) * U + u) * nth + tid), r1[m] + o, ok);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);
    for (int j = 0; j < nst; ++j) {
        cp_async_wait<S - 2>();
        const int slot = j % S;
        uint4 wa[NMAT][U], wb[NMAT][U], xa[NT][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
                wa[m][u] = ring[(size_t)(slot * P + (m * 2 + 0) * U + u) * nth + tid];
                wb[m][u] = ring[(size_t)(slot * P + (m * 2 + 1) * U + u) * nth + tid];
            }
            const int off = off_of(j, u);
            const bool ok = off < ke;
            xa[0][u] = (ok && xv0) ? ld_keep(xr0 + off) : zero4();
            if (NT == 2) xa[NT - 1][u] = (ok && xv1) ? ld_keep(xr1 + off) : zero4();
        }
        issue(j + S - 1);
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
    cp_async_wait<0>();  // the trailing (empty) groups: nothing may land in the ring after we return
}

// Sum a [NMAT][16 rows][16 batch] tile across the warps of the CTA (fixed order -> deterministic).
// On return red[0..NMAT*256) holds the CTA sum; needs NW*NMAT*256 floats of shared memory.
template <int NT, int NMAT>
__device__ __forceinline__ void cta_reduce_tile(const float (&acc)[NMAT][NT][4], float* red, int nw) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    __syncthreads();  // red may alias the cp.async ring other warps are still reading
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
// Weight pieces go through the per-thread cp.async ring (one 16-row group = 8 pieces per stage).
template <typename T>
__global__ void __launch_bounds__(256, 2) down_kernel(const T* __restrict__ act, int Mpad, const int32_t* __restrict__ idx,
                                                  int bs, int M, const T* __restrict__ w, const T* __restrict__ bias,
                                                  T* __restrict__ y, float* __restrict__ part,
                                                  unsigned* __restrict__ ctr, int B, int d, int S) {
    extern __shared__ __align__(16) unsigned char dsm[];
    uint4* ring = reinterpret_cast<uint4*>(dsm);
    float* red = reinterpret_cast<float*>(dsm);  // [nw][B][128], reused after the ring is drained
    constexpr int P = 8, NS = kRingPieces / P;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, wid = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5, nth = blockDim.x, tid = threadIdx.x;
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
    const int nst = gb + wid < ge ? cdiv(ge - gb - wid, nw) : 0;  // this warp's groups
    auto issue = [&](int j) {
        const int slot = j % NS;
        const bool live = j < nst;
        const int jb = (gb + wid + j * nw) * 16;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int mi = jb + 2 * c + (i & 1) + (i >> 1) * 8;
            const int row = live ? expand_row(idx, mi < M ? mi : M - 1, bs) : 0;  // padded rows: act is 0
            const T* wr = w + (size_t)row * d;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = col0 + h * 64 + g * 8;
                const bool ok = live && col < d;
                cp_async16(ring + ((size_t)(slot * P + h * 4 + i) * nth + tid), ok ? wr + col : w, ok);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < NS - 1; ++j) issue(j);
    for (int j = 0; j < nst; ++j) {
        cp_async_wait<NS - 2>();
        const int slot = j % NS;
        const int jb = (gb + wid + j * nw) * 16;
        uint4 wv[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) wv[h][i] = ring[(size_t)(slot * P + h * 4 + i) * nth + tid];
        const uint32_t a0 = *reinterpret_cast<const uint32_t*>(arow0 + jb + 2 * c);
        const uint32_t a1 = *reinterpret_cast<const uint32_t*>(arow1 + jb + 2 * c);
        const uint32_t a2 = *reinterpret_cast<const uint32_t*>(arow0 + jb + 2 * c + 8);
        const uint32_t a3 = *reinterpret_cast<const uint32_t*>(arow1 + jb + 2 * c + 8);
        issue(j + NS - 1);
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
    cp_async_wait<0>();
    __syncthreads();  // red aliases other threads' ring slots
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
            if (S == 1) y[(size_t)b * d + col] = from_f<T>(s + (bias ? to_f(bias[col]) : 0.f));
            else part[((size_t)blockIdx.y * B + b) * d + col] = s;
        }
    }
    if (S == 1) return;
    if (!last_arrival(ctr + blockIdx.x, (unsigned)S)) return;
    for (int i = threadIdx.x; i < B * 128; i += blockDim.x) {
        const int b = i >> 7, col = col0 + (i & 127);
        if (col >= d) continue;
        float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // 8 independent chains: loads stay in flight
        int k = 0;
        for (; k + 8 <= S; k += 8)
#pragma unroll
            for (int q = 0; q < 8; ++q) s[q] += __ldcg(part + ((size_t)(k + q) * B + b) * d + col);
        for (; k < S; ++k) s[0] += __ldcg(part + ((size_t)k * B + b) * d + col);
        const float tot = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        y[(size_t)b * d + col] = from_f<T>(tot + (bias ? to_f(bias[col]) : 0.f));
    }
}

// Host-side split choices. The GEMV kernels are sized to the CTAs that fit at once (occupancy query:
// registers and the 96 KB cp.async ring give 2 per SM on an H100/H200), so no grid ends in a nearly
// empty extra wave. Depends on the current device, so workspace sizes must be queried on the device
// that runs the op.
inline int sm_count() {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return sms > 0 ? sms : 132;
}
template <typename K> inline int occupancy(K kernel, int threads, size_t smem) {
    // Set on every call: each translation unit holds its own copy of a kernel (no -rdc), so a "done once"
    // flag shared through an inline function would skip the other copies.
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) n = 1;
    (void)cudaGetLastError();
    return n;
}
constexpr int kDownThreads = 256;
inline size_t down_smem(int B) {
    const size_t red = (size_t)(kDownThreads / 32) * B * 128 * sizeof(float);
    return red > kRingBytes ? red : kRingBytes;
}
inline int down_resident(int B) { return occupancy(down_kernel<__half>, kDownThreads, down_smem(B)) * sm_count(); }
inline int down_splits(int d, int Mpad, int B) {
    const int slices = cdiv(d, 128), groups = Mpad / 16;
    int s = down_resident(B) / slices;  // one wave, every CTA busy
    const int cap = groups / 8 > 1 ? groups / 8 : 1;  // at least one 16-row group per warp
    return s < 1 ? 1 : (s > cap ? cap : s);
}
// Split of the reduction axis for the row-tile GEMV kernels (grid tiles x ks over `resident` slots):
// the smallest split whose last wave is >= 95% full (else the best one), >= 512 elements per split.
inline int tile_ksplit(int tiles, int d, int resident) {
    const int cap = d / 512 > 1 ? (d / 512 < 16 ? d / 512 : 16) : 1;
    int best = 1;
    double best_eff = 0.0;
    for (int ks = 1; ks <= cap; ++ks) {
        const int chunk = (int)align_up((size_t)cdiv(d, ks), 256);
        if (ks > 1 && cdiv(d, chunk) != ks) continue;  // this split would realise fewer chunks
        const double w = (double)tiles * ks / resident;
        const double eff = w / (double)cdiv(tiles * ks, resident);
        if (eff >= 0.95) return ks;
        if (eff > best_eff + 1e-9) { best_eff = eff; best = ks; }
    }
    return best;
}
__host__ __device__ inline int ksplit_chunk(int d, int ks) {
    return ks == 1 ? (int)align_up((size_t)d, 8) : (int)align_up((size_t)cdiv(d, ks), 256);
}

template <typename T>
inline cudaError_t launch_down(const T* act, int Mpad, const int32_t* idx, int bs, int M, const T* w, const T* bias,
                               T* y, float* part, unsigned* ctr, int B, int d, cudaStream_t st) {
    const int S = down_splits(d, Mpad, B);
    const size_t smem = down_smem(B);
    cudaError_t e = cudaFuncSetAttribute(down_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    dim3 grid(cdiv(d, 128), S);
    down_kernel<T><<<grid, kDownThreads, smem, st>>>(act, Mpad, idx, bs, M, w, bias, y, part, ctr, B, d, S);
    return cudaGetLastError();
}

}  // namespace djv
