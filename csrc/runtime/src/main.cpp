// deploykit-run: run a deploykit bundle on .npy inputs and write its outputs as .npy files.
//
//   deploykit-run BUNDLE --input x=x.npy [--input ...] [--inputs DIR] [-o OUT_DIR]
//                 [--backend auto|onnxruntime|tensorrt|aoti] [--trust-bundle] [--ort-library PATH]
//                 [--op-library PATH | --no-op-library] [--threads N] [--tensorrt-library PATH] [--plugin PATH] [--engine FILE]
//                 [--aoti-device cpu|cuda] [--aoti-packages both|static|dynamic] [--aoti-package FILE]
//                 [--device N] [--repeat N]
//
// Native code from the bundle (its op library, an engine's plugins, its AOTInductor packages) loads when this
// machine's deploykit built or wrote it (the rule of `deploykit run`, src/trust.hpp), else only with
// --trust-bundle; --op-library / --plugin bring your own build instead. The summary on stderr names the
// rule each native file loaded under. Exit codes as the Python CLI: 0 ok, 2 bad input or usage, 3 missing environment, 4 internal.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "deploykit/runtime.hpp"
#include "internal.hpp"

namespace {

const char* kUsage =
    "usage: deploykit-run BUNDLE (--input NAME=FILE.npy ... | --inputs DIR) [-o OUT_DIR]\n"
    "         [--backend auto|onnxruntime|tensorrt|aoti] [--trust-bundle] [--ort-library PATH]\n"
    "         [--op-library PATH | --no-op-library] [--threads N]\n"
    "         [--tensorrt-library PATH] [--plugin PATH] [--engine FILE]\n"
    "         [--aoti-device cpu|cuda] [--aoti-packages both|static|dynamic] [--aoti-package FILE]\n"
    "         [--device N] [--repeat N]\n"
    "Writes OUT_DIR/<output name>.npy (default OUT_DIR: the current directory; created if missing).\n"
    "--backend auto "
    "(the default) is onnxruntime, or the AOTInductor package the bundle's tuning table names for\n"
    "the batch size on a machine like the one it was tuned on.\n"
    "The bundle's native code (op library, engine plugins, AOTInductor packages) loads when this\n"
    "machine's deploykit built or wrote it; --trust-bundle loads it from anyone; or pass your own\n"
    "build (--op-library, --plugin) or --no-op-library.\n";

struct Arguments {
  std::string bundle, inputs_dir, output_dir = ".";
  std::vector<std::pair<std::string, std::string>> inputs;
  deploykit::Options options;
  int repeat = 1;
};

[[noreturn]] void usage_error(const std::string& message) {
  throw deploykit::Error(deploykit::ErrorKind::BadInput, message + "\n" + kUsage);
}

int to_int(const std::string& text, const std::string& option) {
  try {
    return std::stoi(text);
  } catch (const std::exception&) {
    usage_error(option + " takes a number, not " + text);
  }
}

Arguments parse(int argc, char** argv) {
  Arguments args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--input") {
      std::string spec = value();
      auto equals = spec.find('=');
      if (equals == std::string::npos) usage_error("--input takes NAME=FILE.npy, not " + spec);
      args.inputs.emplace_back(spec.substr(0, equals), spec.substr(equals + 1));
    } else if (arg == "--inputs") {
      args.inputs_dir = value();
    } else if (arg == "-o" || arg == "--output-dir") {
      args.output_dir = value();
    } else if (arg == "--backend") {
      args.options.backend = value();
    } else if (arg == "--ort-library") {
      args.options.ort_library = value();
    } else if (arg == "--trust-bundle") {
      args.options.trust_native = true;
    } else if (arg == "--op-library") {
      args.options.op_library_path = value();
    } else if (arg == "--no-op-library") {
      args.options.op_library = false;
    } else if (arg == "--threads") {
      args.options.threads = to_int(value(), arg);
    } else if (arg == "--tensorrt-library") {
      args.options.tensorrt_library = value();
    } else if (arg == "--plugin") {
      args.options.plugin_libraries.push_back(value());
    } else if (arg == "--engine") {
      args.options.engine = value();
    } else if (arg == "--aoti-device") {
      args.options.aoti_device = value();
    } else if (arg == "--aoti-packages") {
      args.options.aoti_packages = value();
    } else if (arg == "--aoti-package") {
      args.options.aoti_package = value();
    } else if (arg == "--device") {
      args.options.device = to_int(value(), arg);
    } else if (arg == "--repeat") {
      args.repeat = std::max(1, to_int(value(), arg));
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option " + arg);
    } else if (args.bundle.empty()) {
      args.bundle = arg;
    } else {
      usage_error("unexpected argument " + arg);
    }
  }
  if (args.bundle.empty()) usage_error("missing BUNDLE");
  return args;
}

deploykit::Tensors read_inputs(const Arguments& args, const deploykit::Runner& runner) {
  deploykit::Tensors inputs;
  for (const auto& [name, path] : args.inputs) inputs[name] = deploykit::read_npy(path);
  for (const auto& info : runner.inputs()) {
    if (inputs.count(info.name)) continue;
    if (args.inputs_dir.empty()) usage_error("missing input " + info.name + ": pass --input " + info.name + "=FILE.npy");
    inputs[info.name] = deploykit::read_npy(args.inputs_dir + "/" + info.name + ".npy");
  }
  return inputs;
}

// OUT_DIR and its parents are created once the run succeeded, so a failed run leaves no folder behind.
void make_output_dir(const std::string& dir) {
  std::string error;
  if (!deploykit::detail::make_directories(dir, &error)) {
    throw deploykit::Error(deploykit::ErrorKind::BadInput,
                           "cannot create the output folder " + dir + " (" + error + "): pass -o a folder you can write");
  }
}

int run(int argc, char** argv) {
  Arguments args = parse(argc, argv);
  auto runner = deploykit::open_bundle(args.bundle, args.options);
  deploykit::Tensors inputs = read_inputs(args, *runner);
  deploykit::Tensors outputs;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < args.repeat; ++i) outputs = runner->run(inputs);
  std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
  std::fprintf(stderr, "%s\n", runner->describe().c_str());
  make_output_dir(args.output_dir);
  for (const auto& info : runner->outputs()) {
    const auto& tensor = outputs.at(info.name);
    std::string path = args.output_dir + "/" + info.name + ".npy";
    deploykit::write_npy(path, tensor);
    std::printf("%s %s %s -> %s\n", info.name.c_str(), deploykit::dtype_name(tensor.dtype).c_str(),
                tensor.shape_text().c_str(), path.c_str());
  }
  std::fprintf(stderr, "%.3f ms per run (%d run%s)\n", elapsed.count() / args.repeat, args.repeat,
               args.repeat == 1 ? "" : "s");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const deploykit::Error& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return error.exit_code();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "internal error: %s; please report it\n", error.what());
    return 4;
  }
}
