// DejaVuSparseMLP TensorRT adapter (IPluginV3). Contract: docs/ops.md; kernel: sparseMLPKernel.cu.
#pragma once
#include "pluginCommon.h"

namespace dejavu_trt {

class SparseMLPPlugin : public PluginBase {
public:
    static constexpr char const* kName = "DejaVuSparseMLP";
    SparseMLPPlugin(std::string const& activation, int32_t blockSize, int32_t keptUnits, int32_t numNeurons);
    static std::vector<PluginField>& fieldNames();
    static IPluginV3* create(char const* name, PluginFieldCollection const* fc);

    IPluginV3* clone() noexcept override;
    AsciiChar const* getPluginName() const noexcept override { return kName; }
    int32_t getNbOutputs() const noexcept override { return 1; }
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
    int32_t nbInputs() const { return mAct == DJV_SILU_GLU ? 5 : 6; }
    std::string mActivation;
    int32_t mAct, mBlockSize, mKeptUnits, mNumNeurons;
};

class SparseMLPPluginCreator : public Creator<SparseMLPPlugin> {};

}  // namespace dejavu_trt
