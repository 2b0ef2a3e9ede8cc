// djv_bulk.cuh - Hopper (sm_90) bulk copies into shared memory, completed on mbarriers.
//
// Why: a warp's plain loads keep at most a few KB per SM in flight (registers bound it), and the row GEMVs
// of djv_rows.cuh top out near 2.6 TB/s on a 50 MB gather. One thread issuing cp.async.bulk copies of whole
// weight rows (each a contiguous run of d values in the neuron-major layout) keeps 100+ KB per SM in flight
// with no registers at all, which is what HBM3e needs. Every wrapper compiles to nothing below sm_90; callers
// pick these kernels only on devices of compute capability >= 9 (bulk_copy_supported()).
#pragma once
#include <stdlib.h>
#include <utility>
#include "djv_device.cuh"

namespace djv {

// DJV_NO_BULK in the environment forces the portable kernels (djv_rows.cuh) on sm_90 too: the GPU tests run
// once each way on the H200, so the A100 path stays tested, and the benchmark measures the difference.
inline bool is_sm90_or_newer() { return device_attr<cudaDevAttrComputeCapabilityMajor>(0) >= 9; }
inline bool bulk_copy_supported() {
    static const bool env_off = getenv("DJV_NO_BULK") != nullptr;
    return !env_off && is_sm90_or_newer();
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DJV_BULK 1
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
#ifdef DJV_BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}

// Make mbarrier inits visible to the copy engine (async proxy) before the first copy names them.
__device__ __forceinline__ void fence_barrier_init() {
#ifdef DJV_BULK
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Order this thread's earlier generic-proxy shared-memory accesses before later copy-engine writes.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef DJV_BULK
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Arm a barrier phase for `bytes` of incoming copies (one arrival: the issuing thread).
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
#ifdef DJV_BULK
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
#endif
}

// Weights are streamed once: mark them first to go from L2 so that activations and partials stay. `normal`
// gives L2's default priority instead (A/B runs, DJV_MLP_L2_NORMAL: rows read again soon then stay in L2).
__device__ __forceinline__ uint64_t l2_weight_policy(bool normal = false) {
    uint64_t pol = 0;
#ifdef DJV_BULK
    if (normal) asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(pol));
    else asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
#endif
    return pol;
}

// dst (shared) <- src (global), `bytes` a multiple of 16, both 16-byte aligned; completes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar, uint64_t pol) {
#ifdef DJV_BULK
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
            "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(pol)
        : "memory");
#endif
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#ifdef DJV_BULK
    asm volatile(
        "{\n .reg .pred p;\n"
        "DJV_WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra DJV_WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
#endif
}

// Programmatic dependent launch (sm_90): let the next kernel of the stream start its launch now / wait here
// until the previous kernel's results are visible. No-ops below sm_90 and when launched without PDL.
__device__ __forceinline__ void pdl_launch_dependents() {
#ifdef DJV_BULK
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_primary() {
#ifdef DJV_BULK
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launch with programmatic stream serialization (sm_90): the kernel may start while the previous kernel of the
// stream still runs, and must call pdl_wait_primary() before touching anything that kernel writes. Plain
// launch below sm_90 or when DJV_NO_PDL is set in the environment (for ablations).
//
// The chain's rule: every kernel launched this way calls pdl_launch_dependents() only after its own
// pdl_wait_primary() (in at least one CTA; CTAs that exit without waiting count as triggered). So when
// kernel n+1 starts, kernel n-1 has completed and its writes are visible; and since no kernel writes to
// global memory before its wait, a kernel that starts early can race with nothing. What the chain saves is
// the launch latency between kernels (the next grid is resident and waiting). Reads of what the kernel
// before cannot have written may go before the wait: weights always, indices where the op's first kernel
// has already waited for them (the output projection) or the caller promised them (djv_set_indices_ready:
// the QKV projection, the fused MLP). Session 5 measured such early reads slower (benchmarks/RESULTS.md);
// session 23, on the later chain, measured them 3.8% faster on an H100.
inline bool pdl_enabled() {
    static const bool env_off = getenv("DJV_NO_PDL") != nullptr;
    return !env_off && is_sm90_or_newer();
}

template <typename... KArgs, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                              Args&&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl_enabled() ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace djv
