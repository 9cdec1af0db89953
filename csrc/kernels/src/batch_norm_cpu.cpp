// FusedBatchNorm on the CPU: y[n, c, s] = act(x[n, c, s] * scale[c] + bias[c]), fp32 math.
#include <cstdint>

#include "common.h"
#include "deploykit/kernels.h"
#include "half_cpu.h"

namespace dk {
namespace cpu {
namespace {

// One (n, c) row of `len` contiguous elements. Two variants so the compiler vectorises both
// without runtime alias checks: separate buffers (restrict) and in place (one pointer).
template <typename T, bool kRelu>
DK_CPU_CLONES void bn_row(const typename T::storage* __restrict__ x, typename T::storage* __restrict__ y,
            int64_t len, float s, float b) {
  for (int64_t i = 0; i < len; ++i) {
    float v = T::load(x[i]) * s + b;
    if (kRelu) v = relu(v);
    y[i] = T::store(v);
  }
}

template <typename T, bool kRelu>
DK_CPU_CLONES void bn_row_inplace(typename T::storage* __restrict__ y, int64_t len, float s, float b) {
  for (int64_t i = 0; i < len; ++i) {
    float v = T::load(y[i]) * s + b;
    if (kRelu) v = relu(v);
    y[i] = T::store(v);
  }
}

template <typename T, bool kRelu>
void bn(const void* xv, const void* scalev, const void* biasv, void* yv, int64_t batch,
        int64_t channels, int64_t spatial) {
  using S = typename T::storage;
  const S* x = static_cast<const S*>(xv);
  const S* scale = static_cast<const S*>(scalev);
  const S* bias = static_cast<const S*>(biasv);
  S* y = static_cast<S*>(yv);
  const bool inplace = static_cast<const void*>(x) == static_cast<void*>(y);
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t off = (n * channels + c) * spatial;
      const float s = T::load(scale[c]), b = T::load(bias[c]);
      if (inplace)
        bn_row_inplace<T, kRelu>(y + off, spatial, s, b);
      else
        bn_row<T, kRelu>(x + off, y + off, spatial, s, b);
    }
  }
}

template <typename T>
void bn_act(const void* x, const void* scale, const void* bias, void* y, int64_t batch,
            int64_t channels, int64_t spatial, dk_activation act) {
  if (act == DK_ACTIVATION_RELU)
    bn<T, true>(x, scale, bias, y, batch, channels, spatial);
  else
    bn<T, false>(x, scale, bias, y, batch, channels, spatial);
}

}  // namespace
}  // namespace cpu
}  // namespace dk

extern "C" dk_status dk_fused_batch_norm_cpu(dk_dtype dtype, const void* x, const void* scale,
                                             const void* bias, void* y, int64_t batch,
                                             int64_t channels, int64_t spatial,
                                             dk_activation activation) {
  int64_t total = 0;
  const dk_status st = dk::check_batch_norm_args(dtype, x, scale, bias, y, batch, channels,
                                                 spatial, activation, &total);
  if (st != DK_OK || total == 0) return st;
  using namespace dk::cpu;
  switch (dtype) {
    case DK_FLOAT32:
      bn_act<F32>(x, scale, bias, y, batch, channels, spatial, activation);
      break;
    case DK_FLOAT16:
      bn_act<F16>(x, scale, bias, y, batch, channels, spatial, activation);
      break;
    case DK_BFLOAT16:
      bn_act<BF16>(x, scale, bias, y, batch, channels, spatial, activation);
      break;
  }
  return DK_OK;
}
