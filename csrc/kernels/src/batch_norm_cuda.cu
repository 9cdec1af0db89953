// FusedBatchNorm on the GPU: y[n, c, s] = act(x[n, c, s] * scale[c] + bias[c]), fp32 math.
//
// x and y are contiguous, so the kernel walks the whole tensor as one flat array with a
// grid-stride loop: 16-byte vector loads/stores over the aligned middle, scalar elements for the
// unaligned head and the tail. Each vector recomputes its channel once (two integer divisions)
// and steps it lane by lane, so rows of any length (1, odd, unaligned) are handled by the same
// code. When x and y are misaligned differently (mod 16 bytes) everything is scalar.
// Index math is 32-bit (with multiply-shift division) whenever the tensor has < 2^31 elements.
#include <cstdint>

#include "common.h"
#include "cuda_common.cuh"
#include "deploykit/kernels.h"

namespace dk {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// n / d for a divisor fixed at launch. 32-bit indices (all below 2^31) use a multiply-high and a
// shift instead of the ~20-instruction integer division: with s = ceil(log2 d) and
// m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(n, m) + n) >> s, and the sum cannot
// overflow since n < 2^31.
template <typename Index>
struct Divider;

template <>
struct Divider<uint32_t> {
  uint32_t d, m, s;
  explicit Divider(uint32_t divisor) : d(divisor), m(0), s(0) {
    while ((uint64_t{1} << s) < d) ++s;
    m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
};

template <>
struct Divider<uint64_t> {
  uint64_t d;
  explicit Divider(uint64_t divisor) : d(divisor) {}
  __device__ __forceinline__ uint64_t div(uint64_t n) const { return n / d; }
};

template <typename T, typename Index, bool kRelu>
__global__ void __launch_bounds__(kThreads)
    batch_norm_kernel(const T* x, const T* __restrict__ scale, const T* __restrict__ bias, T* y,
                      Index total, Divider<Index> spatial, Divider<Index> channels, Index head,
                      Index nvec) {
  constexpr int kVec = 16 / sizeof(T);
  const Index vec_end = head + nvec * kVec;   // first element of the scalar tail
  const Index items = nvec + (total - nvec * kVec);  // vectors, then scalar elements
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  for (Index t = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; t < items; t += stride) {
    if (t < nvec) {
      const Index e = head + t * kVec;
      const Index q = spatial.div(e);
      Index pos = e - q * spatial.d;
      Index c = q - channels.div(q) * channels.d;
      float s = Cvt<T>::load(scale[c]), b = Cvt<T>::load(bias[c]);
      // x and y may alias exactly: all of this vector is read before any of it is written.
      const uint4 in = *reinterpret_cast<const uint4*>(x + e);
      const T* vin = reinterpret_cast<const T*>(&in);
      uint4 out;
      T* vout = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int l = 0; l < kVec; ++l) {
        float v = Cvt<T>::load(vin[l]) * s + b;
        if (kRelu) v = relu(v);
        vout[l] = Cvt<T>::store(v);
        if (l + 1 < kVec && ++pos == spatial.d) {
          pos = 0;
          if (++c == channels.d) c = 0;
          s = Cvt<T>::load(scale[c]);
          b = Cvt<T>::load(bias[c]);
        }
      }
      *reinterpret_cast<uint4*>(y + e) = out;
    } else {
      const Index r = t - nvec;
      const Index e = r < head ? r : vec_end + (r - head);
      const Index q = spatial.div(e);
      const Index c = q - channels.div(q) * channels.d;
      float v = Cvt<T>::load(x[e]) * Cvt<T>::load(scale[c]) + Cvt<T>::load(bias[c]);
      if (kRelu) v = relu(v);
      y[e] = Cvt<T>::store(v);
    }
  }
}

template <typename T, typename Index>
dk_status launch_typed(const void* xv, const void* scalev, const void* biasv, void* yv,
                       int64_t total, int64_t channels, int64_t spatial, bool relu_act,
                       cudaStream_t stream) {
  constexpr int64_t kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const uintptr_t mis_x = reinterpret_cast<uintptr_t>(x) % 16;
  const uintptr_t mis_y = reinterpret_cast<uintptr_t>(y) % 16;
  int64_t head = total, nvec = 0;
  if (mis_x == mis_y) {
    head = mis_x == 0 ? 0 : static_cast<int64_t>((16 - mis_x) / sizeof(T));
    if (head > total) head = total;
    nvec = (total - head) / kVec;
  }
  const int64_t items = nvec + (total - nvec * kVec);

  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return DK_CUDA_ERROR;
  const int64_t max_blocks = static_cast<int64_t>(sms > 0 ? sms : 1) * 8;
  int64_t blocks = (items + kThreads - 1) / kThreads;
  if (blocks > max_blocks) blocks = max_blocks;

  const Divider<Index> spatial_div(static_cast<Index>(spatial));
  const Divider<Index> channels_div(static_cast<Index>(channels));
  (void)cudaGetLastError();  // clear a stale error of this runtime so the check below is ours
  const T* scale = static_cast<const T*>(scalev);
  const T* bias = static_cast<const T*>(biasv);
  if (relu_act)
    batch_norm_kernel<T, Index, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, scale, bias, y, static_cast<Index>(total), spatial_div, channels_div,
        static_cast<Index>(head), static_cast<Index>(nvec));
  else
    batch_norm_kernel<T, Index, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, scale, bias, y, static_cast<Index>(total), spatial_div, channels_div,
        static_cast<Index>(head), static_cast<Index>(nvec));
  return cudaGetLastError() == cudaSuccess ? DK_OK : DK_CUDA_ERROR;
}

template <typename T>
dk_status launch(const void* x, const void* scale, const void* bias, void* y, int64_t total,
                 int64_t channels, int64_t spatial, bool relu_act, cudaStream_t stream) {
  // 32-bit indices whenever they cannot overflow (index + grid stride stays below 2^32).
  if (total < (int64_t{1} << 31))
    return launch_typed<T, uint32_t>(x, scale, bias, y, total, channels, spatial, relu_act,
                                     stream);
  return launch_typed<T, uint64_t>(x, scale, bias, y, total, channels, spatial, relu_act, stream);
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
  switch (dtype) {
    case DK_FLOAT32:
      return launch<float>(x, scale, bias, y, total, channels, spatial, relu_act, s);
    case DK_FLOAT16:
      return launch<__half>(x, scale, bias, y, total, channels, spatial, relu_act, s);
    case DK_BFLOAT16:
      return launch<__nv_bfloat16>(x, scale, bias, y, total, channels, spatial, relu_act, s);
  }
  return DK_INVALID_ARGUMENT;
}
