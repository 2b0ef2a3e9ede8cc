// Plugin-library entry points, linked into libdejavu_trt_vc_plugins.so: TensorRT's own loading
// (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins, IBuilderConfig::setPluginsToSerialize) calls
// getCreators() and registers what it returns, so this library registers nothing by itself.
#include "headSparseAttentionPlugin.h"
#include "lookaheadPredictorPlugin.h"
#include "sparseMLPPlugin.h"

using namespace dejavu_trt;

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators) {
    static SparseMLPPluginCreator mlp;
    static HeadSparseAttentionPluginCreator attn;
    static LookaheadPredictorPluginCreator pred;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&mlp, &attn, &pred};
    nbCreators = 3;
    return creators;
}

// The adapters log nothing (errors are return codes), so the logger finder is accepted and unused.
extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder*) {}
