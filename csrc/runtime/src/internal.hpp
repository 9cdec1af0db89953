// Shared helpers of the runtime's sources (not installed).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "deploykit/runtime.hpp"

namespace deploykit::detail {

[[noreturn]] void fail(ErrorKind kind, const std::string& message);
bool file_exists(const std::string& path);
// Paths through POSIX calls, not std::filesystem: libtorch's libraries export copies of std::filesystem
// that calls from a program linking libtorch bind to, and libtorch 2.11's remove_all among them calls a
// null pointer. real_path: realpath(3), "" with *error set when the path cannot be resolved.
std::string real_path(const std::string& path, std::string* error);
bool make_directories(const std::string& path, std::string* error);  // mkdir -p; false with *error
std::vector<unsigned char> read_file(const std::string& path);
void* open_library(const std::vector<std::string>& candidates, const std::string& what, std::string* opened);
void check_input(const TensorInfo& info, const Tensor& tensor);
bool dtype_of_name(const std::string& name, DType* dtype);  // numpy's name ("float32") to DType

class Bundle;
struct Tuning;
std::unique_ptr<Runner> open_onnxruntime(const Bundle& bundle, const Options& options);
std::unique_ptr<Runner> open_tensorrt(const Bundle& bundle, const Options& options);
std::unique_ptr<Runner> open_aoti(const Bundle& bundle, const Options& options);
std::unique_ptr<Runner> open_auto(const Bundle& bundle, const Options& options);
bool aoti_takes(const Runner& aoti, int64_t batch);  // whether a runner open_aoti made has a package for `batch`
// Why the tuning table does not describe this machine on GPU `device` ("" when it does; cpu tables
// always do, the C++ runtime running on the CPU); a build without libtorch says it cannot tell.
std::string tuning_problem(const Tuning& tuning, int device);

}  // namespace deploykit::detail
