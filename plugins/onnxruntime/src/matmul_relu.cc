#include <algorithm>
#include <memory>

#include "kernels.h"

namespace dk_ort {
namespace {

constexpr const char* kOp = "MatMulRelu";
constexpr int64_t kMultiplyAddsPerChunk = int64_t{1} << 18;

// Rows [begin, end) of y = relu(a @ b + bias) on the CPU.
struct CpuJob {
  dk_dtype dtype;
  size_t element_size;
  const char* a;
  const void* b;
  const void* bias;
  char* y;
  int64_t k;
  int64_t n;
};

dk_status RunCpuRows(const void* data, int64_t begin, int64_t end) {
  const auto& job = *static_cast<const CpuJob*>(data);
  const auto size = static_cast<int64_t>(job.element_size);
  return dk_matmul_relu_cpu(job.dtype, job.a + begin * job.k * size, job.b, job.bias,
                            job.y + begin * job.n * size, end - begin, job.k, job.n);
}

// cuBLASLt workspace from ORT's allocator for the device that holds the inputs; empty (and
// the kernel then runs without one) when ORT cannot provide it.
class Workspace {
 public:
  Workspace(const Ort::KernelContext& ctx, const Ort::ConstValue& on_device, size_t bytes) {
    if (bytes == 0) return;
    try {
      const Ort::ConstMemoryInfo memory = on_device.GetTensorMemoryInfo();
      allocator_ = ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(memory));
      data_ = allocator_ ? allocator_->Alloc(allocator_, bytes) : nullptr;
      bytes_ = data_ ? bytes : 0;
    } catch (const std::exception&) {  // no allocator, or out of memory
      data_ = nullptr;
      bytes_ = 0;
    }
  }
  ~Workspace() {
    if (data_) allocator_->Free(allocator_, data_);
    if (allocator_) Ort::GetApi().ReleaseAllocator(allocator_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  OrtAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace

MatMulReluKernel::MatMulReluKernel(const Ort::ConstKernelInfo&, OpConfig config) : config_(config) {}

void MatMulReluKernel::Compute(Ort::KernelContext& ctx) const {
  const auto a = ctx.GetInput(0);
  const auto b = ctx.GetInput(1);
  const Ort::ConstValue bias = ctx.GetInputCount() > 2 ? ctx.GetInput(2) : Ort::ConstValue{nullptr};
  const Shape a_shape = InputShape(a, config_, kOp, "A");
  const Shape b_shape = InputShape(b, config_, kOp, "B");
  if (a_shape.size() < 2 || b_shape.size() != 2 || a_shape.back() != b_shape[0]) {
    Fail(ORT_INVALID_ARGUMENT, "deploykit::MatMulRelu: needs A of shape [..., M, K] and B of shape [K, N], got A " +
                                   ShapeString(a_shape) + " and B " + ShapeString(b_shape));
  }
  const int64_t k = b_shape[0];
  const int64_t n = b_shape[1];
  if (bias && InputShape(bias, config_, kOp, "bias") != Shape{n}) {
    Fail(ORT_INVALID_ARGUMENT, "deploykit::MatMulRelu: bias must have shape [N] = [" + std::to_string(n) +
                                   "], got " + ShapeString(InputShape(bias, config_, kOp, "bias")));
  }
  Shape y_shape(a_shape.begin(), a_shape.end() - 1);
  y_shape.push_back(n);
  auto y = ctx.GetOutput(0, y_shape);
  const int64_t m = Product(a_shape, 0, a_shape.size() - 1);
  if (m * n == 0) return;

  const void* bias_data = bias ? bias.GetTensorRawData() : nullptr;
  if (config_.device == Device::kCuda) {
    RunCuda(ctx, a, bias_data, y.GetTensorMutableRawData(), m, k, n);
    return;
  }
  const CpuJob job{ToKernelType(config_.type),
                   ElementSize(config_.type),
                   static_cast<const char*>(a.GetTensorRawData()),
                   b.GetTensorRawData(),
                   bias_data,
                   static_cast<char*>(y.GetTensorMutableRawData()),
                   k,
                   n};
  const int64_t rows_per_chunk = std::max<int64_t>(1, kMultiplyAddsPerChunk / std::max<int64_t>(1, k * n));
  ParallelChunks(ctx, m, rows_per_chunk, RunCpuRows, &job, kOp, "dk_matmul_relu_cpu");
}

void MatMulReluKernel::RunCuda(Ort::KernelContext& ctx, const Ort::ConstValue& a, const void* bias,
                               void* y, int64_t m, int64_t k, int64_t n) const {
  const Workspace workspace(ctx, a, dk_matmul_relu_cuda_workspace_bytes());
  const auto b = ctx.GetInput(1);
  const bool tf32 = config_.allow_tf32 && config_.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  CheckKernel(dk_matmul_relu_cuda(ToKernelType(config_.type), a.GetTensorRawData(), b.GetTensorRawData(),
                                  bias, y, m, k, n, tf32 ? 1 : 0, workspace.data(), workspace.bytes(),
                                  ctx.GetGPUComputeStream()),
              kOp, "dk_matmul_relu_cuda");
}

}  // namespace dk_ort
