// Shared helpers of the TensorRT IPluginV3 adapters: attribute (PluginField) parsing and serialisation,
// dtype mapping, and a creator template. Adapters stay thin: shapes/formats/fields here and in the
// plugin classes, all arithmetic in libdejavu_kernels (dejavu_kernels.h).
#pragma once
#include <NvInferRuntime.h>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>
#include "dejavu_kernels.h"

namespace dejavu_trt {
using namespace nvinfer1;

constexpr char const* kNamespace = "dejavu_trt";
constexpr char const* kVersion = "1";  // == OP_CONTRACT_VERSION (dejavu_trt/ops/contract.py)

// -1 for types the kernels do not take.
inline int toDjv(DataType t) {
    return t == DataType::kHALF ? DJV_FLOAT16 : (t == DataType::kBF16 ? DJV_BFLOAT16 : -1);
}

// Attribute set: ints, floats and strings by name, in PluginField form for getFieldsToSerialize().
class Fields {
public:
    void setInt(char const* n, int32_t v) { put(n, &v, PluginFieldType::kINT32, 1, sizeof(v)); }
    void setFloat(char const* n, float v) { put(n, &v, PluginFieldType::kFLOAT32, 1, sizeof(v)); }
    void setString(char const* n, std::string const& v) {
        put(n, v.c_str(), PluginFieldType::kCHAR, (int32_t)v.size() + 1, v.size() + 1);
    }
    void setInt64(char const* n, int64_t v) { put(n, &v, PluginFieldType::kINT64, 1, sizeof(v)); }
    // Read name from fc (a creator's input): false if it is absent (unless optional, which leaves `out` as
    // it is) or has the wrong type. Every attribute the rewrite writes is required: a node missing one is an
    // error, not a default.
    static bool getInt(PluginFieldCollection const* fc, char const* n, int32_t& out, bool optional = false) {
        return getScalar(fc, n, PluginFieldType::kINT32, out, optional);
    }
    static bool getInt64(PluginFieldCollection const* fc, char const* n, int64_t& out, bool optional = false) {
        return getScalar(fc, n, PluginFieldType::kINT64, out, optional);
    }
    static bool getFloat(PluginFieldCollection const* fc, char const* n, float& out, bool optional = false) {
        return getScalar(fc, n, PluginFieldType::kFLOAT32, out, optional);
    }
    static bool getString(PluginFieldCollection const* fc, char const* n, std::string& out, bool optional = false) {
        for (int32_t i = 0; fc && i < fc->nbFields; ++i)
            if (!std::strcmp(fc->fields[i].name, n)) {
                if (fc->fields[i].type != PluginFieldType::kCHAR) return false;
                char const* p = static_cast<char const*>(fc->fields[i].data);
                out.assign(p, strnlen(p, (size_t)fc->fields[i].length));
                return true;
            }
        return optional;
    }
    PluginFieldCollection const* collection() {
        mList.clear();
        for (auto& e : mEntries)
            mList.emplace_back(e.name.c_str(), e.bytes.data(), e.type, e.length);
        mFc.nbFields = (int32_t)mList.size();
        mFc.fields = mList.data();
        return &mFc;
    }

private:
    template <typename V>
    static bool getScalar(PluginFieldCollection const* fc, char const* n, PluginFieldType type, V& out, bool optional) {
        for (int32_t i = 0; fc && i < fc->nbFields; ++i)
            if (!std::strcmp(fc->fields[i].name, n)) {
                if (fc->fields[i].type != type || fc->fields[i].length < 1) return false;
                out = *static_cast<V const*>(fc->fields[i].data);
                return true;
            }
        return optional;
    }
    struct Entry { std::string name; std::vector<char> bytes; PluginFieldType type; int32_t length; };
    void put(char const* n, void const* p, PluginFieldType t, int32_t len, size_t nbytes) {
        for (auto& e : mEntries)
            if (e.name == n) { e.bytes.assign((char const*)p, (char const*)p + nbytes); e.type = t; e.length = len; return; }
        mEntries.push_back({n, std::vector<char>((char const*)p, (char const*)p + nbytes), t, len});
    }
    std::vector<Entry> mEntries;
    std::vector<PluginField> mList;
    PluginFieldCollection mFc{};
};

// Creator: Plugin must provide static fieldNames() and static create(PluginFieldCollection const*).
template <class Plugin>
class Creator : public IPluginCreatorV3One {
public:
    Creator() { mFc.nbFields = (int32_t)Plugin::fieldNames().size(); mFc.fields = Plugin::fieldNames().data(); }
    IPluginV3* createPlugin(AsciiChar const* name, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
        try {
            return Plugin::create(name, fc);
        } catch (...) {
            return nullptr;
        }
    }
    PluginFieldCollection const* getFieldNames() noexcept override { return &mFc; }
    AsciiChar const* getPluginName() const noexcept override { return Plugin::kName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

private:
    PluginFieldCollection mFc{};
};

// Base of the three plugins: the V3 capability plumbing shared by all.
class PluginBase : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2, public IPluginV3OneRuntime {
public:
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
        switch (type) {
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }
    AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }
    int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override { return 0; }
    IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override { return mFields.collection(); }

    // The build-time workspace size travels with the attributes (field "workspace_bytes", absent from the
    // ONNX node): configurePlugin records what getWorkspaceSize returns for the profile's largest shapes,
    // and enqueue passes it to the kernels as the size TensorRT allocated, so their size check compares
    // against the real allocation (a plan run on another GPU, or with another DJV_MLP_SLACK, fails there).
    static constexpr char const* kWorkspaceField = "workspace_bytes";
    void setWorkspace(int64_t bytes) {
        mWorkspaceBytes = bytes;
        mFields.setInt64(kWorkspaceField, bytes);
    }
    // From a creator's fields (deserialisation); absent at build time.
    bool readWorkspace(PluginFieldCollection const* fc) {
        int64_t b = 0;
        if (!Fields::getInt64(fc, kWorkspaceField, b, /*optional=*/true)) return false;
        if (b > 0) setWorkspace(b);
        return true;
    }
    // What enqueue passes: the recorded size, or (never configured: should not happen) today's formula.
    size_t workspaceFor(size_t formula) const { return mWorkspaceBytes > 0 ? (size_t)mWorkspaceBytes : formula; }

protected:
    // Linear (row-major) format and the expected type for every tensor; `io` is the shared float type.
    static bool linearIs(PluginTensorDesc const& d, DataType t) {
        return d.format == TensorFormat::kLINEAR && d.type == t;
    }
    Fields mFields;
    int64_t mWorkspaceBytes = 0;
};

// configurePlugin's shape checks: a tensor of rank `rank` whose dims equal `want` where want[i] >= 0.
inline bool dimsAre(DynamicPluginTensorDesc const& t, std::initializer_list<int64_t> want) {
    if (t.desc.dims.nbDims != (int32_t)want.size()) return false;
    int32_t i = 0;
    for (int64_t w : want) {
        if (w >= 0 && t.max.d[i] != w) return false;
        ++i;
    }
    return true;
}

// Runs the kernel entry point; the kernels leave their counters at zero, but TensorRT's scratch memory is
// shared with other layers, so the counter region is re-zeroed on every enqueue (one small memset).
inline int32_t prepare(void* ws, size_t bytes, cudaStream_t st) { return djv_workspace_prepare(ws, bytes, st) == 0 ? 0 : -1; }

}  // namespace dejavu_trt
