// Tensors, .npy files, files and libraries: what both backends need.
#include <dlfcn.h>
#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include "bundle.hpp"
#include "internal.hpp"

namespace deploykit {

namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  const char* descr;  // numpy's dtype.str
  std::size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::Float32, "float32", "<f4", 4}, {DType::Float16, "float16", "<f2", 2},
    {DType::Float64, "float64", "<f8", 8}, {DType::Int64, "int64", "<i8", 8},
    {DType::Int32, "int32", "<i4", 4},     {DType::Int8, "int8", "|i1", 1},
    {DType::UInt8, "uint8", "|u1", 1},     {DType::Bool, "bool", "|b1", 1},
};

const DTypeInfo& info_of(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  detail::fail(ErrorKind::Internal, "unknown dtype");
}

// The value of 'key' in numpy's header dict, e.g. "'<f4'" or "(2, 13)".
std::string header_value(const std::string& header, const std::string& key, const std::string& path) {
  auto at = header.find("'" + key + "'");
  if (at == std::string::npos) detail::fail(ErrorKind::BadInput, path + ": .npy header lacks '" + key + "'");
  at = header.find(':', at) + 1;
  while (at < header.size() && header[at] == ' ') ++at;
  std::size_t end = header[at] == '(' ? header.find(')', at) + 1 : header.find_first_of(",}", at);
  return header.substr(at, end - at);
}

std::vector<int64_t> parse_shape(const std::string& text) {
  std::vector<int64_t> shape;
  std::string digits;
  for (char c : text) {
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits += c;
    } else if (!digits.empty()) {
      shape.push_back(std::stoll(digits));
      digits.clear();
    }
  }
  return shape;
}

}  // namespace

std::size_t dtype_size(DType dtype) { return info_of(dtype).size; }
std::string dtype_name(DType dtype) { return info_of(dtype).name; }

std::size_t Tensor::elements() const {
  return std::accumulate(shape.begin(), shape.end(), std::size_t{1},
                         [](std::size_t a, int64_t b) { return a * static_cast<std::size_t>(b); });
}

std::string Tensor::shape_text() const {
  std::ostringstream text;
  for (std::size_t i = 0; i < shape.size(); ++i) text << (i ? "x" : "") << shape[i];
  return text.str();
}

Tensor Tensor::zeros(DType dtype, std::vector<int64_t> shape) {
  Tensor tensor{dtype, std::move(shape), {}};
  tensor.data.assign(tensor.elements() * dtype_size(dtype), 0);
  return tensor;
}

Tensor read_npy(const std::string& path) {
  auto bytes = detail::read_file(path);
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) {
    detail::fail(ErrorKind::BadInput, path + " is not a .npy file (save it with numpy.save)");
  }
  int major = bytes[6];
  std::size_t length_size = major == 1 ? 2 : 4, length = 0;
  for (std::size_t i = 0; i < length_size; ++i) length |= std::size_t{bytes[8 + i]} << (8 * i);
  std::size_t offset = 8 + length_size + length;
  std::string header(bytes.begin() + 8 + length_size, bytes.begin() + offset);
  if (header_value(header, "fortran_order", path) != "False") {
    detail::fail(ErrorKind::BadInput, path + " is in Fortran order: save numpy.ascontiguousarray(x)");
  }
  std::string descr = header_value(header, "descr", path);
  descr = descr.substr(1, descr.size() - 2);
  Tensor tensor;
  const DTypeInfo* found = nullptr;
  for (const auto& info : kDTypes) {
    if (descr == info.descr || (descr[0] == '=' && descr.substr(1) == std::string(info.descr).substr(1))) found = &info;
  }
  if (!found) detail::fail(ErrorKind::BadInput, path + " has dtype " + descr + ", which deploykit-run does not read");
  tensor.dtype = found->dtype;
  tensor.shape = parse_shape(header_value(header, "shape", path));
  std::size_t size = tensor.elements() * found->size;
  if (bytes.size() - offset != size) {
    detail::fail(ErrorKind::BadInput, path + " is truncated: " + std::to_string(bytes.size() - offset) +
                                          " data bytes for shape " + tensor.shape_text());
  }
  tensor.data.assign(bytes.begin() + offset, bytes.end());
  return tensor;
}

void write_npy(const std::string& path, const Tensor& tensor) {
  std::string shape = "(";
  for (auto dim : tensor.shape) shape += std::to_string(dim) + ", ";
  if (tensor.shape.size() > 1) shape.resize(shape.size() - 2);
  else if (tensor.shape.size() == 1) shape.resize(shape.size() - 1);
  shape += ")";
  std::string header = std::string("{'descr': '") + info_of(tensor.dtype).descr +
                       "', 'fortran_order': False, 'shape': " + shape + ", }";
  header.append(63 - (10 + header.size()) % 64, ' ');  // numpy aligns the data to 64 bytes
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) detail::fail(ErrorKind::BadInput, "cannot write " + path);
  const unsigned char length[2] = {static_cast<unsigned char>(header.size() & 0xff),
                                   static_cast<unsigned char>(header.size() >> 8)};
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(length), 2);
  out << header;
  out.write(reinterpret_cast<const char*>(tensor.data.data()), static_cast<std::streamsize>(tensor.data.size()));
}

std::unique_ptr<Runner> open_bundle(const std::string& bundle, const Options& options) {
  if (!detail::file_exists(bundle + "/manifest.json")) {
    detail::fail(ErrorKind::BadInput, bundle + " is not a deploykit bundle (no manifest.json); run deploykit convert first");
  }
  if (options.backend != "auto" && options.backend != "onnxruntime" && options.backend != "tensorrt" &&
      options.backend != "aoti") {
    detail::fail(ErrorKind::BadInput, "backend " + options.backend + ": use auto, onnxruntime, tensorrt or aoti");
  }
  detail::Bundle checked(bundle);
  if (options.backend == "auto") return detail::open_auto(checked, options);
  if (options.backend == "onnxruntime") return detail::open_onnxruntime(checked, options);
  if (options.backend == "aoti") return detail::open_aoti(checked, options);
  return detail::open_tensorrt(checked, options);
}

namespace detail {

void fail(ErrorKind kind, const std::string& message) { throw Error(kind, message); }

bool file_exists(const std::string& path) {
  struct stat info {};
  return stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

std::string real_path(const std::string& path, std::string* error) {
  char* resolved = realpath(path.c_str(), nullptr);
  if (!resolved) {
    *error = std::strerror(errno);
    return "";
  }
  std::string real(resolved);
  std::free(resolved);
  return real;
}

bool make_directories(const std::string& path, std::string* error) {
  for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    std::string prefix = path.substr(0, end);
    struct stat info {};
    if (!prefix.empty() && mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) {
      *error = std::strerror(errno);
      return false;
    }
    if (end == std::string::npos) {
      if (stat(path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
        *error = "a file of that name is in the way";
        return false;
      }
      return true;
    }
  }
}

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorKind::BadInput, "cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void* open_library(const std::vector<std::string>& candidates, const std::string& what, std::string* opened) {
  std::string errors;
  for (const auto& candidate : candidates) {
    if (candidate.empty()) continue;
    if (void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      *opened = candidate;
      return handle;
    }
    errors += std::string("; ") + dlerror();
  }
  fail(ErrorKind::Environment, "cannot load " + what + errors);
}

bool dtype_of_name(const std::string& name, DType* dtype) {
  for (const auto& info : kDTypes) {
    if (name != info.name) continue;
    *dtype = info.dtype;
    return true;
  }
  return false;
}

void check_input(const TensorInfo& info, const Tensor& tensor) {
  bool fits = tensor.dtype == info.dtype && tensor.shape.size() == info.shape.size();
  for (std::size_t i = 0; fits && i < info.shape.size(); ++i) {
    fits = info.shape[i] < 0 || info.shape[i] == tensor.shape[i];
  }
  if (!fits) {
    std::string want;
    for (std::size_t i = 0; i < info.shape.size(); ++i) {
      want += (i ? "x" : "") + (info.shape[i] < 0 ? std::string("N") : std::to_string(info.shape[i]));
    }
    fail(ErrorKind::BadInput, "input " + info.name + " is " + dtype_name(tensor.dtype) + " " + tensor.shape_text() +
                                  ", the model takes " + dtype_name(info.dtype) + " " + want);
  }
}

}  // namespace detail
}  // namespace deploykit
