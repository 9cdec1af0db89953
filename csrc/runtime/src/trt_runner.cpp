// The TensorRT path: the bundle's engine (our plugins serialized inside it) on a GPU.
//
// The TensorRT runtime library is dlopen'ed (createInferRuntime_INTERNAL), so the build needs
// TensorRT's headers only; device memory and copies use the CUDA runtime (cudart, static).
// Plain TensorRT >= 10 only: TensorRT-RTX has other headers and library names.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>

#include "bundle.hpp"
#include "internal.hpp"
#include "trust.hpp"

namespace deploykit::detail {
namespace {

class Logger : public nvinfer1::ILogger {
 public:
  void log(Severity severity, const char* message) noexcept override {
    if (severity <= Severity::kWARNING) std::fprintf(stderr, "tensorrt: %s\n", message);
    if (severity <= Severity::kERROR) last_error = message;
  }
  std::string last_error;
};

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    fail(ErrorKind::Environment, std::string(what) + " failed: " + cudaGetErrorString(status) +
                                     " (run deploykit doctor to check the driver and GPU)");
  }
}

DType to_dtype(nvinfer1::DataType type, const std::string& name) {
  switch (type) {
    case nvinfer1::DataType::kFLOAT: return DType::Float32;
    case nvinfer1::DataType::kHALF: return DType::Float16;
    case nvinfer1::DataType::kINT64: return DType::Int64;
    case nvinfer1::DataType::kINT32: return DType::Int32;
    case nvinfer1::DataType::kINT8: return DType::Int8;
    case nvinfer1::DataType::kUINT8: return DType::UInt8;
    case nvinfer1::DataType::kBOOL: return DType::Bool;
    default: fail(ErrorKind::BadInput, name + " has a TensorRT type deploykit-run does not handle");
  }
}

struct DeviceBuffer {
  void* pointer = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { check_cuda(cudaMalloc(&pointer, bytes ? bytes : 1), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(pointer); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// The engine to run, read and checked; whether TensorRT may run the plugin code serialized in it and,
// for a bundle's engine, the rule that lets it (native_rule).
struct EngineChoice {
  std::string path;
  std::vector<unsigned char> bytes;
  bool host_code_allowed;
  std::string rule;
};

// options.engine outside the bundle is the caller's own; a bundle engine must be listed and unchanged,
// and its plugin code runs only as native_rule allows (or not at all when the caller brings the plugin library).
EngineChoice choose_engine(const Bundle& bundle, const Options& options) {
  std::string name;
  if (!options.engine.empty() && !bundle.contains(options.engine, &name)) {
    return {options.engine, read_file(options.engine), true, ""};
  }
  auto engines = bundle.engines();
  auto entry = std::find_if(engines.begin(), engines.end(),
                            [&](const EngineEntry& listed) { return name.empty() || listed.file == name; });
  if (entry == engines.end() && name.empty()) {
    fail(ErrorKind::BadInput, bundle.directory() + " has no TensorRT engine: convert with --backend tensorrt");
  }
  if (entry == engines.end()) fail(ErrorKind::BadInput, "--engine " + options.engine + ": the manifest lists no such engine");
  std::string path = bundle.directory() + "/" + entry->file;
  auto bytes = bundle.verified_bytes(entry->file);
  std::string rule = entry->plugins ? native_rule(bundle, entry->file, options.trust_native) : "";
  if (entry->plugins && rule.empty() && options.plugin_libraries.empty()) {
    refuse_native(bundle, entry->file, " (its plugin code runs inside TensorRT), or pass --plugin PATH with your own "
                                       "build of the plugin library");
  }
  return {path, std::move(bytes), !rule.empty(), rule};
}

class TensorRTRunner : public Runner {
 public:
  TensorRTRunner(const Bundle& bundle, const Options& options) {
    EngineChoice engine = choose_engine(bundle, options);
    engine_path_ = engine.path;
    plugins_rule_ = engine.rule;
    std::vector<std::string> candidates{"libnvinfer.so.10", "libnvinfer.so"};
    if (!options.tensorrt_library.empty()) candidates = {options.tensorrt_library};
    void* library = open_library(candidates,
                                 "the TensorRT runtime (pip install tensorrt, or pass --tensorrt-library)", &library_);
    using Create = void* (*)(void*, int32_t);
    auto create = reinterpret_cast<Create>(dlsym(library, "createInferRuntime_INTERNAL"));
    if (!create) fail(ErrorKind::Environment, library_ + " is not a TensorRT runtime library");
    check_cuda(cudaSetDevice(options.device), "cudaSetDevice");
    runtime_.reset(static_cast<nvinfer1::IRuntime*>(create(&logger_, NV_TENSORRT_VERSION)));
    if (!runtime_) fail(ErrorKind::Environment, library_ + " refused to create a runtime: " + logger_.last_error);
    runtime_->setEngineHostCodeAllowed(engine.host_code_allowed);  // plugin code serialized in the engine
    for (const auto& plugin : options.plugin_libraries) {
      if (!runtime_->getPluginRegistry().loadLibrary(plugin.c_str())) {
        fail(ErrorKind::Environment, "TensorRT cannot load plugin library " + plugin + ": " + logger_.last_error);
      }
    }
    engine_.reset(runtime_->deserializeCudaEngine(engine.bytes.data(), engine.bytes.size()));
    if (!engine_) {
      fail(ErrorKind::Environment, "TensorRT cannot load " + engine_path_ + ": " + logger_.last_error +
                                       " (engines run only with the TensorRT version and GPU they were built for)");
    }
    context_.reset(engine_->createExecutionContext());
    check_cuda(cudaStreamCreate(&stream_), "cudaStreamCreate");
    for (int32_t i = 0; i < engine_->getNbIOTensors(); ++i) {
      const char* name = engine_->getIOTensorName(i);
      auto dims = engine_->getTensorShape(name);
      TensorInfo info{name, to_dtype(engine_->getTensorDataType(name), name), {dims.d, dims.d + dims.nbDims}};
      (engine_->getTensorIOMode(name) == nvinfer1::TensorIOMode::kINPUT ? inputs_ : outputs_).push_back(info);
    }
  }

  ~TensorRTRunner() override {
    if (stream_) cudaStreamDestroy(stream_);
  }

  const std::vector<TensorInfo>& inputs() const override { return inputs_; }
  const std::vector<TensorInfo>& outputs() const override { return outputs_; }
  std::string describe() const override {
    std::string plugins = plugins_rule_.empty() ? "" : " (its plugins: " + plugins_rule_ + ")";
    return "tensorrt: " + library_ + "; engine: " + engine_path_ + plugins;
  }

  Tensors run(const Tensors& given) override {
    std::vector<std::unique_ptr<DeviceBuffer>> buffers;
    for (const auto& info : inputs_) {
      auto found = given.find(info.name);
      if (found == given.end()) fail(ErrorKind::BadInput, "missing input " + info.name);
      const Tensor& tensor = found->second;
      check_input(info, tensor);
      nvinfer1::Dims dims{};
      dims.nbDims = static_cast<int32_t>(tensor.shape.size());
      for (int32_t d = 0; d < dims.nbDims; ++d) dims.d[d] = tensor.shape[d];
      if (!context_->setInputShape(info.name.c_str(), dims)) {
        fail(ErrorKind::BadInput, "the engine does not accept " + info.name + " of shape " + tensor.shape_text() +
                                      ": " + logger_.last_error);
      }
      buffers.push_back(std::make_unique<DeviceBuffer>(tensor.data.size()));
      check_cuda(cudaMemcpyAsync(buffers.back()->pointer, tensor.data.data(), tensor.data.size(),
                                 cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
      context_->setTensorAddress(info.name.c_str(), buffers.back()->pointer);
    }
    Tensors outputs;
    std::vector<void*> output_pointers;
    for (const auto& info : outputs_) {
      auto dims = context_->getTensorShape(info.name.c_str());
      Tensor tensor = Tensor::zeros(info.dtype, {dims.d, dims.d + dims.nbDims});
      buffers.push_back(std::make_unique<DeviceBuffer>(tensor.data.size()));
      context_->setTensorAddress(info.name.c_str(), buffers.back()->pointer);
      output_pointers.push_back(buffers.back()->pointer);
      outputs.emplace(info.name, std::move(tensor));
    }
    if (!context_->enqueueV3(stream_)) fail(ErrorKind::Internal, "TensorRT failed to run the engine: " + logger_.last_error);
    for (std::size_t i = 0; i < outputs_.size(); ++i) {
      Tensor& tensor = outputs.at(outputs_[i].name);
      check_cuda(cudaMemcpyAsync(tensor.data.data(), output_pointers[i], tensor.data.size(), cudaMemcpyDeviceToHost,
                                 stream_), "cudaMemcpyAsync");
    }
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return outputs;
  }

 private:
  std::string engine_path_, plugins_rule_, library_;
  Logger logger_;
  std::unique_ptr<nvinfer1::IRuntime> runtime_;
  std::unique_ptr<nvinfer1::ICudaEngine> engine_;
  std::unique_ptr<nvinfer1::IExecutionContext> context_;
  cudaStream_t stream_ = nullptr;
  std::vector<TensorInfo> inputs_, outputs_;
};

}  // namespace

std::unique_ptr<Runner> open_tensorrt(const Bundle& bundle, const Options& options) {
  return std::make_unique<TensorRTRunner>(bundle, options);
}

}  // namespace deploykit::detail

bool deploykit::tensorrt_compiled_in() { return true; }
