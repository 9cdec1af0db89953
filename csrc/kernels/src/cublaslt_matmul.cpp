// cuBLASLt path of the CUDA MatMulRelu.
//
// Row-major y (m x n) is, read column-major, y^T (n x m); y^T = b^T a^T, and row-major b (k x n)
// and a (m x k) are, read column-major, exactly b^T (n x k, ld n) and a^T (k x m, ld k). So we
// ask cuBLASLt for D = A' B' (+ C) with A' = b, B' = a, D = y and no transposes, and epilogue
// RELU: D = relu(alpha A' B' + beta C), one rounding to the output type.
//
// Bias. In column-major D (n x m) the op's bias[n] is one value per ROW, broadcast along the m
// columns; cuBLASLt's epilogue bias vector is per row of D too, so RELU_BIAS would fit. But
// measured on an H200 (cuBLASLt 13), some bf16 kernels round the fp32 accumulator to bf16 before
// adding that bias (errors of an ulp of |a @ b| where the result is much smaller), which breaks
// the op's "accumulate in fp32, round once". So the bias goes in as C instead: a column-major
// n x m matrix with leading dimension 0 (every column is the bias vector), beta = 1; C is
// combined in the fp32 scale type before the epilogue. If cuBLASLt rejects that layout, fp32
// (where the output type is the compute type) uses the RELU_BIAS epilogue (bias 16-byte aligned
// only: the heuristic's alignment preferences do not cover the bias pointer); fp16/bf16 use the
// fallback kernel.
//
// cuBLASLt is loaded lazily: $DEPLOYKIT_CUBLASLT_LIB, then libcublasLt.so.13, then
// libcublasLt.so; DEPLOYKIT_DISABLE_CUBLASLT=1 disables it. Only cublasLt.h's types and enums are
// used at compile time; every function is called through a dlsym'd pointer.
#include "cublaslt_matmul.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(DK_HAVE_CUBLASLT) && !defined(_WIN32)
#include <cublasLt.h>
#include <dlfcn.h>

#include <unordered_map>
#endif

namespace dk {
namespace cuda {

namespace {
std::atomic<bool> g_force_fallback{false};
}

void set_force_fallback(bool force) { g_force_fallback.store(force); }
bool force_fallback() { return g_force_fallback.load(); }

#if defined(DK_HAVE_CUBLASLT) && !defined(_WIN32)

namespace {

struct LtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0 && std::strcmp(v, "false") != 0 &&
         std::strcmp(v, "no") != 0 && std::strcmp(v, "off") != 0;
}

template <typename F>
bool resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

const LtApi* load_api() {
  static LtApi api;
  static const LtApi* result = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    if (env_flag("DEPLOYKIT_DISABLE_CUBLASLT")) return;
    void* lib = nullptr;
    const char* explicit_path = std::getenv("DEPLOYKIT_CUBLASLT_LIB");
    if (explicit_path && *explicit_path) lib = dlopen(explicit_path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    // Never dlclosed: handles and algorithms stay valid for the life of the process.
    const bool ok = resolve(lib, "cublasLtCreate", &api.create) &&
                    resolve(lib, "cublasLtMatmulDescCreate", &api.desc_create) &&
                    resolve(lib, "cublasLtMatmulDescDestroy", &api.desc_destroy) &&
                    resolve(lib, "cublasLtMatmulDescSetAttribute", &api.desc_set) &&
                    resolve(lib, "cublasLtMatrixLayoutCreate", &api.layout_create) &&
                    resolve(lib, "cublasLtMatrixLayoutDestroy", &api.layout_destroy) &&
                    resolve(lib, "cublasLtMatmulPreferenceCreate", &api.pref_create) &&
                    resolve(lib, "cublasLtMatmulPreferenceDestroy", &api.pref_destroy) &&
                    resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &api.pref_set) &&
                    resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &api.heuristic) &&
                    resolve(lib, "cublasLtMatmul", &api.matmul);
    if (ok) result = &api;
  });
  return result;
}

// One handle per (thread, device), created on first use and kept for the thread's life
// (deliberately never destroyed: destroying at thread or process exit can race CUDA teardown).
cublasLtHandle_t handle_for(const LtApi& api, int device) {
  thread_local std::unordered_map<int, cublasLtHandle_t> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  if (api.create(&h) != CUBLAS_STATUS_SUCCESS) return nullptr;
  handles.emplace(device, h);
  return h;
}

// Largest power of two dividing the address, capped at 256 (cuBLASLt's default requirement).
uint32_t alignment_of(const void* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a >>= 1;
  return a;
}

enum class BiasMode { kNone = 0, kMatrixC = 1, kEpilogue = 2 };

// Heuristic results per problem, per thread (the heuristic call costs far more than a small
// product). Everything the heuristic depends on is in the key.
struct AlgoKey {
  int device;
  int dtype;
  int tf32;
  int bias_mode;
  int64_t m, k, n;
  uint32_t align_a, align_b, align_c, align_d, align_bias, unused;
  size_t workspace;
  bool operator==(const AlgoKey& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};
static_assert(sizeof(AlgoKey) == 72, "AlgoKey must have no padding (compared with memcmp)");
struct AlgoKeyHash {
  size_t operator()(const AlgoKey& key) const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&key);
    size_t h = 1469598103934665603ull;  // FNV-1a
    for (size_t i = 0; i < sizeof key; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};
struct AlgoEntry {
  bool found;
  bool timed;  // false: the heuristic's first choice, picked while the stream was capturing
  cublasLtMatmulAlgo_t algo;
};

// Tactic selection (like TensorRT's): on first use of a problem the heuristic proposes up to
// kCandidates algorithms (tile shapes, split-K, stream-K, ...) and each is timed on the caller's
// stream with CUDA events; the fastest is kept for the life of the thread. The heuristic's own
// first choice often leaves most SMs idle on thin products (m = 32 or 256 with n, k = 1024 to
// 4096), where a split of k fills the GPU.
// Small products are not timed: at a few microseconds, back-to-back calls on the same (L2-warm)
// inputs ranked the candidates wrongly (measured on the H200: 32x1024x1024 bf16 went from 4.7
// to 6.5 us with a tuned algorithm in the rotating-input benchmark). A candidate must also beat
// the heuristic's first choice by kMargin to replace it.
constexpr int kCandidates = 32;
constexpr int kTimedRounds = 3;  // the first one is a warm-up
constexpr double kMinTunedFlops = 1e9;
constexpr float kMargin = 0.9f;

// Split-K reductions may only add partial sums in the compute type (fp32): the INPLACE and
// OUTPUT_TYPE schemes add them in the output type (fp16/bf16), which breaks "accumulates in fp32"
// and loses accuracy. (Unsplit algorithms, scheme NONE, are always allowed.)
const uint32_t kReductionSchemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;

// RAII holders so every exit path frees the descriptors.
struct Desc {
  const LtApi& api;
  cublasLtMatmulDesc_t d = nullptr;
  ~Desc() { if (d) api.desc_destroy(d); }
};
struct Layout {
  const LtApi& api;
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() { if (l) api.layout_destroy(l); }
};
struct Pref {
  const LtApi& api;
  cublasLtMatmulPreference_t p = nullptr;
  ~Pref() { if (p) api.pref_destroy(p); }
};

}  // namespace

bool lt_available() { return load_api() != nullptr; }

namespace {

struct Problem {
  dk_dtype dtype;
  const void* a;
  const void* b;
  const void* bias;
  void* y;
  int64_t m, k, n;
  bool tf32;
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
};

// Index of the fastest of `count` candidates for this problem, timed with CUDA events on the
// caller's stream (it writes y, which the real call then overwrites); 0 (the heuristic's first
// choice) if timing fails. A candidate that cuBLASLt refuses at run time is skipped.
int fastest(const LtApi& api, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
            cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc,
            cublasLtMatrixLayout_t ld, const void* c, bool bias_as_c,
            const cublasLtMatmulHeuristicResult_t* results, int count, const Problem& p) {
  const float alpha = 1.0f, beta = bias_as_c ? 1.0f : 0.0f;
  // Enough calls per measurement that launch jitter stays small against the product.
  const double flops = 2.0 * static_cast<double>(p.m) * static_cast<double>(p.k) *
                       static_cast<double>(p.n);
  const int calls = flops < 2e10 ? 3 : 1;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess) return 0;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return 0;
  }
  float total[kCandidates] = {};
  bool usable[kCandidates];
  for (int i = 0; i < count; ++i) usable[i] = true;
  bool ok = true;
  for (int round = 0; round < kTimedRounds && ok; ++round) {
    for (int i = 0; i < count && ok; ++i) {
      if (!usable[i]) continue;
      ok = cudaEventRecord(start, p.stream) == cudaSuccess;
      for (int j = 0; j < calls && ok && usable[i]; ++j)
        usable[i] = api.matmul(handle, desc, &alpha, p.b, la, p.a, lb, &beta, c, lc, p.y, ld,
                               &results[i].algo, p.workspace, p.workspace_bytes,
                               p.stream) == CUBLAS_STATUS_SUCCESS;
      float ms = 0.0f;
      ok = ok && cudaEventRecord(stop, p.stream) == cudaSuccess &&
           cudaEventSynchronize(stop) == cudaSuccess &&
           cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
      if (round > 0) total[i] += ms;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!ok) return 0;
  int best = -1;
  for (int i = 1; i < count; ++i)
    if (usable[i] && (best < 0 || total[i] < total[best])) best = i;
  if (best < 0 || (usable[0] && total[best] > kMargin * total[0])) return 0;
  return best;
}

// One cuBLASLt attempt with the bias supplied as `mode` says.
LtResult run(const LtApi& api, cublasLtHandle_t handle, int device, const Problem& p,
             BiasMode mode) {
  cudaDataType_t io_type = CUDA_R_32F;
  if (p.dtype == DK_FLOAT16) io_type = CUDA_R_16F;
  if (p.dtype == DK_BFLOAT16) io_type = CUDA_R_16BF;
  const cublasComputeType_t compute =
      (p.dtype == DK_FLOAT32 && p.tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

  Desc desc{api};
  if (api.desc_create(&desc.d, compute, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
    return LtResult::kRejected;
  const cublasOperation_t no_trans = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue =
      mode == BiasMode::kEpilogue ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
  if (api.desc_set(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &no_trans, sizeof no_trans) ||
      api.desc_set(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof no_trans) ||
      api.desc_set(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue))
    return LtResult::kRejected;
  if (mode == BiasMode::kEpilogue &&
      api.desc_set(desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias))
    return LtResult::kRejected;

  // Column-major views (top of this file): A' = b (n x k), B' = a (k x m), D = y (n x m), and
  // C = D (not read, beta = 0) or the bias broadcast along columns (ld 0, beta = 1).
  const uint64_t m = static_cast<uint64_t>(p.m), k = static_cast<uint64_t>(p.k),
                 n = static_cast<uint64_t>(p.n);
  Layout la{api}, lb{api}, ld{api}, lc{api};
  if (api.layout_create(&la.l, io_type, n, k, p.n) ||
      api.layout_create(&lb.l, io_type, k, m, p.k) ||
      api.layout_create(&ld.l, io_type, n, m, p.n))
    return LtResult::kRejected;
  const bool bias_as_c = mode == BiasMode::kMatrixC;
  if (bias_as_c && api.layout_create(&lc.l, io_type, n, m, 0)) return LtResult::kRejected;
  const void* c = bias_as_c ? p.bias : p.y;
  cublasLtMatrixLayout_t c_layout = bias_as_c ? lc.l : ld.l;

  const AlgoKey key{device,
                    static_cast<int>(p.dtype),
                    compute == CUBLAS_COMPUTE_32F_FAST_TF32,
                    static_cast<int>(mode),
                    p.m,
                    p.k,
                    p.n,
                    alignment_of(p.b),
                    alignment_of(p.a),
                    alignment_of(c),
                    alignment_of(p.y),
                    mode == BiasMode::kEpilogue ? alignment_of(p.bias) : 0u,
                    0u,
                    p.workspace_bytes};
  thread_local std::unordered_map<AlgoKey, AlgoEntry, AlgoKeyHash> algos;
  auto it = algos.find(key);
  if (it == algos.end() || !it->second.timed) {
    Pref pref{api};
    if (api.pref_create(&pref.p) != CUBLAS_STATUS_SUCCESS) return LtResult::kRejected;
    const uint64_t ws = p.workspace_bytes;
    if (api.pref_set(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ||
        api.pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a,
                     sizeof key.align_a) ||
        api.pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b,
                     sizeof key.align_b) ||
        api.pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c,
                     sizeof key.align_c) ||
        api.pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d,
                     sizeof key.align_d) ||
        api.pref_set(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &kReductionSchemes,
                     sizeof kReductionSchemes))
      return LtResult::kRejected;
    cublasLtMatmulHeuristicResult_t results[kCandidates];
    std::memset(results, 0, sizeof results);
    int count = 0;
    const cublasStatus_t hs = api.heuristic(handle, desc.d, la.l, lb.l, c_layout, ld.l, pref.p,
                                            kCandidates, results, &count);
    if (hs != CUBLAS_STATUS_SUCCESS) count = 0;
    int valid = 0;  // keep the usable results, in the heuristic's order
    for (int i = 0; i < count; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS) results[valid++] = results[i];
    // Never time while a graph is being captured (nothing would run); use the first choice and
    // time at the next call outside a capture.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusActive;
    const bool capturing = cudaStreamIsCapturing(p.stream, &capture) != cudaSuccess ||
                           capture != cudaStreamCaptureStatusNone;
    AlgoEntry entry{};
    entry.found = valid > 0;
    entry.timed = !capturing;
    if (entry.found) {
      const double flops = 2.0 * static_cast<double>(p.m) * static_cast<double>(p.k) *
                           static_cast<double>(p.n);
      const int best = capturing || valid == 1 || flops < kMinTunedFlops
                           ? 0
                           : fastest(api, handle, desc.d, la.l, lb.l, c_layout, ld.l, c,
                                     bias_as_c, results, valid, p);
      entry.algo = results[best].algo;
    }
    if (algos.size() >= 1024) algos.clear();  // bound the cache
    it = algos.insert_or_assign(key, entry).first;
  }
  if (!it->second.found) return LtResult::kRejected;

  const float alpha = 1.0f, beta = bias_as_c ? 1.0f : 0.0f;  // beta = 0: C (= y) is not read
  const cublasStatus_t st = api.matmul(handle, desc.d, &alpha, p.b, la.l, p.a, lb.l, &beta, c,
                                       c_layout, p.y, ld.l, &it->second.algo, p.workspace,
                                       p.workspace_bytes, p.stream);
  return st == CUBLAS_STATUS_SUCCESS ? LtResult::kDone : LtResult::kRejected;
}

}  // namespace

LtResult lt_matmul_relu(dk_dtype dtype, const void* a, const void* b, const void* bias, void* y,
                        int64_t m, int64_t k, int64_t n, bool allow_tf32, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  if (force_fallback()) return LtResult::kUnavailable;
  const LtApi* api = load_api();
  if (!api) return LtResult::kUnavailable;
  if (k == 0) return LtResult::kRejected;  // an empty reduction: the fallback writes relu(bias)

  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return LtResult::kCudaError;
  cublasLtHandle_t handle = handle_for(*api, device);
  if (!handle) return LtResult::kRejected;

  // cuBLASLt wants a 256-byte aligned workspace: round the caller's pointer up.
  if (!workspace) workspace_bytes = 0;
  if (workspace_bytes > 0) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(workspace);
    const uintptr_t aligned = (p + 255) & ~static_cast<uintptr_t>(255);
    const size_t lost = static_cast<size_t>(aligned - p);
    workspace_bytes = workspace_bytes > lost ? workspace_bytes - lost : 0;
    workspace = workspace_bytes > 0 ? reinterpret_cast<void*>(aligned) : nullptr;
  }
  const Problem problem{dtype, a, b, bias, y, m, k, n, allow_tf32, workspace, workspace_bytes,
                        stream};
  if (!bias) return run(*api, handle, device, problem, BiasMode::kNone);
  const LtResult r = run(*api, handle, device, problem, BiasMode::kMatrixC);
  if (r != LtResult::kRejected || dtype != DK_FLOAT32 || alignment_of(bias) < 16) return r;
  return run(*api, handle, device, problem, BiasMode::kEpilogue);
}

#else  // no cuBLASLt headers at build time (or Windows): always the fallback kernel

bool lt_available() { return false; }

LtResult lt_matmul_relu(dk_dtype, const void*, const void*, const void*, void*, int64_t, int64_t,
                        int64_t, bool, void*, size_t, cudaStream_t) {
  return LtResult::kUnavailable;
}

#endif

}  // namespace cuda
}  // namespace dk
