#include "headSparseAttentionPlugin.h"
#include <stdexcept>

namespace dejavu_trt {

namespace {
constexpr int32_t kNbIn = 15, kNbOut = 3, kKCache = 13, kVCache = 14;
}

HeadSparseAttentionPlugin::HeadSparseAttentionPlugin(Attrs const& a) : mA(a) {
    if (a.kvPolicy == "dense") mPolicy = DJV_KV_DENSE;
    else if (a.kvPolicy == "active") mPolicy = DJV_KV_ACTIVE;
    else throw std::invalid_argument("DejaVuHeadSparseAttention: kv_policy must be dense or active");
    if (a.numHeads < 1 || a.numKvHeads < 1 || a.numHeads % a.numKvHeads || a.keptHeads < 1 || a.keptHeads > a.numHeads ||
        (a.headDim != 64 && a.headDim != 128 && a.headDim != 256))
        throw std::invalid_argument("DejaVuHeadSparseAttention: bad head attributes");
    mFields.setInt("num_heads", a.numHeads);
    mFields.setInt("num_kv_heads", a.numKvHeads);
    mFields.setInt("head_dim", a.headDim);
    mFields.setInt("kept_heads", a.keptHeads);
    mFields.setInt("rotary", a.rotary);
    mFields.setFloat("scale", a.scale);
    mFields.setString("kv_policy", a.kvPolicy);
}

std::vector<PluginField>& HeadSparseAttentionPlugin::fieldNames() {
    static std::vector<PluginField> f{{"num_heads", nullptr, PluginFieldType::kINT32, 1},
                                      {"num_kv_heads", nullptr, PluginFieldType::kINT32, 1},
                                      {"head_dim", nullptr, PluginFieldType::kINT32, 1},
                                      {"kept_heads", nullptr, PluginFieldType::kINT32, 1},
                                      {"rotary", nullptr, PluginFieldType::kINT32, 1},
                                      {"scale", nullptr, PluginFieldType::kFLOAT32, 1},
                                      {"kv_policy", nullptr, PluginFieldType::kCHAR, 0}};
    return f;
}

IPluginV3* HeadSparseAttentionPlugin::create(char const*, PluginFieldCollection const* fc) {
    Attrs a{0, 0, 0, 0, 0, 0.f, ""};
    if (!Fields::getInt(fc, "num_heads", a.numHeads) || !Fields::getInt(fc, "num_kv_heads", a.numKvHeads) ||
        !Fields::getInt(fc, "head_dim", a.headDim) || !Fields::getInt(fc, "kept_heads", a.keptHeads) ||
        !Fields::getInt(fc, "rotary", a.rotary) || !Fields::getFloat(fc, "scale", a.scale) ||
        !Fields::getString(fc, "kv_policy", a.kvPolicy))
        return nullptr;
    auto p = std::make_unique<HeadSparseAttentionPlugin>(a);
    if (!p->readWorkspace(fc)) return nullptr;
    return p.release();
}

IPluginV3* HeadSparseAttentionPlugin::clone() noexcept {
    try {
        auto* p = new HeadSparseAttentionPlugin(mA);
        if (mWorkspaceBytes > 0) p->setWorkspace(mWorkspaceBytes);
        return p;
    } catch (...) {
        return nullptr;
    }
}

int32_t HeadSparseAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept {
    return outputIndex == 1 ? kKCache : (outputIndex == 2 ? kVCache : -1);
}

int32_t HeadSparseAttentionPlugin::getOutputDataTypes(DataType* out, int32_t nbOut, DataType const* in,
                                                      int32_t nbIn) const noexcept {
    if (nbIn != kNbIn || nbOut != kNbOut) return -1;
    out[0] = in[0];
    out[1] = in[kKCache];
    out[2] = in[kVCache];
    return 0;
}

int32_t HeadSparseAttentionPlugin::getOutputShapes(DimsExprs const* in, int32_t nbIn, DimsExprs const*, int32_t,
                                                   DimsExprs* out, int32_t nbOut, IExprBuilder&) noexcept {
    if (nbIn != kNbIn || nbOut != kNbOut || in[0].nbDims != 2 || in[kKCache].nbDims != 4) return -1;
    out[0] = in[0];
    out[1] = in[kKCache];
    out[2] = in[kVCache];
    return 0;
}

bool HeadSparseAttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbIn,
                                                          int32_t nbOut) noexcept {
    if (nbIn != kNbIn || nbOut != kNbOut || pos < 0 || pos >= nbIn + nbOut) return false;
    auto const& d = io[pos].desc;
    if (pos == 1 || pos == 2) return d.format == TensorFormat::kLINEAR && d.type == DataType::kINT32;  // idx, position
    if (pos == 0) return d.format == TensorFormat::kLINEAR && toDjv(d.type) >= 0;
    return linearIs(d, io[0].desc.type);
}

int32_t HeadSparseAttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbIn,
                                                   DynamicPluginTensorDesc const* out, int32_t nbOut) noexcept {
    // x [B, d], head_idx [kept_heads], position [B], w_q/w_o_t [H*hd, d], w_k/w_v [Hkv*hd, d], b_q [H*hd],
    // b_k/b_v [Hkv*hd], b_o [d], caches [B, Hkv, T, hd] (outputs alike)
    if (nbIn != kNbIn || nbOut != kNbOut || in[0].desc.dims.nbDims != 2) return -1;
    const int64_t d = in[0].max.d[1], q = (int64_t)mA.numHeads * mA.headDim, kv = (int64_t)mA.numKvHeads * mA.headDim;
    if (!dimsAre(in[1], {mA.keptHeads}) || !dimsAre(in[2], {-1}) || !dimsAre(in[3], {q, d}) ||
        !dimsAre(in[4], {kv, d}) || !dimsAre(in[5], {kv, d}) || !dimsAre(in[6], {q, d}) || !dimsAre(in[7], {q}) ||
        !dimsAre(in[8], {kv}) || !dimsAre(in[9], {kv}) || !dimsAre(in[10], {d}))
        return -1;
    for (int32_t i : {kKCache, kVCache})
        if (!dimsAre(in[i], {-1, mA.numKvHeads, -1, mA.headDim})) return -1;
    if (!dimsAre(out[0], {-1, d})) return -1;
    setWorkspace((int64_t)getWorkspaceSize(in, nbIn, out, nbOut));
    return 0;
}

size_t HeadSparseAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t,
                                                   DynamicPluginTensorDesc const*, int32_t) const noexcept {
    const int32_t Bmax = (int32_t)in[0].max.d[0], d = (int32_t)in[0].max.d[1], T = (int32_t)in[kKCache].max.d[2];
    size_t m = 0;  // the token split depends on B: take the largest over the profile's batch range
    for (int32_t b = 1; b <= Bmax; ++b) {
        const size_t s = djv_head_attention_workspace_size(b, d, mA.numHeads, mA.numKvHeads, mA.headDim, mA.keptHeads,
                                                           T, mPolicy);
        m = s > m ? s : m;
    }
    return m;
}

int32_t HeadSparseAttentionPlugin::enqueue(PluginTensorDesc const* in, PluginTensorDesc const*,
                                           void const* const* inputs, void* const* outputs, void* ws,
                                           cudaStream_t stream) noexcept {
    const int32_t B = (int32_t)in[0].dims.d[0], d = (int32_t)in[0].dims.d[1], T = (int32_t)in[kKCache].dims.d[2];
    const size_t bytes = workspaceFor(
        djv_head_attention_workspace_size(B, d, mA.numHeads, mA.numKvHeads, mA.headDim, mA.keptHeads, T, mPolicy));
    if (prepare(ws, bytes, stream)) return -1;
    // outputs[1]/[2] alias inputs 13/14 (ALIASED_PLUGIN_IO_10_03): the kernel updates them in place. Should
    // TensorRT hand us distinct buffers all the same, carry the past into the output first (one copy).
    const size_t cacheBytes = (size_t)B * mA.numKvHeads * T * mA.headDim * 2;  // fp16 or bf16
    for (int32_t i : {1, 2}) {
        void const* past = inputs[i == 1 ? kKCache : kVCache];
        if (outputs[i] != past && cudaMemcpyAsync(outputs[i], past, cacheBytes, cudaMemcpyDeviceToDevice, stream))
            return -1;
    }
    const int st = djv_head_sparse_attention(
        inputs[0], static_cast<int32_t const*>(inputs[1]), static_cast<int32_t const*>(inputs[2]), inputs[3],
        inputs[4], inputs[5], inputs[6], inputs[7], inputs[8], inputs[9], inputs[10], inputs[11], inputs[12],
        outputs[1], outputs[2], /*residual: the graph keeps its Add*/ nullptr, outputs[0], B, d, mA.numHeads, mA.numKvHeads, mA.headDim, mA.keptHeads, T, mA.rotary,
        mA.scale, mPolicy, toDjv(in[0].type), ws, bytes, stream);
    return st == 0 ? 0 : -1;
}

}  // namespace dejavu_trt
