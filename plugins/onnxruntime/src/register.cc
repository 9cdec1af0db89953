// Entry point of libdeploykit_ort.so: ONNX Runtime calls RegisterCustomOps when the library is
// loaded with SessionOptions.register_custom_ops_library / RegisterCustomOpsLibrary.
#include <mutex>
#include <vector>

#include "kernels.h"

namespace dk_ort {
namespace {

// Session config entry that lets fp32 MatMulRelu use TF32 tensor cores on CUDA (off by default).
constexpr const char* kAllowTf32Key = "deploykit.allow_tf32";

constexpr ONNXTensorElementDataType kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ONNXTensorElementDataType kHalf = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr ONNXTensorElementDataType kBFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;

// One op object per (op, element type, execution provider): ORT merges same-named ops into one
// schema and picks the kernel whose type matches the node.
template <typename Kernel>
void AddOps(std::vector<const OrtCustomOp*>& ops, std::initializer_list<ONNXTensorElementDataType> types,
            Device device, bool allow_tf32) {
  for (auto type : types) ops.push_back(new Op<Kernel>(OpConfig{type, device, allow_tf32}));
}

std::vector<const OrtCustomOp*> MakeOps(bool allow_tf32) {
  std::vector<const OrtCustomOp*> ops;
  AddOps<FusedBatchNormKernel>(ops, {kFloat, kHalf}, Device::kCpu, false);
  AddOps<MatMulReluKernel>(ops, {kFloat, kHalf, kBFloat}, Device::kCpu, false);
#ifdef DK_HAVE_CUDA
  AddOps<FusedBatchNormKernel>(ops, {kFloat, kHalf}, Device::kCuda, false);
  AddOps<MatMulReluKernel>(ops, {kFloat, kHalf, kBFloat}, Device::kCuda, allow_tf32);
#endif
  return ops;
}

// Op objects and domains must outlive every session that uses them, so they are never freed
// (freeing them at unload could race ORT's own teardown).
const std::vector<const OrtCustomOp*>& Ops(bool allow_tf32) {
  static const auto without_tf32 = MakeOps(false);
  static const auto with_tf32 = MakeOps(true);
  return allow_tf32 ? with_tf32 : without_tf32;
}

std::mutex domains_mutex;
std::vector<Ort::CustomOpDomain>& Domains() {
  static auto* domains = new std::vector<Ort::CustomOpDomain>();
  return *domains;
}

void Register(OrtSessionOptions* options) {
  Ort::UnownedSessionOptions session_options(options);
  const bool allow_tf32 = session_options.GetConfigEntryOrDefault(kAllowTf32Key, "0") == "1";
  Ort::CustomOpDomain domain(kDomain);
  for (const OrtCustomOp* op : Ops(allow_tf32)) domain.Add(op);
  session_options.Add(domain);
  std::lock_guard<std::mutex> lock(domains_mutex);
  Domains().push_back(std::move(domain));
}

}  // namespace
}  // namespace dk_ort

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const std::string message = std::string("libdeploykit_ort.so needs ONNX Runtime with C API version ") +
                                std::to_string(ORT_API_VERSION) + " or newer; this process has ONNX Runtime " +
                                api_base->GetVersionString();
    const OrtApi* oldest = api_base->GetApi(1);
    return oldest ? oldest->CreateStatus(ORT_FAIL, message.c_str()) : nullptr;
  }
  Ort::InitApi(api);
  return dk_ort::Guard([&] { dk_ort::Register(options); });
}
