// Embedding deploykit's C++ runtime: open a bundle, feed it a tensor, read the outputs.
//
//   ./embed BUNDLE [auto|onnxruntime|tensorrt|aoti] [--trust-bundle]
//
// The bundle's native code (its op library, an engine's plugins, its AOTInductor packages) loads when
// this machine's deploykit built or wrote it, else only with consent (Options::trust_native, here
// --trust-bundle): a foreign bundle without it is exit 2. `aoti` needs a runtime configured with
// libtorch (examples/cpp/README.md).
//
// Inputs are filled with a ramp at batch 1 (dynamic dimensions become 1); a real program fills
// Tensor::data from its own buffers (C order, the dtype the model declares).
#include <cstdio>
#include <string>

#include "deploykit/runtime.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s BUNDLE [auto|onnxruntime|tensorrt|aoti] [--trust-bundle]\n", argv[0]);
    return 2;
  }
  deploykit::Options options;
  for (int i = 2; i < argc; ++i) {
    if (std::string(argv[i]) == "--trust-bundle") options.trust_native = true;
    else options.backend = argv[i];
  }
  try {
    auto runner = deploykit::open_bundle(argv[1], options);
    deploykit::Tensors inputs;
    for (const auto& info : runner->inputs()) {
      std::vector<int64_t> shape;
      for (auto dim : info.shape) shape.push_back(dim < 0 ? 1 : dim);
      auto tensor = deploykit::Tensor::zeros(info.dtype, shape);
      if (info.dtype == deploykit::DType::Float32) {
        for (std::size_t i = 0; i < tensor.elements(); ++i) tensor.as<float>()[i] = 0.01f * static_cast<float>(i % 100);
      }
      inputs.emplace(info.name, std::move(tensor));
    }
    deploykit::Tensors outputs = runner->run(inputs);
    for (const auto& [name, tensor] : outputs) {
      std::printf("%s: %s %s", name.c_str(), deploykit::dtype_name(tensor.dtype).c_str(), tensor.shape_text().c_str());
      if (tensor.dtype == deploykit::DType::Float32 && tensor.elements() > 0) std::printf(" first=%g", tensor.as<float>()[0]);
      std::printf("\n");
    }
  } catch (const deploykit::Error& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return error.exit_code();
  }
  return 0;
}
