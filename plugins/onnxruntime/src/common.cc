#include "common.h"

#include <algorithm>
#include <atomic>
#include <sstream>

namespace dk_ort {

void Fail(OrtErrorCode code, const std::string& message) {
  throw Ort::Exception(std::string(message), code);
}

void CheckKernel(dk_status status, const char* op, const char* function) {
  if (status == DK_OK) return;
  std::ostringstream message;
  message << "deploykit::" << op << ": " << function << " failed: " << dk_status_string(status);
  Fail(status == DK_INVALID_ARGUMENT ? ORT_INVALID_ARGUMENT : ORT_FAIL, message.str());
}

dk_dtype ToKernelType(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return DK_FLOAT32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return DK_FLOAT16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return DK_BFLOAT16;
    default: Fail(ORT_INVALID_ARGUMENT, std::string("deploykit: unsupported element type ") + TypeName(type));
  }
}

size_t ElementSize(ONNXTensorElementDataType type) {
  return type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2;
}

const char* TypeName(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "double";
    default: return "a non-float type";
  }
}

std::string ShapeString(const Shape& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

int64_t Product(const Shape& shape, size_t begin, size_t end) {
  int64_t product = 1;
  for (size_t i = begin; i < end && i < shape.size(); ++i) product *= shape[i];
  return product;
}

Shape InputShape(const Ort::ConstValue& value, const OpConfig& config, const char* op,
                 const char* input) {
  if (!value.IsTensor()) {
    Fail(ORT_INVALID_ARGUMENT, std::string("deploykit::") + op + ": input " + input + " must be a tensor");
  }
  auto info = value.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != config.type) {
    Fail(ORT_INVALID_ARGUMENT, std::string("deploykit::") + op + ": input " + input + " is " +
                                   TypeName(info.GetElementType()) + ", expected " + TypeName(config.type));
  }
  return info.GetShape();
}

namespace {

struct ChunkJob {
  dk_status (*body)(const void*, int64_t, int64_t);
  const void* job;
  int64_t total;
  int64_t chunk;
  std::atomic<int> status{DK_OK};
};

void RunChunk(void* data, size_t index) {
  auto* state = static_cast<ChunkJob*>(data);
  const int64_t begin = static_cast<int64_t>(index) * state->chunk;
  const int64_t end = std::min(state->total, begin + state->chunk);
  const dk_status status = state->body(state->job, begin, end);
  int expected = DK_OK;
  if (status != DK_OK) state->status.compare_exchange_strong(expected, status);
}

}  // namespace

void ParallelChunks(const Ort::KernelContext& ctx, int64_t total, int64_t grain,
                    dk_status (*body)(const void* job, int64_t begin, int64_t end),
                    const void* job, const char* op, const char* function) {
  if (total <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (total <= grain) {
    CheckKernel(body(job, 0, total), op, function);
    return;
  }
  ChunkJob state{body, job, total, grain};
  const int64_t chunks = (total + grain - 1) / grain;
  ctx.ParallelFor(RunChunk, static_cast<size_t>(chunks), 0, &state);
  CheckKernel(static_cast<dk_status>(state.status.load()), op, function);
}

}  // namespace dk_ort
