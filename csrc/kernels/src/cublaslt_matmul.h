// The cuBLASLt path of the CUDA MatMulRelu (cublaslt_matmul.cpp). cuBLASLt is not linked: it is
// loaded with dlopen on first use, so the library works (with the fallback kernel) without it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "deploykit/kernels.h"

namespace dk {
namespace cuda {

enum class LtResult {
  kDone,         // cuBLASLt ran the product
  kUnavailable,  // cuBLASLt not loaded, disabled, or this build has no cuBLASLt headers
  kRejected,     // cuBLASLt has no algorithm for this problem or refused it: use the fallback
  kCudaError,    // a CUDA runtime call failed (no device, ...)
};

// y = relu(a @ b + bias), row-major, on `stream`.
LtResult lt_matmul_relu(dk_dtype dtype, const void* a, const void* b, const void* bias, void* y,
                        int64_t m, int64_t k, int64_t n, bool allow_tf32, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);

bool lt_available();          // loads cuBLASLt on first call
void set_force_fallback(bool force);
bool force_fallback();

}  // namespace cuda
}  // namespace dk
