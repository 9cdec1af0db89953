// Helpers shared by the CUDA kernels: the storage type of a dk_dtype, loads / stores of each
// storage type, integer
// division by a launch-time constant, the aligned head / vector / tail split of a range, and the
// per-channel elementwise map over an NCHW tensor that FusedBatchNorm, the BatchNorm normalize
// pass and the BatchNorm backward dx pass all run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "deploykit/kernels.h"

namespace dk {
namespace cuda {

// Storage type -> accumulation type (fp32, double for double), exact loads, round-to-nearest
// stores.
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

// Calls f(T{}) with T the storage type of dtype and returns its status: float, __half,
// __nv_bfloat16, and double where kFloat64 (the BatchNorm training kernels); any other dtype is
// DK_INVALID_ARGUMENT. One switch for every C entry point.
template <bool kFloat64 = false, typename F>
dk_status with_storage_type(dk_dtype dtype, F&& f) {
  switch (dtype) {
    case DK_FLOAT32:
      return f(float{});
    case DK_FLOAT16:
      return f(__half{});
    case DK_BFLOAT16:
      return f(__nv_bfloat16{});
    case DK_FLOAT64:
      if constexpr (kFloat64) return f(double{});
      break;
  }
  return DK_INVALID_ARGUMENT;
}

// max(v, 0) that keeps NaN (like torch.relu), the same on CPU and GPU.
__device__ __forceinline__ float relu(float v) { return v < 0.0f ? 0.0f : v; }

// n / d for a divisor fixed at launch. Div32 needs n < 2^31: with s = ceil(log2 d) and
// m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(n, m) + n) >> s (no overflow below 2^31),
// a multiply-high and a shift instead of the ~20-instruction integer division.
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

// A range of `len` elements of `elem` bytes starting at `addr`, cut into a scalar head up to the
// first 16-byte boundary, `nvec` 16-byte vectors, and a scalar tail from `tail` on.
struct VecSplit {
  int64_t head, nvec, tail;
};
__host__ __device__ __forceinline__ VecSplit vec_split(uintptr_t addr, int64_t len,
                                                       int64_t elem) {
  int64_t head = static_cast<int64_t>((16 - (addr & 15)) & 15) / elem;
  if (head > len) head = len;
  const int64_t nvec = (len - head) / (16 / elem);
  return VecSplit{head, nvec, head + nvec * (16 / elem)};
}

// 16-byte accesses of streamed data, read or written once: loads skip L1, stores are marked
// evict-first in L2 (.cs) so they do not push out data a later pass re-reads. The loads are
// coherent (not .nc), since an elementwise output may alias its input exactly.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void store_stream(void* p, const uint4& v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// ----------------------------------------------------------------- per-channel elementwise map

// out[e] = op.apply(op.get(channel of e), a[e], b[e]) over a contiguous (N, C, HW) tensor; b is
// read only when Op::kBinary. Op provides a parameter type P, get(c) -> P and
// apply(P, A a, A b) -> A (A = Io<T>::Acc).
//
// One block per tile of kMapThreads * U 16-byte vectors (no grid-stride loop: the block
// scheduler balances the SMs and the last wave is short). Each thread issues its U loads (and
// the parameter loads) before it uses any, so U * 16 bytes per input are in flight per thread.
// Tiles run from the end of the tensor to its start: the BatchNorm statistics pass reads the
// end last, so the normalize pass starts on data still in L2. A vector inside one channel takes
// one set of parameters. When rows hold at least a vector, one that crosses a row end takes the
// next channel's parameters too (loaded with its data, only for such vectors) and picks per lane
// with a select: on 7x7 rows one vector in six (fp16) crosses, and stepping lane by lane with a
// dependent load there cost 14% on (256, 2048, 7, 7). Shorter rows step lane by lane. Elements
// outside the 16-byte aligned middle (or all of them, when a, b and out are misaligned
// differently) go through scalar tiles after the vector tiles. out may alias a (or b) exactly:
// each element is read before it is written, by the same thread.
constexpr int kMapThreads = 256;

// c ? a : b for a parameter struct, word by word: a select of the struct itself put it in local
// memory.
template <typename P>
__device__ __forceinline__ P pick(bool c, const P& a, const P& b) {
  static_assert(sizeof(P) % 4 == 0, "parameter structs hold 4- or 8-byte fields");
  uint32_t wa[sizeof(P) / 4], wb[sizeof(P) / 4];
  memcpy(wa, &a, sizeof(P));
  memcpy(wb, &b, sizeof(P));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(P) / 4); ++i) wa[i] = c ? wa[i] : wb[i];
  P r;
  memcpy(&r, wa, sizeof(P));
  return r;
}

template <typename Index>
struct MapShape {
  Index head, nvec, tail, nscalar, vec_tiles;  // nscalar = head + elements from tail on
  typename DivFor<Index>::type hw, ch;
};

template <typename T, typename Index, typename Op, int U, bool kStream>
__global__ void __launch_bounds__(kMapThreads)
    channel_map_kernel(const T* a, const T* b, T* out, MapShape<Index> sh, Op op) {
  using A = typename Io<T>::Acc;
  constexpr int kVec = 16 / sizeof(T);
  constexpr Index kTile = static_cast<Index>(kMapThreads) * U;
  const Index hw = static_cast<Index>(sh.hw.d), channels = static_cast<Index>(sh.ch.d);
  const Index tile = static_cast<Index>(blockIdx.x);
  if (tile < sh.vec_tiles) {
    const Index v0 = (sh.vec_tiles - 1 - tile) * kTile + threadIdx.x;
    // rest[u]: lanes of vector u left in its row (>= kVec: the vector stays in one channel).
    Index e[U], rest[U];
    typename Op::P p[U], p1[U];
    uint4 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const Index v = v0 + static_cast<Index>(u) * kMapThreads;
      if (v < sh.nvec) {
        e[u] = sh.head + v * kVec;
        const Index q = sh.hw.div(e[u]);
        const Index c = q - sh.ch.div(q) * channels;
        rest[u] = hw - (e[u] - q * hw);
        p[u] = op.get(static_cast<int64_t>(c));
        // Rows of >= kVec lanes: a vector crosses at most one row end, into channel c + 1
        // (wrapping to 0). Its parameters load here, with the data, and only for such vectors.
        if (rest[u] < kVec && hw >= kVec)
          p1[u] = op.get(static_cast<int64_t>(c + 1 == channels ? 0 : c + 1));
        va[u] = kStream ? load_stream(a + e[u]) : *reinterpret_cast<const uint4*>(a + e[u]);
        if (Op::kBinary)
          vb[u] = kStream ? load_stream(b + e[u]) : *reinterpret_cast<const uint4*>(b + e[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (v0 + static_cast<Index>(u) * kMapThreads >= sh.nvec) continue;
      const T* ea = reinterpret_cast<const T*>(&va[u]);
      const T* eb = reinterpret_cast<const T*>(&vb[u]);
      uint4 vo;
      T* eo = reinterpret_cast<T*>(&vo);
      if (rest[u] >= kVec) {
#pragma unroll
        for (int l = 0; l < kVec; ++l)
          eo[l] = Io<T>::store(op.apply(p[u], Io<T>::load(ea[l]),
                                        Op::kBinary ? Io<T>::load(eb[l]) : A(0)));
      } else if (hw >= kVec) {  // one row end: lanes from rest[u] on take channel c + 1
#pragma unroll
        for (int l = 0; l < kVec; ++l)
          eo[l] = Io<T>::store(op.apply(pick(static_cast<Index>(l) < rest[u], p[u], p1[u]),
                                        Io<T>::load(ea[l]),
                                        Op::kBinary ? Io<T>::load(eb[l]) : A(0)));
      } else {  // rows shorter than a vector: step lane by lane
        Index ps = hw - rest[u], cc = sh.hw.div(e[u]);
        cc -= sh.ch.div(cc) * channels;
        typename Op::P q = p[u];
#pragma unroll
        for (int l = 0; l < kVec; ++l) {
          eo[l] = Io<T>::store(
              op.apply(q, Io<T>::load(ea[l]), Op::kBinary ? Io<T>::load(eb[l]) : A(0)));
          if (l + 1 < kVec && ++ps == hw) {
            ps = 0;
            if (++cc == channels) cc = 0;
            q = op.get(static_cast<int64_t>(cc));
          }
        }
      }
      if (kStream)
        store_stream(out + e[u], vo);
      else
        *reinterpret_cast<uint4*>(out + e[u]) = vo;
    }
  } else {
    const Index s0 = (tile - sh.vec_tiles) * kTile + threadIdx.x;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const Index s = s0 + static_cast<Index>(u) * kMapThreads;
      if (s >= sh.nscalar) break;
      const Index e = s < sh.head ? s : sh.tail + (s - sh.head);
      const Index q = sh.hw.div(e);
      const Index c = q - sh.ch.div(q) * channels;
      const A bv = Op::kBinary ? Io<T>::load(b[e]) : A(0);
      out[e] = Io<T>::store(op.apply(op.get(static_cast<int64_t>(c)), Io<T>::load(a[e]), bv));
    }
  }
}

// Launches channel_map_kernel over `total` elements of (., channels, hw); false if the launch
// failed. 16-byte vectors when a, out (and b) share their misalignment.
template <typename T, typename Op, int U, bool kStream>
bool launch_channel_map(const T* a, const T* b, T* out, int64_t total, int64_t channels,
                        int64_t hw, const Op& op, cudaStream_t stream) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(a) % 16;
  bool vec = reinterpret_cast<uintptr_t>(out) % 16 == mis;
  if (Op::kBinary) vec = vec && reinterpret_cast<uintptr_t>(b) % 16 == mis;
  VecSplit sp = vec_split(reinterpret_cast<uintptr_t>(a), total, sizeof(T));
  if (!vec) sp = VecSplit{total, 0, total};
  const int64_t nscalar = sp.head + (total - sp.tail);
  constexpr int64_t kTile = int64_t{kMapThreads} * U;
  const int64_t vec_tiles = (sp.nvec + kTile - 1) / kTile;
  const int64_t tiles = vec_tiles + (nscalar + kTile - 1) / kTile;
  if (tiles > 0x7fffffff) return false;
  (void)cudaGetLastError();  // clear a stale error of this runtime so the check below is ours
  if (total < (int64_t{1} << 31)) {
    const MapShape<uint32_t> sh{static_cast<uint32_t>(sp.head), static_cast<uint32_t>(sp.nvec),
                                static_cast<uint32_t>(sp.tail), static_cast<uint32_t>(nscalar),
                                static_cast<uint32_t>(vec_tiles),
                                Div32(static_cast<uint64_t>(hw)),
                                Div32(static_cast<uint64_t>(channels))};
    channel_map_kernel<T, uint32_t, Op, U, kStream>
        <<<static_cast<unsigned>(tiles), kMapThreads, 0, stream>>>(a, b, out, sh, op);
  } else {
    const MapShape<uint64_t> sh{static_cast<uint64_t>(sp.head), static_cast<uint64_t>(sp.nvec),
                                static_cast<uint64_t>(sp.tail), static_cast<uint64_t>(nscalar),
                                static_cast<uint64_t>(vec_tiles),
                                Div64(static_cast<uint64_t>(hw)),
                                Div64(static_cast<uint64_t>(channels))};
    channel_map_kernel<T, uint64_t, Op, U, kStream>
        <<<static_cast<unsigned>(tiles), kMapThreads, 0, stream>>>(a, b, out, sh, op);
  }
  return cudaGetLastError() == cudaSuccess;
}

// The map as the BatchNorm kernels run it: U = 4 vectors per thread for one input, 2 per input
// for two (64 bytes in flight per thread either way), streaming loads and stores. Measured on
// the H200: U = 8 ran no faster on large tensors and slower on (256, 2048, 7, 7) (fewer
// resident blocks); plain loads and stores ran the same.
template <typename T, typename Op>
bool channel_map(const T* a, const T* b, T* out, int64_t total, int64_t channels, int64_t hw,
                 const Op& op, cudaStream_t stream) {
  return launch_channel_map<T, Op, Op::kBinary ? 2 : 4, true>(a, b, out, total, channels, hw, op,
                                                              stream);
}

}  // namespace cuda
}  // namespace dk
