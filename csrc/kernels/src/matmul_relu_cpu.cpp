// MatMulRelu on the CPU: y = max(a @ b + bias, 0), row-major, fp32 accumulation.
// Cache-blocked i-k-j loops over fp32 copies of the operands (fp16/bf16 are widened once:
// b as a whole, a one block of rows at a time); the innermost loop runs over contiguous
// columns of b and of an fp32 accumulator tile, which the compiler vectorises.
#include <algorithm>
#include <cstdint>
#include <new>
#include <vector>

#include "common.h"
#include "deploykit/kernels.h"
#include "half_cpu.h"

namespace dk {
namespace cpu {
namespace {

constexpr int64_t kRowBlock = 32;   // rows of a / y per block
constexpr int64_t kColBlock = 256;  // columns of b / y per block (accumulator row: 1 KiB)
constexpr int64_t kDepthBlock = 256;  // rows of b per block (b tile: 256 KiB, stays in L2)

template <typename T>
DK_CPU_CLONES void widen_into(const typename T::storage* __restrict__ src, float* __restrict__ dst,
                              int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = T::load(src[i]);
}

template <typename T>
const float* widen(const void* src, int64_t count, std::vector<float>* buf) {
  buf->resize(static_cast<size_t>(count));
  widen_into<T>(static_cast<const typename T::storage*>(src), buf->data(), count);
  return buf->data();
}

// acc[i, 0:nj] += sum over kk in [k0, k1) of a[i, kk] * b[kk, 0:nj], rows i in [0, mi).
DK_CPU_CLONES void accumulate(float* __restrict__ acc, const float* __restrict__ a, int64_t lda,
                              const float* __restrict__ b, int64_t ldb, int64_t mi, int64_t nj,
                              int64_t k0, int64_t k1) {
  for (int64_t i = 0; i < mi; ++i) {
    float* __restrict__ acc_row = acc + i * kColBlock;
    const float* a_row = a + i * lda;
    for (int64_t kk = k0; kk < k1; ++kk) {
      const float aik = a_row[kk];
      const float* __restrict__ b_row = b + kk * ldb;
      for (int64_t j = 0; j < nj; ++j) acc_row[j] += aik * b_row[j];
    }
  }
}

template <typename T>
void matmul_relu(const void* av, const void* bv, const void* biasv, void* yv, int64_t m,
                 int64_t k, int64_t n) {
  using S = typename T::storage;
  const bool is_f32 = sizeof(S) == sizeof(float);
  std::vector<float> b_buf, a_buf, bias_buf;
  const float* b32 = nullptr;
  if (k > 0) b32 = is_f32 ? static_cast<const float*>(bv) : widen<T>(bv, k * n, &b_buf);
  const float* bias32 = nullptr;
  if (biasv) bias32 = is_f32 ? static_cast<const float*>(biasv) : widen<T>(biasv, n, &bias_buf);
  S* y = static_cast<S*>(yv);
  std::vector<float> acc(static_cast<size_t>(kRowBlock * kColBlock));

  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const int64_t mi = std::min(kRowBlock, m - i0);
    const float* a32 = nullptr;  // rows i0 .. i0 + mi of a, fp32, row stride k
    if (k > 0) {
      const S* a_rows = static_cast<const S*>(av) + i0 * k;
      a32 = is_f32 ? reinterpret_cast<const float*>(a_rows) : widen<T>(a_rows, mi * k, &a_buf);
    }
    for (int64_t j0 = 0; j0 < n; j0 += kColBlock) {
      const int64_t nj = std::min(kColBlock, n - j0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k0 = 0; k0 < k; k0 += kDepthBlock) {
        accumulate(acc.data(), a32, k, b32 + j0, n, mi, nj, k0, std::min(k, k0 + kDepthBlock));
      }
      for (int64_t i = 0; i < mi; ++i) {
        const float* acc_row = acc.data() + i * kColBlock;
        S* __restrict__ y_row = y + (i0 + i) * n + j0;
        for (int64_t j = 0; j < nj; ++j) {
          float v = acc_row[j];
          if (bias32) v += bias32[j0 + j];
          v = relu(v);
          y_row[j] = T::store(v);
        }
      }
    }
  }
}

}  // namespace
}  // namespace cpu
}  // namespace dk

extern "C" dk_status dk_matmul_relu_cpu(dk_dtype dtype, const void* a, const void* b,
                                        const void* bias, void* y, int64_t m, int64_t k,
                                        int64_t n) {
  const dk_status st = dk::check_matmul_args(dtype, a, b, bias, y, m, k, n);
  if (st != DK_OK || m == 0 || n == 0) return st;
  using namespace dk::cpu;
  try {
    switch (dtype) {
      case DK_FLOAT32:
        matmul_relu<F32>(a, b, bias, y, m, k, n);
        break;
      case DK_FLOAT16:
        matmul_relu<F16>(a, b, bias, y, m, k, n);
        break;
      case DK_BFLOAT16:
        matmul_relu<BF16>(a, b, bias, y, m, k, n);
        break;
    }
  } catch (const std::bad_alloc&) {
    return DK_INVALID_ARGUMENT;  // operands too large to widen to fp32 in memory
  }
  return DK_OK;
}
