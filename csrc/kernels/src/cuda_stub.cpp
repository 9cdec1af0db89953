// CUDA entry points of a build without CUDA: each reports DK_NOT_COMPILED.
#include "deploykit/kernels.h"

extern "C" {

dk_status dk_fused_batch_norm_cuda(dk_dtype, const void*, const void*, const void*, void*, int64_t,
                                   int64_t, int64_t, dk_activation, void*) {
  return DK_NOT_COMPILED;
}

dk_status dk_matmul_relu_cuda(dk_dtype, const void*, const void*, const void*, void*, int64_t,
                              int64_t, int64_t, int, void*, size_t, void*) {
  return DK_NOT_COMPILED;
}

size_t dk_matmul_relu_cuda_workspace_bytes(void) { return 0; }

size_t dk_batch_norm_workspace_bytes(dk_dtype, int64_t, int64_t, int64_t) { return 0; }

dk_status dk_batch_norm_train_forward_cuda(dk_dtype, const void*, const void*, const void*, void*,
                                           void*, double, double, void*, void*, void*, void*,
                                           size_t, int64_t, int64_t, int64_t, void*) {
  return DK_NOT_COMPILED;
}

dk_status dk_batch_norm_eval_forward_cuda(dk_dtype, const void*, const void*, const void*,
                                          const void*, const void*, double, void*, int, void*,
                                          size_t, int64_t, int64_t, int64_t, void*) {
  return DK_NOT_COMPILED;
}

dk_status dk_batch_norm_backward_cuda(dk_dtype, const void*, const void*, const void*,
                                      const void*, const void*, void*, void*, void*, void*, size_t,
                                      int64_t, int64_t, int64_t, int, void*) {
  return DK_NOT_COMPILED;
}

int dk_matmul_relu_cuda_last_path(void) { return -1; }

int dk_cublaslt_available(void) { return 0; }

void dk_matmul_relu_cuda_force_fallback(int) {}

}  // extern "C"
