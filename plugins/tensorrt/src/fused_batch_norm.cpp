/*
 * FusedBatchNorm(X, scale, bias) -> Y = act(X * scale[c] + bias[c]), channel axis 1, rank >= 2.
 * Spec: docs/ops.md. Attribute `activation` ("none" | "relu") arrives from the ONNX parser as a
 * kCHAR field and is serialized into the engine the same way.
 */
#include <cstring>
#include <string>

#include "common.h"

namespace deploykit_trt {
namespace {

constexpr char const* kName = "FusedBatchNorm";
constexpr char const* kActivationField = "activation";

bool parseActivation(std::string const& text, dk_activation* out) {
  if (text.empty() || text == "none") {
    *out = DK_ACTIVATION_NONE;
  } else if (text == "relu") {
    *out = DK_ACTIVATION_RELU;
  } else {
    return false;
  }
  return true;
}

class FusedBatchNormPlugin final : public PluginBase {
 public:
  explicit FusedBatchNormPlugin(dk_activation activation) : mActivation(activation) {
    mActivationText = activation == DK_ACTIVATION_RELU ? "relu" : "none";
    mConfigText = std::string(kName) + "(activation=" + mActivationText + ")";
    mField = nvinfer1::PluginField(kActivationField, mActivationText.c_str(),
                                   nvinfer1::PluginFieldType::kCHAR,
                                   static_cast<int32_t>(mActivationText.size()));
    mFields.nbFields = 1;
    mFields.fields = &mField;
  }

  FusedBatchNormPlugin(FusedBatchNormPlugin const& other) : FusedBatchNormPlugin(other.mActivation) {}

  char const* getPluginName() const noexcept override { return kName; }

  nvinfer1::IPluginV3* clone() noexcept override {
    try {
      return new FusedBatchNormPlugin(*this);
    } catch (...) {
      return nullptr;
    }
  }

  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                          nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs,
                          nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override {
    if (nbInputs != 3 || nbOutputs != 1) {
      logError("FusedBatchNorm takes (X, scale, bias), got " + std::to_string(nbInputs) + " inputs");
      return 1;
    }
    if (inputs[0].nbDims < 2 || inputs[1].nbDims != 1 || inputs[2].nbDims != 1) {
      logError("FusedBatchNorm needs X of rank >= 2 and 1-D scale and bias");
      return 1;
    }
    outputs[0] = inputs[0];
    return 0;
  }

  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
    if (nbInputs != 3 || nbOutputs != 1) return 1;
    int64_t const channels = in[0].desc.dims.d[1];
    int64_t const scaleLength = in[1].desc.dims.d[0];
    int64_t const biasLength = in[2].desc.dims.d[0];
    if (channels >= 0 && ((scaleLength >= 0 && scaleLength != channels) ||
                          (biasLength >= 0 && biasLength != channels))) {
      logError("FusedBatchNorm: X has " + std::to_string(channels) + " channels but scale has " +
               std::to_string(scaleLength) + " and bias " + std::to_string(biasLength));
      return 1;
    }
    return 0;
  }

  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
                  nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
    nvinfer1::Dims const& dims = inputDesc[0].dims;
    dk_dtype dtype;
    if (!toKernelType(inputDesc[0].type, &dtype)) {
      logError("FusedBatchNorm: unsupported data type");
      return 1;
    }
    int64_t const batch = dims.d[0];
    int64_t const channels = dims.d[1];
    int64_t const spatial = volume(dims, 2, dims.nbDims);
    if (batch == 0 || channels == 0 || spatial == 0) return 0;
    dk_status const status =
        dk_fused_batch_norm_cuda(dtype, inputs[0], inputs[1], inputs[2], outputs[0], batch,
                                 channels, spatial, mActivation, stream);
    if (status != DK_OK) {
      logError(std::string("FusedBatchNorm kernel failed: ") + dk_status_string(status));
      return 1;
    }
    return 0;
  }

  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    return &mFields;
  }

 protected:
  bool supportsType(nvinfer1::DataType type) const noexcept override {
    return type == nvinfer1::DataType::kFLOAT || type == nvinfer1::DataType::kHALF;
  }
  bool acceptsInputCount(int32_t nbInputs) const noexcept override { return nbInputs == 3; }

 private:
  dk_activation mActivation;
  std::string mActivationText;
  nvinfer1::PluginField mField;
  nvinfer1::PluginFieldCollection mFields;
};

class FusedBatchNormCreator final : public CreatorBase {
 public:
  FusedBatchNormCreator() : CreatorBase(kName, mFields, 1) {}

  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override {
    try {
      dk_activation activation = DK_ACTIVATION_NONE;
      for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
        nvinfer1::PluginField const& field = fc->fields[i];
        if (field.name == nullptr || std::strcmp(field.name, kActivationField) != 0) continue;
        std::string text;
        if (field.type == nvinfer1::PluginFieldType::kCHAR) {
          text = fieldText(field);
        } else if (field.type == nvinfer1::PluginFieldType::kINT32 && field.length == 1) {
          // Tolerated for hand-made networks: 0 = none, 1 = relu (dk_activation's values).
          text = *static_cast<int32_t const*>(field.data) == 1 ? "relu" : "none";
        } else {
          logError(std::string("FusedBatchNorm ") + (name ? name : "") +
                   ": attribute 'activation' must be a string");
          return nullptr;
        }
        if (!parseActivation(text, &activation)) {
          logError(std::string("FusedBatchNorm ") + (name ? name : "") +
                   ": activation must be \"none\" or \"relu\", got \"" + text + "\"");
          return nullptr;
        }
      }
      return new FusedBatchNormPlugin(activation);
    } catch (...) {
      return nullptr;
    }
  }

 private:
  nvinfer1::PluginField mFields[1] = {
      nvinfer1::PluginField(kActivationField, nullptr, nvinfer1::PluginFieldType::kCHAR, 0)};
};

}  // namespace

nvinfer1::IPluginCreatorInterface* fusedBatchNormCreator() {
  static FusedBatchNormCreator creator;
  return &creator;
}

}  // namespace deploykit_trt
