// Row normalisation for the CUDA executor (not a plugin: in the ONNX graph the norms are standard ops that
// TensorRT fuses itself). At batch 1 the decode step's LayerNorm is one 10 KB row; torch's kernel spends
// ~10 us on it (profiled, H200), longer than the head-sparse attention core. One CTA per row, the row held in
// registers (16-byte loads), two-pass variance, one rounding for LayerNorm; RMSNorm rounds as HF's
// LlamaRMSNorm does (normalise in fp32, round, then scale in the I/O dtype). The row code is djv_norm.cuh,
// shared with the norm fused into the MLP's and attention's last reduction (post_norm).
#include "dejavu_kernels.h"
#include "djv_norm.cuh"

namespace {
using namespace djv;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" DJV_API int djv_norm(const void* x, const void* weight, const void* bias, void* y, int rows, int d,
                                int kind, float eps, int dtype, cudaStream_t stream) {
    if (rows < 1 || d < 8 || d % 8 || d > 8 * 2 * kNormMaxThreads) return DJV_E_SHAPE;
    if ((kind != DJV_LAYERNORM && kind != DJV_RMSNORM) || (dtype != DJV_FLOAT16 && dtype != DJV_BFLOAT16))
        return DJV_E_DTYPE;
    if (!x || !weight || !y || (kind == DJV_RMSNORM && bias)) return DJV_E_POINTER;
    if (!aligned16(x) || !aligned16(weight) || !aligned16(y) || (bias && !aligned16(bias))) return DJV_E_POINTER;
    const int rms = kind == DJV_RMSNORM;
    if (dtype == DJV_FLOAT16)
        return (int)launch_norm<__half>(static_cast<const __half*>(x), static_cast<const __half*>(weight),
                                        static_cast<const __half*>(bias), static_cast<__half*>(y), rows, d, rms, eps,
                                        stream);
    return (int)launch_norm<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(x),
                                           static_cast<const __nv_bfloat16*>(weight),
                                           static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(y),
                                           rows, d, rms, eps, stream);
}
