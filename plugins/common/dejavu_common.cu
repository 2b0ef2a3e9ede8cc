// C ABI entry points shared by all ops (version, status strings, workspace preparation).
#include "dejavu_kernels.h"
#include "djv_device.cuh"

extern "C" {

DJV_API int djv_abi_version(void) { return DJV_ABI_VERSION; }

DJV_API const char* djv_status_string(int status) {
    switch (status) {
    case DJV_OK: return "ok";
    case DJV_E_SHAPE: return "bad shape or size";
    case DJV_E_DTYPE: return "unknown dtype, activation or kv_policy";
    case DJV_E_WORKSPACE: return "workspace missing or too small";
    case DJV_E_POINTER: return "required pointer is NULL or not 16-byte aligned";
    default: return status > 0 ? cudaGetErrorString((cudaError_t)status) : "unknown status";
    }
}

DJV_API int djv_workspace_prepare(void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    if (!workspace || workspace_bytes < djv::kCounterBytes) return DJV_E_WORKSPACE;
    return (int)cudaMemsetAsync(workspace, 0, djv::kCounterBytes, stream);
}

DJV_API int djv_set_mlp_grid_slack(int sms) {
    if (sms < 0 || sms > djv::sm_count() / 2) return DJV_E_SHAPE;
    const int prev = djv::mlp_grid_slack();
    djv::mlp_grid_slack() = sms;
    return prev;
}

DJV_API int djv_set_indices_ready(int ready) {
    if (ready != 0 && ready != 1) return DJV_E_SHAPE;
    const int prev = djv::indices_ready();
    djv::indices_ready() = ready;
    return prev;
}

}  // extern "C"
