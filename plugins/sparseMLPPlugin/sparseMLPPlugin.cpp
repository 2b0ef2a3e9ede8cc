#include "sparseMLPPlugin.h"
#include <stdexcept>

namespace dejavu_trt {

static int32_t parseActivation(std::string const& a) {
    if (a == "relu") return DJV_RELU;
    if (a == "gelu") return DJV_GELU;
    if (a == "silu_glu") return DJV_SILU_GLU;
    throw std::invalid_argument("DejaVuSparseMLP: activation must be relu, gelu or silu_glu");
}

SparseMLPPlugin::SparseMLPPlugin(std::string const& activation, int32_t blockSize, int32_t keptUnits,
                                 int32_t numNeurons)
    : mActivation(activation), mAct(parseActivation(activation)), mBlockSize(blockSize), mKeptUnits(keptUnits),
      mNumNeurons(numNeurons) {
    if (blockSize < 1 || keptUnits < 1 || numNeurons < 1 || numNeurons % blockSize ||
        (int64_t)keptUnits * blockSize > numNeurons)
        throw std::invalid_argument("DejaVuSparseMLP: bad block_size / kept_units / num_neurons");
    mFields.setString("activation", mActivation);
    mFields.setInt("block_size", mBlockSize);
    mFields.setInt("kept_units", mKeptUnits);
    mFields.setInt("num_neurons", mNumNeurons);
}

std::vector<PluginField>& SparseMLPPlugin::fieldNames() {
    static std::vector<PluginField> f{{"activation", nullptr, PluginFieldType::kCHAR, 0},
                                      {"block_size", nullptr, PluginFieldType::kINT32, 1},
                                      {"kept_units", nullptr, PluginFieldType::kINT32, 1},
                                      {"num_neurons", nullptr, PluginFieldType::kINT32, 1}};
    return f;
}

IPluginV3* SparseMLPPlugin::create(char const*, PluginFieldCollection const* fc) {
    std::string act;
    int32_t bs = 0, k = 0, n = 0;
    if (!Fields::getString(fc, "activation", act) || !Fields::getInt(fc, "block_size", bs) ||
        !Fields::getInt(fc, "kept_units", k) || !Fields::getInt(fc, "num_neurons", n))
        return nullptr;
    auto p = std::make_unique<SparseMLPPlugin>(act, bs, k, n);
    if (!p->readWorkspace(fc)) return nullptr;
    return p.release();
}

IPluginV3* SparseMLPPlugin::clone() noexcept {
    try {
        auto* p = new SparseMLPPlugin(mActivation, mBlockSize, mKeptUnits, mNumNeurons);
        if (mWorkspaceBytes > 0) p->setWorkspace(mWorkspaceBytes);
        return p;
    } catch (...) {
        return nullptr;
    }
}

int32_t SparseMLPPlugin::getOutputDataTypes(DataType* out, int32_t nbOut, DataType const* in, int32_t nbIn) const noexcept {
    if (nbOut != 1 || nbIn != nbInputs()) return -1;
    out[0] = in[0];
    return 0;
}

int32_t SparseMLPPlugin::getOutputShapes(DimsExprs const* in, int32_t nbIn, DimsExprs const*, int32_t, DimsExprs* out,
                                         int32_t nbOut, IExprBuilder&) noexcept {
    if (nbIn != nbInputs() || nbOut != 1 || in[0].nbDims != 2) return -1;
    out[0] = in[0];  // y [B, d]
    return 0;
}

bool SparseMLPPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbIn,
                                                int32_t nbOut) noexcept {
    if (nbIn != nbInputs() || nbOut != 1 || pos < 0 || pos >= nbIn + nbOut) return false;
    auto const& d = io[pos].desc;
    if (pos == 1) return d.format == TensorFormat::kLINEAR && d.type == DataType::kINT32;  // idx
    if (pos == 0) return d.format == TensorFormat::kLINEAR && toDjv(d.type) >= 0;
    return linearIs(d, io[0].desc.type);  // weights, biases and y share x's type
}

int32_t SparseMLPPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbIn,
                                         DynamicPluginTensorDesc const* out, int32_t nbOut) noexcept {
    // x [B, d], idx [kept_units], rows [num_neurons, d] (biases [num_neurons] / [d]), y [B, d]
    if (nbIn != nbInputs() || nbOut != 1 || in[0].desc.dims.nbDims != 2) return -1;
    const int64_t d = in[0].max.d[1];
    if (!dimsAre(in[1], {(int64_t)mKeptUnits}) || !dimsAre(out[0], {-1, d})) return -1;
    const bool glu = mAct == DJV_SILU_GLU;
    for (int32_t i : glu ? std::initializer_list<int32_t>{2, 3, 4} : std::initializer_list<int32_t>{2, 4})
        if (!dimsAre(in[i], {mNumNeurons, d})) return -1;
    if (!glu && (!dimsAre(in[3], {mNumNeurons}) || !dimsAre(in[5], {d}))) return -1;
    setWorkspace((int64_t)getWorkspaceSize(in, nbIn, out, nbOut));
    return 0;
}

size_t SparseMLPPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t, DynamicPluginTensorDesc const*,
                                         int32_t) const noexcept {
    const int32_t B = (int32_t)in[0].max.d[0], d = (int32_t)in[0].max.d[1];
    return djv_sparse_mlp_workspace_size(B, d, mNumNeurons, mKeptUnits, mBlockSize, mAct);
}

int32_t SparseMLPPlugin::enqueue(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs,
                                 void* const* outputs, void* ws, cudaStream_t stream) noexcept {
    const int32_t B = (int32_t)in[0].dims.d[0], d = (int32_t)in[0].dims.d[1];
    const size_t bytes = workspaceFor(djv_sparse_mlp_workspace_size(B, d, mNumNeurons, mKeptUnits, mBlockSize, mAct));
    if (prepare(ws, bytes, stream)) return -1;
    const bool glu = mAct == DJV_SILU_GLU;
    // inputs: x, idx, (w_gate, w_up, w_down_t) | (w_up, b_up, w_down_t, b_down)
    void const* wg = glu ? inputs[2] : nullptr;
    void const* wu = glu ? inputs[3] : inputs[2];
    void const* bu = glu ? nullptr : inputs[3];
    void const* wd = glu ? inputs[4] : inputs[4];
    void const* bd = glu ? nullptr : inputs[5];
    // The ONNX op has no residual input (the graph keeps its Add): pass none.
    const int st = djv_sparse_mlp(inputs[0], static_cast<int32_t const*>(inputs[1]), wg, wu, bu, wd, bd, nullptr,
                                  outputs[0], B, d, mNumNeurons, mKeptUnits, mBlockSize, mAct, toDjv(in[0].type), ws, bytes, stream);
    return st == 0 ? 0 : -1;
}

}  // namespace dejavu_trt
