// A package is compiled code for one torch release and one device: libtorch must be the release that
// compiled it (major.minor.patch), a cpu package's vector ISA must be this CPU's, a cuda package's
// compute capability must be the GPU's. The GPU's capability comes from the CUDA driver (dlopen'ed),
// so this file needs no CUDA headers and builds against a CPU-only libtorch as well.
#include "aoti_compat.hpp"

#include <ATen/cpu/Utils.h>
#include <dlfcn.h>
#include <torch/cuda.h>
#include <torch/headeronly/version.h>

#include <cctype>
#include <map>
#include <sstream>
#include <vector>

namespace deploykit::detail {
namespace {

// "2.14.1+cu130" or "2.11.0a0+git1234" -> "2.14.1", "2.11.0": the release, without local or pre-release tags.
std::string release_of(const std::string& version) {
  std::string release;
  int dots = 0;
  for (char c : version) {
    if (c == '.' && ++dots > 2) break;
    if (c != '.' && !std::isdigit(static_cast<unsigned char>(c))) break;
    release += c;
  }
  return release;
}

// Inductor's ISA words (str(torch._inductor.cpu_vec_isa.pick_vec_isa())) as the CPU features each
// compiles for, named as at::cpu::get_cpu_capabilities() names them.
const std::map<std::string, std::vector<std::string>>& isa_features() {
  static const std::map<std::string, std::vector<std::string>> features{
      {"avx2", {"avx2", "fma3"}},
      {"avx512", {"avx512_f", "avx512_dq", "avx512_vl", "avx512_bw", "fma3"}},
      {"avx512_vnni", {"avx512_vnni"}},
      {"amx_tile", {"amx_tile", "amx_bf16", "amx_int8"}},
  };
  return features;
}

std::string cpu_isa_problem(const std::string& isa) {
  auto capabilities = at::cpu::get_cpu_capabilities();
  std::istringstream words(isa);
  for (std::string word; words >> word;) {
    auto known = isa_features().find(word);
    std::vector<std::string> needed = known == isa_features().end() ? std::vector<std::string>{word} : known->second;
    for (const auto& feature : needed) {
      auto found = capabilities.find(feature);
      if (found == capabilities.end() || !found->second.isBool() || !found->second.toBool()) {
        return "it was compiled for the CPU vector ISA '" + isa + "' and this CPU lacks " + feature;
      }
    }
  }
  return "";
}

// GPU `device` as the CUDA driver (dlopen'ed) names it: its name and compute capability ("9.0"),
// both "" when the driver cannot say.
struct Gpu {
  std::string name, capability;
};

Gpu gpu_of(int device) {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!driver) return {};
  using Init = int (*)(unsigned);
  using Get = int (*)(int*, int);
  using Attribute = int (*)(int*, int, int);
  using Name = int (*)(char*, int, int);
  auto init = reinterpret_cast<Init>(dlsym(driver, "cuInit"));
  auto get = reinterpret_cast<Get>(dlsym(driver, "cuDeviceGet"));
  auto attribute = reinterpret_cast<Attribute>(dlsym(driver, "cuDeviceGetAttribute"));
  auto name = reinterpret_cast<Name>(dlsym(driver, "cuDeviceGetName"));
  constexpr int kMajor = 75, kMinor = 76;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
  int handle = 0, major = 0, minor = 0;
  char text[256] = {};
  bool known = init && get && attribute && name && init(0) == 0 && get(&handle, device) == 0 &&
               attribute(&major, kMajor, handle) == 0 && attribute(&minor, kMinor, handle) == 0 &&
               name(text, sizeof text - 1, handle) == 0;
  return known ? Gpu{text, std::to_string(major) + "." + std::to_string(minor)} : Gpu{};
}

std::string cuda_problem(const AotiEntry& entry, int device) {
  if (!libtorch_sees_gpu(device)) {
    return "it is a cuda package and this libtorch sees no GPU " + std::to_string(device) +
           (torch::cuda::is_available() ? "" : " (a CPU-only libtorch, or no GPU or driver here)");
  }
  std::string here = gpu_of(device).capability;
  if (!entry.cuda_arch.empty() && here != entry.cuda_arch) {
    return "it was compiled for compute capability " + entry.cuda_arch + " and GPU " + std::to_string(device) +
           " has " + (here.empty() ? "one the CUDA driver does not report" : here);
  }
  return "";
}

}  // namespace

std::string libtorch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

bool libtorch_sees_gpu(int device) {
  return torch::cuda::is_available() && device >= 0 && device < static_cast<int>(torch::cuda::device_count());
}

std::string aoti_problem(const AotiEntry& entry, int device) {
  if (release_of(entry.torch) != libtorch_version()) {
    return "it was compiled by torch " + entry.torch + " and this deploykit-run has libtorch " + libtorch_version() +
           " (a package loads only in the torch release that compiled it)";
  }
  if (entry.device == "cuda") return cuda_problem(entry, device);
  if (entry.device != "cpu") return "its device '" + entry.device + "' is neither cpu nor cuda";
  return entry.cpu_isa.empty() ? "" : cpu_isa_problem(entry.cpu_isa);
}

std::string tuning_problem(const Tuning& tuning, int device) {
  if (tuning.device == "cpu") return "";
  if (tuning.device != "cuda") return "it was tuned on '" + tuning.device + "'";
  if (!libtorch_sees_gpu(device)) return "it was tuned on a GPU and this libtorch sees no GPU " + std::to_string(device);
  Gpu here = gpu_of(device);
  if (here.name != tuning.gpu || here.capability != tuning.cuda_arch) {
    return "it was tuned on " + tuning.gpu + " (" + tuning.cuda_arch + "), this is " +
           (here.name.empty() ? std::string("a GPU the CUDA driver does not describe") : here.name + " (" + here.capability + ")");
  }
  return "";
}

}  // namespace deploykit::detail
