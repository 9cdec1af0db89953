// Argument checks shared by the CPU and CUDA entry points.
#pragma once

#include <cstddef>
#include <cstdint>

#include "deploykit/kernels.h"

namespace dk {

inline bool valid_dtype(dk_dtype dtype) {
  return dtype == DK_FLOAT32 || dtype == DK_FLOAT16 || dtype == DK_BFLOAT16;
}

inline size_t dtype_size(dk_dtype dtype) { return dtype == DK_FLOAT32 ? 4 : 2; }

// a * b * c without signed overflow; false if any is negative or the product exceeds INT64_MAX.
inline bool checked_volume(int64_t a, int64_t b, int64_t c, int64_t* out) {
  if (a < 0 || b < 0 || c < 0) return false;
  int64_t ab = 0, abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) return false;
  *out = abc;
  return true;
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// True when [x, x + bytes) and [y, y + bytes) overlap without being the same range. Elementwise
// kernels allow x == y (in place) but not a shifted overlap.
inline bool partial_overlap(const void* x, const void* y, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(x), b = reinterpret_cast<uintptr_t>(y);
  if (a == b) return false;
  return a < b ? b - a < bytes : a - b < bytes;
}

// Checks common to both FusedBatchNorm entry points; sets *total to batch * channels * spatial.
inline dk_status check_batch_norm_args(dk_dtype dtype, const void* x, const void* scale,
                                       const void* bias, const void* y, int64_t batch,
                                       int64_t channels, int64_t spatial,
                                       dk_activation activation, int64_t* total) {
  if (!valid_dtype(dtype)) return DK_INVALID_ARGUMENT;
  if (activation != DK_ACTIVATION_NONE && activation != DK_ACTIVATION_RELU)
    return DK_INVALID_ARGUMENT;
  if (!checked_volume(batch, channels, spatial, total)) return DK_INVALID_ARGUMENT;
  if (*total == 0) return DK_OK;
  const size_t es = dtype_size(dtype);
  if (!x || !scale || !bias || !y) return DK_INVALID_ARGUMENT;
  if (!aligned_to(x, es) || !aligned_to(y, es) || !aligned_to(scale, es) || !aligned_to(bias, es))
    return DK_INVALID_ARGUMENT;
  if (static_cast<uint64_t>(*total) > SIZE_MAX / es) return DK_INVALID_ARGUMENT;
  if (partial_overlap(x, y, static_cast<size_t>(*total) * es)) return DK_INVALID_ARGUMENT;
  return DK_OK;
}

// Checks common to both MatMulRelu entry points.
inline dk_status check_matmul_args(dk_dtype dtype, const void* a, const void* b, const void* bias,
                                   const void* y, int64_t m, int64_t k, int64_t n) {
  if (!valid_dtype(dtype)) return DK_INVALID_ARGUMENT;
  int64_t mk = 0, kn = 0, mn = 0;
  if (!checked_volume(m, k, 1, &mk) || !checked_volume(k, n, 1, &kn) ||
      !checked_volume(m, n, 1, &mn))
    return DK_INVALID_ARGUMENT;
  const size_t es = dtype_size(dtype);
  if (mn == 0) return DK_OK;  // nothing to write
  if (!y || !aligned_to(y, es)) return DK_INVALID_ARGUMENT;
  if (mk > 0 && (!a || !aligned_to(a, es))) return DK_INVALID_ARGUMENT;
  if (kn > 0 && (!b || !aligned_to(b, es))) return DK_INVALID_ARGUMENT;
  if (bias && !aligned_to(bias, es)) return DK_INVALID_ARGUMENT;
  return DK_OK;
}

}  // namespace dk
