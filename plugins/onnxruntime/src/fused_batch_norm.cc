#include <algorithm>

#include "kernels.h"

namespace dk_ort {
namespace {

constexpr const char* kOp = "FusedBatchNorm";
constexpr int64_t kElementsPerChunk = int64_t{1} << 16;

dk_activation ReadActivation(const Ort::ConstKernelInfo& info) {
  std::string value = "none";
  try {
    value = info.GetAttribute<std::string>("activation");
  } catch (const Ort::Exception& e) {
    // An absent attribute means the default; any other failure is a malformed node.
    if (std::string(e.what()).find("No attribute") == std::string::npos) {
      Fail(ORT_INVALID_ARGUMENT, "deploykit::FusedBatchNorm: attribute 'activation' must be a string");
    }
  }
  if (value == "none") return DK_ACTIVATION_NONE;
  if (value == "relu") return DK_ACTIVATION_RELU;
  Fail(ORT_INVALID_ARGUMENT, "deploykit::FusedBatchNorm: activation must be \"none\" or \"relu\", got \"" +
                                 value + "\"");
}

// One CPU launch: elements [begin, end) of a contiguous (batch, channels, spatial) tensor,
// split into calls that each cover whole rows of one batch item or part of a single row.
struct CpuJob {
  dk_dtype dtype;
  size_t element_size;
  const char* x;
  const char* scale;
  const char* bias;
  char* y;
  int64_t channels;
  int64_t spatial;
  dk_activation activation;

  dk_status Run(int64_t row, int64_t offset, int64_t rows, int64_t length) const {
    const int64_t start = row * spatial + offset;
    const int64_t channel = row % channels;
    const auto at = [&](const char* p, int64_t i) { return p + i * static_cast<int64_t>(element_size); };
    return dk_fused_batch_norm_cpu(dtype, at(x, start), at(scale, channel), at(bias, channel),
                                   const_cast<char*>(at(y, start)), 1, rows,
                                   rows == 1 ? length : spatial, activation);
  }
};

dk_status RunCpuRange(const void* data, int64_t begin, int64_t end) {
  const auto& job = *static_cast<const CpuJob*>(data);
  const int64_t s = job.spatial;
  int64_t position = begin;
  while (position < end) {
    const int64_t row = position / s;
    const int64_t offset = position % s;
    dk_status status;
    int64_t done;
    if (offset != 0 || end - position < s) {  // part of one row
      done = std::min(end - position, s - offset);
      status = job.Run(row, offset, 1, done);
    } else {  // whole rows up to the end of this batch item or of the range
      const int64_t rows_left_in_item = job.channels - row % job.channels;
      const int64_t rows = std::min(rows_left_in_item, (end - position) / s);
      done = rows * s;
      status = job.Run(row, 0, rows, s);
    }
    if (status != DK_OK) return status;
    position += done;
  }
  return DK_OK;
}

}  // namespace

FusedBatchNormKernel::FusedBatchNormKernel(const Ort::ConstKernelInfo& info, OpConfig config)
    : config_(config), activation_(ReadActivation(info)) {}

void FusedBatchNormKernel::Compute(Ort::KernelContext& ctx) const {
  const auto x = ctx.GetInput(0);
  const auto scale = ctx.GetInput(1);
  const auto bias = ctx.GetInput(2);
  const Shape x_shape = InputShape(x, config_, kOp, "X");
  const Shape scale_shape = InputShape(scale, config_, kOp, "scale");
  const Shape bias_shape = InputShape(bias, config_, kOp, "bias");
  if (x_shape.size() < 2) {
    Fail(ORT_INVALID_ARGUMENT, "deploykit::FusedBatchNorm: X must have rank >= 2 (N, C, ...), got shape " +
                                   ShapeString(x_shape));
  }
  const int64_t channels = x_shape[1];
  if (scale_shape != Shape{channels} || bias_shape != Shape{channels}) {
    Fail(ORT_INVALID_ARGUMENT, "deploykit::FusedBatchNorm: scale and bias must have shape [C] = [" +
                                   std::to_string(channels) + "] for X of shape " + ShapeString(x_shape) +
                                   ", got scale " + ShapeString(scale_shape) + " and bias " +
                                   ShapeString(bias_shape));
  }
  auto y = ctx.GetOutput(0, x_shape);
  const int64_t batch = x_shape[0];
  const int64_t spatial = Product(x_shape, 2, x_shape.size());
  if (batch * channels * spatial == 0) return;

  const dk_dtype dtype = ToKernelType(config_.type);
  if (config_.device == Device::kCuda) {
    CheckKernel(dk_fused_batch_norm_cuda(dtype, x.GetTensorRawData(), scale.GetTensorRawData(),
                                         bias.GetTensorRawData(), y.GetTensorMutableRawData(), batch,
                                         channels, spatial, activation_, ctx.GetGPUComputeStream()),
                kOp, "dk_fused_batch_norm_cuda");
    return;
  }
  const CpuJob job{dtype,
                   ElementSize(config_.type),
                   static_cast<const char*>(x.GetTensorRawData()),
                   static_cast<const char*>(scale.GetTensorRawData()),
                   static_cast<const char*>(bias.GetTensorRawData()),
                   static_cast<char*>(y.GetTensorMutableRawData()),
                   channels,
                   spatial,
                   activation_};
  ParallelChunks(ctx, batch * channels * spatial, kElementsPerChunk, RunCpuRange, &job, kOp,
                 "dk_fused_batch_norm_cpu");
}

}  // namespace dk_ort
