// The decode step's first and last kernels for the CUDA executor (not plugins: in the ONNX graph these are
// standard Gather/Add/ArgMax ops). At batch 1 torch spends 5 launches on the embedding (token rows, position
// cast and offset, position rows, add) and 5 after the LM head (fp32 cast, copy, argmax, token copy,
// position increment): ~22 us of the step after the LM head alone (graph timeline, benchmarks/RESULTS.md
// session 16), for a few hundred KB of traffic. Each becomes one launch here (session 17: 22-27 us faster).
#include <type_traits>

#include "dejavu_kernels.h"
#include "djv_bulk.cuh"
#include "djv_device.cuh"

namespace {
using namespace djv;

constexpr int kEmbedThreads = 128;
constexpr int kTailThreads = 256;
constexpr int kTailPerThread = 8;  // independent loads in flight per thread
constexpr int kTailChunk = kTailThreads * kTailPerThread;
constexpr int kTailMaxBlocks = 1024;

// grid (cdiv(d/8, kEmbedThreads), rows): y[r] = E[tok[r]] + P[pos[r] + off], one rounding as torch's add.
// A token or position outside its table writes NaN (no device assert mid-graph; the logits show it).
template <typename T>
__global__ void __launch_bounds__(kEmbedThreads) embed_kernel(const int64_t* __restrict__ tokens,
                                                              const int32_t* __restrict__ positions,
                                                              const T* __restrict__ emb, const T* __restrict__ pemb,
                                                              int pos_offset, T* __restrict__ y, int d, int V, int Tp) {
    pdl_wait_primary();  // the tokens and positions come from the step before
    pdl_launch_dependents();
    const int r = blockIdx.y, c = (blockIdx.x * kEmbedThreads + threadIdx.x) * 8;
    if (c >= d) return;
    const int64_t tok = tokens[r];
    const int p = pemb ? positions[r] + pos_offset : 0;
    float o[8];
    if (tok < 0 || tok >= V || (pemb && (p < 0 || p >= Tp))) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = __int_as_float(0x7fc00000);
    } else {
        unpack8<T>(*reinterpret_cast<const uint4*>(emb + (size_t)tok * d + c), o);
        if (pemb) {
            float q[8];
            unpack8<T>(*reinterpret_cast<const uint4*>(pemb + (size_t)p * d + c), q);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] += q[e];
        }
    }
    *reinterpret_cast<uint4*>(y + (size_t)r * d + c) =
        make_uint4(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]), pack2<T>(o[4], o[5]), pack2<T>(o[6], o[7]));
}

// torch.argmax's order: NaN above every number, then the lower index on ties.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {
    const bool vn = v != v, bn = bv != bv;
    if (vn != bn) return vn;
    if (!vn && v != bv) return v > bv;
    return i < bi;
}

__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (beats(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// Best of the CTA, on thread 0.
__device__ __forceinline__ void block_best(float& v, int& i) {
    __shared__ float sv[kTailThreads / 32];
    __shared__ int si[kTailThreads / 32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    warp_best(v, i);
    if (lane == 0) { sv[wid] = v; si[wid] = i; }
    __syncthreads();
    if (wid == 0) {
        v = lane < kTailThreads / 32 ? sv[lane] : __int_as_float(0xff800000);
        i = lane < kTailThreads / 32 ? si[lane] : 0x7fffffff;
        warp_best(v, i);
    }
}

// grid (nblk, B): logits_out[b] = float(logits[b]) (when given), tokens[b] = argmax, position[b] += 1 (when
// given). Each CTA takes kTailChunk logits of a row and publishes its best; the row's last CTA picks among them.
template <typename T>
__global__ void __launch_bounds__(kTailThreads) greedy_tail_kernel(const T* __restrict__ logits, float* logits_out,
                                                                   int64_t* tokens, int32_t* position, int V,
                                                                   float* cand_v, int* cand_i, unsigned* ctr) {
    pdl_wait_primary();
    pdl_launch_dependents();
    const int b = blockIdx.y, nblk = gridDim.x, c0 = blockIdx.x * kTailChunk;
    const T* row = logits + (size_t)b * V;
    float x[kTailPerThread];
#pragma unroll
    for (int k = 0; k < kTailPerThread; ++k) {
        const int c = c0 + k * kTailThreads + threadIdx.x;
        x[k] = c < V ? to_f(row[c]) : __int_as_float(0xff800000);
    }
    float bv = __int_as_float(0xff800000);
    int bi = 0x7fffffff;
#pragma unroll
    for (int k = 0; k < kTailPerThread; ++k) {
        const int c = c0 + k * kTailThreads + threadIdx.x;
        if (c >= V) continue;
        if (logits_out) logits_out[(size_t)b * V + c] = x[k];
        if (beats(x[k], c, bv, bi)) { bv = x[k]; bi = c; }
    }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        cand_v[(size_t)b * nblk + blockIdx.x] = bv;
        cand_i[(size_t)b * nblk + blockIdx.x] = bi;
    }
    if (!last_arrival(ctr + b, (unsigned)nblk)) return;
    bv = __int_as_float(0xff800000);
    bi = 0x7fffffff;
    for (int k = threadIdx.x; k < nblk; k += kTailThreads) {
        const float v = __ldcg(cand_v + (size_t)b * nblk + k);
        const int i = __ldcg(cand_i + (size_t)b * nblk + k);
        if (beats(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        tokens[b] = bi;
        if (position) position[b] += 1;
    }
}

int tail_blocks(int V) { return cdiv(V, kTailChunk); }

}  // namespace

extern "C" DJV_API int djv_embed(const int64_t* tokens, const int32_t* positions, const void* emb, const void* pos_emb,
                                 int pos_offset, void* y, int rows, int d, int V, int Tp, int dtype,
                                 cudaStream_t stream) {
    if (rows < 1 || rows > 65535 || d < 8 || d % 8 || V < 1 || (pos_emb && Tp < 1)) return DJV_E_SHAPE;
    if (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16) return DJV_E_DTYPE;
    if (!tokens || !emb || !y || (pos_emb && !positions)) return DJV_E_POINTER;
    if (!aligned16(emb) || !aligned16(y) || (pos_emb && !aligned16(pos_emb))) return DJV_E_POINTER;
    const dim3 grid(cdiv(d / 8, kEmbedThreads), rows);
    auto go = [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        return (int)launch_pdl(embed_kernel<T>, grid, dim3(kEmbedThreads), 0, stream, tokens, positions,
                               static_cast<const T*>(emb), static_cast<const T*>(pos_emb), pos_offset,
                               static_cast<T*>(y), d, V, Tp);
    };
    return dtype == DJV_FLOAT16 ? go((__half*)nullptr) : go((__nv_bfloat16*)nullptr);
}

extern "C" DJV_API size_t djv_greedy_tail_workspace_size(int B, int V) {
    if (B < 1 || V < 1) return 0;
    return kCounterBytes + (size_t)B * tail_blocks(V) * 8;
}

extern "C" DJV_API int djv_greedy_tail(const void* logits, float* logits_out, int64_t* tokens, int32_t* position,
                                       int B, int V, int dtype, void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream) {
    if (B < 1 || B > 65535 || V < 1 || tail_blocks(V) > kTailMaxBlocks) return DJV_E_SHAPE;
    if (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16) return DJV_E_DTYPE;
    if (!logits || !tokens) return DJV_E_POINTER;
    if ((size_t)B * 4 > kCounterBytes) return DJV_E_SHAPE;
    if (!workspace || !aligned16(workspace) || workspace_bytes < djv_greedy_tail_workspace_size(B, V))
        return DJV_E_WORKSPACE;
    const int nblk = tail_blocks(V);
    char* base = static_cast<char*>(workspace);
    unsigned* ctr = reinterpret_cast<unsigned*>(base);
    float* cand_v = reinterpret_cast<float*>(base + kCounterBytes);
    int* cand_i = reinterpret_cast<int*>(cand_v + (size_t)B * nblk);
    auto go = [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        return (int)launch_pdl(greedy_tail_kernel<T>, dim3(nblk, B), dim3(kTailThreads), 0, stream,
                               static_cast<const T*>(logits), logits_out, tokens, position, V, cand_v, cand_i, ctr);
    };
    return dtype == DJV_FLOAT16 ? go((__half*)nullptr) : go((__nv_bfloat16*)nullptr);
}
