#include "deploykit/kernels.h"

extern "C" const char* dk_status_string(dk_status status) {
  switch (status) {
    case DK_OK:
      return "ok";
    case DK_INVALID_ARGUMENT:
      return "invalid argument (bad shape, null or misaligned pointer, overlapping buffers, "
             "unsupported dtype or activation)";
    case DK_CUDA_ERROR:
      return "a CUDA runtime call or kernel launch failed (no GPU or driver, bad pointer or "
             "stream, or an earlier asynchronous error)";
    case DK_CUBLAS_ERROR:
      return "a cuBLASLt call failed";
    case DK_NOT_COMPILED:
      return "this deploykit kernels build has no CUDA support";
  }
  return "unknown deploykit status";
}
