// A bundle as its manifest describes it (not installed): every file a runner opens is named by
// manifest.json, resolves inside the bundle directory and matches the sha256 recorded there.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "internal.hpp"

namespace deploykit::detail {

// An engine the manifest lists; plugins: whether it carries plugin code (native code from the bundle).
struct EngineEntry {
  std::string file;
  bool plugins;
};

// An AOTInductor package the manifest lists (its `aoti` entries): compiled code for one device and
// torch version, taking the batch sizes batch_min..batch_max (a static package: one size).
struct AotiEntry {
  std::string file, device, torch, cuda_arch, cpu_isa, precision;
  int64_t batch_min, batch_max;
  bool is_static() const { return batch_min == batch_max; }
  bool takes(int64_t batch) const { return batch_min <= batch && batch <= batch_max; }
};

// The manifest's tuning table (written by deploykit tune): the machine it was timed on and, per batch
// size, the backend that won there; an aoti choice names its packages by kind (packages: static,
// dynamic or both) or one file.
struct TunedChoice {
  int64_t batch;
  std::string backend, packages, file;
};
struct Tuning {
  std::string device, gpu, cuda_arch;
  std::vector<TunedChoice> choices;
};

class Bundle {
 public:
  // Reads and checks manifest.json (format tag, format_version, the keys the runners use).
  explicit Bundle(const std::string& directory);

  const std::string& directory() const { return directory_; }
  // The real path of the file the manifest calls `name`, inside the bundle and unchanged.
  std::string verified_path(const std::string& name) const;
  // The bytes of that file, hashed as read: what is checked is what is used.
  std::vector<unsigned char> verified_bytes(const std::string& name) const;
  // The sha256 manifest.json records for the file it calls `name`: what those two check its bytes against.
  std::string sha256(const std::string& name) const;
  std::string model() const;
  std::vector<std::string> op_libraries(const std::string& runtime) const;
  std::vector<EngineEntry> engines() const;
  std::vector<AotiEntry> aoti_packages() const;
  bool has_tuning() const;
  Tuning tuning() const;  // has_tuning() first
  // The model's inputs and outputs as the manifest declares them (a named dimension is -1).
  std::vector<TensorInfo> tensors(const std::string& key) const;
  // Whether `path` resolves inside the bundle directory; `relative` then holds its name there.
  bool contains(const std::string& path, std::string* relative) const;

 private:
  std::string inside(const std::string& name) const;
  void check_sha256(const std::string& name, const std::vector<unsigned char>& bytes) const;
  std::string directory_;
  nlohmann::json manifest_;
};

// The lowercase hex sha256 of `bytes` (OpenSSL's libcrypto), as manifest.json records it.
std::string sha256_hex(const std::vector<unsigned char>& bytes);

}  // namespace deploykit::detail
