// BatchNorm for training on the GPU (NCHW): batch statistics + normalization, backward, and the
// forward from running statistics. C ABI and contracts: include/deploykit/kernels.h.
//
// Layout. x is (N, C, HW) contiguous. Channel c's values form a "plane" of N rows of HW elements,
// row n starting at element (n * C + c) * HW; a plane index i = n * HW + s names one value.
//
// Training forward, three launches on the caller's stream:
//   1. stats_kernel: one block per (chunk, channel), in one of three modes (pass_mode):
//      kPlaneVectors (rows of >= kRowPathMin elements, 16-byte aligned): a chunk is a range of
//      plane indices read as 16-byte vectors straight across row ends; kSegments (long rows,
//      unaligned): the same with scalar head and tail per row segment; kTiles (rows of at most
//      1 KB, e.g. 7x7 and 14x14, aligned, C a multiple of the vector width): stats_tile_kernel
//      (stats_tile_pair_kernel for 2-byte types), a block per (range of n, group of 64
//      channels) staging contiguous runs in shared memory with cp.async; kShortRows (other
//      short rows): a chunk is a range of rows, each warp reads kRowsPerGroup rows at once,
//      lanes along the rows. Each block writes one partial (count, mean, M2) per channel.
//   2. finalize_train_kernel: one warp per channel merges that channel's partials in double,
//      writes save_mean / save_invstd, updates running_mean / running_var (unbiased variance,
//      like PyTorch) and the per-channel parameters of the last pass.
//   3. channel_map_kernel (cuda_common.cuh): y = (x - mean) * (gamma * invstd) + beta over
//      the flat tensor.
// Eval forward: eval_params_kernel (per-channel parameters), then either the deployed
// FusedBatchNorm kernel on folded scale / bias, or channel_map_kernel on the unfolded form.
// So x is read twice and y written once. Blocks of pass 1 run chunk-major (the last blocks read
// the end of the tensor) and pass 3 walks the tensor backwards, so it starts on data that pass 1
// left in L2.
//
// Numerics. Statistics are taken of x - K, K = x[0, c, 0]: values near K subtract exactly, so
// data with a large mean and a small spread (mean 1e4, std 1e-2) keeps its digits. Each thread
// takes the values of one batch of loads (up to 4 vectors, or one value of each of 8 rows) two
// passes in registers (mean, then sum of squared deviations from it) and folds the batch into
// its (count, mean, M2) triple with Chan's update: Welford's algorithm taken a batch at a time.
// Warps, blocks and chunks merge with the same formula. Nothing forms sum(x^2) - sum(x)^2.
//
// Backward: reduce_backward_kernel or reduce_tile_kernel (per (chunk, channel) sums of dy and
// dy * (x - mean), same traversal as pass 1), finalize_backward_kernel (dgamma, dbeta and the coefficients of dx), and
// the elementwise pass dx = a * dy + b * (x - mean) + d, again walking the tensor backwards.
//
// fp16 / bf16 are loaded to fp32; statistics, weights and running statistics are fp32. float64
// (DK_FLOAT64, for gradcheck) runs the same kernels with double everywhere. No kernel allocates
// or synchronizes: the caller passes a workspace of dk_batch_norm_workspace_bytes() bytes, so a
// whole step can be captured in a CUDA graph.
#include <cstddef>
#include <cstdint>

#include "common.h"
#include "cuda_common.cuh"
#include "deploykit/kernels.h"

namespace dk {
namespace cuda {
namespace bn {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVecUnroll = 4;          // 16-byte loads in flight per thread and input, vector path
constexpr int kRowsPerGroup = 8;       // rows a warp reads at once, short-row path
constexpr int64_t kRowGroup = kWarps * kRowsPerGroup;  // rows a block reads at once
constexpr int64_t kRowPathMin = 1024;  // rows at least this long take the vector path
constexpr int64_t kMaxChunk = int64_t{1} << 22;  // keeps per-block fp32 counts exact
constexpr int kBlocksPerSm = 16;       // stats / reduce grid target: a few waves

// 16-byte vectors a thread of the statistics pass loads at once: 64 bytes for 4- and 8-byte
// types, 128 bytes for 2-byte types (whose per-element work is cheaper).
template <typename T>
__host__ __device__ constexpr int stats_unroll() { return sizeof(T) == 2 ? 8 : 4; }
// Vector-path chunk lengths are multiples of one block-wide batch of loads, so every batch of
// a chunk is full when rows are aligned.
template <typename T>
__host__ __device__ constexpr int64_t chunk_align() {
  return int64_t{kThreads} * stats_unroll<T>() * (16 / sizeof(T));
}

// a / b where b is a positive count: the fast approximate division for float (2 ulp), exact for
// double.
__device__ __forceinline__ float ratio(float a, float b) { return __fdividef(a, b); }
__device__ __forceinline__ double ratio(double a, double b) { return a / b; }

// (count, mean, M2) of a set of values; merge() folds in another set (Chan et al.).
template <typename A>
struct Welford {
  A n, mean, m2;
  __device__ __forceinline__ void merge(A nb, A mean_b, A m2_b) {
    if (!(nb > A(0))) return;
    const A total = n + nb;
    const A f = ratio(nb, total);
    const A d = mean_b - mean;
    mean += d * f;
    m2 += m2_b + d * d * n * f;
    n = total;
  }
};

// Folds the first `count` of v[0..K) into w (count >= 1; entries past it are ignored).
template <int K, typename A>
__device__ __forceinline__ void add_group(Welford<A>& w, const A (&v)[K], int count) {
  A s = A(0);
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (k < count) s += v[k];
  const A m = count == K ? s * (A(1) / A(K)) : ratio(s, A(count));
  A q = A(0);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const A e = v[k] - m;
    if (k < count) q = fma(e, e, q);
  }
  w.merge(A(count), m, q);
}

template <typename A>
__device__ __forceinline__ void warp_merge(Welford<A>& w) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const A nb = __shfl_xor_sync(0xffffffffu, w.n, o);
    const A mb = __shfl_xor_sync(0xffffffffu, w.mean, o);
    const A qb = __shfl_xor_sync(0xffffffffu, w.m2, o);
    w.merge(nb, mb, qb);
  }
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ------------------------------------------------------------------------------ pass 1: stats

// Folds the first `nv` (>= 1) of buf[0..U) (vectors of T, minus shift) into w as one
// batch: mean and M2 two-pass in registers, then one Chan merge.
template <typename T, int U, typename A>
__device__ __forceinline__ void add_vectors(Welford<A>& w, const uint4 (&buf)[U], int nv, A shift) {
  constexpr int kVec = 16 / sizeof(T);
  A part[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const T* e = reinterpret_cast<const T*>(&buf[u]);
    A sum = A(0);
#pragma unroll
    for (int l = 0; l < kVec; ++l) sum += Io<T>::load(e[l]) - shift;
    part[u] = u < nv ? sum : A(0);
  }
  A total = A(0);
#pragma unroll
  for (int u = 0; u < U; ++u) total += part[u];
  const int count = nv * kVec;
  const A m = nv == U ? total * (A(1) / A(U * kVec)) : ratio(total, A(count));
  A q[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const T* e = reinterpret_cast<const T*>(&buf[u]);
    A acc = A(0);
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      const A d = (Io<T>::load(e[l]) - shift) - m;
      acc = fma(d, d, acc);
    }
    q[u] = u < nv ? acc : A(0);
  }
  A m2 = A(0);
#pragma unroll
  for (int u = 0; u < U; ++u) m2 += q[u];
  w.merge(A(count), m, m2);
}

// Welford triple of x[seg[0 .. len)] - shift over the block's threads (per-thread partials).
template <typename T, typename A>
__device__ __forceinline__ void segment_stats(const T* seg, int64_t len, A shift, Welford<A>& w) {
  const VecSplit sp = vec_split(reinterpret_cast<uintptr_t>(seg), len, sizeof(T));
  const int64_t nvec = sp.nvec;
  for (int64_t j = threadIdx.x; j < sp.head + (len - sp.tail); j += kThreads) {
    const int64_t e = j < sp.head ? j : sp.tail + (j - sp.head);
    w.merge(A(1), Io<T>::load(seg[e]) - shift, A(0));
  }
  constexpr int U = stats_unroll<T>();
  const uint4* v = reinterpret_cast<const uint4*>(seg + sp.head);
  for (int64_t j0 = threadIdx.x; j0 < nvec; j0 += kThreads * U) {
    uint4 buf[U];
    int nv = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + static_cast<int64_t>(u) * kThreads;
      buf[u] = j < nvec ? __ldg(v + j) : make_uint4(0, 0, 0, 0);
      nv += j < nvec ? 1 : 0;
    }
    add_vectors<T, U, A>(w, buf, nv, shift);
  }
}

// Block-wide merge; thread 0 gets the result.
template <typename A>
__device__ __forceinline__ Welford<A> block_merge(Welford<A> w) {
  __shared__ A sh[3][kWarps];
  warp_merge(w);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sh[0][warp] = w.n;
    sh[1][warp] = w.mean;
    sh[2][warp] = w.m2;
  }
  __syncthreads();
  Welford<A> r{A(0), A(0), A(0)};
  if (warp == 0) {
    if (lane < kWarps) r = Welford<A>{sh[0][lane], sh[1][lane], sh[2][lane]};
    warp_merge(r);
  }
  return r;
}

// How the statistics and reduction passes walk a channel plane.
enum Mode : int {
  kShortRows = 0,   // chunks of rows; warps read kRowsPerGroup rows at once, lanes along rows
  kSegments = 1,    // chunks of plane indices; 16-byte vectors per row segment, scalar ends
  kPlaneVectors = 2, // rows a multiple of 16 bytes and aligned: 16-byte vectors across rows
  kTiles = 3         // short rows, channel groups staged in shared memory (stats_tile_kernel)
};

// Grid: chunks * C blocks, chunk-major. part: [3][C * chunks] (count, mean of x - K, M2).
// chunk_len counts rows (kShortRows) or plane indices (else). hwv: hw / (16 / sizeof(T)).
// Register caps: 4 blocks per SM (<= 64 registers), 3 for 2-byte types (their 8 vectors in
// flight need more registers than 64 without spilling).
template <typename T, int kMode>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 3 : 4)
    stats_kernel(const T* __restrict__ x, int64_t channels, int64_t hw, int64_t extent,
                 int64_t chunk_len, int64_t chunks, Div32 hwv,
                 typename Io<T>::Acc* __restrict__ part) {
  using A = typename Io<T>::Acc;
  constexpr int kVec = 16 / sizeof(T);
  const int64_t b = blockIdx.x;
  const int64_t k = b / channels, c = b - k * channels;
  const int64_t i0 = k * chunk_len;
  const int64_t i1 = i0 + chunk_len < extent ? i0 + chunk_len : extent;
  const A shift = Io<T>::load(x[c * hw]);
  Welford<A> w{A(0), A(0), A(0)};
  if (kMode == kPlaneVectors) {
    constexpr int U = stats_unroll<T>();
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int64_t nv = static_cast<int64_t>(hwv.d);
    const int64_t v1 = i1 / kVec;
    for (int64_t j0 = i0 / kVec + threadIdx.x; j0 < v1; j0 += kThreads * U) {
      uint4 buf[U];
      int count = 0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + static_cast<int64_t>(u) * kThreads;
        buf[u] = make_uint4(0, 0, 0, 0);
        if (j < v1) {
          const int64_t n = hwv.div(static_cast<uint32_t>(j));
          buf[u] = __ldg(xv + (n * channels + c) * nv + (j - n * nv));
          ++count;
        }
      }
      add_vectors<T, U, A>(w, buf, count, shift);
    }
  } else if (kMode == kSegments) {
    int64_t n = i0 / hw;
    for (int64_t r0 = n * hw; r0 < i1; ++n, r0 += hw) {
      const int64_t s0 = (i0 > r0 ? i0 : r0) - r0;
      const int64_t s1 = (i1 < r0 + hw ? i1 : r0 + hw) - r0;
      segment_stats<T, A>(x + (n * channels + c) * hw + s0, s1 - s0, shift, w);
    }
  } else {
    // Two positions along the rows (s, s + 32) times kRowsPerGroup rows: 16 loads in flight.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int64_t n = i0 + warp; n < i1; n += kRowGroup) {
      const int64_t left = (i1 - n + kWarps - 1) / kWarps;
      const int rows = left < kRowsPerGroup ? static_cast<int>(left) : kRowsPerGroup;
      const T* row[kRowsPerGroup];
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r)
        row[r] = x + ((n + static_cast<int64_t>(r) * kWarps) * channels + c) * hw;
      for (int64_t s = lane; s < hw; s += 64) {
        const bool second = s + 32 < hw;
        A va[kRowsPerGroup], vb[kRowsPerGroup];
#pragma unroll
        for (int r = 0; r < kRowsPerGroup; ++r) {
          va[r] = r < rows ? Io<T>::load(__ldg(row[r] + s)) - shift : A(0);
          vb[r] = r < rows && second ? Io<T>::load(__ldg(row[r] + s + 32)) - shift : A(0);
        }
        add_group<kRowsPerGroup>(w, va, rows);
        if (second) add_group<kRowsPerGroup>(w, vb, rows);
      }
    }
  }
  const Welford<A> r = block_merge(w);
  if (threadIdx.x == 0) {
    const int64_t p = c * chunks + k, parts = channels * chunks;
    part[p] = r.n;
    part[parts + p] = r.mean;
    part[2 * parts + p] = r.m2;
  }
}

// ------------------------------------------------------------------------- pass 2: finalize

// One warp per channel. params: [3][C] = mean, gamma * invstd, beta (for the elementwise pass).
template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_train_kernel(
    const T* __restrict__ x, const typename Io<T>::Acc* __restrict__ part, int64_t channels,
    int64_t hw, int64_t chunks, const typename Io<T>::Acc* __restrict__ weight,
    const typename Io<T>::Acc* __restrict__ bias, typename Io<T>::Acc* running_mean,
    typename Io<T>::Acc* running_var, double momentum, double eps,
    typename Io<T>::Acc* __restrict__ save_mean, typename Io<T>::Acc* __restrict__ save_invstd,
    typename Io<T>::Acc* __restrict__ params) {
  using A = typename Io<T>::Acc;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (c >= channels) return;
  const int64_t parts = channels * chunks;
  Welford<double> w{0.0, 0.0, 0.0};
  for (int64_t k = lane; k < chunks; k += 32) {
    const int64_t p = c * chunks + k;
    w.merge(static_cast<double>(part[p]), static_cast<double>(part[parts + p]),
            static_cast<double>(part[2 * parts + p]));
  }
  warp_merge(w);
  if (lane != 0) return;
  const double mean = static_cast<double>(Io<T>::load(x[c * hw])) + w.mean;
  const double var = w.m2 / w.n;
  const double invstd = 1.0 / sqrt(var + eps);
  save_mean[c] = static_cast<A>(mean);
  save_invstd[c] = static_cast<A>(invstd);
  if (running_mean)
    running_mean[c] = static_cast<A>((1.0 - momentum) * static_cast<double>(running_mean[c]) +
                                     momentum * mean);
  if (running_var)
    running_var[c] = static_cast<A>((1.0 - momentum) * static_cast<double>(running_var[c]) +
                                    momentum * (w.m2 / (w.n - 1.0)));
  const double g = weight ? static_cast<double>(weight[c]) : 1.0;
  params[c] = static_cast<A>(mean);
  params[channels + c] = static_cast<A>(g * invstd);
  params[2 * channels + c] = bias ? bias[c] : A(0);
}

// ----------------------------------------------------------------------- elementwise passes

// y = (x - p[c]) * p[C + c] + p[2C + c].
template <typename A>
struct NormOp {
  static constexpr bool kBinary = false;
  const A* p;
  int64_t channels;
  struct P {
    A m, s, t;
  };
  __device__ __forceinline__ P get(int64_t c) const {
    return P{p[c], p[channels + c], p[2 * channels + c]};
  }
  __device__ __forceinline__ A apply(const P& q, A x, A) const { return fma(x - q.m, q.s, q.t); }
};

// dx = p[C + c] * dy + p[2C + c] * (x - p[c]) + p[3C + c].
template <typename A>
struct GradOp {
  static constexpr bool kBinary = true;
  const A* p;
  int64_t channels;
  struct P {
    A m, a, b, d;
  };
  __device__ __forceinline__ P get(int64_t c) const {
    return P{p[c], p[channels + c], p[2 * channels + c], p[3 * channels + c]};
  }
  __device__ __forceinline__ A apply(const P& q, A dy, A x) const {
    return fma(q.a, dy, fma(q.b, x - q.m, q.d));
  }
};

// --------------------------------------------------------------------------- backward reduce

template <typename T, typename A>
__device__ __forceinline__ void segment_sums(const T* dy, const T* x, int64_t len, A mean,
                                             A& s_dy, A& s_dyx) {
  constexpr int kVec = 16 / sizeof(T);
  const VecSplit sp = vec_split(reinterpret_cast<uintptr_t>(x), len, sizeof(T));
  const int64_t nvec = sp.nvec;
  for (int64_t j = threadIdx.x; j < sp.head + (len - sp.tail); j += kThreads) {
    const int64_t e = j < sp.head ? j : sp.tail + (j - sp.head);
    const A g = Io<T>::load(dy[e]);
    s_dy += g;
    s_dyx = fma(g, Io<T>::load(x[e]) - mean, s_dyx);
  }
  const uint4* vdy = reinterpret_cast<const uint4*>(dy + sp.head);
  const uint4* vx = reinterpret_cast<const uint4*>(x + sp.head);
  for (int64_t j0 = threadIdx.x; j0 < nvec; j0 += kThreads * kVecUnroll) {
    uint4 bg[kVecUnroll], bx[kVecUnroll];
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      const int64_t j = j0 + static_cast<int64_t>(u) * kThreads;
      bg[u] = j < nvec ? __ldg(vdy + j) : make_uint4(0, 0, 0, 0);
      bx[u] = j < nvec ? __ldg(vx + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      if (j0 + static_cast<int64_t>(u) * kThreads < nvec) {
        const T* eg = reinterpret_cast<const T*>(&bg[u]);
        const T* ex = reinterpret_cast<const T*>(&bx[u]);
#pragma unroll
        for (int l = 0; l < kVec; ++l) {
          const A g = Io<T>::load(eg[l]);
          s_dy += g;
          s_dyx = fma(g, Io<T>::load(ex[l]) - mean, s_dyx);
        }
      }
    }
  }
}

// Grid: chunks * C blocks, chunk-major. part: [2][C * chunks] = sum dy, sum dy * (x - mean).
// Same modes as stats_kernel.
template <typename T, int kMode>
__global__ void __launch_bounds__(kThreads)
    reduce_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                           const typename Io<T>::Acc* __restrict__ mean_in, int64_t channels,
                           int64_t hw, int64_t extent, int64_t chunk_len, int64_t chunks,
                           Div32 hwv, typename Io<T>::Acc* __restrict__ part) {
  using A = typename Io<T>::Acc;
  constexpr int kVec = 16 / sizeof(T);
  const int64_t b = blockIdx.x;
  const int64_t k = b / channels, c = b - k * channels;
  const int64_t i0 = k * chunk_len;
  const int64_t i1 = i0 + chunk_len < extent ? i0 + chunk_len : extent;
  const A mean = mean_in[c];
  A s_dy = A(0), s_dyx = A(0);
  if (kMode == kPlaneVectors) {
    const uint4* gv = reinterpret_cast<const uint4*>(dy);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int64_t nv = static_cast<int64_t>(hwv.d);
    const int64_t v1 = i1 / kVec;
    for (int64_t j0 = i0 / kVec + threadIdx.x; j0 < v1; j0 += kThreads * kVecUnroll) {
      uint4 bg[kVecUnroll], bx[kVecUnroll];
#pragma unroll
      for (int u = 0; u < kVecUnroll; ++u) {
        const int64_t j = j0 + static_cast<int64_t>(u) * kThreads;
        bg[u] = bx[u] = make_uint4(0, 0, 0, 0);
        if (j < v1) {
          const int64_t n = hwv.div(static_cast<uint32_t>(j));
          const int64_t off = (n * channels + c) * nv + (j - n * nv);
          bg[u] = __ldg(gv + off);
          bx[u] = __ldg(xv + off);
        }
      }
#pragma unroll
      for (int u = 0; u < kVecUnroll; ++u) {
        const T* eg = reinterpret_cast<const T*>(&bg[u]);
        const T* ex = reinterpret_cast<const T*>(&bx[u]);
        const bool live = j0 + static_cast<int64_t>(u) * kThreads < v1;
#pragma unroll
        for (int l = 0; l < kVec; ++l) {
          const A g = live ? Io<T>::load(eg[l]) : A(0);
          s_dy += g;
          s_dyx = fma(g, Io<T>::load(ex[l]) - mean, s_dyx);
        }
      }
    }
  } else if (kMode == kSegments) {
    int64_t n = i0 / hw;
    for (int64_t r0 = n * hw; r0 < i1; ++n, r0 += hw) {
      const int64_t s0 = (i0 > r0 ? i0 : r0) - r0;
      const int64_t s1 = (i1 < r0 + hw ? i1 : r0 + hw) - r0;
      const int64_t off = (n * channels + c) * hw + s0;
      segment_sums<T, A>(dy + off, x + off, s1 - s0, mean, s_dy, s_dyx);
    }
  } else {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int64_t n = i0 + warp; n < i1; n += kRowGroup) {
      const int64_t left = (i1 - n + kWarps - 1) / kWarps;
      const int rows = left < kRowsPerGroup ? static_cast<int>(left) : kRowsPerGroup;
      int64_t off[kRowsPerGroup];
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r)
        off[r] = ((n + static_cast<int64_t>(r) * kWarps) * channels + c) * hw;
      for (int64_t s = lane; s < hw; s += 32) {
        A g[kRowsPerGroup], v[kRowsPerGroup];
#pragma unroll
        for (int r = 0; r < kRowsPerGroup; ++r) {
          g[r] = r < rows ? Io<T>::load(__ldg(dy + off[r] + s)) : A(0);
          v[r] = r < rows ? Io<T>::load(__ldg(x + off[r] + s)) - mean : A(0);
        }
#pragma unroll
        for (int r = 0; r < kRowsPerGroup; ++r) {
          s_dy += g[r];
          s_dyx = fma(g[r], v[r], s_dyx);
        }
      }
    }
  }
  __shared__ A sh[2][kWarps];
  s_dy = warp_sum(s_dy);
  s_dyx = warp_sum(s_dyx);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sh[0][warp] = s_dy;
    sh[1][warp] = s_dyx;
  }
  __syncthreads();
  if (warp == 0) {
    A r0 = lane < kWarps ? sh[0][lane] : A(0);
    A r1 = lane < kWarps ? sh[1][lane] : A(0);
    r0 = warp_sum(r0);
    r1 = warp_sum(r1);
    if (lane == 0) {
      const int64_t p = c * chunks + k;
      part[p] = r0;
      part[channels * chunks + p] = r1;
    }
  }
}

// One warp per channel (chunks may be 0: no sums, eval-mode dx only). params: [4][C] for GradOp;
// in eval mode (training == 0) rows 0..2 are 0, gamma * invstd, 0, for NormOp applied to dy.
template <typename A>
__global__ void __launch_bounds__(kThreads) finalize_backward_kernel(
    const A* __restrict__ part, int64_t channels, int64_t chunks, double count,
    const A* __restrict__ weight, const A* __restrict__ mean, const A* __restrict__ invstd,
    A* __restrict__ dweight, A* __restrict__ dbias, A* __restrict__ params, int training) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (c >= channels) return;
  const int64_t parts = channels * chunks;
  double s_dy = 0.0, s_dyx = 0.0;
  for (int64_t k = lane; k < chunks; k += 32) {
    s_dy += static_cast<double>(part[c * chunks + k]);
    s_dyx += static_cast<double>(part[parts + c * chunks + k]);
  }
  s_dy = warp_sum(s_dy);
  s_dyx = warp_sum(s_dyx);
  if (lane != 0) return;
  const double is = static_cast<double>(invstd[c]);
  if (dbias) dbias[c] = static_cast<A>(s_dy);
  if (dweight) dweight[c] = static_cast<A>(s_dyx * is);
  const double a = (weight ? static_cast<double>(weight[c]) : 1.0) * is;
  if (training) {
    params[c] = mean[c];
    params[channels + c] = static_cast<A>(a);
    params[2 * channels + c] = static_cast<A>(-a * is * is * s_dyx / count);
    params[3 * channels + c] = static_cast<A>(-a * s_dy / count);
  } else {
    params[c] = A(0);
    params[channels + c] = static_cast<A>(a);
    params[2 * channels + c] = A(0);
    params[3 * channels + c] = A(0);
  }
}

// ------------------------------------------------------------- short rows: channel tiles

// kTiles mode (stats and backward reduce), for short rows (7x7 and 14x14 planes and the like)
// when x (and dy) are 16-byte aligned and C is a multiple of 16 / sizeof(T). Then, for each n,
// the rows of kTileChannels consecutive channels are one contiguous, 16-byte aligned run of
// memory. A block owns one such channel group and a range of n: per stage it copies
// kTileBatch / S runs (of each input) into shared memory with cp.async, two stages in flight,
// and then S threads reduce each row (n, c) of the stage out of shared memory (thread q takes
// elements q, q + S, ...), two passes in registers like add_group. S (tile_split) is 1 for rows
// of at most 256 bytes, 2 or 4 for rows up to kTileRowBytes, so a stage stays 64 KB at most.
// Unlike kShortRows (a block per channel, warps reading rows scattered C * HW apart), the
// global reads are long 16-byte coalesced runs and a whole stage of them is in flight at once.
constexpr int kTileChannels = 64;
constexpr int kTileBatch = kThreads / kTileChannels;  // threads per channel
constexpr int64_t kTileRowBytes = 1024;               // longest row (bytes) the mode takes
constexpr int kTileBlocksPerSm = 4;                   // backward grid target
constexpr int kThreadsPerSm = 2048;                   // resident-thread limit (sm_80 .. sm_90)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all_but_one() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// Threads per row in kTiles mode: 1 up to 256 bytes, else 2 or 4.
template <typename T>
__host__ __device__ inline int tile_split(int64_t hw) {
  const int64_t bytes = hw * static_cast<int64_t>(sizeof(T));
  return bytes <= 256 ? 1 : bytes <= 512 ? 2 : 4;
}

// Dynamic shared memory of a tile kernel: two stages of kThreads / S rows per input, and at
// least the kThreads (count, mean, M2) triples of the final merge.
template <typename T>
inline size_t tile_smem_bytes(int64_t hw, int inputs) {
  using A = typename Io<T>::Acc;
  const size_t stages = 2 * static_cast<size_t>(inputs) * (kThreads / tile_split<T>(hw)) * hw *
                        sizeof(T);
  const size_t merge = 3 * kThreads * sizeof(A);
  return stages > merge ? stages : merge;
}

// Thread t of a tile block takes part q = t % S of channel g = (t / S) % kTileChannels in the
// stage's row r = t / (S * kTileChannels).
struct TileThread {
  int q, g, r;
};
__device__ __forceinline__ TileThread tile_thread(int split) {
  const int t = static_cast<int>(threadIdx.x);
  return TileThread{t % split, (t / split) % kTileChannels, t / (split * kTileChannels)};
}

// What a tile block owns (grid: chunks * groups blocks, chunk-major): chunk k = n in [na, nb),
// channels [c0, c0 + gc); split and this thread's channel g < kTileChannels (g >= gc: idle).
struct TileBlock {
  int64_t k, c0, na, nb;
  int gc, split, g;
  // This thread's channel, or the group's first for an idle thread (a valid address).
  __device__ __forceinline__ int64_t channel() const { return c0 + (g < gc ? g : 0); }
};
template <typename T>
__device__ __forceinline__ TileBlock tile_block(int64_t n, int64_t channels, int hw,
                                                int64_t n_per_chunk, int64_t groups) {
  const int64_t k = blockIdx.x / groups;
  const int64_t c0 = (blockIdx.x - k * groups) * kTileChannels;
  const int gc = static_cast<int>(channels - c0 < kTileChannels ? channels - c0 : kTileChannels);
  const int64_t na = k * n_per_chunk, nb = na + n_per_chunk < n ? na + n_per_chunk : n;
  const int split = tile_split<T>(hw);
  return TileBlock{k, c0, na, nb, gc, split, tile_thread(split).g};
}

// Runs the stages of block b, kTileBatch / split values of n per stage; calls
// row(const T* (&rows)[kInputs]) for this thread's row of each stage (shared memory).
template <typename T, int kInputs, typename Row>
__device__ __forceinline__ void tile_pass(const T* const (&in)[kInputs], T* smem,
                                          int64_t channels, int hw, const TileBlock& b,
                                          Row&& row) {
  const int split = b.split, gc = b.gc, g = b.g;
  const int64_t c0 = b.c0, na = b.na, nb = b.nb;
  const int batch = kTileBatch / split;
  const int64_t stage = int64_t{kThreads / split} * hw;  // elements per input and stage buffer
  const int seg_vecs = static_cast<int>(gc * hw * static_cast<int>(sizeof(T)) / 16);
  const int64_t stages = (nb - na + batch - 1) / batch;
  const int r = tile_thread(split).r;
  auto issue = [&](int64_t st) {
    for (int rr = 0; rr < batch; ++rr) {
      const int64_t n = na + st * batch + rr;
      if (n >= nb) break;
#pragma unroll
      for (int i = 0; i < kInputs; ++i) {
        const uint4* src = reinterpret_cast<const uint4*>(in[i] + (n * channels + c0) * hw);
        uint4* dst = reinterpret_cast<uint4*>(smem + ((st & 1) * kInputs + i) * stage +
                                              static_cast<int64_t>(rr) * gc * hw);
        for (int q = threadIdx.x; q < seg_vecs; q += kThreads) cp_async16(dst + q, src + q);
      }
    }
    cp_async_commit();
  };
  issue(0);
  for (int64_t st = 0; st < stages; ++st) {
    if (st + 1 < stages)
      issue(st + 1);
    else
      cp_async_commit();  // an empty group keeps "all but the newest" meaning stage st
    cp_async_wait_all_but_one();
    __syncthreads();
    if (g < gc && na + st * batch + r < nb) {
      const T* rows[kInputs];
#pragma unroll
      for (int i = 0; i < kInputs; ++i)
        rows[i] = smem + ((st & 1) * kInputs + i) * stage + static_cast<int64_t>(r * gc + g) * hw;
      row(rows);
    }
    __syncthreads();  // the buffer is refilled by the next issue
  }
}

// A thread's part of a row: `count` elements q, q + S, ... It starts at a rotated index when
// count is even, so that the warp's rows (S * count elements apart) fall in different
// shared-memory banks; odd counts spread them already.
struct RowPart {
  int q, split, count, start;
  template <typename F>
  __device__ __forceinline__ void each(F&& f) const {
    for (int i = 0, k = start; i < count; ++i, k = k + 1 == count ? 0 : k + 1) f(q + split * k);
  }
};
__device__ __forceinline__ RowPart row_part(int hw, int split) {
  const TileThread me = tile_thread(split);
  const int count = (hw - me.q + split - 1) / split;
  const int lane_row = static_cast<int>(threadIdx.x % 32) / split;
  return RowPart{me.q, split, count, count % 2 == 0 ? lane_row % count : 0};
}

// 2-byte types read a row in aligned pairs instead (half the shared-memory loads and
// conversions; the tile passes are bound by instructions, not bytes). 4- and 8-byte types keep
// RowPart: batching their scalar values (7 Chan merges for 49 fp32 values) measured 11-13%
// slower (run d).
template <typename T>
struct alignas(2 * sizeof(T)) Pair {
  T v[2];
};
// A thread's pairs of a row: pairs q, q + S, ... of the row's pairs, which start at element
// `lead` (1 when the row starts mid-pair: rows start at element (r * gc + g) * hw with gc even,
// so when g and hw are odd), and for thread q = 0 of a row of odd length the one element
// outside the pairs (`single`, else -1). Rows of even length all start pair-aligned; their
// threads start at a rotated pair so that the warp's rows fall in different banks.
struct PairPart {
  int q, split, lead, count, start, single;
  // Index of the k-th (0 <= k < count) pair of this thread in the row's pairs.
  __device__ __forceinline__ int pair(int k) const {
    const int i = start + k;
    return q + split * (i >= count ? i - count : i);
  }
};
__device__ __forceinline__ PairPart pair_part(int hw, int split) {
  const TileThread me = tile_thread(split);
  const int lead = me.g & hw & 1;
  const int pairs = (hw - lead) / 2;
  const int count = (pairs - me.q + split - 1) / split;
  const int single = me.q == 0 && (hw & 1) ? (lead ? 0 : hw - 1) : -1;
  const int lane_row = static_cast<int>(threadIdx.x % 32) / split;
  return PairPart{me.q, split, lead, count, hw % 2 == 0 && count > 0 ? lane_row % count : 0,
                  single};
}
// The i-th (0 <= i < kTileBatch) of the threads that take channel g of a stage.
__device__ __forceinline__ int tile_thread_of(int g, int i, int split) {
  return (i / split) * split * kTileChannels + g * split + i % split;
}

// part as in stats_kernel, chunk k = range of n (TileBlock). The body of stats_tile_kernel (4-
// and 8-byte types) and stats_tile_pair_kernel (2-byte types).
template <typename T>
__device__ __forceinline__ void stats_tile_body(const T* __restrict__ x, int64_t n,
                                                int64_t channels, int hw, int64_t n_per_chunk,
                                                int64_t chunks, int64_t groups,
                                                typename Io<T>::Acc* __restrict__ part) {
  using A = typename Io<T>::Acc;
  extern __shared__ uint4 tile_smem[];
  const TileBlock b = tile_block<T>(n, channels, hw, n_per_chunk, groups);
  const A shift = Io<T>::load(x[b.channel() * hw]);
  Welford<A> w{A(0), A(0), A(0)};
  const T* in[1] = {x};
  if constexpr (sizeof(T) == 2) {
    // Each value is read once, in pairs, into one pass of shifted sums (x - shift and its
    // square, fp32) per row, Chan-merged once per row as in the 4- and 8-byte loop. The
    // difference of two 2-byte values is exact in fp32 and shift is a value of the channel, so
    // m2 = sum(d^2) - sum(d)^2 / count loses only the bits of (row mean - shift)^2 / variance.
    const PairPart pp = pair_part(hw, b.split);
    const A count = A(2 * pp.count + (pp.single >= 0 ? 1 : 0));
    const A inv_count = count > A(0) ? A(1) / count : A(0);
    tile_pass<T, 1>(in, reinterpret_cast<T*>(tile_smem), channels, hw, b,
                    [&](const T* (&rows)[1]) {
                      const Pair<T>* u = reinterpret_cast<const Pair<T>*>(rows[0] + pp.lead);
                      A s = A(0), q = A(0);
                      if (pp.single >= 0) {
                        const A d = Io<T>::load(rows[0][pp.single]) - shift;
                        s = d;
                        q = d * d;
                      }
                      for (int j = 0; j < pp.count; ++j) {
                        const Pair<T> e = u[pp.pair(j)];
                        const A d0 = Io<T>::load(e.v[0]) - shift;
                        const A d1 = Io<T>::load(e.v[1]) - shift;
                        s += d0 + d1;
                        q = fma(d0, d0, fma(d1, d1, q));
                      }
                      const A m = s * inv_count;
                      w.merge(count, m, fmax(fma(-s, m, q), A(0)));
                    });
  } else {
    const RowPart part_of_row = row_part(hw, b.split);
    const A inv_count = A(1) / A(part_of_row.count);
    tile_pass<T, 1>(in, reinterpret_cast<T*>(tile_smem), channels, hw, b,
                    [&](const T* (&rows)[1]) {
                      const T* p = rows[0];
                      A s = A(0);
                      part_of_row.each([&](int j) { s += Io<T>::load(p[j]) - shift; });
                      const A m = s * inv_count;
                      A q = A(0);
                      part_of_row.each([&](int j) {
                        const A d = (Io<T>::load(p[j]) - shift) - m;
                        q = fma(d, d, q);
                      });
                      w.merge(A(part_of_row.count), m, q);
                    });
  }
  // Merge the kTileBatch threads of each channel (shared memory is free after tile_pass).
  A* sh = reinterpret_cast<A*>(tile_smem);
  sh[threadIdx.x] = w.n;
  sh[kThreads + threadIdx.x] = w.mean;
  sh[2 * kThreads + threadIdx.x] = w.m2;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < b.gc) {
    Welford<A> r{A(0), A(0), A(0)};
#pragma unroll
    for (int i = 0; i < kTileBatch; ++i) {
      const int t = tile_thread_of(threadIdx.x, i, b.split);
      r.merge(sh[t], sh[kThreads + t], sh[2 * kThreads + t]);
    }
    const int64_t p = (b.c0 + threadIdx.x) * chunks + b.k, parts = channels * chunks;
    part[p] = r.n;
    part[parts + p] = r.mean;
    part[2 * parts + p] = r.m2;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    stats_tile_kernel(const T* __restrict__ x, int64_t n, int64_t channels, int hw,
                      int64_t n_per_chunk, int64_t chunks, int64_t groups,
                      typename Io<T>::Acc* __restrict__ part) {
  static_assert(sizeof(T) != 2, "2-byte types take stats_tile_pair_kernel");
  stats_tile_body<T>(x, n, channels, hw, n_per_chunk, chunks, groups, part);
}
// At least 4 blocks per SM (64 registers): the grid is one wave of the blocks that shared
// memory allows, 4 per SM for 7x7 fp16, and registers must not allow fewer.
// A kernel of its own because any such bound on the 4- and 8-byte kernel, even
// (kThreads, 1), changes their code (fp32: 32 -> 52 registers).
template <typename T>
__global__ void __launch_bounds__(kThreads, 4)
    stats_tile_pair_kernel(const T* __restrict__ x, int64_t n, int64_t channels, int hw,
                           int64_t n_per_chunk, int64_t chunks, int64_t groups,
                           typename Io<T>::Acc* __restrict__ part) {
  static_assert(sizeof(T) == 2, "4- and 8-byte types take stats_tile_kernel");
  stats_tile_body<T>(x, n, channels, hw, n_per_chunk, chunks, groups, part);
}
template <typename T>
constexpr auto stats_tile_kernel_for() {
  if constexpr (sizeof(T) == 2)
    return &stats_tile_pair_kernel<T>;
  else
    return &stats_tile_kernel<T>;
}

// Backward sums (as reduce_backward_kernel) over channel tiles; grid and part as above.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    reduce_tile_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                       const typename Io<T>::Acc* __restrict__ mean_in, int64_t n,
                       int64_t channels, int hw, int64_t n_per_chunk, int64_t chunks,
                       int64_t groups, typename Io<T>::Acc* __restrict__ part) {
  using A = typename Io<T>::Acc;
  extern __shared__ uint4 tile_smem[];
  const TileBlock b = tile_block<T>(n, channels, hw, n_per_chunk, groups);
  const A mean = mean_in[b.channel()];
  A s_dy = A(0), s_dyx = A(0);
  const T* in[2] = {dy, x};
  if constexpr (sizeof(T) == 2) {
    // dy and x in pairs, as in stats_tile_kernel.
    const PairPart pp = pair_part(hw, b.split);
    tile_pass<T, 2>(in, reinterpret_cast<T*>(tile_smem), channels, hw, b,
                    [&](const T* (&rows)[2]) {
                      const Pair<T>* ug = reinterpret_cast<const Pair<T>*>(rows[0] + pp.lead);
                      const Pair<T>* ux = reinterpret_cast<const Pair<T>*>(rows[1] + pp.lead);
                      if (pp.single >= 0) {
                        const A gv = Io<T>::load(rows[0][pp.single]);
                        s_dy += gv;
                        s_dyx = fma(gv, Io<T>::load(rows[1][pp.single]) - mean, s_dyx);
                      }
#pragma unroll 4
                      for (int k = 0; k < pp.count; ++k) {
                        const int i = pp.pair(k);
                        const Pair<T> eg = ug[i], ex = ux[i];
#pragma unroll
                        for (int l = 0; l < 2; ++l) {
                          const A gv = Io<T>::load(eg.v[l]);
                          s_dy += gv;
                          s_dyx = fma(gv, Io<T>::load(ex.v[l]) - mean, s_dyx);
                        }
                      }
                    });
  } else {
    const RowPart part_of_row = row_part(hw, b.split);
    tile_pass<T, 2>(in, reinterpret_cast<T*>(tile_smem), channels, hw, b,
                    [&](const T* (&rows)[2]) {
                      part_of_row.each([&](int j) {
                        const A gv = Io<T>::load(rows[0][j]);
                        s_dy += gv;
                        s_dyx = fma(gv, Io<T>::load(rows[1][j]) - mean, s_dyx);
                      });
                    });
  }
  A* sh = reinterpret_cast<A*>(tile_smem);
  sh[threadIdx.x] = s_dy;
  sh[kThreads + threadIdx.x] = s_dyx;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < b.gc) {
    A r0 = A(0), r1 = A(0);
#pragma unroll
    for (int i = 0; i < kTileBatch; ++i) {
      const int t = tile_thread_of(threadIdx.x, i, b.split);
      r0 += sh[t];
      r1 += sh[kThreads + t];
    }
    const int64_t p = (b.c0 + threadIdx.x) * chunks + b.k;
    part[p] = r0;
    part[channels * chunks + p] = r1;
  }
}

// --------------------------------------------------------------------------- eval forward

// One thread per channel: mean, gamma / sqrt(var + eps), beta (params, for NormOp) and the
// folded scale = gamma / sqrt(var + eps), shift = beta - mean * scale in the storage type (for
// dk_fused_batch_norm_cuda).
template <typename T>
__global__ void eval_params_kernel(const typename Io<T>::Acc* __restrict__ weight,
                                   const typename Io<T>::Acc* __restrict__ bias,
                                   const typename Io<T>::Acc* __restrict__ running_mean,
                                   const typename Io<T>::Acc* __restrict__ running_var,
                                   double eps, int64_t channels,
                                   typename Io<T>::Acc* __restrict__ params,
                                   T* __restrict__ folded) {
  using A = typename Io<T>::Acc;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const double m = static_cast<double>(running_mean[c]);
  const double s = (weight ? static_cast<double>(weight[c]) : 1.0) /
                   sqrt(static_cast<double>(running_var[c]) + eps);
  const double t = bias ? static_cast<double>(bias[c]) : 0.0;
  params[c] = static_cast<A>(m);
  params[channels + c] = static_cast<A>(s);
  params[2 * channels + c] = static_cast<A>(t);
  if (folded) {
    folded[c] = Io<T>::store(static_cast<A>(s));
    folded[channels + c] = Io<T>::store(static_cast<A>(t - m * s));
  }
}

// ------------------------------------------------------------------------------------ host

// How a pass over the channel planes is cut into blocks: `count` chunks of `len` units, units
// being plane indices (vector path) or rows (short-row path); `extent` units in all.
struct Chunking {
  int64_t extent = 0, len = 0, count = 0;
};

struct Plan {
  int64_t plane = 0;  // values per channel: batch * spatial
  Chunking vec, rows;
  Chunking tiles[2];  // kTiles: ranges of n, over `groups` channel groups; [inputs - 1]
  int64_t groups = 0;
  size_t acc = 0, elem = 0;
  size_t part_off = 0, params_off = 0, folded_off = 0, bytes = 0;
};

inline bool valid_dtype(dk_dtype dtype) {
  return dtype == DK_FLOAT32 || dtype == DK_FLOAT16 || dtype == DK_BFLOAT16 ||
         dtype == DK_FLOAT64;
}
inline size_t elem_size(dk_dtype dtype) {
  return dtype == DK_FLOAT64 ? 8 : dtype == DK_FLOAT32 ? 4 : 2;
}
inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// An attribute of the current device; 0 when it cannot be read (callers then take safe paths).
inline int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess)
    return 0;
  return value;
}
inline int device_smem_optin() {
  return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
}
inline int device_smem_per_sm() {
  return device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
}
inline int device_sms() { return device_attribute(cudaDevAttrMultiProcessorCount); }

// `extent` units cut into about `wanted` chunks, at most `most`, at least `least`, chunk lengths
// multiples of `align` when longer than it.
inline Chunking cut(int64_t extent, int64_t wanted, int64_t most, int64_t least, int64_t align) {
  Chunking ch;
  ch.extent = extent;
  int64_t count = wanted < most ? wanted : most;
  if (count < least) count = least;
  if (count < 1) count = 1;
  int64_t len = ceil_div(extent, count);
  if (len > align) len = ceil_div(len, align) * align;
  ch.len = len;
  ch.count = ceil_div(extent, len);
  return ch;
}

// Chunking of both paths and the workspace layout; false for invalid sizes.
inline bool make_plan(dk_dtype dtype, int64_t n, int64_t c, int64_t hw, int sms, Plan* plan) {
  int64_t total = 0;
  if (!valid_dtype(dtype) || !checked_volume(n, c, hw, &total) || sms <= 0) return false;
  plan->plane = n * hw;
  plan->acc = dtype == DK_FLOAT64 ? 8 : 4;
  plan->elem = elem_size(dtype);
  if (static_cast<uint64_t>(total) > SIZE_MAX / 8) return false;
  if (c > 0 && plan->plane > 0) {
    const int64_t wanted = ceil_div(static_cast<int64_t>(sms) * kBlocksPerSm, c);
    const int64_t least = ceil_div(plan->plane, kMaxChunk);  // fp32 counts stay exact
    // Vector path: whole block-wide batches of loads, at least two per block.
    const int64_t align = dtype == DK_FLOAT64   ? chunk_align<double>()
                          : dtype == DK_FLOAT32 ? chunk_align<float>()
                                                : chunk_align<__half>();
    plan->vec = cut(plan->plane, wanted, ceil_div(plan->plane, 2 * align), least, align);
    const int64_t rows_most = kMaxChunk / hw > 0 ? kMaxChunk / hw : 1;  // rows per chunk
    plan->rows = cut(n, wanted, ceil_div(n, kRowGroup), ceil_div(n, rows_most), kRowGroup);
    // kTiles. Statistics: one wave of resident blocks (as many as shared memory allows), so
    // each block runs many stages and pays the pipeline start once (measured 3% faster on
    // (256, 2048, 7, 7) fp32 than kTileBlocksPerSm). Backward: kTileBlocksPerSm per SM; its
    // fp32 stages allow one resident block per SM, and a one-wave grid cut into whole chunks
    // left a ragged second wave (11% slower).
    plan->groups = ceil_div(c, kTileChannels);
    const int smem_sm = device_smem_per_sm();
    const size_t smem = dtype == DK_FLOAT64   ? tile_smem_bytes<double>(hw, 1)
                        : dtype == DK_FLOAT32 ? tile_smem_bytes<float>(hw, 1)
                                              : tile_smem_bytes<__half>(hw, 1);
    int64_t per_sm = smem_sm > 0 ? static_cast<int64_t>(smem_sm) / (smem + 1024) : 0;
    per_sm = per_sm < 1 ? 1 : per_sm > kThreadsPerSm / kThreads ? kThreadsPerSm / kThreads
                                                                 : per_sm;
    plan->tiles[0] = cut(n, ceil_div(static_cast<int64_t>(sms) * per_sm, plan->groups),
                         ceil_div(n, kTileBatch), ceil_div(n, rows_most), kTileBatch);
    plan->tiles[1] =
        cut(n, ceil_div(static_cast<int64_t>(sms) * kTileBlocksPerSm, plan->groups),
            ceil_div(n, kTileBatch), ceil_div(n, rows_most), kTileBatch);
    const int64_t most_blocks = (int64_t{1} << 31) - 1;  // grid.x limit
    if (plan->vec.count * c > most_blocks || plan->rows.count * c > most_blocks ||
        plan->tiles[0].count * plan->groups > most_blocks ||
        plan->tiles[1].count * plan->groups > most_blocks)
      return false;
  }
  int64_t chunks = plan->vec.count > plan->rows.count ? plan->vec.count : plan->rows.count;
  for (const Chunking& t : plan->tiles)
    if (t.count > chunks) chunks = t.count;
  const size_t cs = static_cast<size_t>(c);
  plan->part_off = 0;
  plan->params_off = round_up(3 * cs * static_cast<size_t>(chunks) * plan->acc, 256);
  plan->folded_off = plan->params_off + round_up(4 * cs * plan->acc, 256);
  plan->bytes = plan->folded_off + round_up(2 * cs * plan->elem, 256);
  return true;
}

inline bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

inline dk_status launch_status() {
  return cudaGetLastError() == cudaSuccess ? DK_OK : DK_CUDA_ERROR;
}

inline unsigned warp_blocks(int64_t channels) {
  return static_cast<unsigned>((channels + kWarps - 1) / kWarps);
}

template <typename T, typename Op>
dk_status launch_elementwise(const T* a, const T* b, T* out, int64_t total, int64_t channels,
                             int64_t hw, Op op, cudaStream_t stream) {
  return channel_map<T>(a, b, out, total, channels, hw, op, stream) ? DK_OK : DK_CUDA_ERROR;
}

// Rows of at most kTileRowBytes take kTiles when x (and dy) are 16-byte aligned, C is a
// multiple of 16 / sizeof(T) and the stages fit in shared memory. Other short rows take
// kShortRows. Long rows take kPlaneVectors when every row starts on a 16-byte boundary in x
// (and dy), else kSegments when x and dy share their misalignment, else kShortRows (scalar
// loads, correct for any layout).
template <typename T>
inline int pass_mode(int64_t hw, int64_t plane, int64_t channels, const void* x, const void* dy) {
  constexpr int64_t kVec = 16 / sizeof(T);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(x) % 16;
  const bool same_mis = !dy || reinterpret_cast<uintptr_t>(dy) % 16 == mis;
  if (hw * static_cast<int64_t>(sizeof(T)) <= kTileRowBytes && channels % kVec == 0 &&
      mis == 0 && same_mis &&
      tile_smem_bytes<T>(hw, dy ? 2 : 1) <= static_cast<size_t>(device_smem_optin()))
    return kTiles;
  if (hw < kRowPathMin || !same_mis) return kShortRows;
  if (mis == 0 && hw % kVec == 0 && plane / kVec < (int64_t{1} << 31)) return kPlaneVectors;
  return kSegments;
}

// Launches a tile kernel with its dynamic shared memory (above 48 KB only once allowed).
template <typename Kernel, typename... Args>
inline dk_status launch_tiles(Kernel kernel, const Plan& plan, int inputs, size_t smem,
                              cudaStream_t stream, Args... args) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess)
    return DK_CUDA_ERROR;
  const unsigned grid = static_cast<unsigned>(plan.tiles[inputs - 1].count * plan.groups);
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  return launch_status();
}

template <typename T>
dk_status train_forward(const void* xv, const void* weight, const void* bias, void* running_mean,
                        void* running_var, double momentum, double eps, void* yv,
                        void* save_mean, void* save_invstd, void* workspace, const Plan& plan,
                        int64_t n, int64_t channels, int64_t hw, int sms, cudaStream_t stream) {
  using A = typename Io<T>::Acc;
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  char* ws = static_cast<char*>(workspace);
  A* part = reinterpret_cast<A*>(ws + plan.part_off);
  A* params = reinterpret_cast<A*>(ws + plan.params_off);
  (void)cudaGetLastError();
  const int mode = pass_mode<T>(hw, plan.plane, channels, x, nullptr);
  const Chunking& ch = mode == kTiles      ? plan.tiles[0]
                       : mode == kShortRows ? plan.rows
                                            : plan.vec;
  const unsigned grid = static_cast<unsigned>(ch.count * channels);
  const Div32 hwv(mode == kPlaneVectors ? static_cast<uint64_t>(hw / (16 / sizeof(T))) : 1);
  if (mode == kTiles) {
    if (launch_tiles(stats_tile_kernel_for<T>(), plan, 1, tile_smem_bytes<T>(hw, 1), stream, x, n,
                     channels, static_cast<int>(hw), ch.len, ch.count, plan.groups,
                     part) != DK_OK)
      return DK_CUDA_ERROR;
  } else if (mode == kPlaneVectors)
    stats_kernel<T, kPlaneVectors><<<grid, kThreads, 0, stream>>>(
        x, channels, hw, ch.extent, ch.len, ch.count, hwv, part);
  else if (mode == kSegments)
    stats_kernel<T, kSegments><<<grid, kThreads, 0, stream>>>(
        x, channels, hw, ch.extent, ch.len, ch.count, hwv, part);
  else
    stats_kernel<T, kShortRows><<<grid, kThreads, 0, stream>>>(
        x, channels, hw, ch.extent, ch.len, ch.count, hwv, part);
  if (launch_status() != DK_OK) return DK_CUDA_ERROR;
  finalize_train_kernel<T><<<warp_blocks(channels), kThreads, 0, stream>>>(
      x, part, channels, hw, ch.count, static_cast<const A*>(weight),
      static_cast<const A*>(bias), static_cast<A*>(running_mean), static_cast<A*>(running_var),
      momentum, eps, static_cast<A*>(save_mean), static_cast<A*>(save_invstd), params);
  if (launch_status() != DK_OK) return DK_CUDA_ERROR;
  return launch_elementwise<T>(x, nullptr, y, n * channels * hw, channels, hw,
                               NormOp<A>{params, channels}, stream);
}

template <typename T>
dk_status eval_forward(dk_dtype dtype, const void* xv, const void* weight, const void* bias,
                       const void* running_mean, const void* running_var, double eps, void* yv,
                       int fold, void* workspace, const Plan& plan, int64_t n, int64_t channels,
                       int64_t hw, int sms, cudaStream_t stream) {
  using A = typename Io<T>::Acc;
  char* ws = static_cast<char*>(workspace);
  A* params = reinterpret_cast<A*>(ws + plan.params_off);
  T* folded = dtype == DK_FLOAT64 || !fold ? nullptr
                                           : reinterpret_cast<T*>(ws + plan.folded_off);
  (void)cudaGetLastError();
  eval_params_kernel<T><<<static_cast<unsigned>((channels + 127) / 128), 128, 0, stream>>>(
      static_cast<const A*>(weight), static_cast<const A*>(bias),
      static_cast<const A*>(running_mean), static_cast<const A*>(running_var), eps, channels,
      params, folded);
  if (launch_status() != DK_OK) return DK_CUDA_ERROR;
  if (folded)  // the deployed FusedBatchNorm kernel: what the exported model computes
    return dk_fused_batch_norm_cuda(dtype, xv, folded, folded + channels, yv, n, channels, hw,
                                    DK_ACTIVATION_NONE, stream);
  return launch_elementwise<T>(static_cast<const T*>(xv), nullptr, static_cast<T*>(yv),
                               n * channels * hw, channels, hw, NormOp<A>{params, channels},
                               stream);
}

template <typename T>
dk_status backward(const void* dyv, const void* xv, const void* weight, const void* mean,
                   const void* invstd, void* dxv, void* dweight, void* dbias, void* workspace,
                   const Plan& plan, int64_t n, int64_t channels, int64_t hw, int training,
                   int sms, cudaStream_t stream) {
  using A = typename Io<T>::Acc;
  const T* dy = static_cast<const T*>(dyv);
  const T* x = static_cast<const T*>(xv);
  char* ws = static_cast<char*>(workspace);
  A* part = reinterpret_cast<A*>(ws + plan.part_off);
  A* params = reinterpret_cast<A*>(ws + plan.params_off);
  const bool sums = training || dweight || dbias;
  const int mode = pass_mode<T>(hw, plan.plane, channels, x, dy);
  const Chunking& ch = mode == kTiles      ? plan.tiles[1]
                       : mode == kShortRows ? plan.rows
                                            : plan.vec;
  const int64_t chunks = sums ? ch.count : 0;
  (void)cudaGetLastError();
  if (chunks > 0) {
    const unsigned grid = static_cast<unsigned>(ch.count * channels);
    const A* m = static_cast<const A*>(mean);
    const Div32 hwv(mode == kPlaneVectors ? static_cast<uint64_t>(hw / (16 / sizeof(T))) : 1);
    if (mode == kTiles) {
      if (launch_tiles(reduce_tile_kernel<T>, plan, 2, tile_smem_bytes<T>(hw, 2), stream, dy, x, m,
                       n, channels, static_cast<int>(hw), ch.len, ch.count, plan.groups,
                       part) != DK_OK)
        return DK_CUDA_ERROR;
    } else if (mode == kPlaneVectors)
      reduce_backward_kernel<T, kPlaneVectors><<<grid, kThreads, 0, stream>>>(
          dy, x, m, channels, hw, ch.extent, ch.len, ch.count, hwv, part);
    else if (mode == kSegments)
      reduce_backward_kernel<T, kSegments><<<grid, kThreads, 0, stream>>>(
          dy, x, m, channels, hw, ch.extent, ch.len, ch.count, hwv, part);
    else
      reduce_backward_kernel<T, kShortRows><<<grid, kThreads, 0, stream>>>(
          dy, x, m, channels, hw, ch.extent, ch.len, ch.count, hwv, part);
    if (launch_status() != DK_OK) return DK_CUDA_ERROR;
  }
  finalize_backward_kernel<A><<<warp_blocks(channels), kThreads, 0, stream>>>(
      part, channels, chunks, static_cast<double>(plan.plane), static_cast<const A*>(weight),
      static_cast<const A*>(mean), static_cast<const A*>(invstd), static_cast<A*>(dweight),
      static_cast<A*>(dbias), params, training);
  if (launch_status() != DK_OK) return DK_CUDA_ERROR;
  if (!dxv) return DK_OK;
  const int64_t total = n * channels * hw;
  if (training)
    return launch_elementwise<T>(dy, x, static_cast<T*>(dxv), total, channels, hw,
                                 GradOp<A>{params, channels}, stream);
  return launch_elementwise<T>(dy, nullptr, static_cast<T*>(dxv), total, channels, hw,
                               NormOp<A>{params, channels}, stream);
}

// Checks shared by the entry points: dtype, sizes, workspace, pointer alignment.
inline dk_status check_common(dk_dtype dtype, int64_t n, int64_t c, int64_t hw,
                              const void* workspace, size_t workspace_bytes, int* sms,
                              Plan* plan) {
  if (!valid_dtype(dtype)) return DK_INVALID_ARGUMENT;
  int64_t total = 0;
  if (!checked_volume(n, c, hw, &total)) return DK_INVALID_ARGUMENT;
  *sms = device_sms();
  if (*sms <= 0) return DK_CUDA_ERROR;
  if (!make_plan(dtype, n, c, hw, *sms, plan)) return DK_INVALID_ARGUMENT;
  if (total == 0) return DK_OK;
  if (!workspace || workspace_bytes < plan->bytes || !aligned(workspace, 16))
    return DK_INVALID_ARGUMENT;
  return DK_OK;
}

inline bool ok_ptr(const void* p, size_t a, bool required) {
  return p ? aligned(p, a) : !required;
}

}  // namespace bn
}  // namespace cuda
}  // namespace dk

using dk::cuda::bn::Plan;

extern "C" size_t dk_batch_norm_workspace_bytes(dk_dtype dtype, int64_t batch, int64_t channels,
                                                int64_t spatial) {
  Plan plan;
  const int sms = dk::cuda::bn::device_sms();
  if (!dk::cuda::bn::make_plan(dtype, batch, channels, spatial, sms, &plan)) return 0;
  return plan.bytes;
}

extern "C" dk_status dk_batch_norm_train_forward_cuda(
    dk_dtype dtype, const void* x, const void* weight, const void* bias, void* running_mean,
    void* running_var, double momentum, double eps, void* y, void* save_mean, void* save_invstd,
    void* workspace, size_t workspace_bytes, int64_t batch, int64_t channels, int64_t spatial,
    void* stream) {
  using namespace dk::cuda::bn;
  Plan plan;
  int sms = 0;
  const dk_status st =
      check_common(dtype, batch, channels, spatial, workspace, workspace_bytes, &sms, &plan);
  if (st != DK_OK) return st;
  if (channels == 0) return DK_OK;
  if (plan.plane < 2) return DK_INVALID_ARGUMENT;  // one value per channel: no variance
  if (!(eps >= 0.0) || !(momentum == momentum)) return DK_INVALID_ARGUMENT;
  const size_t es = plan.elem, as = plan.acc;
  if (!ok_ptr(x, es, true) || !ok_ptr(y, es, true) || !ok_ptr(save_mean, as, true) ||
      !ok_ptr(save_invstd, as, true) || !ok_ptr(weight, as, false) || !ok_ptr(bias, as, false) ||
      !ok_ptr(running_mean, as, false) || !ok_ptr(running_var, as, false))
    return DK_INVALID_ARGUMENT;
  if (dk::partial_overlap(x, y, static_cast<size_t>(batch * channels * spatial) * es))
    return DK_INVALID_ARGUMENT;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dk::cuda::with_storage_type<true>(dtype, [&](auto storage) {
    return train_forward<decltype(storage)>(x, weight, bias, running_mean, running_var, momentum,
                                            eps, y, save_mean, save_invstd, workspace, plan, batch,
                                            channels, spatial, sms, s);
  });
}

extern "C" dk_status dk_batch_norm_eval_forward_cuda(
    dk_dtype dtype, const void* x, const void* weight, const void* bias, const void* running_mean,
    const void* running_var, double eps, void* y, int fold, void* workspace,
    size_t workspace_bytes, int64_t batch, int64_t channels, int64_t spatial, void* stream) {
  using namespace dk::cuda::bn;
  Plan plan;
  int sms = 0;
  const dk_status st =
      check_common(dtype, batch, channels, spatial, workspace, workspace_bytes, &sms, &plan);
  if (st != DK_OK || batch * channels * spatial == 0) return st;
  if (!(eps >= 0.0)) return DK_INVALID_ARGUMENT;
  const size_t es = plan.elem, as = plan.acc;
  if (!ok_ptr(x, es, true) || !ok_ptr(y, es, true) || !ok_ptr(running_mean, as, true) ||
      !ok_ptr(running_var, as, true) || !ok_ptr(weight, as, false) || !ok_ptr(bias, as, false))
    return DK_INVALID_ARGUMENT;
  if (dk::partial_overlap(x, y, static_cast<size_t>(batch * channels * spatial) * es))
    return DK_INVALID_ARGUMENT;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dk::cuda::with_storage_type<true>(dtype, [&](auto storage) {
    return eval_forward<decltype(storage)>(dtype, x, weight, bias, running_mean, running_var, eps,
                                           y, fold, workspace, plan, batch, channels, spatial,
                                           sms, s);
  });
}

extern "C" dk_status dk_batch_norm_backward_cuda(
    dk_dtype dtype, const void* dy, const void* x, const void* weight, const void* mean,
    const void* invstd, void* dx, void* dweight, void* dbias, void* workspace,
    size_t workspace_bytes, int64_t batch, int64_t channels, int64_t spatial, int training,
    void* stream) {
  using namespace dk::cuda::bn;
  Plan plan;
  int sms = 0;
  const dk_status st =
      check_common(dtype, batch, channels, spatial, workspace, workspace_bytes, &sms, &plan);
  if (st != DK_OK) return st;
  if (channels == 0) return DK_OK;
  const bool empty = plan.plane == 0;
  if (empty && !dweight && !dbias) return DK_OK;
  const size_t es = plan.elem, as = plan.acc;
  const bool sums = training || dweight || dbias;
  if (!ok_ptr(dy, es, !empty) || !ok_ptr(x, es, !empty && sums) || !ok_ptr(dx, es, false) ||
      !ok_ptr(mean, as, true) || !ok_ptr(invstd, as, true) || !ok_ptr(weight, as, false) ||
      !ok_ptr(dweight, as, false) || !ok_ptr(dbias, as, false))
    return DK_INVALID_ARGUMENT;
  const size_t bytes = static_cast<size_t>(batch * channels * spatial) * es;
  if (dx && (dk::partial_overlap(dy, dx, bytes) || (x && dk::partial_overlap(x, dx, bytes))))
    return DK_INVALID_ARGUMENT;
  if (empty) dx = nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dk::cuda::with_storage_type<true>(dtype, [&](auto storage) {
    return backward<decltype(storage)>(dy, x, weight, mean, invstd, dx, dweight, dbias, workspace,
                                       plan, batch, channels, spatial, training, sms, s);
  });
}
