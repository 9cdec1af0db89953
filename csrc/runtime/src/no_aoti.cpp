// Built instead of aoti_runner.cpp when the runtime is configured without libtorch.
#include "internal.hpp"

namespace deploykit::detail {

std::unique_ptr<Runner> open_aoti(const Bundle&, const Options&) {
  fail(ErrorKind::Environment, "deploykit's C++ runtime was built without libtorch, so it cannot run AOTInductor "
                               "packages: configure csrc/runtime with -DDEPLOYKIT_WITH_LIBTORCH=ON and "
                               "-DCMAKE_PREFIX_PATH=\"$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')\"");
}

bool aoti_takes(const Runner&, int64_t) { return false; }

std::string tuning_problem(const Tuning&, int) {
  return "this deploykit-run was built without libtorch, so it runs no AOTInductor package";
}

}  // namespace deploykit::detail

bool deploykit::aoti_compiled_in() { return false; }
