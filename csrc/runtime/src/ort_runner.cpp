// The ONNX Runtime path: the manifest's model in a session with the bundle's op library (when
// native_rule lets it load) or the caller's own.
//
// ONNX Runtime is dlopen'ed and reached through the OrtApi table it hands out
// (ORT_API_MANUAL_INIT), so this file needs ORT's headers only and runs against any ORT whose
// API version is at least the headers' (e.g. the libonnxruntime.so.1.x inside the Python wheel).
#define ORT_API_MANUAL_INIT
#include <dlfcn.h>
#include <onnxruntime_cxx_api.h>

#include <cstdlib>
#include <cstring>

#include "bundle.hpp"
#include "internal.hpp"
#include "trust.hpp"

#ifndef DK_DEFAULT_ORT_LIBRARY
#define DK_DEFAULT_ORT_LIBRARY ""
#endif

namespace deploykit::detail {
namespace {

DType to_dtype(ONNXTensorElementDataType type, const std::string& name) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return DType::Float32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return DType::Float16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return DType::Float64;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return DType::Int64;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return DType::Int32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return DType::Int8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return DType::UInt8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return DType::Bool;
    default: fail(ErrorKind::BadInput, name + " has an element type deploykit-run does not handle");
  }
}

ONNXTensorElementDataType to_onnx(DType dtype) {
  switch (dtype) {
    case DType::Float32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case DType::Float16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case DType::Float64: return ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE;
    case DType::Int64: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    case DType::Int32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case DType::Int8: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    case DType::UInt8: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    case DType::Bool: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  }
  fail(ErrorKind::Internal, "unknown dtype");
}

TensorInfo tensor_info(const std::string& name, const Ort::TypeInfo& type) {
  auto tensor = type.GetTensorTypeAndShapeInfo();
  return {name, to_dtype(tensor.GetElementType(), name), tensor.GetShape()};
}

// Load ONNX Runtime once per process and point the C++ API at its OrtApi table.
std::string load_onnxruntime(const Options& options) {
  static std::string loaded;
  if (!loaded.empty()) return loaded;
  const char* env = std::getenv("DEPLOYKIT_ORT_LIBRARY");
  std::vector<std::string> candidates{DK_DEFAULT_ORT_LIBRARY, "libonnxruntime.so.1", "libonnxruntime.so"};
  if (!options.ort_library.empty() || (env && *env)) {  // asked for one: that one or nothing
    candidates = {options.ort_library.empty() ? std::string(env) : options.ort_library};
  }
  void* handle = open_library(candidates,
                              "ONNX Runtime (pass --ort-library, set DEPLOYKIT_ORT_LIBRARY, or pip install onnxruntime "
                              "and point at onnxruntime/capi/libonnxruntime.so.1.*)",
                              &loaded);
  using GetApiBase = const OrtApiBase* (*)();
  auto get_api_base = reinterpret_cast<GetApiBase>(dlsym(handle, "OrtGetApiBase"));
  if (!get_api_base) fail(ErrorKind::Environment, loaded + " has no OrtGetApiBase: not an ONNX Runtime library");
  const OrtApi* api = get_api_base()->GetApi(ORT_API_VERSION);
  if (!api) {
    fail(ErrorKind::Environment, "ONNX Runtime " + std::string(get_api_base()->GetVersionString()) + " at " + loaded +
                                     " is older than deploykit-run's headers (API version " +
                                     std::to_string(ORT_API_VERSION) + "): install a newer onnxruntime");
  }
  Ort::InitApi(api);
  loaded += " (ONNX Runtime " + std::string(get_api_base()->GetVersionString()) + ")";
  return loaded;
}

// The op library to register (path "" = none) and, for the bundle's own, the rule that lets it load.
struct OpLibrary {
  std::string path, rule;
};

// The caller's own op library, or the bundle's, checked and allowed by native_rule.
OpLibrary choose_op_library(const Bundle& bundle, const Options& options) {
  if (!options.op_library) return {};
  if (!options.op_library_path.empty()) {
    if (!file_exists(options.op_library_path)) fail(ErrorKind::BadInput, "--op-library " + options.op_library_path + ": no such file");
    return {options.op_library_path, ""};
  }
  auto listed = bundle.op_libraries("onnxruntime");
  if (listed.empty()) return {};
  std::string path = bundle.verified_path(listed.front());
  std::string rule = native_rule(bundle, listed.front(), options.trust_native);
  if (rule.empty()) {
    refuse_native(bundle, listed.front(), ", --op-library PATH to use your own build of it, or --no-op-library to "
                                          "run deploykit ops as their ONNX functions");
  }
  return {path, rule};
}

class OnnxRuntimeRunner : public Runner {
 public:
  OnnxRuntimeRunner(const Bundle& bundle, const Options& options)
      : op_library_(choose_op_library(bundle, options)),
        library_(load_onnxruntime(options)),
        env_(ORT_LOGGING_LEVEL_WARNING, "deploykit-run") {
    std::string model = bundle.verified_path(bundle.model());
    Ort::SessionOptions session_options;
    if (options.threads > 0) session_options.SetIntraOpNumThreads(options.threads);
    if (!op_library_.path.empty()) session_options.RegisterCustomOpsLibrary(op_library_.path.c_str());
    session_ = std::make_unique<Ort::Session>(env_, model.c_str(), session_options);
    Ort::AllocatorWithDefaultOptions allocator;
    for (std::size_t i = 0; i < session_->GetInputCount(); ++i) {
      inputs_.push_back(tensor_info(session_->GetInputNameAllocated(i, allocator).get(), session_->GetInputTypeInfo(i)));
    }
    for (std::size_t i = 0; i < session_->GetOutputCount(); ++i) {
      outputs_.push_back(tensor_info(session_->GetOutputNameAllocated(i, allocator).get(), session_->GetOutputTypeInfo(i)));
    }
  }

  const std::vector<TensorInfo>& inputs() const override { return inputs_; }
  const std::vector<TensorInfo>& outputs() const override { return outputs_; }

  std::string describe() const override {
    if (op_library_.path.empty()) return "onnxruntime: " + library_ + "; op library: none (ONNX functions)";
    std::string rule = op_library_.rule.empty() ? "" : " (" + op_library_.rule + ")";
    return "onnxruntime: " + library_ + "; op library: " + op_library_.path + rule;
  }

  Tensors run(const Tensors& given) override {
    auto memory = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    std::vector<Ort::Value> values;
    std::vector<const char*> input_names, output_names;
    for (const auto& info : inputs_) {
      auto found = given.find(info.name);
      if (found == given.end()) fail(ErrorKind::BadInput, "missing input " + info.name);
      check_input(info, found->second);
      Tensor& tensor = const_cast<Tensor&>(found->second);  // ORT only reads inputs
      values.push_back(Ort::Value::CreateTensor(memory, tensor.data.data(), tensor.data.size(), tensor.shape.data(),
                                                tensor.shape.size(), to_onnx(tensor.dtype)));
      input_names.push_back(info.name.c_str());
    }
    for (const auto& info : outputs_) output_names.push_back(info.name.c_str());
    std::vector<Ort::Value> results;
    try {
      results = session_->Run(Ort::RunOptions{nullptr}, input_names.data(), values.data(), values.size(),
                              output_names.data(), output_names.size());
    } catch (const Ort::Exception& error) {
      fail(ErrorKind::BadInput, std::string("ONNX Runtime failed to run the model: ") + error.what());
    }
    Tensors outputs;
    for (std::size_t i = 0; i < results.size(); ++i) {
      auto shape_info = results[i].GetTensorTypeAndShapeInfo();
      Tensor tensor{to_dtype(shape_info.GetElementType(), outputs_[i].name), shape_info.GetShape(), {}};
      const auto* data = static_cast<const unsigned char*>(results[i].GetTensorRawData());
      tensor.data.assign(data, data + tensor.elements() * dtype_size(tensor.dtype));
      outputs.emplace(outputs_[i].name, std::move(tensor));
    }
    return outputs;
  }

 private:
  OpLibrary op_library_;
  std::string library_;
  Ort::Env env_;
  std::unique_ptr<Ort::Session> session_;
  std::vector<TensorInfo> inputs_, outputs_;
};

}  // namespace

std::unique_ptr<Runner> open_onnxruntime(const Bundle& bundle, const Options& options) {
  try {
    return std::make_unique<OnnxRuntimeRunner>(bundle, options);
  } catch (const Ort::Exception& error) {
    fail(ErrorKind::Environment, "ONNX Runtime cannot load " + bundle.directory() + ": " + error.what());
  }
}

}  // namespace deploykit::detail
