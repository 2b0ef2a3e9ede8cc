// Static registration, linked into libdejavu_trt_plugins.so: the creators register themselves when the
// library is dlopen'ed (polygraphy's LoadPlugins, ctypes, LD_PRELOAD, Triton's TensorRT backend, trtexec
// --staticPlugins). Not in the same library as getCreators(): IPluginRegistry::loadLibrary refuses a
// library whose creators are already registered, and dlopen runs these registrars before it asks.
#include "headSparseAttentionPlugin.h"
#include "lookaheadPredictorPlugin.h"
#include "sparseMLPPlugin.h"

using namespace dejavu_trt;

REGISTER_TENSORRT_PLUGIN(SparseMLPPluginCreator);
REGISTER_TENSORRT_PLUGIN(HeadSparseAttentionPluginCreator);
REGISTER_TENSORRT_PLUGIN(LookaheadPredictorPluginCreator);
