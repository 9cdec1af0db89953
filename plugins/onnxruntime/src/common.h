// Shared pieces of deploykit's ONNX Runtime op library: the ORT C++ API set up for a custom-op
// library, error reporting through ORT's status mechanism, and the adapter that turns a kernel
// class into an OrtCustomOp registered per (element type, execution provider).
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <string>
#include <vector>

#include "deploykit/kernels.h"

namespace dk_ort {

constexpr const char* kDomain = "deploykit";
constexpr const char* kCudaProvider = "CUDAExecutionProvider";

enum class Device { kCpu, kCuda };

// What one registered op object stands for; every kernel it creates gets a copy.
struct OpConfig {
  ONNXTensorElementDataType type;
  Device device;
  bool allow_tf32;  // MatMulRelu on CUDA with fp32 inputs only
};

using Shape = std::vector<int64_t>;

// Throws the Ort::Exception that the op adapter turns into an OrtStatus.
[[noreturn]] void Fail(OrtErrorCode code, const std::string& message);

// Turns a failed kernel call into an ORT error carrying dk_status_string().
void CheckKernel(dk_status status, const char* op, const char* function);

dk_dtype ToKernelType(ONNXTensorElementDataType type);
size_t ElementSize(ONNXTensorElementDataType type);
const char* TypeName(ONNXTensorElementDataType type);
std::string ShapeString(const Shape& shape);
int64_t Product(const Shape& shape, size_t begin, size_t end);

// Shape and element type of a kernel input, checked against the op's registered type.
Shape InputShape(const Ort::ConstValue& value, const OpConfig& config, const char* op,
                 const char* input);

// Runs fn and converts any exception into an OrtStatus, so none crosses the C ABI into ORT.
template <typename F>
OrtStatusPtr Guard(F&& fn) noexcept {
  try {
    fn();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  } catch (const std::exception& e) {
    return Ort::Status(e).release();
  } catch (...) {
    return Ort::Status("deploykit: unknown exception in a custom op", ORT_FAIL).release();
  }
}

// Adapter from a kernel class to ORT's custom-op interface (status-returning variant).
// Kernel provides: kName, kInputCount, IsOptionalInput(i), Kernel(ConstKernelInfo, OpConfig)
// and Compute(Ort::KernelContext&).
template <typename Kernel>
struct Op : Ort::CustomOpBase<Op<Kernel>, Kernel, true> {
  explicit Op(OpConfig config) : config_(config) {}

  const char* GetName() const { return Kernel::kName; }
  const char* GetExecutionProviderType() const {
    return config_.device == Device::kCuda ? kCudaProvider : nullptr;
  }
  size_t GetInputTypeCount() const { return Kernel::kInputCount; }
  ONNXTensorElementDataType GetInputType(size_t) const { return config_.type; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return Kernel::IsOptionalInput(index) ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return config_.type; }

  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return Guard([&] { *kernel = new Kernel(Ort::ConstKernelInfo{info}, config_); });
  }

 private:
  OpConfig config_;
};

// Base of the kernel classes: the status-returning entry point ORT calls.
template <typename Derived>
struct KernelBase {
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return Guard([&] {
      Ort::KernelContext ctx(context);
      static_cast<Derived*>(this)->Compute(ctx);
    });
  }
};

// Runs body(begin, end) over [0, total) in chunks of about `grain` on ORT's intra-op
// thread pool; the first failing chunk's status is reported.
void ParallelChunks(const Ort::KernelContext& ctx, int64_t total, int64_t grain,
                    dk_status (*body)(const void* job, int64_t begin, int64_t end),
                    const void* job, const char* op, const char* function);

}  // namespace dk_ort
