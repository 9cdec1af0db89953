// The sha256 values in manifest.json prove a file unchanged since the manifest was written, not who
// made it: so native code from a bundle loads only when it is byte-identical to what this machine's
// deploykit wrote into a bundle (convert appends each native file's sha256 to
// $DEPLOYKIT_CACHE/native-written.txt) or built (a library a build manifest,
// $DEPLOYKIT_CACHE/build/*/deploykit-build.json, lists), or with consent. The same record, read the
// same way, as deploykit/bundle/trust.py reads it; POSIX calls, not std::filesystem (internal.hpp says why).
#include "trust.hpp"

#include <dirent.h>
#include <pwd.h>
#include <unistd.h>

#include <cstdlib>
#include <iterator>
#include <memory>
#include <set>
#include <sstream>
#include <vector>

#include "bundle.hpp"

namespace deploykit::detail {
namespace {

// trust.py's WRITTEN_HERE and SAME_AS_BUILD: one wording for both runtimes.
constexpr const char* kWrittenHere = "written by this machine's deploykit";
constexpr const char* kSameAsBuild = "same as this machine's build";
constexpr const char* kTrusted = "trusted with --trust-bundle";
constexpr const char* kWrittenRecord = "native-written.txt";
constexpr const char* kBuildManifest = "deploykit-build.json";

// $HOME, else the user's home in the password database, as Python's Path.home() finds it.
std::string home() {
  if (const char* variable = std::getenv("HOME")) return variable;
  const passwd* user = getpwuid(getuid());
  return user && user->pw_dir ? user->pw_dir : "";
}

// $DEPLOYKIT_CACHE (a leading ~ expanded), else ~/.cache/deploykit: deploykit.native.build.cache_dir().
std::string cache_dir() {
  const char* configured = std::getenv("DEPLOYKIT_CACHE");
  if (!configured || !*configured) return home() + "/.cache/deploykit";
  std::string path = configured;
  return path == "~" || path.rfind("~/", 0) == 0 ? home() + path.substr(1) : path;
}

// The sha256 of each native file convert wrote into a bundle here, one a line.
std::set<std::string> written_digests(const std::string& cache) {
  std::string record = cache + "/" + kWrittenRecord;
  if (!file_exists(record)) return {};
  auto bytes = read_file(record);
  std::istringstream lines(std::string(bytes.begin(), bytes.end()));
  return {std::istream_iterator<std::string>(lines), std::istream_iterator<std::string>()};
}

// The libraries one build manifest lists (paths relative to its folder); none when it is unreadable.
std::vector<std::string> listed_libraries(const std::string& build) {
  std::vector<std::string> libraries;
  try {
    auto bytes = read_file(build + "/" + kBuildManifest);
    auto listed = nlohmann::json::parse(bytes.begin(), bytes.end()).at("libraries");
    for (const auto& [kind, relative] : listed.items()) {
      if (relative.is_string()) libraries.push_back(build + "/" + relative.get<std::string>());
    }
  } catch (const std::exception&) {  // unreadable, or not a manifest of ours: it vouches for nothing
  }
  return libraries;
}

// The sha256 of every library of this machine's build cache, hashed as the bundle's files are.
std::set<std::string> build_digests(const std::string& cache) {
  std::set<std::string> digests;
  std::unique_ptr<DIR, int (*)(DIR*)> folder(opendir((cache + "/build").c_str()), closedir);
  for (const dirent* entry = folder ? readdir(folder.get()) : nullptr; entry; entry = readdir(folder.get())) {
    std::string build = cache + "/build/" + entry->d_name;
    if (entry->d_name[0] == '.' || !file_exists(build + "/" + kBuildManifest)) continue;
    for (const auto& library : listed_libraries(build)) {
      if (file_exists(library)) digests.insert(sha256_hex(read_file(library)));
    }
  }
  return digests;
}

}  // namespace

std::string native_rule(const Bundle& bundle, const std::string& name, bool trust_native) {
  std::string digest = bundle.sha256(name), cache = cache_dir();
  if (written_digests(cache).count(digest)) return kWrittenHere;
  if (build_digests(cache).count(digest)) return kSameAsBuild;
  return trust_native ? kTrusted : "";
}

void refuse_native(const Bundle& bundle, const std::string& name, const std::string& ways_out) {
  std::string cache = cache_dir();
  fail(ErrorKind::BadInput, bundle.directory() + "/" + name + " is native code this machine's deploykit did not "
                            "build (its sha256 is in neither " + cache + "/" + kWrittenRecord + " nor a build of " +
                            cache + "/build, and the one in manifest.json only proves the file unchanged since the "
                            "manifest was written, not who made it): pass --trust-bundle (Options::trust_native) if "
                            "you trust whoever made " + bundle.directory() + ways_out);
}

}  // namespace deploykit::detail
