#include "lookaheadPredictorPlugin.h"
#include <stdexcept>

namespace dejavu_trt {

LookaheadPredictorPlugin::LookaheadPredictorPlugin(int32_t keptUnits, int32_t keptHeads, float eps)
    : mKeptUnits(keptUnits), mKeptHeads(keptHeads), mEps(eps) {
    if (keptUnits < 1 || keptHeads < 1) throw std::invalid_argument("DejaVuLookaheadPredictor: kept_* must be >= 1");
    mFields.setInt("kept_units", mKeptUnits);
    mFields.setInt("kept_heads", mKeptHeads);
    mFields.setFloat("eps", mEps);
}

std::vector<PluginField>& LookaheadPredictorPlugin::fieldNames() {
    static std::vector<PluginField> f{{"kept_units", nullptr, PluginFieldType::kINT32, 1},
                                      {"kept_heads", nullptr, PluginFieldType::kINT32, 1},
                                      {"eps", nullptr, PluginFieldType::kFLOAT32, 1}};
    return f;
}

IPluginV3* LookaheadPredictorPlugin::create(char const*, PluginFieldCollection const* fc) {
    int32_t k = 0, kh = 0;
    float eps = 0.f;
    if (!Fields::getInt(fc, "kept_units", k) || !Fields::getInt(fc, "kept_heads", kh) ||
        !Fields::getFloat(fc, "eps", eps))
        return nullptr;
    auto p = std::make_unique<LookaheadPredictorPlugin>(k, kh, eps);
    if (!p->readWorkspace(fc)) return nullptr;
    return p.release();
}

IPluginV3* LookaheadPredictorPlugin::clone() noexcept {
    try {
        auto* p = new LookaheadPredictorPlugin(mKeptUnits, mKeptHeads, mEps);
        if (mWorkspaceBytes > 0) p->setWorkspace(mWorkspaceBytes);
        return p;
    } catch (...) {
        return nullptr;
    }
}

int32_t LookaheadPredictorPlugin::getOutputDataTypes(DataType* out, int32_t nbOut, DataType const*, int32_t nbIn) const noexcept {
    if (nbIn != 5 || nbOut != 2) return -1;
    out[0] = out[1] = DataType::kINT32;
    return 0;
}

int32_t LookaheadPredictorPlugin::getOutputShapes(DimsExprs const* in, int32_t nbIn, DimsExprs const*, int32_t,
                                                  DimsExprs* out, int32_t nbOut, IExprBuilder& eb) noexcept {
    if (nbIn != 5 || nbOut != 2 || in[0].nbDims != 2) return -1;
    out[0].nbDims = 1;
    out[0].d[0] = eb.constant(mKeptUnits);
    out[1].nbDims = 1;
    out[1].d[0] = eb.constant(mKeptHeads);
    return 0;
}

bool LookaheadPredictorPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbIn,
                                                         int32_t nbOut) noexcept {
    if (nbIn != 5 || nbOut != 2 || pos < 0 || pos >= 7) return false;
    auto const& d = io[pos].desc;
    if (pos >= 5) return d.format == TensorFormat::kLINEAR && d.type == DataType::kINT32;
    if (pos == 0) return d.format == TensorFormat::kLINEAR && toDjv(d.type) >= 0;
    return linearIs(d, io[0].desc.type);
}

int32_t LookaheadPredictorPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbIn,
                                                  DynamicPluginTensorDesc const* out, int32_t nbOut) noexcept {
    // h [B, d], mlp_a [d, r_m], mlp_b [r_m, Nb >= kept_units], head_a [d, r_h], head_b [r_h, H >= kept_heads]
    if (nbIn != 5 || nbOut != 2 || in[0].desc.dims.nbDims != 2) return -1;
    const int64_t d = in[0].max.d[1];
    if (!dimsAre(in[1], {d, -1}) || !dimsAre(in[2], {in[1].max.d[1], -1}) || !dimsAre(in[3], {d, -1}) ||
        !dimsAre(in[4], {in[3].max.d[1], -1}) || in[2].max.d[1] < mKeptUnits || in[4].max.d[1] < mKeptHeads)
        return -1;
    setWorkspace((int64_t)getWorkspaceSize(in, nbIn, out, nbOut));
    return 0;
}

size_t LookaheadPredictorPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t,
                                                  DynamicPluginTensorDesc const*, int32_t) const noexcept {
    // inputs: h [B,d], mlp_a [d,r_m], mlp_b [r_m,Nb], head_a [d,r_h], head_b [r_h,H]
    return djv_predictor_workspace_size((int32_t)in[0].max.d[0], (int32_t)in[0].max.d[1], (int32_t)in[1].max.d[1],
                                        (int32_t)in[2].max.d[1], (int32_t)in[3].max.d[1], (int32_t)in[4].max.d[1]);
}

int32_t LookaheadPredictorPlugin::enqueue(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs,
                                          void* const* outputs, void* ws, cudaStream_t stream) noexcept {
    const int32_t B = (int32_t)in[0].dims.d[0], d = (int32_t)in[0].dims.d[1];
    const int32_t rm = (int32_t)in[1].dims.d[1], nb = (int32_t)in[2].dims.d[1];
    const int32_t rh = (int32_t)in[3].dims.d[1], H = (int32_t)in[4].dims.d[1];
    const size_t bytes = workspaceFor(djv_predictor_workspace_size(B, d, rm, nb, rh, H));
    if (prepare(ws, bytes, stream)) return -1;
    const int st = djv_lookahead_predictor(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4],
                                           static_cast<int32_t*>(outputs[0]), static_cast<int32_t*>(outputs[1]),
                                           nullptr, B, d, rm, nb, mKeptUnits, rh, H, mKeptHeads, mEps,
                                           toDjv(in[0].type), ws, bytes, stream);
    return st == 0 ? 0 : -1;
}

}  // namespace dejavu_trt
