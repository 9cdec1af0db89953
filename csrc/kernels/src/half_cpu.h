// fp16 / bf16 <-> fp32 conversions for the CPU kernels, written as plain bit manipulation with
// mask selects instead of branches or ?: (which GCC keeps as control flow) so loops over them
// vectorise. fp32 -> half types round to nearest,
// ties to even; NaN stays NaN (quiet), infinities and overflow give infinity.
#pragma once

#include <cstdint>
#include <cstring>

// Hot loops are compiled twice on x86-64 Linux with GCC, for AVX2 and for the baseline, and the
// loader picks one (ifunc). AVX2 without FMA: no contraction, so results are identical on every
// machine.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define DK_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DK_CPU_CLONES
#endif

namespace dk {
namespace cpu {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// cond ? a : b without a branch.
inline uint32_t select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

// max(v, 0) that keeps NaN (like torch.relu); a mask select, so it vectorises next to the
// conversions below.
inline float relu(float v) { return bits_to_float(select(v < 0.0f, 0u, float_to_bits(v))); }

// IEEE binary16 -> binary32 (exact).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;  // exponent and mantissa
  // Normal numbers: move the mantissa up by 13 bits and rebias the exponent (15 -> 127).
  uint32_t normal = (mag << 13) + ((127u - 15u) << 23);
  // Infinity and NaN: all-ones exponent, mantissa (NaN payload) kept.
  normal = select(mag >= 0x7c00u, (mag << 13) | 0x7f800000u, normal);
  // Zero and subnormals: value = mantissa * 2^-24, exact in fp32 (and computed from an integer,
  // so a denormals-are-zero mode cannot affect it).
  const float sub = static_cast<float>(static_cast<int32_t>(mag)) * 5.9604644775390625e-08f;
  const uint32_t mag_bits = select(mag < 0x0400u, float_to_bits(sub), normal);
  return bits_to_float(mag_bits | sign);
}

// IEEE binary32 -> binary16, round to nearest even.
inline uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t mag = u & 0x7fffffffu;

  // Normal half range: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits
  // to nearest even by adding 0xfff plus the lowest kept bit before truncating.
  const uint32_t odd = (mag >> 13) & 1u;
  const uint32_t normal = (mag + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd) >> 13;

  // Below 2^-14 the result is subnormal (or zero): adding 0.5f aligns the value so that the
  // hardware's round-to-nearest-even addition leaves the half's mantissa in the low bits.
  const float aligned = bits_to_float(mag) + 0.5f;
  const uint32_t subnormal = float_to_bits(aligned) - 0x3f000000u;

  uint32_t r = select(mag < 0x38800000u, subnormal, normal);
  // Values that round to at least 65520 overflow to infinity.
  r = select(mag >= 0x477ff000u, 0x7c00u, r);
  // NaN: keep the top of the payload and force a quiet NaN.
  r = select(mag > 0x7f800000u, 0x7e00u | ((mag >> 13) & 0x3ffu), r);
  return static_cast<uint16_t>(r | sign);
}

// bfloat16 -> binary32 (exact: bf16 is the top half of an fp32).
inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// binary32 -> bfloat16, round to nearest even; NaN stays a quiet NaN.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>(select((u & 0x7fffffffu) > 0x7f800000u, nan, rounded));
}

// Storage types with load/store in fp32, so kernels are written once for all dtypes.
struct F32 {
  using storage = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F16 {
  using storage = uint16_t;
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float v) { return float_to_half(v); }
};
struct BF16 {
  using storage = uint16_t;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float v) { return float_to_bf16(v); }
};

}  // namespace cpu
}  // namespace dk
