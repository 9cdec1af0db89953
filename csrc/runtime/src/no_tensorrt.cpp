// Built instead of trt_runner.cpp when TensorRT headers or the CUDA toolkit are missing.
#include "internal.hpp"

namespace deploykit::detail {

std::unique_ptr<Runner> open_tensorrt(const Bundle&, const Options&) {
  fail(ErrorKind::Environment, "deploykit's C++ runtime was built without TensorRT: configure csrc/runtime with "
                               "TENSORRT_INCLUDE_DIR and the CUDA toolkit");
}

}  // namespace deploykit::detail

bool deploykit::tensorrt_compiled_in() { return false; }
