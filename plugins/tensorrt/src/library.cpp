/*
 * The library's only exported symbols: the two C entry points TensorRT looks up when it loads a
 * plugin library (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins, or an engine that
 * carries the library because it was in IBuilderConfig::setPluginsToSerialize).
 */
#include "common.h"

namespace deploykit_trt {
void setLoggerFinderImpl(nvinfer1::ILoggerFinder* finder) noexcept;
}

#define DK_TRT_EXPORT __attribute__((visibility("default")))

extern "C" DK_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  deploykit_trt::setLoggerFinderImpl(finder);
}

extern "C" DK_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  // Creators live as long as the library: TensorRT keeps pointers to them after this returns.
  static nvinfer1::IPluginCreatorInterface* const creators[] = {
      deploykit_trt::fusedBatchNormCreator(),
      deploykit_trt::matMulReluCreator(),
  };
  nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
  return creators;
}
