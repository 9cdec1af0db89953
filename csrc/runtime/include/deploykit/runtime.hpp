// deploykit runtime for C++: run a deploykit bundle (bundle/model.onnx with our op library, its
// TensorRT engine, or its AOTInductor packages) from a C++ program. The ONNX Runtime and TensorRT
// libraries are loaded at run time (dlopen), so a program built against this header needs neither to
// link; the AOTInductor path links libtorch and exists only in a build configured with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace deploykit {

// Exit codes shared with the Python CLI: 2 bad input or usage, 3 missing environment, 4 internal.
enum class ErrorKind { BadInput = 2, Environment = 3, Internal = 4 };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }
  int exit_code() const noexcept { return static_cast<int>(kind_); }

 private:
  ErrorKind kind_;
};

enum class DType { Float32, Float16, Float64, Int64, Int32, Int8, UInt8, Bool };

std::size_t dtype_size(DType dtype);
std::string dtype_name(DType dtype);  // numpy's name: "float32", "int64", ...

// A dense C-order tensor in host memory.
struct Tensor {
  DType dtype = DType::Float32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> data;

  std::size_t elements() const;
  std::string shape_text() const;  // "2x13"
  template <class T> T* as() { return reinterpret_cast<T*>(data.data()); }
  template <class T> const T* as() const { return reinterpret_cast<const T*>(data.data()); }
  static Tensor zeros(DType dtype, std::vector<int64_t> shape);
};

using Tensors = std::map<std::string, Tensor>;

// .npy files (format 1.0-3.0, little-endian, C order), as numpy.save writes them.
Tensor read_npy(const std::string& path);
void write_npy(const std::string& path, const Tensor& tensor);

struct Options {
  // "auto": ONNX Runtime, except for the batch sizes the manifest's tuning table (deploykit tune) gives
  // to an AOTInductor package, on a machine like the one it was tuned on; or "onnxruntime",
  // "tensorrt", "aoti" (a build with libtorch).
  std::string backend = "auto";
  // Native code from the bundle (its op library, an engine's plugin code, its AOTInductor packages)
  // loads when it is byte-identical to what this machine's deploykit built or wrote into a bundle (the
  // record in $DEPLOYKIT_CACHE, default ~/.cache/deploykit, that deploykit.load reads too), else only
  // when trust_native is set; or the caller's own library replaces it (op_library_path,
  // plugin_libraries). describe() names the rule each one loaded under. Every bundle file opened is
  // checked first: inside the bundle and matching its manifest sha256.
  bool trust_native = false;
  // ONNX Runtime: the shared library to load ("" = $DEPLOYKIT_ORT_LIBRARY, the one configured at
  // build time, then libonnxruntime.so.1 on the library path); whether to register the bundle's
  // op library (without it, deploykit ops run as their ONNX functions); an op library of the
  // caller's own to register instead of the bundle's ("" = the bundle's); intra-op threads.
  std::string ort_library;
  bool op_library = true;
  std::string op_library_path;
  int threads = 0;
  // TensorRT: the runtime library ("" = libnvinfer.so.10), extra plugin libraries (engines carry
  // ours), the engine: a file the manifest lists, or one of the caller's own ("" = the manifest's
  // first), the GPU.
  std::string tensorrt_library;
  std::vector<std::string> plugin_libraries;
  std::string engine;
  int device = 0;
  // AOTInductor: the bundle's packages for this device, "cpu" or "cuda" ("" = cuda when the bundle has
  // cuda packages and libtorch sees a GPU, else cpu); the GPU is `device`.
  std::string aoti_device;
  // Which packages: "static", "dynamic" or "both" (each call's static package, else the dynamic one);
  // or only the one file the manifest lists as aoti_package.
  std::string aoti_packages = "both";
  std::string aoti_package;
};

// What a bundle's model takes and returns.
struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;  // -1 for dynamic dimensions
};

class Runner {
 public:
  virtual ~Runner() = default;
  virtual const std::vector<TensorInfo>& inputs() const = 0;
  virtual const std::vector<TensorInfo>& outputs() const = 0;
  virtual Tensors run(const Tensors& inputs) = 0;
  virtual std::string describe() const = 0;  // backend, library versions, files
};

// Open BUNDLE (a directory written by `deploykit convert`) with options.backend.
std::unique_ptr<Runner> open_bundle(const std::string& bundle, const Options& options = {});

bool tensorrt_compiled_in();  // whether this build has the TensorRT path
bool aoti_compiled_in();      // whether this build has the AOTInductor path (libtorch)

}  // namespace deploykit
