// manifest.json, checked on open, and the bundle files it names, checked before they are used: a
// bundle from a stranger must not send deploykit-run outside its folder or feed it changed files.
#include "bundle.hpp"

#include <openssl/evp.h>

#include <algorithm>

namespace deploykit::detail {
namespace {

using json = nlohmann::json;

constexpr const char* kFormat = "deploykit-bundle";
constexpr int64_t kFormatVersion = 1;  // deploykit.bundle.format.FORMAT_VERSION this runtime reads

[[noreturn]] void bad_manifest(const std::string& directory, const std::string& problem) {
  fail(ErrorKind::BadInput, directory + "/manifest.json: " + problem + "; convert the model again with deploykit convert");
}

const char* type_name(json::value_t type) {
  switch (type) {
    case json::value_t::object: return "an object";
    case json::value_t::array: return "a list";
    default: return "a string";
  }
}

// object[key], which must be there with the given type; `where` is the object's path ("files.x.").
const json& member(const std::string& directory, const json& object, const std::string& key, json::value_t type,
                   const std::string& where) {
  auto found = object.find(key);
  if (found == object.end()) bad_manifest(directory, "'" + where + key + "' is missing");
  if (found->type() != type) {
    bad_manifest(directory, "'" + where + key + "' must be " + type_name(type) + ", not " + found->type_name());
  }
  return *found;
}

void check_format(const std::string& directory, const json& manifest) {
  if (member(directory, manifest, "format", json::value_t::string, "") != kFormat) {
    bad_manifest(directory, std::string("'format' must be \"") + kFormat + "\"");
  }
  auto version = manifest.find("format_version");
  if (version == manifest.end() || !version->is_number_integer() || version->get<int64_t>() < 1) {
    bad_manifest(directory, "'format_version' must be a whole number from 1");
  }
  if (version->get<int64_t>() > kFormatVersion) {
    fail(ErrorKind::BadInput, directory + " has bundle format_version " + version->dump() + "; this deploykit-run reads " +
                                  std::to_string(kFormatVersion) + ": use a newer deploykit-run");
  }
}

// Each entry of the optional list `key` is an object with the string fields `strings`.
void check_entries(const std::string& directory, const json& manifest, const std::string& key,
                   const std::vector<std::string>& strings) {
  if (!manifest.contains(key)) return;
  const json& entries = member(directory, manifest, key, json::value_t::array, "");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::string where = key + "[" + std::to_string(i) + "]";
    if (!entries[i].is_object()) bad_manifest(directory, where + " must be an object");
    for (const auto& field : strings) member(directory, entries[i], field, json::value_t::string, where + ".");
  }
}

json read_manifest(const std::string& directory) {
  json manifest;
  try {
    auto bytes = read_file(directory + "/manifest.json");
    manifest = json::parse(bytes.begin(), bytes.end());
  } catch (const json::exception& error) {
    bad_manifest(directory, std::string("not JSON (") + error.what() + ")");
  }
  if (!manifest.is_object()) bad_manifest(directory, std::string("must be a JSON object, not ") + manifest.type_name());
  check_format(directory, manifest);
  member(directory, manifest, "model", json::value_t::string, "");
  for (const auto& [name, entry] : member(directory, manifest, "files", json::value_t::object, "").items()) {
    if (!entry.is_object()) bad_manifest(directory, "files." + name + " must be an object");
    member(directory, entry, "sha256", json::value_t::string, "files." + name + ".");
  }
  check_entries(directory, manifest, "custom_op_libraries", {"file", "runtime"});
  check_entries(directory, manifest, "engines", {"file"});
  check_entries(directory, manifest, "aoti", {"file", "device", "torch", "precision"});
  for (std::size_t i = 0; i < manifest.value("aoti", json::array()).size(); ++i) {
    std::string where = "aoti[" + std::to_string(i) + "].";
    const json& batch = member(directory, manifest["aoti"][i], "batch", json::value_t::object, where);
    for (const char* key : {"min", "max"}) {
      if (!batch.contains(key) || !batch[key].is_number_integer()) {
        bad_manifest(directory, "'" + where + "batch." + key + "' must be a whole number");
      }
    }
  }
  return manifest;
}

}  // namespace

std::string sha256_hex(const std::vector<unsigned char>& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(), nullptr) != 1) {
    fail(ErrorKind::Internal, "OpenSSL could not compute a sha256");
  }
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) hex += {kHex[digest[i] >> 4], kHex[digest[i] & 15]};
  return hex;
}

Bundle::Bundle(const std::string& directory) {
  std::string error;
  directory_ = real_path(directory, &error);
  if (directory_.empty()) fail(ErrorKind::BadInput, "cannot open bundle " + directory + ": " + error);
  manifest_ = read_manifest(directory_);
}

std::string Bundle::inside(const std::string& name) const {
  bool climbs = false;
  for (size_t start = 0; start <= name.size();) {
    size_t end = std::min(name.find('/', start), name.size());
    climbs = climbs || name.compare(start, end - start, "..") == 0;
    start = end + 1;
  }
  if (name.empty() || name[0] == '/' || climbs) {
    fail(ErrorKind::BadInput, directory_ + "/manifest.json names '" + name +
                                  "', which is not a path inside the bundle: refusing the bundle");
  }
  std::string error;
  std::string real = real_path(directory_ + "/" + name, &error);
  if (real.empty()) fail(ErrorKind::BadInput, directory_ + "/" + name + " is missing: the bundle is incomplete");
  if (real.compare(0, directory_.size() + 1, directory_ + "/") != 0) {
    fail(ErrorKind::BadInput, directory_ + "/" + name + " leads out of the bundle (to " + real + "): refusing the bundle");
  }
  if (!file_exists(real)) fail(ErrorKind::BadInput, directory_ + "/" + name + " is not a file");
  return real;
}

std::string Bundle::sha256(const std::string& name) const {
  const json& files = manifest_.at("files");
  auto entry = files.find(name);
  if (entry == files.end()) {
    fail(ErrorKind::BadInput, directory_ + "/" + name + " is not listed in manifest.json's files, so its sha256 "
                                  "cannot be checked: refusing the bundle");
  }
  return entry->at("sha256").get<std::string>();
}

void Bundle::check_sha256(const std::string& name, const std::vector<unsigned char>& bytes) const {
  if (sha256(name) != sha256_hex(bytes)) {
    fail(ErrorKind::BadInput, directory_ + "/" + name + " does not match its sha256 in manifest.json: it changed "
                                  "after convert; restore it or convert the model again");
  }
}

std::string Bundle::verified_path(const std::string& name) const {
  std::string path = inside(name);
  check_sha256(name, read_file(path));
  return path;
}

std::vector<unsigned char> Bundle::verified_bytes(const std::string& name) const {
  auto bytes = read_file(inside(name));
  check_sha256(name, bytes);
  return bytes;
}

std::string Bundle::model() const { return manifest_.at("model").get<std::string>(); }

std::vector<std::string> Bundle::op_libraries(const std::string& runtime) const {
  std::vector<std::string> files;
  for (const auto& entry : manifest_.value("custom_op_libraries", json::array())) {
    if (entry.at("runtime") == runtime) files.push_back(entry.at("file").get<std::string>());
  }
  return files;
}

std::vector<EngineEntry> Bundle::engines() const {
  std::vector<EngineEntry> engines;
  for (const auto& entry : manifest_.value("engines", json::array())) {
    auto layers = entry.find("plugin_layers");
    bool without_plugins = layers != entry.end() && layers->is_number_integer() && *layers == 0;
    engines.push_back({entry.at("file").get<std::string>(), !without_plugins});
  }
  return engines;
}

std::vector<AotiEntry> Bundle::aoti_packages() const {
  std::vector<AotiEntry> packages;
  auto optional = [](const json& entry, const char* key) {
    auto found = entry.find(key);
    return found != entry.end() && found->is_string() ? found->get<std::string>() : std::string();
  };
  for (const auto& entry : manifest_.value("aoti", json::array())) {
    packages.push_back({entry.at("file").get<std::string>(), entry.at("device").get<std::string>(),
                        entry.at("torch").get<std::string>(), optional(entry, "cuda_arch"), optional(entry, "cpu_isa"),
                        entry.at("precision").get<std::string>(), entry.at("batch").at("min").get<int64_t>(),
                        entry.at("batch").at("max").get<int64_t>()});
  }
  return packages;
}

bool Bundle::has_tuning() const { return manifest_.contains("tuning") && !manifest_["tuning"].is_null(); }

Tuning Bundle::tuning() const {
  const json& table = member(directory_, manifest_, "tuning", json::value_t::object, "");
  auto text = [&](const json& object, const char* key) {
    auto found = object.find(key);
    return found != object.end() && found->is_string() ? found->get<std::string>() : std::string();
  };
  Tuning tuning{member(directory_, table, "device", json::value_t::string, "tuning.").get<std::string>(),
                text(table, "gpu"), text(table, "cuda_arch"), {}};
  const json& choices = member(directory_, table, "choices", json::value_t::array, "tuning.");
  for (std::size_t i = 0; i < choices.size(); ++i) {
    std::string where = "tuning.choices[" + std::to_string(i) + "].";
    if (!choices[i].is_object() || !choices[i].contains("batch") || !choices[i]["batch"].is_number_integer()) {
      bad_manifest(directory_, "'" + where + "batch' must be a whole number");
    }
    std::string backend = member(directory_, choices[i], "backend", json::value_t::string, where).get<std::string>();
    const json options = choices[i].value("options", json::object());
    std::string packages = text(options, "packages"), file = text(options, "file");
    if (backend == "aoti" && packages.empty() && file.empty()) {
      bad_manifest(directory_, "'" + where + "options' must name the AOTInductor packages or file");
    }
    tuning.choices.push_back({choices[i]["batch"].get<int64_t>(), backend, packages.empty() ? "both" : packages, file});
  }
  return tuning;
}

std::vector<TensorInfo> Bundle::tensors(const std::string& key) const {
  auto list = manifest_.find(key);
  if (list == manifest_.end() || !list->is_array()) bad_manifest(directory_, "'" + key + "' must be a list");
  std::vector<TensorInfo> tensors;
  for (std::size_t i = 0; i < list->size(); ++i) {
    std::string where = key + "[" + std::to_string(i) + "].";
    const json& entry = (*list)[i];
    if (!entry.is_object()) bad_manifest(directory_, key + "[" + std::to_string(i) + "] must be an object");
    std::string name = member(directory_, entry, "name", json::value_t::string, where).get<std::string>();
    std::string dtype = member(directory_, entry, "dtype", json::value_t::string, where).get<std::string>();
    TensorInfo info{name, DType::Float32, {}};
    if (!dtype_of_name(dtype, &info.dtype)) {
      fail(ErrorKind::BadInput, directory_ + ": " + key + " " + name + " is " + dtype + ", which deploykit-run does not handle");
    }
    for (const auto& dim : member(directory_, entry, "shape", json::value_t::array, where)) {
      if (!dim.is_number_integer() && !dim.is_string()) bad_manifest(directory_, "'" + where + "shape' holds sizes or names");
      info.shape.push_back(dim.is_string() ? -1 : dim.get<int64_t>());
    }
    tensors.push_back(std::move(info));
  }
  return tensors;
}

bool Bundle::contains(const std::string& path, std::string* relative) const {
  std::string error;
  std::string real = real_path(path, &error);  // a path that does not exist is no file of the bundle
  if (real.empty() || real.compare(0, directory_.size() + 1, directory_ + "/") != 0) return false;
  *relative = real.substr(directory_.size() + 1);
  return true;
}

}  // namespace deploykit::detail
