// DejaVuHeadSparseAttention TensorRT adapter (IPluginV3). Outputs 1 and 2 (the KV caches) alias inputs 13
// and 14 (IPluginV3OneBuildV2::getAliasedInput): the kernel updates the caches in place.
#pragma once
#include "pluginCommon.h"

namespace dejavu_trt {

class HeadSparseAttentionPlugin : public PluginBase {
public:
    static constexpr char const* kName = "DejaVuHeadSparseAttention";
    struct Attrs { int32_t numHeads, numKvHeads, headDim, keptHeads, rotary; float scale; std::string kvPolicy; };
    explicit HeadSparseAttentionPlugin(Attrs const& a);
    static std::vector<PluginField>& fieldNames();
    static IPluginV3* create(char const* name, PluginFieldCollection const* fc);

    IPluginV3* clone() noexcept override;
    AsciiChar const* getPluginName() const noexcept override { return kName; }
    int32_t getNbOutputs() const noexcept override { return 3; }
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;
    int32_t getOutputDataTypes(DataType* out, int32_t nbOut, DataType const* in, int32_t nbIn) const noexcept override;
    int32_t getOutputShapes(DimsExprs const* in, int32_t nbIn, DimsExprs const* shapeIn, int32_t nbShapeIn,
                            DimsExprs* out, int32_t nbOut, IExprBuilder& eb) noexcept override;
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbIn,
                                   int32_t nbOut) noexcept override;
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbIn, DynamicPluginTensorDesc const* out,
                            int32_t nbOut) noexcept override;
    size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t nbIn, DynamicPluginTensorDesc const* out,
                            int32_t nbOut) const noexcept override;
    int32_t enqueue(PluginTensorDesc const* inDesc, PluginTensorDesc const* outDesc, void const* const* inputs,
                    void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

private:
    Attrs mA;
    int32_t mPolicy;
};

class HeadSparseAttentionPluginCreator : public Creator<HeadSparseAttentionPlugin> {};

}  // namespace dejavu_trt
