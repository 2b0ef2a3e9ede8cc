// Probe: what one grid-wide step boundary costs on this GPU, three ways, with (almost) no work in between.
//   barrier  - one launch of 2 CTAs x 256 threads per SM doing R grid barriers (the barrier of the persistent
//              attention kernel tried in 77db4c8: atomicAdd arrival, ld.acquire spin, top-bit flip);
//   pdl      - R launches of the same grid in a CUDA graph, each launched with programmatic stream
//              serialisation, waiting (griddepcontrol.wait) for the one before;
//   plain    - R launches of the same grid in a CUDA graph, ordinary stream order.
// Each kernel does one dependent global read and write per CTA, so a boundary also carries a data hand-off.
// Build: nvcc -O3 -gencode=arch=compute_90,code=sm_90 sync_cost.cu -o sync_cost && ./sync_cost
#include <cstdio>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ __forceinline__ void grid_barrier(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();
        const unsigned old = atomicAdd(bar, add);
        unsigned cur;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(cur) : "l"(bar) : "memory");
        } while (((cur ^ old) & 0x80000000u) == 0);
        __threadfence();
    }
    __syncthreads();
}

// Step s: CTA c reads what CTA (c + 1) % grid wrote in step s - 1 and writes its own slot.
__device__ __forceinline__ void hand_off(volatile int* buf, int s) {
    if (threadIdx.x == 0) {
        const int nb = gridDim.x, c = blockIdx.x;
        const int prev = buf[(s & 1) * nb + (c + 1) % nb];
        buf[((s + 1) & 1) * nb + c] = prev + 1;
    }
}

__global__ void __launch_bounds__(256, 2) persistent(int* buf, unsigned* bar, int rounds) {
    for (int s = 0; s < rounds; ++s) {
        hand_off(buf, s);
        grid_barrier(bar);
    }
}

__global__ void __launch_bounds__(256, 2) one_step(int* buf, int s) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    hand_off(buf, s);
}

int main() {
    int sms = 0, dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent, 256, 0));
    const int grid = 2 * sms, R = 2000;
    if (per_sm < 2) { printf("2 CTAs per SM do not fit\n"); return 1; }
    int* buf;
    unsigned* bar;
    CK(cudaMalloc(&buf, 2 * grid * sizeof(int)));
    CK(cudaMalloc(&bar, sizeof(unsigned)));
    CK(cudaMemset(buf, 0, 2 * grid * sizeof(int)));
    CK(cudaMemset(bar, 0, sizeof(unsigned)));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    float ms = 0.f;

    for (int rep = 0; rep < 3; ++rep) {  // the last repetition is reported (the first ones warm up)
        CK(cudaEventRecord(a, st));
        persistent<<<grid, 256, 0, st>>>(buf, bar, R);
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&ms, a, b));
    }
    printf("barrier  grid %d x 256: %.3f us per grid barrier (%d in one launch)\n", grid, 1e3f * ms / R, R);

    for (int pdl = 1; pdl >= 0; --pdl) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int s = 0; s < R; ++s) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(grid);
            cfg.blockDim = dim3(256);
            cfg.stream = st;
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr[0].val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = attr;
            cfg.numAttrs = pdl;
            CK(cudaLaunchKernelEx(&cfg, one_step, buf, s));
        }
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        for (int rep = 0; rep < 3; ++rep) {
            CK(cudaEventRecord(a, st));
            CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            CK(cudaEventElapsedTime(&ms, a, b));
        }
        printf("%-8s grid %d x 256: %.3f us per kernel boundary (%d launches in one CUDA graph)\n",
               pdl ? "pdl" : "plain", grid, 1e3f * ms / R, R);
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
    }
    return 0;
}
