// MatMulRelu on the GPU: cuBLASLt (cublaslt_matmul.cpp) when it is loadable and has an
// algorithm for the problem, else the plain tiled kernel below.
#include <cstdint>

#include "common.h"
#include "cublaslt_matmul.h"
#include "cuda_common.cuh"
#include "deploykit/kernels.h"

namespace dk {
namespace cuda {
namespace {

// Fallback: classic shared-memory tiling. A block computes a kTileM x kTileN tile of y with
// 16 x 16 threads, each owning a 4 x 4 strided set of outputs (rows ty + 16 i, columns
// tx + 16 j, so stores are coalesced and shared-memory reads are conflict-free). Operands are
// widened to fp32 when staged into shared memory; accumulation is fp32, in k order.
constexpr int kTileM = 64, kTileN = 64, kTileK = 16;
constexpr int kThreadsX = 16, kThreadsY = 16, kPerThread = 4;

template <typename T>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    matmul_relu_fallback_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                const T* __restrict__ bias, T* __restrict__ y, int64_t m,
                                int64_t k, int64_t n, int64_t n_tiles) {
  __shared__ float as[kTileK][kTileM + 1];  // a tile, transposed: as[kk][row]
  __shared__ float bs[kTileK][kTileN];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreadsX + tx;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileM;

  for (int64_t tile_n = blockIdx.y; tile_n < n_tiles; tile_n += gridDim.y) {
    const int64_t col0 = tile_n * kTileN;
    float acc[kPerThread][kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) acc[i][j] = 0.0f;

    for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
      // Stage a[row0 .. +64, k0 .. +16] and b[k0 .. +16, col0 .. +64]; zeros outside.
#pragma unroll
      for (int e = tid; e < kTileM * kTileK; e += kThreadsX * kThreadsY) {
        const int r = e / kTileK, kk = e % kTileK;
        const int64_t gr = row0 + r, gk = k0 + kk;
        as[kk][r] = (gr < m && gk < k) ? Io<T>::load(a[gr * k + gk]) : 0.0f;
      }
#pragma unroll
      for (int e = tid; e < kTileK * kTileN; e += kThreadsX * kThreadsY) {
        const int kk = e / kTileN, c = e % kTileN;
        const int64_t gk = k0 + kk, gc = col0 + c;
        bs[kk][c] = (gk < k && gc < n) ? Io<T>::load(b[gk * n + gc]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTileK; ++kk) {
        float av[kPerThread], bv[kPerThread];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) av[i] = as[kk][ty + kThreadsY * i];
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) bv[j] = bs[kk][tx + kThreadsX * j];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i)
#pragma unroll
          for (int j = 0; j < kPerThread; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t gr = row0 + ty + kThreadsY * i;
      if (gr >= m) continue;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int64_t gc = col0 + tx + kThreadsX * j;
        if (gc >= n) continue;
        float v = acc[i][j];
        if (bias) v += Io<T>::load(bias[gc]);
        y[gr * n + gc] = Io<T>::store(relu(v));
      }
    }
  }
}

template <typename T>
dk_status launch_fallback(const void* a, const void* b, const void* bias, void* y, int64_t m,
                          int64_t k, int64_t n, cudaStream_t stream) {
  const int64_t m_tiles = (m + kTileM - 1) / kTileM;
  const int64_t n_tiles = (n + kTileN - 1) / kTileN;
  if (m_tiles > 0x7fffffff) return DK_INVALID_ARGUMENT;
  const dim3 grid(static_cast<unsigned>(m_tiles),
                  static_cast<unsigned>(n_tiles < 65535 ? n_tiles : 65535));
  const dim3 block(kThreadsX, kThreadsY);
  (void)cudaGetLastError();  // clear a stale error of this runtime so the check below is ours
  matmul_relu_fallback_kernel<T><<<grid, block, 0, stream>>>(
      static_cast<const T*>(a), static_cast<const T*>(b), static_cast<const T*>(bias),
      static_cast<T*>(y), m, k, n, n_tiles);
  return cudaGetLastError() == cudaSuccess ? DK_OK : DK_CUDA_ERROR;
}

thread_local int t_last_path = -1;

}  // namespace
}  // namespace cuda
}  // namespace dk

extern "C" dk_status dk_matmul_relu_cuda(dk_dtype dtype, const void* a, const void* b,
                                         const void* bias, void* y, int64_t m, int64_t k,
                                         int64_t n, int allow_tf32, void* workspace,
                                         size_t workspace_bytes, void* stream) {
  const dk_status st = dk::check_matmul_args(dtype, a, b, bias, y, m, k, n);
  if (st != DK_OK || m == 0 || n == 0) return st;
  using namespace dk::cuda;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (lt_matmul_relu(dtype, a, b, bias, y, m, k, n, allow_tf32 != 0, workspace,
                         workspace_bytes, s)) {
    case LtResult::kDone:
      t_last_path = 0;
      return DK_OK;
    case LtResult::kCudaError:
      return DK_CUDA_ERROR;
    case LtResult::kUnavailable:
    case LtResult::kRejected:
      break;
  }
  const dk_status fs = with_storage_type(dtype, [&](auto storage) {
    return launch_fallback<decltype(storage)>(a, b, bias, y, m, k, n, s);
  });
  if (fs == DK_OK) t_last_path = 1;
  return fs;
}

extern "C" size_t dk_matmul_relu_cuda_workspace_bytes(void) {
  return size_t{32} << 20;  // cuBLAS's recommendation for Hopper; ample for older GPUs
}

extern "C" int dk_matmul_relu_cuda_last_path(void) { return dk::cuda::t_last_path; }

extern "C" int dk_cublaslt_available(void) { return dk::cuda::lt_available() ? 1 : 0; }

extern "C" void dk_matmul_relu_cuda_force_fallback(int force) {
  dk::cuda::set_force_fallback(force != 0);
}
