// djv_trace.cuh - a timeline probe: per-CTA %globaltimer stamps from inside the fused MLP kernel and its
// partial-sum reduction, so that a call's fixed cost (launch, launch wait, first bytes, tail, reduction) can
// be split into its parts (benchmarks/probes/mlp_trace.py).
//
// Compiled in only with -DDJV_TRACE (cmake -DDJV_TRACE=ON: a separate build of the library, never the
// default one); without it every macro below is empty and the kernels are unchanged. In the traced build
// thread 0 of each CTA notes its stamps in shared memory and, at its end, stores one record at
// g_trace[kind][CTA][launch % kTraceCalls] with plain stores: no atomics, so nothing delays the CTA's exit.
// The launch number is the CTA's own counter, loaded at its start (the next launch's CTA of the same index
// starts only after this launch has ended: every kernel here waits for the one before). Each translation
// unit has its own storage, read through its own accessors (DJV_TRACE_ACCESSORS): sparseMLPKernel.cu's
// (_mlp: the fused MLP and its reduction) and headSparseAttentionKernel.cu's (_attn: the attention op's four).
#pragma once
#include <stdint.h>

#ifdef DJV_TRACE
namespace djv {
constexpr int kTraceEvents = 6;
// 0: mlp_bulk_kernel, 1: rows_reduce_kernel, 2: qkv_rows_kernel, 3: attn_kernel, 4: rows_down_kernel
constexpr int kTraceKinds = 5;
constexpr int kTraceCtas = 1024;   // CTAs per grid recorded (trace_cta(): x fastest, then y, then z)
constexpr int kTraceCalls = 64;    // launches kept per CTA (a ring)
struct TraceRec {
    unsigned long long t[kTraceEvents];  // 0 = not stamped
    unsigned launch, grid, smid, items;
};
static __device__ TraceRec g_trace[kTraceKinds][kTraceCtas][kTraceCalls];
static __device__ unsigned g_trace_launches[kTraceKinds][kTraceCtas];

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned sm_id() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
__device__ __forceinline__ unsigned trace_cta() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
}  // namespace djv

#define DJV_TRACE_DECL __shared__ unsigned long long djv_trace_t_[djv::kTraceEvents]
#define DJV_TRACE_MARK(i)                                                                   \
    do {                                                                                    \
        if (threadIdx.x == 0) djv_trace_t_[(i)] = djv::global_ns();                         \
    } while (0)
// The launch counter's load is issued here and used only at the end, so its latency hides in the kernel.
#define DJV_TRACE_START(kind)                                                               \
    unsigned djv_trace_launch_ = 0;                                                         \
    do {                                                                                    \
        if (threadIdx.x == 0) {                                                             \
            djv_trace_t_[0] = djv::global_ns();                                             \
            for (int i_ = 1; i_ < djv::kTraceEvents; ++i_) djv_trace_t_[i_] = 0;            \
            if (djv::trace_cta() < (unsigned)djv::kTraceCtas)                               \
                djv_trace_launch_ = *(volatile unsigned*)&djv::g_trace_launches[(kind)][djv::trace_cta()]; \
        }                                                                                   \
    } while (0)
#define DJV_TRACE_END(kind, nitems)                                                        \
    do {                                                                                    \
        if (threadIdx.x == 0 && djv::trace_cta() < (unsigned)djv::kTraceCtas) {             \
            djv_trace_t_[djv::kTraceEvents - 1] = djv::global_ns();                         \
            djv::TraceRec& r_ = djv::g_trace[(kind)][djv::trace_cta()][djv_trace_launch_ % djv::kTraceCalls]; \
            for (int i_ = 0; i_ < djv::kTraceEvents; ++i_) r_.t[i_] = djv_trace_t_[i_];     \
            r_.launch = djv_trace_launch_;                                                  \
            r_.grid = gridDim.x * gridDim.y * gridDim.z;                                    \
            r_.smid = djv::sm_id();                                                         \
            r_.items = (unsigned)(nitems);                                                  \
            djv::g_trace_launches[(kind)][djv::trace_cta()] = djv_trace_launch_ + 1;        \
        }                                                                                   \
    } while (0)
// The accessors of one translation unit's records (extern "C", in a -DDJV_TRACE build only; not part of the
// C ABI): djv_trace_layout_<tu> {kinds, CTAs, launches kept per CTA, stamps, record bytes}, djv_trace_reset_<tu>
// (every record and launch counter to 0, synchronous), djv_trace_read_<tu> (the records, [kinds][CTAs][launches]).
#define DJV_TRACE_ACCESSORS(tu)                                                                  \
    DJV_API void djv_trace_layout_##tu(int* out) {                                               \
        out[0] = djv::kTraceKinds;                                                               \
        out[1] = djv::kTraceCtas;                                                                \
        out[2] = djv::kTraceCalls;                                                               \
        out[3] = djv::kTraceEvents;                                                              \
        out[4] = (int)sizeof(djv::TraceRec);                                                     \
    }                                                                                            \
    DJV_API int djv_trace_reset_##tu(void) {                                                     \
        void* p = nullptr;                                                                       \
        cudaError_t e = cudaGetSymbolAddress(&p, djv::g_trace);                                  \
        if (e == cudaSuccess) e = cudaMemset(p, 0, sizeof(djv::g_trace));                        \
        if (e == cudaSuccess) e = cudaGetSymbolAddress(&p, djv::g_trace_launches);               \
        if (e == cudaSuccess) e = cudaMemset(p, 0, sizeof(djv::g_trace_launches));               \
        if (e == cudaSuccess) e = cudaDeviceSynchronize();                                       \
        return (int)e;                                                                           \
    }                                                                                            \
    DJV_API int djv_trace_read_##tu(void* dst, size_t bytes) {                                   \
        if (bytes < sizeof(djv::g_trace)) return DJV_E_WORKSPACE;                                \
        return (int)cudaMemcpyFromSymbol(dst, djv::g_trace, sizeof(djv::g_trace));               \
    }
#else
#define DJV_TRACE_DECL
#define DJV_TRACE_MARK(i) \
    do {                  \
    } while (0)
#define DJV_TRACE_START(kind) \
    do {                      \
    } while (0)
#define DJV_TRACE_END(kind, nitems) \
    do {                           \
    } while (0)
#endif
