/*
 * deploykit TensorRT plugins: what both plugins share.
 *
 * The plugins implement IPluginV3 with the "one" capability interfaces (core, build, runtime) so
 * that TensorRT 10+ and TensorRT-RTX load them the same way, from `getCreators()` in a shared
 * library. They use TensorRT only through its virtual interfaces: the library links no TensorRT
 * library and so serves every flavour whose plugin ABI matches the headers it was built with.
 * The arithmetic lives in dk_kernels (csrc/kernels, plain C ABI); this layer only maps TensorRT's
 * tensor descriptions onto that ABI.
 */
#ifndef DEPLOYKIT_TRT_COMMON_H
#define DEPLOYKIT_TRT_COMMON_H

#include <NvInferRuntime.h>

#include <string>
#include <vector>

#include "deploykit/kernels.h"

namespace deploykit_trt {

// Registered without a namespace and with version "1": the ONNX parser looks plugins up by
// (op_type, node attribute plugin_version or "1", node attribute plugin_namespace or ""), so our
// deploykit::FusedBatchNorm / deploykit::MatMulRelu nodes find these creators by op type alone.
constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "";

// Logs through the logger TensorRT handed to setLoggerFinder(), else to stderr.
void log(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;
inline void logError(std::string const& message) noexcept {
  log(nvinfer1::ILogger::Severity::kERROR, message);
}

// Returns false for data types the kernels do not implement.
bool toKernelType(nvinfer1::DataType type, dk_dtype* out) noexcept;

// Product of dims [begin, end); -1 if any of them is unknown.
int64_t volume(nvinfer1::Dims const& dims, int32_t begin, int32_t end) noexcept;

// Text of a kCHAR plugin field. The ONNX parser passes string attributes as kCHAR with
// `length` characters that may or may not include a terminating NUL; both are accepted.
std::string fieldText(nvinfer1::PluginField const& field);

// Shared by both plugins: the capability plumbing, one output of the first input's type,
// linear formats and the same type for every input and output.
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuild,
                   public nvinfer1::IPluginV3OneRuntime {
 public:
  ~PluginBase() override = default;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(
      nvinfer1::PluginCapabilityType type) noexcept override;

  // IPluginV3OneCore
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             nvinfer1::DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                 int32_t nbInputs, int32_t nbOutputs) noexcept override;
  char const* getTimingCacheID() noexcept override { return mConfigText.c_str(); }
  char const* getMetadataString() noexcept override { return mConfigText.c_str(); }

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                        nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override {
    return clone();
  }

 protected:
  // Whether the kernels of this op take `type` (checked for input 0; the rest must match it).
  virtual bool supportsType(nvinfer1::DataType type) const noexcept = 0;
  // Input counts this op accepts.
  virtual bool acceptsInputCount(int32_t nbInputs) const noexcept = 0;

  // "<name>(key=value,...)": the timing-cache suffix and the metadata the inspector shows.
  std::string mConfigText;
};

// Shared by both creators: name, version, name space and the fields the ONNX parser may pass.
class CreatorBase : public nvinfer1::IPluginCreatorV3One {
 public:
  // `fields` must outlive the creator (the creators are function-local statics).
  CreatorBase(char const* name, nvinfer1::PluginField* fields, int32_t nbFields) : mName(name) {
    mFieldCollection.nbFields = nbFields;
    mFieldCollection.fields = fields;
  }

  char const* getPluginName() const noexcept override { return mName; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override {
    return &mFieldCollection;
  }

 private:
  char const* mName;
  nvinfer1::PluginFieldCollection mFieldCollection;
};

nvinfer1::IPluginCreatorInterface* fusedBatchNormCreator();
nvinfer1::IPluginCreatorInterface* matMulReluCreator();

}  // namespace deploykit_trt

#endif  // DEPLOYKIT_TRT_COMMON_H
