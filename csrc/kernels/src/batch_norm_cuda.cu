// FusedBatchNorm on the GPU: y[n, c, s] = act(x[n, c, s] * scale[c] + bias[c]), fp32 math.
//
// x and y are contiguous, so this is the per-channel elementwise map of cuda_common.cuh
// (channel_map_kernel: 16-byte vectors, several loads in flight per thread, streaming stores,
// any row length and misalignment) with the folded scale and bias as its per-channel parameters.
// The BatchNorm eval forward of deploykit.ops.batch_norm runs this same kernel.
#include <cstdint>

#include "common.h"
#include "cuda_common.cuh"
#include "deploykit/kernels.h"

namespace dk {
namespace cuda {
namespace {

// act(x * scale[c] + bias[c]) with scale and bias in the storage type.
template <typename T, bool kRelu>
struct FoldOp {
  static constexpr bool kBinary = false;
  const T* scale;
  const T* bias;
  struct P {
    float s, b;
  };
  __device__ __forceinline__ P get(int64_t c) const {
    return P{Io<T>::load(__ldg(scale + c)), Io<T>::load(__ldg(bias + c))};
  }
  __device__ __forceinline__ float apply(const P& p, float x, float) const {
    const float v = fmaf(x, p.s, p.b);
    return kRelu ? relu(v) : v;
  }
};

template <typename T>
dk_status launch(const void* xv, const void* scalev, const void* biasv, void* yv, int64_t total,
                 int64_t channels, int64_t spatial, bool relu_act, cudaStream_t stream) {
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const T* scale = static_cast<const T*>(scalev);
  const T* bias = static_cast<const T*>(biasv);
  const bool ok =
      relu_act ? channel_map<T>(x, nullptr, y, total, channels, spatial,
                                FoldOp<T, true>{scale, bias}, stream)
               : channel_map<T>(x, nullptr, y, total, channels, spatial,
                                FoldOp<T, false>{scale, bias}, stream);
  return ok ? DK_OK : DK_CUDA_ERROR;
}

}  // namespace
}  // namespace cuda
}  // namespace dk

extern "C" dk_status dk_fused_batch_norm_cuda(dk_dtype dtype, const void* x, const void* scale,
                                              const void* bias, void* y, int64_t batch,
                                              int64_t channels, int64_t spatial,
                                              dk_activation activation, void* stream) {
  int64_t total = 0;
  const dk_status st = dk::check_batch_norm_args(dtype, x, scale, bias, y, batch, channels,
                                                 spatial, activation, &total);
  if (st != DK_OK || total == 0) return st;
  const bool relu_act = activation == DK_ACTIVATION_RELU;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  using namespace dk::cuda;
  return with_storage_type(dtype, [&](auto storage) {
    return launch<decltype(storage)>(x, scale, bias, y, total, channels, spatial, relu_act, s);
  });
}
