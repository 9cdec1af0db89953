/*
 * MatMulRelu(A, B[, bias]) -> Y = max(A @ B + bias, 0); A is (..., M, K) with leading dims
 * flattened into M, B is (K, N), bias is (N,). Spec: docs/ops.md. No attributes.
 * The cuBLASLt workspace comes from TensorRT (getWorkspaceSize), so the kernel never allocates.
 */
#include <cstring>
#include <string>

#include "common.h"

namespace deploykit_trt {
namespace {

constexpr char const* kName = "MatMulRelu";
constexpr char const* kHasBiasField = "has_bias";  // engine-internal, not an ONNX attribute

class MatMulReluPlugin final : public PluginBase {
 public:
  explicit MatMulReluPlugin(bool hasBias) : mHasBias(hasBias) {
    mConfigText = std::string(kName) + "()";
    mField = nvinfer1::PluginField(kHasBiasField, &mHasBiasValue, nvinfer1::PluginFieldType::kINT32, 1);
    mFields.nbFields = 1;
    mFields.fields = &mField;
  }

  char const* getPluginName() const noexcept override { return kName; }

  nvinfer1::IPluginV3* clone() noexcept override {
    try {
      return new MatMulReluPlugin(mHasBias);
    } catch (...) {
      return nullptr;
    }
  }

  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                          nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs,
                          nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override {
    if (!acceptsInputCount(nbInputs) || nbOutputs != 1) {
      logError("MatMulRelu takes (A, B[, bias]), got " + std::to_string(nbInputs) + " inputs");
      return 1;
    }
    if (inputs[0].nbDims < 2 || inputs[1].nbDims != 2 || (nbInputs == 3 && inputs[2].nbDims != 1)) {
      logError("MatMulRelu needs A of rank >= 2, a 2-D B and a 1-D bias");
      return 1;
    }
    outputs[0] = inputs[0];
    outputs[0].d[outputs[0].nbDims - 1] = inputs[1].d[1];
    return 0;
  }

  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
    if (!acceptsInputCount(nbInputs) || nbOutputs != 1) return 1;
    mHasBias = nbInputs == 3;
    nvinfer1::Dims const& a = in[0].desc.dims;
    nvinfer1::Dims const& b = in[1].desc.dims;
    int64_t const k = a.d[a.nbDims - 1];
    if (k >= 0 && b.d[0] >= 0 && k != b.d[0]) {
      logError("MatMulRelu: A has K=" + std::to_string(k) + " but B has " +
               std::to_string(b.d[0]) + " rows");
      return 1;
    }
    if (nbInputs == 3 && in[2].desc.dims.d[0] >= 0 && b.d[1] >= 0 &&
        in[2].desc.dims.d[0] != b.d[1]) {
      logError("MatMulRelu: bias length differs from B's columns");
      return 1;
    }
    return 0;
  }

  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs,
                          int32_t nbOutputs) const noexcept override {
    return dk_matmul_relu_cuda_workspace_bytes();
  }

  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
                  nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs,
                  void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
    nvinfer1::Dims const& a = inputDesc[0].dims;
    nvinfer1::Dims const& b = inputDesc[1].dims;
    dk_dtype dtype;
    if (!toKernelType(inputDesc[0].type, &dtype)) {
      logError("MatMulRelu: unsupported data type");
      return 1;
    }
    int64_t const m = volume(a, 0, a.nbDims - 1);
    int64_t const k = a.d[a.nbDims - 1];
    int64_t const n = b.d[1];
    if (m == 0 || n == 0) return 0;
    void const* bias = mHasBias ? inputs[2] : nullptr;
    size_t const workspaceBytes = workspace ? dk_matmul_relu_cuda_workspace_bytes() : 0;
    dk_status const status = dk_matmul_relu_cuda(dtype, inputs[0], inputs[1], bias, outputs[0], m,
                                                 k, n, /*allow_tf32=*/0, workspace,
                                                 workspaceBytes, stream);
    if (status != DK_OK) {
      logError(std::string("MatMulRelu kernel failed: ") + dk_status_string(status));
      return 1;
    }
    return 0;
  }

  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                        nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override {
    mHasBias = nbInputs == 3;
    return PluginBase::onShapeChange(in, nbInputs, out, nbOutputs);
  }

  // The engine remembers whether the node had a bias; the ONNX node itself has no attributes.
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    mHasBiasValue = mHasBias ? 1 : 0;
    return &mFields;
  }

 protected:
  bool supportsType(nvinfer1::DataType type) const noexcept override {
    return type == nvinfer1::DataType::kFLOAT || type == nvinfer1::DataType::kHALF ||
           type == nvinfer1::DataType::kBF16;
  }
  bool acceptsInputCount(int32_t nbInputs) const noexcept override {
    return nbInputs == 2 || nbInputs == 3;
  }

 private:
  bool mHasBias;
  int32_t mHasBiasValue = 0;
  nvinfer1::PluginField mField;
  nvinfer1::PluginFieldCollection mFields;
};

class MatMulReluCreator final : public CreatorBase {
 public:
  MatMulReluCreator() : CreatorBase(kName, nullptr, 0) {}

  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override {
    try {
      bool hasBias = false;
      for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
        nvinfer1::PluginField const& field = fc->fields[i];
        if (field.name != nullptr && std::strcmp(field.name, kHasBiasField) == 0 &&
            field.type == nvinfer1::PluginFieldType::kINT32 && field.length == 1) {
          hasBias = *static_cast<int32_t const*>(field.data) != 0;
        }
      }
      return new MatMulReluPlugin(hasBias);
    } catch (...) {
      return nullptr;
    }
  }
};

}  // namespace

nvinfer1::IPluginCreatorInterface* matMulReluCreator() {
  static MatMulReluCreator creator;
  return &creator;
}

}  // namespace deploykit_trt
