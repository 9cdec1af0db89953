#include "common.h"

#include <atomic>
#include <cstdio>
#include <cstring>

namespace deploykit_trt {

namespace {
// Set by TensorRT through setLoggerFinder() when it loads the library (loadLibrary,
// trtexec --dynamicPlugins, an engine carrying the library).
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
}  // namespace

void setLoggerFinderImpl(nvinfer1::ILoggerFinder* finder) noexcept { gLoggerFinder.store(finder); }

void log(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept {
  try {
    std::string const line = "deploykit plugin: " + message;
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder ? finder->findLogger() : nullptr;
    if (logger) {
      logger->log(severity, line.c_str());
    } else if (severity <= nvinfer1::ILogger::Severity::kWARNING) {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  } catch (...) {
    // Logging must never throw through TensorRT's noexcept interfaces.
  }
}

bool toKernelType(nvinfer1::DataType type, dk_dtype* out) noexcept {
  switch (type) {
    case nvinfer1::DataType::kFLOAT: *out = DK_FLOAT32; return true;
    case nvinfer1::DataType::kHALF: *out = DK_FLOAT16; return true;
    case nvinfer1::DataType::kBF16: *out = DK_BFLOAT16; return true;
    default: return false;
  }
}

int64_t volume(nvinfer1::Dims const& dims, int32_t begin, int32_t end) noexcept {
  int64_t product = 1;
  for (int32_t i = begin; i < end; ++i) {
    if (dims.d[i] < 0) return -1;
    product *= dims.d[i];
  }
  return product;
}

std::string fieldText(nvinfer1::PluginField const& field) {
  if (field.data == nullptr || field.length <= 0) return {};
  char const* text = static_cast<char const*>(field.data);
  size_t const length = strnlen(text, static_cast<size_t>(field.length));
  return std::string(text, length);
}

nvinfer1::IPluginCapability* PluginBase::getCapabilityInterface(
    nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE:
      return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD:
      return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME:
      return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

int32_t PluginBase::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                                       nvinfer1::DataType const* inputTypes,
                                       int32_t nbInputs) const noexcept {
  if (nbOutputs != 1 || !acceptsInputCount(nbInputs)) {
    logError(std::string(getPluginName()) + ": unexpected number of inputs (" +
             std::to_string(nbInputs) + ")");
    return 1;
  }
  outputTypes[0] = inputTypes[0];
  return 0;
}

bool PluginBase::supportsFormatCombination(int32_t pos,
                                           nvinfer1::DynamicPluginTensorDesc const* inOut,
                                           int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (pos < 0 || pos >= nbInputs + nbOutputs) return false;
  nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
  if (desc.format != nvinfer1::TensorFormat::kLINEAR) return false;
  if (pos == 0) return supportsType(desc.type);
  return desc.type == inOut[0].desc.type;
}

int32_t PluginBase::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                                  nvinfer1::PluginTensorDesc const* out,
                                  int32_t nbOutputs) noexcept {
  return acceptsInputCount(nbInputs) && nbOutputs == 1 ? 0 : 1;
}

}  // namespace deploykit_trt
