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
//      unaligned): the same with scalar head and tail per row segment; kShortRows (7x7,
//      14x14): a chunk is a range of rows, each warp reads kRowsPerGroup rows at once, lanes
//      along the rows (coalesced, no per-element index arithmetic). Each block writes one
//      partial (count, mean, M2).
//   2. finalize_train_kernel: one warp per channel merges that channel's partials in double,
//      writes save_mean / save_invstd, updates running_mean / running_var (unbiased variance,
//      like PyTorch) and the per-channel parameters of the last pass.
//   3. elementwise_kernel: y = (x - mean) * (gamma * invstd) + beta over the flat tensor.
// Eval forward: eval_params_kernel (per-channel parameters), then either the deployed
// FusedBatchNorm kernel on folded scale / bias, or elementwise_kernel on the unfolded form.
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
// Backward: reduce_backward_kernel (per (chunk, channel) sums of dy and dy * (x - mean), same
// traversal as pass 1), finalize_backward_kernel (dgamma, dbeta and the coefficients of dx), and
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
constexpr int kElementwiseBlocksPerSm = 8;  // at most; fewer if registers allow fewer

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

// Storage type -> accumulation type, and exact loads / round-to-nearest stores.
template <typename T>
struct Io;
template <>
struct Io<float> {
  using Acc = float;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};
template <>
struct Io<double> {
  using Acc = double;
  static __device__ __forceinline__ double load(double v) { return v; }
  static __device__ __forceinline__ double store(double v) { return v; }
};
template <>
struct Io<__half> {
  using Acc = float;
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Io<__nv_bfloat16> {
  using Acc = float;
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

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

// n / d for a divisor fixed at launch. Div32 needs n < 2^31: with s = ceil(log2 d) and
// m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(n, m) + n) >> s (no overflow below 2^31).
struct Div32 {
  uint32_t d, m, s;
  Div32() : d(1), m(1), s(0) {}
  explicit Div32(uint64_t divisor) : d(static_cast<uint32_t>(divisor)), m(0), s(0) {
    while ((uint64_t{1} << s) < d) ++s;
    m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
};
struct Div64 {
  uint64_t d;
  Div64() : d(1) {}
  explicit Div64(uint64_t divisor) : d(divisor) {}
  __device__ __forceinline__ uint64_t div(uint64_t n) const { return n / d; }
};
template <typename Index>
struct DivFor;
template <>
struct DivFor<uint32_t> { using type = Div32; };
template <>
struct DivFor<uint64_t> { using type = Div64; };

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
  constexpr int kVec = 16 / sizeof(T);
  int64_t head = static_cast<int64_t>(((16 - (reinterpret_cast<uintptr_t>(seg) & 15)) & 15) /
                                      sizeof(T));
  if (head > len) head = len;
  const int64_t nvec = (len - head) / kVec;
  const int64_t tail = head + nvec * kVec;
  const int64_t nscalar = head + (len - tail);
  for (int64_t j = threadIdx.x; j < nscalar; j += kThreads) {
    const int64_t e = j < head ? j : tail + (j - head);
    w.merge(A(1), Io<T>::load(seg[e]) - shift, A(0));
  }
  constexpr int U = stats_unroll<T>();
  const uint4* v = reinterpret_cast<const uint4*>(seg + head);
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
  kPlaneVectors = 2 // rows a multiple of 16 bytes and aligned: 16-byte vectors across rows
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

// out[e] = op(channel(e), a[e], b[e]) over the flat tensor, 16-byte vectors over the aligned
// middle (a, b and out share their misalignment, else `nvec` is 0 and all is scalar). Items are
// taken from the end of the tensor first (see the top of the file). out may alias a exactly.
template <typename T, typename Index, typename Op>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(const T* a, const T* b, T* out, Index total, Index head, Index nvec,
                       typename DivFor<Index>::type hw_div,
                       typename DivFor<Index>::type ch_div, Op op) {
  using A = typename Io<T>::Acc;
  constexpr int kVec = 16 / sizeof(T);
  const Index vec_end = head + nvec * kVec;
  const Index items = nvec + (total - nvec * kVec);
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  const Index hw = static_cast<Index>(hw_div.d), channels = static_cast<Index>(ch_div.d);

  auto vector_item = [&](Index r, const uint4& va, const uint4& vb) {
    const Index e = head + r * kVec;
    const Index q = hw_div.div(e);
    Index pos = e - q * hw;
    Index c = q - ch_div.div(q) * channels;
    typename Op::P prm = op.get(static_cast<int64_t>(c));
    const T* ea = reinterpret_cast<const T*>(&va);
    const T* eb = reinterpret_cast<const T*>(&vb);
    uint4 vo;
    T* eo = reinterpret_cast<T*>(&vo);
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      const A bv = Op::kBinary ? Io<T>::load(eb[l]) : A(0);
      eo[l] = Io<T>::store(op.apply(prm, Io<T>::load(ea[l]), bv));
      if (l + 1 < kVec && ++pos == hw) {
        pos = 0;
        if (++c == channels) c = 0;
        prm = op.get(static_cast<int64_t>(c));
      }
    }
    *reinterpret_cast<uint4*>(out + e) = vo;
  };
  auto scalar_item = [&](Index r) {
    const Index s = r - nvec;
    const Index e = s < head ? s : vec_end + (s - head);
    const Index q = hw_div.div(e);
    const Index c = q - ch_div.div(q) * channels;
    const A bv = Op::kBinary ? Io<T>::load(b[e]) : A(0);
    out[e] = Io<T>::store(op.apply(op.get(static_cast<int64_t>(c)), Io<T>::load(a[e]), bv));
  };

  // kItems items per thread and iteration, all loads issued before any is used: 64 bytes in
  // flight per thread for one input, 64 for two.
  constexpr int kItems = Op::kBinary ? 2 : 4;
  for (Index t = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; t < items;
       t += kItems * stride) {
    Index r[kItems];
    uint4 va[kItems], vb[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const Index ti = t + static_cast<Index>(i) * stride;
      r[i] = ti < items ? items - 1 - ti : items;  // `items`: no item
      va[i] = vb[i] = make_uint4(0, 0, 0, 0);
      if (r[i] < nvec) {
        va[i] = *reinterpret_cast<const uint4*>(a + head + r[i] * kVec);
        if (Op::kBinary) vb[i] = *reinterpret_cast<const uint4*>(b + head + r[i] * kVec);
      }
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (r[i] < nvec)
        vector_item(r[i], va[i], vb[i]);
      else if (r[i] < items)
        scalar_item(r[i]);
    }
  }
}

// --------------------------------------------------------------------------- backward reduce

template <typename T, typename A>
__device__ __forceinline__ void segment_sums(const T* dy, const T* x, int64_t len, A mean,
                                             A& s_dy, A& s_dyx) {
  constexpr int kVec = 16 / sizeof(T);
  int64_t head = static_cast<int64_t>(((16 - (reinterpret_cast<uintptr_t>(x) & 15)) & 15) /
                                      sizeof(T));
  if (head > len) head = len;
  const int64_t nvec = (len - head) / kVec;
  const int64_t tail = head + nvec * kVec;
  const int64_t nscalar = head + (len - tail);
  for (int64_t j = threadIdx.x; j < nscalar; j += kThreads) {
    const int64_t e = j < head ? j : tail + (j - head);
    const A g = Io<T>::load(dy[e]);
    s_dy += g;
    s_dyx = fma(g, Io<T>::load(x[e]) - mean, s_dyx);
  }
  const uint4* vdy = reinterpret_cast<const uint4*>(dy + head);
  const uint4* vx = reinterpret_cast<const uint4*>(x + head);
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

inline int device_sms() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  return sms;
}

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
    const int64_t most_blocks = (int64_t{1} << 31) - 1;  // grid.x limit
    if (plan->vec.count * c > most_blocks || plan->rows.count * c > most_blocks) return false;
  }
  const int64_t chunks = plan->vec.count > plan->rows.count ? plan->vec.count : plan->rows.count;
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
                             int64_t hw, int sms, Op op, cudaStream_t stream) {
  constexpr int64_t kVec = 16 / sizeof(T);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(a) % 16;
  bool vec = reinterpret_cast<uintptr_t>(out) % 16 == mis;
  if (b) vec = vec && reinterpret_cast<uintptr_t>(b) % 16 == mis;
  int64_t head = total, nvec = 0;
  if (vec) {
    head = mis == 0 ? 0 : static_cast<int64_t>((16 - mis) / sizeof(T));
    if (head > total) head = total;
    nvec = (total - head) / kVec;
  }
  const int64_t items = nvec + (total - nvec * kVec);
  // One wave of resident blocks (a second, partial wave of equal-sized blocks would idle SMs).
  auto grid = [&](auto kernel) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) !=
            cudaSuccess || per_sm <= 0)
      per_sm = 1;
    if (per_sm > kElementwiseBlocksPerSm) per_sm = kElementwiseBlocksPerSm;
    constexpr int64_t kItems = Op::kBinary ? 2 : 4;  // per thread and iteration (kernel)
    int64_t blocks = (items + kItems * kThreads - 1) / (kItems * kThreads);
    const int64_t most = static_cast<int64_t>(sms) * per_sm;
    if (blocks > most) blocks = most;
    return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
  };
  if (total < (int64_t{1} << 31)) {
    auto kernel = elementwise_kernel<T, uint32_t, Op>;
    kernel<<<grid(kernel), kThreads, 0, stream>>>(
        a, b, out, static_cast<uint32_t>(total), static_cast<uint32_t>(head),
        static_cast<uint32_t>(nvec), Div32(static_cast<uint64_t>(hw)),
        Div32(static_cast<uint64_t>(channels)), op);
  } else {
    auto kernel = elementwise_kernel<T, uint64_t, Op>;
    kernel<<<grid(kernel), kThreads, 0, stream>>>(
        a, b, out, static_cast<uint64_t>(total), static_cast<uint64_t>(head),
        static_cast<uint64_t>(nvec), Div64(static_cast<uint64_t>(hw)),
        Div64(static_cast<uint64_t>(channels)), op);
  }
  return launch_status();
}

// Short rows take kShortRows. Long rows take kPlaneVectors when every row starts on a 16-byte
// boundary in x (and dy), else kSegments when x and dy share their misalignment, else
// kShortRows (scalar loads, correct for any layout).
template <typename T>
inline int pass_mode(int64_t hw, int64_t plane, const void* x, const void* dy) {
  constexpr int64_t kVec = 16 / sizeof(T);
  if (hw < kRowPathMin) return kShortRows;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(x) % 16;
  if (dy && reinterpret_cast<uintptr_t>(dy) % 16 != mis) return kShortRows;
  if (mis == 0 && hw % kVec == 0 && plane / kVec < (int64_t{1} << 31)) return kPlaneVectors;
  return kSegments;
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
  const int mode = pass_mode<T>(hw, plan.plane, x, nullptr);
  const Chunking& ch = mode == kShortRows ? plan.rows : plan.vec;
  const unsigned grid = static_cast<unsigned>(ch.count * channels);
  const Div32 hwv(mode == kPlaneVectors ? static_cast<uint64_t>(hw / (16 / sizeof(T))) : 1);
  if (mode == kPlaneVectors)
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
  return launch_elementwise<T>(x, nullptr, y, n * channels * hw, channels, hw, sms,
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
                               n * channels * hw, channels, hw, sms, NormOp<A>{params, channels},
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
  const int mode = pass_mode<T>(hw, plan.plane, x, dy);
  const Chunking& ch = mode == kShortRows ? plan.rows : plan.vec;
  const int64_t chunks = sums ? ch.count : 0;
  (void)cudaGetLastError();
  if (chunks > 0) {
    const unsigned grid = static_cast<unsigned>(ch.count * channels);
    const A* m = static_cast<const A*>(mean);
    const Div32 hwv(mode == kPlaneVectors ? static_cast<uint64_t>(hw / (16 / sizeof(T))) : 1);
    if (mode == kPlaneVectors)
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
    return launch_elementwise<T>(dy, x, static_cast<T*>(dxv), total, channels, hw, sms,
                                 GradOp<A>{params, channels}, stream);
  return launch_elementwise<T>(dy, nullptr, static_cast<T*>(dxv), total, channels, hw, sms,
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
  switch (dtype) {
    case DK_FLOAT32:
      return train_forward<float>(x, weight, bias, running_mean, running_var, momentum, eps, y,
                                  save_mean, save_invstd, workspace, plan, batch, channels,
                                  spatial, sms, s);
    case DK_FLOAT16:
      return train_forward<__half>(x, weight, bias, running_mean, running_var, momentum, eps, y,
                                   save_mean, save_invstd, workspace, plan, batch, channels,
                                   spatial, sms, s);
    case DK_BFLOAT16:
      return train_forward<__nv_bfloat16>(x, weight, bias, running_mean, running_var, momentum,
                                          eps, y, save_mean, save_invstd, workspace, plan, batch,
                                          channels, spatial, sms, s);
    case DK_FLOAT64:
      return train_forward<double>(x, weight, bias, running_mean, running_var, momentum, eps, y,
                                   save_mean, save_invstd, workspace, plan, batch, channels,
                                   spatial, sms, s);
  }
  return DK_INVALID_ARGUMENT;
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
  switch (dtype) {
    case DK_FLOAT32:
      return eval_forward<float>(dtype, x, weight, bias, running_mean, running_var, eps, y,
                                 fold, workspace, plan, batch, channels, spatial, sms, s);
    case DK_FLOAT16:
      return eval_forward<__half>(dtype, x, weight, bias, running_mean, running_var, eps, y,
                                  fold, workspace, plan, batch, channels, spatial, sms, s);
    case DK_BFLOAT16:
      return eval_forward<__nv_bfloat16>(dtype, x, weight, bias, running_mean, running_var, eps,
                                         y, fold, workspace, plan, batch, channels, spatial,
                                         sms, s);
    case DK_FLOAT64:
      return eval_forward<double>(dtype, x, weight, bias, running_mean, running_var, eps, y,
                                  fold, workspace, plan, batch, channels, spatial, sms, s);
  }
  return DK_INVALID_ARGUMENT;
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
  switch (dtype) {
    case DK_FLOAT32:
      return backward<float>(dy, x, weight, mean, invstd, dx, dweight, dbias, workspace, plan,
                             batch, channels, spatial, training, sms, s);
    case DK_FLOAT16:
      return backward<__half>(dy, x, weight, mean, invstd, dx, dweight, dbias, workspace, plan,
                              batch, channels, spatial, training, sms, s);
    case DK_BFLOAT16:
      return backward<__nv_bfloat16>(dy, x, weight, mean, invstd, dx, dweight, dbias, workspace,
                                     plan, batch, channels, spatial, training, sms, s);
    case DK_FLOAT64:
      return backward<double>(dy, x, weight, mean, invstd, dx, dweight, dbias, workspace, plan,
                              batch, channels, spatial, training, sms, s);
  }
  return DK_INVALID_ARGUMENT;
}
