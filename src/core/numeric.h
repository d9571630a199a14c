// src/core/numeric.h — the number formats and the quantisation formula, one definition for the
// cpu backend and the cuda kernels (host + device), so results agree bit for bit.
//
//   bf16:  round-to-nearest-even from float32; NaN -> 0x7FC0.
//   fp16:  round-to-nearest-even from float32 (IEEE binary16: subnormals down to 2^-24, magnitudes
//          from 65520 on and infinities to +-inf); NaN -> 0x7E00.
//   fp8 e4m3fn: round-to-nearest-even, saturating to +-448 (inf and overflow saturate; NaN -> 0x7F).
//   Quantisation of one 128-channel group of a token (docs/semantics.md §2.2):
//     amax  = max(max_i |x_i|, 1e-4f)
//     scale = amax / 448.0f                      (float32 division)
//     round_scale: scale = next power of two >= scale (exact, on the bits)
//     inv   = 1.0f / scale;  q_i = e4m3(x_i * inv)
//     UE8M0 byte = biased exponent of the (power-of-two) scale; 4 bytes per int32, group g in
//     byte g % 4 of int g / 4 (little endian).
//   Reductions are plain float32 adds / fmaf in a fixed order; device code must not be compiled
//   with fast-math.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define EPX_HD __host__ __device__ __forceinline__
#else
#define EPX_HD inline
#endif

namespace epx::detail {

inline constexpr float kFp8Max = 448.0f;
inline constexpr float kAmaxFloor = 1e-4f;
inline constexpr int kQuantGroup = 128;

EPX_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

EPX_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

EPX_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

EPX_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Two conversions at once: low half = bf16(lo), high half = bf16(hi). Device code on sm_80+ uses
// the hardware cvt.rn.bf16x2.f32 (one instruction for two values instead of ~6 per value: the
// combine reducers' per-SM rate, docs/perf.md §6); f32_to_bf16 is its emulation (GPU test
// NumericGpu.HardwareBf16ConversionMatchesEmulationOnEveryFloat compares all 2^32 inputs). NaN is
// forced to 0x7FC0 as above (the hardware's NaN is 0x7FFF).
EPX_HD uint32_t f32x2_to_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  if (lo != lo) r = (r & 0xFFFF0000u) | 0x7FC0u;
  if (hi != hi) r = (r & 0x0000FFFFu) | 0x7FC00000u;
  return r;
#else
  return static_cast<uint32_t>(f32_to_bf16(lo)) | static_cast<uint32_t>(f32_to_bf16(hi)) << 16;
#endif
}

// fp16 (IEEE binary16): s.eeeee.mmmmmmmmmm; e == 0: m * 2^-24; e == 31: inf (m == 0) or NaN.
// Exact. On the device the hardware conversion (__half2float), whose NaN payload may differ: a
// NaN in a sum makes the sum NaN, which f32_to_f16 writes as 0x7E00 either way.
EPX_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13));  // inf, NaN
  if (e == 0) return bits_f32(f32_bits(static_cast<float>(m) * bits_f32(0x33800000u)) | sign);
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));  // rebias 15 -> 127
#endif
}

// Round-to-nearest-even (cvt.rn.f16.f32's rounding), NaN -> 0x7E00 whatever its sign and payload.
EPX_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7E00;          // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00;  // >= 65520, the tie of 65504 and 2^16: inf
  if (a < 0x33000000u) return sign;            // < 2^-25, half the smallest subnormal: zero
  if (a < 0x38800000u) {                       // < 2^-14: the subnormal grid q * 2^-24
    // |f| = mant * 2^(e - 150), so q = mant * 2^(e - 126) rounded: shift by s = 126 - e.
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t s = 126u - (a >> 23);  // 14..24
    uint32_t q = mant >> s;
    const uint32_t rem = mant & ((1u << s) - 1u), half = 1u << (s - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 0x400: the smallest normal
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t h = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3FFu);  // rebias 127 -> 15
  const uint32_t rem = a & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

// Two conversions at once: low half = fp16(lo), high half = fp16(hi). Device code uses the
// hardware conversion (__floats2half2_rn: cvt.rn.f16x2.f32 on sm_80+); f32_to_f16 is its
// emulation (GPU test NumericGpu.HardwareF16ConversionMatchesEmulationOnEveryFloat compares all
// 2^32 inputs). NaN is forced to 0x7E00 as above (the hardware's NaN is 0x7FFF).
EPX_HD uint32_t f32x2_to_f16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t r;
  std::memcpy(&r, &v, 4);
  if (lo != lo) r = (r & 0xFFFF0000u) | 0x7E00u;
  if (hi != hi) r = (r & 0x0000FFFFu) | 0x7E000000u;
  return r;
#else
  return static_cast<uint32_t>(f32_to_f16(lo)) | static_cast<uint32_t>(f32_to_f16(hi)) << 16;
#endif
}

EPX_HD float fp8_e4m3_to_f32(uint8_t v) {
  const uint32_t sign = (v & 0x80u) << 24;
  const uint32_t e = (v >> 3) & 0xFu, m = v & 0x7u;
  if (e == 0xF && m == 0x7) return bits_f32(sign | 0x7FC00000u);  // NaN
  float mag;
  if (e == 0) {
    mag = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else {
    mag = bits_f32(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e-7)
  }
  return bits_f32(f32_bits(mag) | sign);
}

// Round-to-nearest-even, saturate to finite (matches cvt.rn.satfinite.e4m3x2.f32).
EPX_HD uint8_t f32_to_fp8_e4m3(float f) {
  const uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;                      // NaN
  if (a >= 0x43E00000u) return sign | 0x7E;              // >= 448 (incl. inf): saturate
  if (a < 0x3C800000u) {                                 // < 2^-6: subnormal grid m * 2^-9
    // Exact RNE of a * 2^9 in [0, 8]: a * 512 is exact; round the fraction by hand.
    const float s = bits_f32(a) * 512.0f;
    uint32_t q = static_cast<uint32_t>(s);  // truncation
    const float frac = s - static_cast<float>(q);
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);  // q == 8 encodes the smallest normal 2^-6
  }
  int32_t e = static_cast<int32_t>(a >> 23) - 127;  // -6..8
  uint32_t m = (a >> 20) & 0x7u;
  const uint32_t rem = a & 0xFFFFFu;
  if (rem > 0x80000u || (rem == 0x80000u && (m & 1u))) {
    if (++m == 8) {
      m = 0;
      ++e;
    }
  }
  if (e > 8 || (e == 8 && m == 7)) return sign | 0x7E;
  return sign | static_cast<uint8_t>(((e + 7) << 3) | static_cast<int32_t>(m));
}

// Two conversions at once: byte 0 = e4m3(lo), byte 1 = e4m3(hi). Device code on sm_89+ uses
// the hardware cvt.rn.satfinite.e4m3x2.f32 (one instruction instead of ~40 branchy ones per
// value: the ll fp8 send was bound by the emulation, docs/perf.md §6); f32_to_fp8_e4m3 is
// its emulation (GPU test NumericGpu.HardwareFp8ConversionMatchesEmulationOnEveryFloat: all 2^32
// inputs). NaN is forced to 0x7F as above whatever the hardware makes of its sign
// (fp8_nan_bytes_to_7f).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// The hardware's two bytes in the low half of a 32-bit word, as it makes them (NaN's sign kept).
__device__ __forceinline__ uint32_t f32x2_to_fp8x2_e4m3_hw(float lo, float hi) {
  uint32_t r;
  asm("{\n\t.reg .b16 q;\n\tcvt.rn.satfinite.e4m3x2.f32 q, %1, %2;\n\tmov.b32 %0, {q, 0};\n\t}"
      : "=r"(r)
      : "f"(hi), "f"(lo));
  return r;
}
// Every e4m3 NaN byte of w (0x7F or 0xFF) as 0x7F. With .satfinite a finite input never becomes
// either (the largest finite byte is 0x7E), so they are exactly the NaNs; adding 1 to a byte's
// low 7 bits carries into its bit 7 for them alone, and that bit clears the sign: three integer
// instructions per word instead of a compare and a select per value.
__device__ __forceinline__ uint32_t fp8_nan_bytes_to_7f(uint32_t w) {
  return w & ~(((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u);
}
#endif
EPX_HD uint16_t f32x2_to_fp8x2_e4m3(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<uint16_t>(fp8_nan_bytes_to_7f(f32x2_to_fp8x2_e4m3_hw(lo, hi)));
#else
  return static_cast<uint16_t>(f32_to_fp8_e4m3(lo) | (f32_to_fp8_e4m3(hi) << 8));
#endif
}

// Four values packed little endian (byte i = e4m3 of the i-th argument); on the device one NaN
// fix-up for the word.
EPX_HD uint32_t f32x4_to_fp8x4_e4m3(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return fp8_nan_bytes_to_7f(f32x2_to_fp8x2_e4m3_hw(a, b) | f32x2_to_fp8x2_e4m3_hw(c, d) << 16);
#else
  return f32x2_to_fp8x2_e4m3(a, b) | static_cast<uint32_t>(f32x2_to_fp8x2_e4m3(c, d)) << 16;
#endif
}

// sizeof(V) / 2 floats rounded to bf16 (kF16: to fp16) and packed little endian into a V
// (16-bit element i = the rounding of f[i]), two at a time.
template <typename V, bool kF16 = false>
EPX_HD V f32_to_16bit_vec(const float* f) {
  static_assert(sizeof(V) % 4 == 0, "f32_to_16bit_vec: V must hold whole pairs");
  uint32_t w[sizeof(V) / 4];
  for (int i = 0; i < static_cast<int>(sizeof(V) / 4); ++i) {
    if constexpr (kF16)
      w[i] = f32x2_to_f16x2(f[2 * i], f[2 * i + 1]);
    else
      w[i] = f32x2_to_bf16x2(f[2 * i], f[2 * i + 1]);
  }
  V v;
  std::memcpy(&v, w, sizeof(V));
  return v;
}

template <typename V>
EPX_HD V f32_to_bf16_vec(const float* f) {
  return f32_to_16bit_vec<V>(f);
}

// Smallest power of two >= x (x > 0, finite, normal).
EPX_HD float round_up_pow2(float x) {
  uint32_t u = f32_bits(x);
  if (u & 0x7FFFFFu) u = (u & 0xFF800000u) + 0x800000u;
  return bits_f32(u & 0xFF800000u);
}

// Scale of one group from its amax, per the formula above.
EPX_HD float fp8_scale_from_amax(float amax, bool round_scale) {
  float scale = (amax > kAmaxFloor ? amax : kAmaxFloor) / kFp8Max;
  return round_scale ? round_up_pow2(scale) : scale;
}

EPX_HD uint8_t ue8m0_of_scale(float pow2_scale) {
  return static_cast<uint8_t>((f32_bits(pow2_scale) >> 23) & 0xFFu);
}

// max_i |x_i| over n bf16 values, in index order (0 for n = 0; NaNs are skipped).
EPX_HD float amax_bf16(const uint16_t* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float v = bf16_to_f32(x[i]);
    v = v < 0 ? -v : v;
    amax = v > amax ? v : amax;
  }
  return amax;
}

// Host reference: quantise one token row of `hidden` bf16 values.
// q[hidden] fp8 bytes, scales[hidden / 128] float32 (the scale, i.e. amax / 448 possibly rounded).
inline void quantize_row_fp8(const uint16_t* x, int64_t hidden, bool round_scale, uint8_t* q,
                             float* scales) {
  for (int64_t g = 0; g < hidden / kQuantGroup; ++g) {
    const float scale =
        fp8_scale_from_amax(amax_bf16(x + g * kQuantGroup, kQuantGroup), round_scale);
    const float inv = 1.0f / scale;
    for (int i = 0; i < kQuantGroup; ++i)
      q[g * kQuantGroup + i] = f32_to_fp8_e4m3(bf16_to_f32(x[g * kQuantGroup + i]) * inv);
    scales[g] = scale;
  }
}

}  // namespace epx::detail
