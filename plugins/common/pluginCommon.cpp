// Plugin registration: static registrars (REGISTER_TENSORRT_PLUGIN) for builds that link the library
// into the application, and getCreators() for TensorRT 10's plugin-library loading
// (IPluginRegistry::loadLibrary / trtexec --dynamicPlugins).
#include "pluginCommon.h"
#include "headSparseAttentionPlugin.h"
#include "lookaheadPredictorPlugin.h"
#include "sparseMLPPlugin.h"

using namespace dejavu_trt;

REGISTER_TENSORRT_PLUGIN(SparseMLPPluginCreator);
REGISTER_TENSORRT_PLUGIN(HeadSparseAttentionPluginCreator);
REGISTER_TENSORRT_PLUGIN(LookaheadPredictorPluginCreator);

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators) {
    static SparseMLPPluginCreator mlp;
    static HeadSparseAttentionPluginCreator attn;
    static LookaheadPredictorPluginCreator pred;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&mlp, &attn, &pred};
    nbCreators = 3;
    return creators;
}
