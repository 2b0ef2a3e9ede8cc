"""Names and version of the op contract written in docs/ops.md."""

OP_CONTRACT_VERSION = "1"
PLUGIN_NAMESPACE = "dejavu_trt"  # also the ONNX domain of the plugin nodes and their local functions

PREDICTOR_OP = "DejaVuLookaheadPredictor"
SPARSE_MLP_OP = "DejaVuSparseMLP"
HEAD_ATTENTION_OP = "DejaVuHeadSparseAttention"
OP_NAMES = (PREDICTOR_OP, SPARSE_MLP_OP, HEAD_ATTENTION_OP)

MLP_ACTIVATIONS = ("relu", "gelu", "silu_glu")
KV_POLICIES = ("dense", "active")
PREDICTOR_EPS = 1e-6
