// The AOTInductor path: the bundle's packages (aoti-*.pt2) through libtorch's AOTIModelPackageLoader.
//
// A package is compiled code from the bundle, so it loads only as native_rule allows (this machine's
// deploykit wrote it, or Options::trust_native), after its sha256 is checked; what libtorch loads is a
// private copy of the checked bytes. Each call goes to the static package of its batch size, else to
// the dynamic one whose range takes it; a package is loaded the first time a call needs it. Inputs and outputs are checked against the
// manifest's, as the Python runner does (the package itself only knows its compiled shapes).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>

#include "aoti_compat.hpp"
#include "bundle.hpp"
#include "internal.hpp"
#include "trust.hpp"

namespace deploykit::detail {
namespace {

at::ScalarType to_torch(DType dtype) {
  switch (dtype) {
    case DType::Float32: return at::kFloat;
    case DType::Float16: return at::kHalf;
    case DType::Float64: return at::kDouble;
    case DType::Int64: return at::kLong;
    case DType::Int32: return at::kInt;
    case DType::Int8: return at::kChar;
    case DType::UInt8: return at::kByte;
    case DType::Bool: return at::kBool;
  }
  fail(ErrorKind::Internal, "unknown dtype");
}

DType from_torch(at::ScalarType type, const std::string& name) {
  for (DType dtype : {DType::Float32, DType::Float16, DType::Float64, DType::Int64, DType::Int32, DType::Int8,
                      DType::UInt8, DType::Bool}) {
    if (to_torch(dtype) == type) return dtype;
  }
  fail(ErrorKind::BadInput, "output " + name + " is " + std::string(c10::toString(type)) +
                                ", which deploykit-run does not write");
}

// A private folder holding a copy of a package's checked bytes, removed once libtorch has unpacked it.
class PrivateCopy {
 public:
  PrivateCopy(const std::vector<unsigned char>& bytes, const std::string& name) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/deploykit-aoti-XXXXXX";
    if (!mkdtemp(pattern.data())) fail(ErrorKind::Environment, "cannot make a temporary folder in " + pattern);
    directory_ = pattern;
    path_ = directory_ + "/" + name.substr(name.rfind('/') + 1);
    std::ofstream out(path_, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) fail(ErrorKind::Environment, "cannot write " + path_);
  }
  // unlink and rmdir, not std::filesystem::remove_all (internal.hpp says why: libtorch 2.11's copy
  // segfaulted on every AOTInductor run, seen with torch 2.11.0+cu130).
  ~PrivateCopy() {
    ::unlink(path_.c_str());
    ::rmdir(directory_.c_str());
  }
  PrivateCopy(const PrivateCopy&) = delete;
  PrivateCopy& operator=(const PrivateCopy&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string directory_, path_;
};

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

std::string batch_text(const AotiEntry& entry) {
  return entry.is_static() ? std::to_string(entry.batch_min)
                           : std::to_string(entry.batch_min) + ".." + std::to_string(entry.batch_max);
}

// The devices to look for packages of, best first: the caller's choice, else cuda then cpu.
std::vector<std::string> devices_to_try(const Options& options) {
  if (options.aoti_device.empty()) return {"cuda", "cpu"};
  if (options.aoti_device != "cpu" && options.aoti_device != "cuda") {
    fail(ErrorKind::BadInput, "--aoti-device " + options.aoti_device + ": use cpu or cuda");
  }
  return {options.aoti_device};
}

// Whether the caller keeps `entry`: the one file it named (--aoti-package), else its kind (--aoti-packages).
bool kept(const AotiEntry& entry, const Options& options) {
  if (!options.aoti_package.empty()) return entry.file == options.aoti_package;
  return options.aoti_packages == "both" || (options.aoti_packages == "static") == entry.is_static();
}

void check_choice(const Bundle& bundle, const std::vector<AotiEntry>& listed, const Options& options) {
  if (listed.empty()) fail(ErrorKind::BadInput, bundle.directory() + " has no AOTInductor package: convert with --backend aoti");
  if (options.aoti_packages != "both" && options.aoti_packages != "static" && options.aoti_packages != "dynamic") {
    fail(ErrorKind::BadInput, "--aoti-packages " + options.aoti_packages + ": use both, static or dynamic");
  }
  bool named = std::any_of(listed.begin(), listed.end(), [&](const AotiEntry& entry) { return entry.file == options.aoti_package; });
  if (!options.aoti_package.empty() && !named) {
    fail(ErrorKind::BadInput, "--aoti-package " + options.aoti_package + ": the manifest lists no such AOTInductor package");
  }
}

class AotiRunner : public Runner {
 public:
  AotiRunner(const Bundle& bundle, const Options& options)
      : bundle_(bundle), device_index_(options.device), inputs_(bundle.tensors("inputs")),
        outputs_(bundle.tensors("outputs")) {
    auto listed = bundle.aoti_packages();
    check_choice(bundle, listed, options);
    std::string first_problem;
    for (const auto& device : devices_to_try(options)) {
      for (const auto& entry : listed) {
        if (entry.device != device || !kept(entry, options)) continue;
        std::string problem = aoti_problem(entry, device_index_);
        if (problem.empty()) packages_.push_back(entry);
        else skipped_ += "; left out " + entry.file + ": " + problem;
        if (!problem.empty() && first_problem.empty()) first_problem = entry.file + " cannot run here: " + problem;
      }
      device_ = device;
      if (!packages_.empty()) break;
    }
    if (packages_.empty() && first_problem.empty()) {
      std::string kind = options.aoti_packages == "both" ? "" : options.aoti_packages + " ";
      fail(ErrorKind::BadInput, bundle.directory() + " has no " + kind + "AOTInductor package for " + device_ +
                                    ": convert with --backend aoti on a " + device_ + " machine, or pass --aoti-device " +
                                    (device_ == "cpu" ? "cuda" : "cpu"));
    }
    if (packages_.empty()) {
      fail(ErrorKind::Environment, "cannot run " + bundle.directory() + "'s AOTInductor packages here: " + first_problem +
                                       "; convert with --backend aoti here, or run --backend onnxruntime");
    }
    for (const auto& entry : packages_) {  // each may load, or the bundle is refused before any call
      rules_[entry.file] = native_rule(bundle, entry.file, options.trust_native);
      if (rules_[entry.file].empty()) {
        refuse_native(bundle, entry.file, " (an AOTInductor package is compiled code), or run the bundle with "
                                          "--backend onnxruntime");
      }
    }
  }

  // Whether a package of this runner takes `batch`.
  bool takes(int64_t batch) const { return find_package(batch) != nullptr; }

  const std::vector<TensorInfo>& inputs() const override { return inputs_; }
  const std::vector<TensorInfo>& outputs() const override { return outputs_; }

  std::string describe() const override {
    std::string text = "aoti: libtorch " + libtorch_version() + " on " + device_ + "; packages:";
    for (const auto& entry : packages_) {
      text += " " + entry.file + " (batch " + batch_text(entry) + ", " + rules_.at(entry.file) + ")";
    }
    text += "; ran:";
    for (const auto& [file, loader] : loaded_) text += " " + file;
    return text + skipped_;
  }

  Tensors run(const Tensors& given) override {
    std::vector<at::Tensor> arguments;
    int64_t batch = -1;
    for (const auto& info : inputs_) {
      auto found = given.find(info.name);
      if (found == given.end()) fail(ErrorKind::BadInput, "missing input " + info.name);
      check_input(info, found->second);
      arguments.push_back(to_device(found->second));
      if (batch >= 0 && !found->second.shape.empty() && found->second.shape[0] != batch) {
        fail(ErrorKind::BadInput, "input " + info.name + " has batch " + std::to_string(found->second.shape[0]) +
                                      ", the other inputs " + std::to_string(batch));
      }
      if (!found->second.shape.empty()) batch = found->second.shape[0];
    }
    std::vector<at::Tensor> results;
    {
      c10::DeviceGuard guard(device());
      auto& loader = loader_for(package_for(batch));
      try {
        results = loader.run(arguments);
      } catch (const std::exception& error) {
        fail(ErrorKind::BadInput, "AOTInductor failed to run the package: " + first_line(error.what()));
      }
    }
    return to_host(results);
  }

 private:
  at::Device device() const {
    return device_ == "cuda" ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index_)) : at::Device(at::kCPU);
  }

  at::Tensor to_device(const Tensor& tensor) const {
    auto options = at::TensorOptions().dtype(to_torch(tensor.dtype));
    // from_blob does not copy: the package reads the caller's bytes (a cuda package gets a device copy)
    at::Tensor host = at::from_blob(const_cast<unsigned char*>(tensor.data.data()), tensor.shape, options);
    return device_ == "cuda" ? host.to(device()) : host;
  }

  Tensors to_host(const std::vector<at::Tensor>& results) const {
    if (results.size() != outputs_.size()) {
      fail(ErrorKind::BadInput, "the AOTInductor package returned " + std::to_string(results.size()) +
                                    " outputs and the manifest lists " + std::to_string(outputs_.size()) +
                                    ": the bundle is inconsistent; convert the model again");
    }
    Tensors outputs;
    for (std::size_t i = 0; i < results.size(); ++i) {
      at::Tensor host = results[i].to(at::kCPU).contiguous();
      Tensor tensor{from_torch(host.scalar_type(), outputs_[i].name), host.sizes().vec(), {}};
      const auto* data = static_cast<const unsigned char*>(host.data_ptr());
      tensor.data.assign(data, data + host.nbytes());
      outputs.emplace(outputs_[i].name, std::move(tensor));
    }
    return outputs;
  }

  // The static package of this batch size, else a dynamic one whose range takes it (nullptr: none).
  const AotiEntry* find_package(int64_t batch) const {
    const AotiEntry* dynamic = nullptr;
    for (const auto& entry : packages_) {
      if (entry.is_static() && entry.batch_min == batch) return &entry;
      if (!entry.is_static() && entry.takes(batch) && !dynamic) dynamic = &entry;
    }
    return dynamic;
  }

  const AotiEntry& package_for(int64_t batch) const {
    if (const AotiEntry* found = find_package(batch)) return *found;
    std::string taken;
    for (const auto& entry : packages_) taken += (taken.empty() ? "" : ", ") + batch_text(entry);
    fail(ErrorKind::BadInput, "batch " + std::to_string(batch) + " is not one the bundle's AOTInductor packages for " +
                                  device_ + " take (" + taken + "): pass one of those, or run --backend onnxruntime");
  }

  torch::inductor::AOTIModelPackageLoader& loader_for(const AotiEntry& entry) {
    auto found = loaded_.find(entry.file);
    if (found != loaded_.end()) return *found->second;
    std::string path = bundle_.directory() + "/" + entry.file;
    PrivateCopy copy(bundle_.verified_bytes(entry.file), entry.file);
    try {
      auto index = static_cast<c10::DeviceIndex>(device_ == "cuda" ? device_index_ : -1);
      auto loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(copy.path(), "model", false, 1, index);
      return *loaded_.emplace(entry.file, std::move(loader)).first->second;
    } catch (const std::exception& error) {
      fail(ErrorKind::Environment, "libtorch " + libtorch_version() + " cannot load " + path + ": " +
                                       first_line(error.what()));
    }
  }

  Bundle bundle_;  // a copy: the caller's is gone once open_bundle returns
  int device_index_;
  std::string device_, skipped_;
  std::vector<TensorInfo> inputs_, outputs_;
  std::vector<AotiEntry> packages_;
  std::map<std::string, std::string> rules_;  // file: the rule that lets it load (native_rule)
  std::map<std::string, std::unique_ptr<torch::inductor::AOTIModelPackageLoader>> loaded_;
};

}  // namespace

std::unique_ptr<Runner> open_aoti(const Bundle& bundle, const Options& options) {
  return std::make_unique<AotiRunner>(bundle, options);
}

bool aoti_takes(const Runner& aoti, int64_t batch) { return dynamic_cast<const AotiRunner&>(aoti).takes(batch); }

}  // namespace deploykit::detail

bool deploykit::aoti_compiled_in() { return true; }
