// Probe: HBM read bandwidth of the weight-access patterns a sparse GEMV can use (no math, loads only).
// W is [N, d] fp16 (OPT-13B MLP: N=20480, d=5120); a sorted random subset of rows is read.
// Build: nvcc -O3 -gencode=arch=compute_90,code=sm_90 read_patterns.cu -o read_patterns
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint32_t mix(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// P1: warp per row, whole row, lane reads 16B at l*16 + i*512, U loads in flight.
template <int U>
__global__ void row_warp(const uint8_t* W, const int* idx, int M, int rowbytes, uint32_t* sink) {
    const int lane = threadIdx.x & 31;
    const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
    uint32_t acc = 0;
    for (int m = gw; m < M; m += nw) {
        const uint8_t* r = W + (size_t)idx[m] * rowbytes;
        for (int off = 0; off < rowbytes; off += 512 * U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) { int o = off + u * 512 + lane * 16; v[u] = o < rowbytes ? ld_stream(r + o) : make_uint4(0,0,0,0); }
#pragma unroll
            for (int u = 0; u < U; ++u) acc ^= mix(v[u]);
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
// P2: warp per 16-row tile, per instruction 64 B of each of 16 rows (the mma fragment layout), U steps.
template <int U>
__global__ void tile16(const uint8_t* W, const int* idx, int M, int rowbytes, uint32_t* sink) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
    const int tiles = M / 16, kch = rowbytes / 64;
    uint32_t acc = 0;
    // split each tile into 8 k-ranges so there is enough parallelism
    for (int w = gw; w < tiles * 8; w += nw) {
        const int t = w / 8, part = w % 8;
        const uint8_t* r0 = W + (size_t)idx[t * 16 + g] * rowbytes;
        const uint8_t* r1 = W + (size_t)idx[t * 16 + g + 8] * rowbytes;
        const int k0 = part * kch / 8, k1 = (part + 1) * kch / 8;
        for (int k = k0; k < k1; k += U) {
            uint4 a[U], b[U];
#pragma unroll
            for (int u = 0; u < U; ++u) { bool ok = k + u < k1; int o = (k + u) * 64 + c * 16; a[u] = ok ? ld_stream(r0 + o) : make_uint4(0,0,0,0); b[u] = ok ? ld_stream(r1 + o) : make_uint4(0,0,0,0); }
#pragma unroll
            for (int u = 0; u < U; ++u) acc ^= mix(a[u]) ^ mix(b[u]);
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
// P3: warp per column slice of SB bytes (SB = 512*V), loops over rows with U rows in flight.
template <int V, int U>
__global__ void slice_rows(const uint8_t* W, const int* idx, int M, int rowbytes, int rows_per_warp, uint32_t* sink) {
    const int lane = threadIdx.x & 31;
    const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int slices = rowbytes / (512 * V);
    const int chunks = (M + rows_per_warp - 1) / rows_per_warp;
    if (gw >= slices * chunks) return;
    const int s = gw % slices, ch = gw / slices;
    const int m0 = ch * rows_per_warp, m1 = min(M, m0 + rows_per_warp);
    uint32_t acc = 0;
    for (int m = m0; m < m1; m += U) {
        uint4 v[U][V];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool ok = m + u < m1;
            const uint8_t* r = W + (size_t)idx[ok ? m + u : m0] * rowbytes + s * 512 * V;
#pragma unroll
            for (int j = 0; j < V; ++j) v[u][j] = ok ? ld_stream(r + j * 512 + lane * 16) : make_uint4(0,0,0,0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < V; ++j) acc ^= mix(v[u][j]);
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
    const int N = 20480, d = 5120, rowbytes = d * 2;
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    uint8_t* W; cudaMalloc(&W, (size_t)N * rowbytes); cudaMemset(W, 1, (size_t)N * rowbytes);
    uint32_t* sink; cudaMalloc(&sink, 4);
    int* didx; cudaMalloc(&didx, N * 4);
    uint8_t* flush; size_t fb = 512ull << 20; cudaMalloc(&flush, fb);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    std::mt19937 rng(1);
    for (double kept : {0.25, 1.0}) {
        const int M = (int)(N * kept);
        std::vector<int> all(N); for (int i = 0; i < N; ++i) all[i] = i;
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<int> idx(all.begin(), all.begin() + M); std::sort(idx.begin(), idx.end());
        cudaMemcpy(didx, idx.data(), M * 4, cudaMemcpyHostToDevice);
        const double bytes = (double)M * rowbytes;
        auto timeit = [&](const char* name, auto launch) {
            float best = 1e9;
            for (int it = 0; it < 12; ++it) {
                cudaMemsetAsync(flush, it, fb);  // evict L2
                cudaEventRecord(e0); launch(); cudaEventRecord(e1); cudaEventSynchronize(e1);
                float ms; cudaEventElapsedTime(&ms, e0, e1); if (it >= 2) best = std::min(best, ms);
            }
            cudaError_t err = cudaGetLastError();
            printf("kept=%.2f %-34s %8.1f us %7.0f GB/s %s\n", kept, name, best * 1e3, bytes / (best * 1e-3) / 1e9, err ? cudaGetErrorString(err) : "");
        };
        // contiguous: identity index over the first M rows
        {
            std::vector<int> ident(M); for (int i = 0; i < M; ++i) ident[i] = i;
            int* dident; cudaMalloc(&dident, M * 4); cudaMemcpy(dident, ident.data(), M * 4, cudaMemcpyHostToDevice);
            timeit("row_warp U=8 identity rows", [&] { row_warp<8><<<sms * 4, 128>>>(W, dident, M, rowbytes, sink); });
            cudaFree(dident);
        }
        for (int cta_per_sm : {2, 4}) {
            char nm[64];
            snprintf(nm, 64, "row_warp U=4 ctas/sm=%d", cta_per_sm); timeit(nm, [&] { row_warp<4><<<sms * cta_per_sm, 256>>>(W, didx, M, rowbytes, sink); });
            snprintf(nm, 64, "row_warp U=8 ctas/sm=%d", cta_per_sm); timeit(nm, [&] { row_warp<8><<<sms * cta_per_sm, 256>>>(W, didx, M, rowbytes, sink); });
            snprintf(nm, 64, "row_warp U=20 ctas/sm=%d", cta_per_sm); timeit(nm, [&] { row_warp<20><<<sms * cta_per_sm, 256>>>(W, didx, M, rowbytes, sink); });
            snprintf(nm, 64, "tile16 U=4 ctas/sm=%d", cta_per_sm); timeit(nm, [&] { tile16<4><<<sms * cta_per_sm, 256>>>(W, didx, M, rowbytes, sink); });
            snprintf(nm, 64, "tile16 U=8 ctas/sm=%d", cta_per_sm); timeit(nm, [&] { tile16<8><<<sms * cta_per_sm, 256>>>(W, didx, M, rowbytes, sink); });
        }
        for (int rpw : {16, 48, 128}) {
            char nm[64];
            const int warps1 = (rowbytes / 512) * ((M + rpw - 1) / rpw), warps4 = (rowbytes / 2048) * ((M + rpw - 1) / rpw);
            snprintf(nm, 64, "slice 512B U=8 rows/warp=%d", rpw); timeit(nm, [&] { slice_rows<1, 8><<<(warps1 + 7) / 8, 256>>>(W, didx, M, rowbytes, rpw, sink); });
            snprintf(nm, 64, "slice 2KB U=4 rows/warp=%d", rpw); timeit(nm, [&] { slice_rows<4, 4><<<(warps4 + 7) / 8, 256>>>(W, didx, M, rowbytes, rpw, sink); });
            snprintf(nm, 64, "slice 1KB U=8 rows/warp=%d", rpw); { const int w2 = (rowbytes / 1024) * ((M + rpw - 1) / rpw); timeit(nm, [&] { slice_rows<2, 8><<<(w2 + 7) / 8, 256>>>(W, didx, M, rowbytes, rpw, sink); }); }
        }
        timeit("cudaMemcpyAsync D2D same bytes (r+w)", [&] { cudaMemcpyAsync(flush, W, (size_t)bytes, cudaMemcpyDeviceToDevice); });
    }
    return 0;
}
