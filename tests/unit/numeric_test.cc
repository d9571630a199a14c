// core/numeric.h against scalar references written here from the format definitions (no bit
// tricks shared with numeric.h): fp8 e4m3fn decode of all 256 codes; encode at every code, every
// midpoint between neighbours (ties to even) and the floats just around them, saturation, inf,
// NaN, subnormals and random floats; bf16 round-to-nearest-even against a double reference; fp16
// (IEEE binary16) decode of all 65536 codes and round-to-nearest-even at every code, every
// midpoint and the floats around them, overflow to inf, subnormals and random floats;
// quantize_row_fp8 against the formula of docs/semantics.md §2.2 computed in double (random rows,
// all-zero rows, huge and tiny values, round_scale on and off, UE8M0 bytes).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "core/numeric.h"

namespace epx::detail {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- fp8 e4m3fn reference ------------------------------------------------------------------
// Code s.eeee.mmm: e == 0 -> m/8 * 2^-6; else (1 + m/8) * 2^(e - 7); s.1111.111 is NaN; no inf.
double e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (code & 0x80) ? -mag : mag;
}
bool e4m3_is_nan(uint8_t code) {
  return (code & 0x7F) == 0x7F;
}

// Nearest finite e4m3 to f (ties to the even code), |f| > 448 saturating, NaN -> 0x7F.
uint8_t e4m3_encode_ref(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 448.0) return sign | 0x7E;
  uint8_t best = 0;
  for (uint8_t c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(a - e4m3_value(c)), db = std::fabs(a - e4m3_value(best));
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return sign | best;
}

TEST(Fp8E4m3, DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float got = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    if (e4m3_is_nan(static_cast<uint8_t>(c))) {
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), e4m3_value(static_cast<uint8_t>(c))) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;  // -0 keeps its sign
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
}

TEST(Fp8E4m3, EncodesEveryCodeExactly) {
  for (int c = 0; c < 256; ++c) {
    if (e4m3_is_nan(static_cast<uint8_t>(c))) continue;
    const float v = static_cast<float>(e4m3_value(static_cast<uint8_t>(c)));
    EXPECT_EQ(f32_to_fp8_e4m3(v), c) << "value " << v;
  }
}

TEST(Fp8E4m3, MidpointsTieToEvenAndNeighboursRoundToNearest) {
  int checked = 0;
  for (int c = 0; c < 0x7E; ++c) {  // pairs (c, c + 1) of non-negative finite codes
    const double lo = e4m3_value(static_cast<uint8_t>(c)), hi = e4m3_value(c + 1);
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint exact in float";
    const int even = (c % 2 == 0) ? c : c + 1;
    for (float sign : {1.0f, -1.0f}) {
      const uint8_t sbit = sign < 0 ? 0x80 : 0;
      EXPECT_EQ(f32_to_fp8_e4m3(sign * mid), sbit | even) << "tie at " << sign * mid;
      const float below = std::nextafter(mid, 0.0f), above = std::nextafter(mid, 1000.0f);
      EXPECT_EQ(f32_to_fp8_e4m3(sign * below), sbit | c) << "just below " << sign * mid;
      EXPECT_EQ(f32_to_fp8_e4m3(sign * above), sbit | (c + 1)) << "just above " << sign * mid;
      // Just around the representable values themselves.
      const float v = static_cast<float>(hi);
      EXPECT_EQ(f32_to_fp8_e4m3(sign * std::nextafter(v, 0.0f)), sbit | (c + 1));
      EXPECT_EQ(f32_to_fp8_e4m3(sign * std::nextafter(v, 1000.0f)), sbit | (c + 1));
      checked += 5;
    }
  }
  EXPECT_EQ(checked, 0x7E * 10);
}

TEST(Fp8E4m3, SaturatesInfAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float v :
       {448.0f, std::nextafter(448.0f, 1e9f), 463.9f, 464.0f, 480.0f, 500.0f, 1e6f, 3.0e38f, inf}) {
    EXPECT_EQ(f32_to_fp8_e4m3(v), 0x7E) << v;
    EXPECT_EQ(f32_to_fp8_e4m3(-v), 0xFE) << -v;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(448.0f, 0.0f)), 0x7E);  // rounds to 448
  EXPECT_EQ(f32_to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(f32_to_fp8_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(f32_to_fp8_e4m3(from_bits(0x7F800001u)), 0x7F);  // signalling NaN
}

TEST(Fp8E4m3, SubnormalsAndZero) {
  EXPECT_EQ(f32_to_fp8_e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(-0.0f), 0x80);
  const float half_min = std::ldexp(1.0f, -10);  // midpoint of 0 and 2^-9: ties to 0
  EXPECT_EQ(f32_to_fp8_e4m3(half_min), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(half_min, 1.0f)), 0x01);
  EXPECT_EQ(f32_to_fp8_e4m3(-std::nextafter(half_min, 1.0f)), 0x81);
  EXPECT_EQ(f32_to_fp8_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(f32_to_fp8_e4m3(1e-30f), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(7.5f * std::ldexp(1.0f, -9)), 0x08);  // 7.5 -> 8: smallest normal
  EXPECT_EQ(f32_to_fp8_e4m3(6.5f * std::ldexp(1.0f, -9)), 0x06);  // tie to even
}

// n random floats, half m * 2^e (m in [1, 2), e in [min_exp, max_exp]), half any bit pattern, a
// third negated, through `got` and `want`: the number of differing codes (the first few reported).
template <typename Got, typename Want>
int64_t random_float_mismatches(uint64_t seed, int min_exp, int max_exp, int n, Got got,
                                Want want) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> expo(min_exp, max_exp);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  int64_t mismatches = 0;
  for (int i = 0; i < n; ++i) {
    float f = i % 2 ? std::ldexp(mant(rng), expo(rng)) : from_bits(static_cast<uint32_t>(rng()));
    if (i % 3 == 0) f = -f;
    const unsigned g = got(f), w = want(f);
    if (g != w && ++mismatches < 10)
      ADD_FAILURE() << "f = " << f << " got 0x" << std::hex << g << " want 0x" << w;
  }
  return mismatches;
}

TEST(Fp8E4m3, RandomFloatsMatchReference) {
  EXPECT_EQ(random_float_mismatches(1, -14, 10, 200000, f32_to_fp8_e4m3, e4m3_encode_ref), 0);
}

// ---- bf16 ----------------------------------------------------------------------------------

// Nearest bf16 by value (double arithmetic), ties to the even code; NaN -> 0x7FC0.
uint16_t bf16_ref(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = to_bits(f);
  const uint32_t sign = u & 0x80000000u, mag = u & 0x7FFFFFFFu;
  const uint32_t lo = mag & 0xFFFF0000u, hi = lo + 0x10000u;  // neighbours in magnitude
  const double a = std::fabs(static_cast<double>(f));
  const double vlo = from_bits(lo);
  // hi may be +inf (0x7F800000): its value for rounding purposes is 2^128.
  const double vhi = hi == 0x7F800000u ? std::ldexp(1.0, 128) : from_bits(hi);
  if (mag >= 0x7F800000u) return static_cast<uint16_t>(u >> 16);  // inf stays inf
  const double dlo = a - vlo, dhi = vhi - a;
  uint32_t pick;
  if (dlo < dhi)
    pick = lo;
  else if (dhi < dlo)
    pick = hi;
  else
    pick = ((lo >> 16) & 1) ? hi : lo;
  return static_cast<uint16_t>((sign | pick) >> 16);
}

TEST(Bf16, RoundsToNearestEvenLikeDoubleReference) {
  std::mt19937_64 rng(2);
  int64_t mismatches = 0;
  auto check = [&](uint32_t bits) {
    const float f = from_bits(bits);
    const uint16_t got = f32_to_bf16(f), want = bf16_ref(f);
    if (got != want && ++mismatches < 10)
      ADD_FAILURE() << "bits 0x" << std::hex << bits << " got 0x" << got << " want 0x" << want;
  };
  for (int i = 0; i < 100000; ++i) {
    const uint32_t top = static_cast<uint32_t>(rng()) & 0xFFFF0000u;
    for (uint32_t low : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu,
                         static_cast<uint32_t>(rng()) & 0xFFFFu})
      check(top | low);
  }
  for (uint32_t bits :
       {0x00000000u, 0x80000000u, 0x00008000u, 0x00018000u, 0x007FFFFFu, 0x7F7F7FFFu, 0x7F7F8000u,
        0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0xFF800000u})
    check(bits);
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7F7FFFFFu)), 0x7F80);  // max float rounds to inf
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  EXPECT_EQ(f32_to_bf16(from_bits(0xFF800001u)), 0x7FC0);
}

TEST(Bf16, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = bf16_to_f32(static_cast<uint16_t>(c));
    EXPECT_EQ(to_bits(f), c << 16);
    if (!std::isnan(f)) EXPECT_EQ(f32_to_bf16(f), c) << c;
  }
}

// ---- fp16 (IEEE binary16) ------------------------------------------------------------------
// Code s.eeeee.mmmmmmmmmm: e == 0 -> m * 2^-24; 0 < e < 31 -> (1024 + m) * 2^(e - 25); e == 31:
// inf (m == 0) or NaN.
double f16_value(uint16_t code) {
  const int e = (code >> 10) & 31, m = code & 1023;
  const double mag = e == 0    ? std::ldexp(m, -24)
                     : e == 31 ? (m ? std::nan("") : std::numeric_limits<double>::infinity())
                               : std::ldexp(1024 + m, e - 25);
  return (code & 0x8000) ? -mag : mag;
}

// fp16 of f by value: the quantum of |f|'s binade is 2^(max(E, -14) - 10) (|f| in [2^E, 2^(E+1)));
// |f| / quantum rounded to the nearest integer, ties to even (nearbyint's default mode), counts
// codes from the binade's first: code = max(E + 14, 0) * 1024 + that count (a count of 2048
// carries into the next binade; 1024 below 2^-14 is the smallest normal). Magnitudes of at least
// 65520 (the midpoint of 65504 and 2^16, a tie to the even 2^16) and inf: inf. NaN: 0x7E00.
uint16_t f16_ref(float f) {
  if (std::isnan(f)) return 0x7E00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;
  if (a == 0.0) return sign;
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const int binade = e - 1;
  const double count = std::nearbyint(std::ldexp(a, 10 - std::max(binade, -14)));
  return sign | static_cast<uint16_t>(std::max(binade + 14, 0) * 1024 + static_cast<int>(count));
}

TEST(F16, EveryCodeDecodesAndRoundTrips) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const uint16_t code = static_cast<uint16_t>(c);
    const float f = f16_to_f32(code);
    const double want = f16_value(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << "code 0x" << std::hex << c;
      EXPECT_EQ(f32_to_f16(f), 0x7E00) << "code 0x" << std::hex << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(f), want) << "code 0x" << std::hex << c;
    EXPECT_EQ(std::signbit(f), (c & 0x8000) != 0) << "code 0x" << std::hex << c;
    EXPECT_EQ(f32_to_f16(f), c) << "code 0x" << std::hex << c;
    EXPECT_EQ(f16_ref(f), c) << "reference, code 0x" << std::hex << c;
  }
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));  // smallest normal
}

TEST(F16, MidpointsTieToEvenAndNeighboursRoundToNearest) {
  int checked = 0;
  for (uint32_t c = 0; c < 0x7C00; ++c) {  // pairs (c, c + 1), c + 1 up to inf
    const double lo = f16_value(static_cast<uint16_t>(c));
    const double hi = c + 1 == 0x7C00 ? 65536.0 : f16_value(static_cast<uint16_t>(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint exact in float";
    const uint32_t even = c % 2 == 0 ? c : c + 1;
    for (float sign : {1.0f, -1.0f}) {
      const uint32_t sbit = sign < 0 ? 0x8000 : 0;
      const float below = std::nextafter(mid, 0.0f), above = std::nextafter(mid, 1e9f);
      const float v = static_cast<float>(hi);
      // c + 1 == 0x7C00: hi is 2^16, the overflow to inf (its neighbours are beyond the tie).
      const std::pair<float, uint32_t> probes[] = {{mid, even},
                                                   {below, c},
                                                   {above, c + 1},
                                                   {std::nextafter(v, 0.0f), c + 1},
                                                   {std::nextafter(v, 1e9f), c + 1}};
      for (const auto& [x, want] : probes) {
        EXPECT_EQ(f32_to_f16(sign * x), sbit | want) << "f = " << sign * x;
        EXPECT_EQ(f16_ref(sign * x), sbit | want) << "reference, f = " << sign * x;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 0x7C00 * 10);
}

TEST(F16, OverflowSubnormalsAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7BFF);  // below the tie: 65504
  for (float v : {65520.0f, 65536.0f, 1e5f, 131072.0f, 1e6f, 3.0e38f, inf}) {
    EXPECT_EQ(f32_to_f16(v), 0x7C00) << v;
    EXPECT_EQ(f32_to_f16(-v), 0xFC00) << -v;
  }
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  const float min_sub = std::ldexp(1.0f, -24);
  EXPECT_EQ(f32_to_f16(min_sub / 2), 0x0000);  // the tie of 0 and 2^-24: 0 (even)
  EXPECT_EQ(f32_to_f16(-min_sub / 2), 0x8000);
  EXPECT_EQ(f32_to_f16(std::nextafter(min_sub / 2, 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_f16(1.5f * min_sub), 0x0002);         // tie: 2 (even)
  EXPECT_EQ(f32_to_f16(2.5f * min_sub), 0x0002);         // tie: 2 (even)
  EXPECT_EQ(f32_to_f16(1023.5f * min_sub), 0x0400);      // tie: the smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -30)), 0x0000);  // far below: 0
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::min()), 0x0000);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::quiet_NaN()), 0x7E00);
  EXPECT_EQ(f32_to_f16(from_bits(0x7F800001u)), 0x7E00);  // signalling NaN
}

TEST(F16, RandomFloatsMatchReference) {
  // Exponents around the subnormal (2^-24 .. 2^-14) and overflow (2^16) edges.
  EXPECT_EQ(random_float_mismatches(4, -27, 17, 400000, f32_to_f16, f16_ref), 0);
}

// ---- quantisation (docs/semantics.md §2.2) -------------------------------------------------

// scale = max(amax, 1e-4) / 448 in float32 (computed in double, rounded once: exact for a float
// division), round_scale: the smallest power of two >= scale; inv = 1 / scale (float);
// q = e4m3(float(x * inv)).
void quantize_ref(const std::vector<uint16_t>& x, bool round_scale, std::vector<uint8_t>& q,
                  std::vector<float>& scales) {
  const size_t H = x.size(), G = H / 128;
  q.resize(H);
  scales.resize(G);
  for (size_t g = 0; g < G; ++g) {
    double amax = 0;
    for (size_t i = 0; i < 128; ++i)
      amax = std::max(amax, std::fabs(static_cast<double>(bf16_to_f32(x[g * 128 + i]))));
    const float floored = static_cast<float>(std::max(amax, static_cast<double>(1e-4f)));
    float scale = static_cast<float>(static_cast<double>(floored) / 448.0);
    if (round_scale) {
      int e;
      const double m = std::frexp(static_cast<double>(scale), &e);  // scale = m * 2^e, m in [.5, 1)
      scale = static_cast<float>(m == 0.5 ? scale : std::ldexp(1.0, e));
    }
    const float inv = static_cast<float>(1.0 / static_cast<double>(scale));
    for (size_t i = 0; i < 128; ++i) {
      const float v = static_cast<float>(static_cast<double>(bf16_to_f32(x[g * 128 + i])) * inv);
      q[g * 128 + i] = e4m3_encode_ref(v);
    }
    scales[g] = scale;
  }
}

// The pair conversions' host path (the device path is checked on all 2^32 inputs by the GPU
// tier's NumericGpu tests): the low half / byte is the first value, NaN as the single ones.
TEST(PairConversions, HostPathPacksTheSingleConversions) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float values[] = {0.0f, -0.0f, 1.0f, -3.5f, 447.9f, 500.0f, 1e-9f, -1e30f, nan, -nan};
  for (float lo : values)
    for (float hi : values) {
      EXPECT_EQ(f32x2_to_bf16x2(lo, hi), static_cast<uint32_t>(f32_to_bf16(lo)) |
                                             static_cast<uint32_t>(f32_to_bf16(hi)) << 16)
          << lo << ", " << hi;
      EXPECT_EQ(f32x2_to_fp8x2_e4m3(lo, hi),
                static_cast<uint16_t>(f32_to_fp8_e4m3(lo) | f32_to_fp8_e4m3(hi) << 8))
          << lo << ", " << hi;
      EXPECT_EQ(f32x2_to_f16x2(lo, hi),
                static_cast<uint32_t>(f32_to_f16(lo)) | static_cast<uint32_t>(f32_to_f16(hi)) << 16)
          << lo << ", " << hi;
    }
  EXPECT_EQ(f32x2_to_bf16x2(1.0f, nan), 0x7FC03F80u);
  EXPECT_EQ(f32x2_to_f16x2(1.0f, nan), 0x7E003C00u);
  EXPECT_EQ(f32x2_to_f16x2(-nan, 65520.0f), 0x7C007E00u);
  EXPECT_EQ(f32x2_to_fp8x2_e4m3(-nan, 1.0f), 0x387Fu);
}

TEST(Quantize, MatchesSpecFormula) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-40, 40);
  int rows = 0;
  for (int kind = 0; kind < 7; ++kind) {
    for (int rep = 0; rep < 60; ++rep) {
      const int64_t H = 128 * (1 + rep % 5);
      std::vector<uint16_t> x(H);
      for (int64_t i = 0; i < H; ++i) {
        float v = 0.0f;
        switch (kind) {
          case 0:
            v = normal(rng);
            break;  // ordinary
          case 1:
            v = 0.0f;
            break;  // all zero
          case 2:
            v = normal(rng) * 1e36f;
            break;  // huge
          case 3:
            v = normal(rng) * (rep % 2 ? 1e-36f : 1e-39f);
            break;  // tiny, subnormal bf16
          case 4:
            v = normal(rng) * std::ldexp(1.0f, mag(rng));
            break;  // wide range
          case 5:
            v = (i / 128) % 2 ? normal(rng) * 1e37f : 0.0f;
            break;  // zero / max groups
          case 6:
            v = normal(rng) * 2e-5f;
            break;  // around the floor
        }
        x[i] = f32_to_bf16(v);
      }
      for (bool round_scale : {false, true}) {
        std::vector<uint8_t> q(H), want_q;
        std::vector<float> scales(H / 128), want_scales;
        quantize_row_fp8(x.data(), H, round_scale, q.data(), scales.data());
        quantize_ref(x, round_scale, want_q, want_scales);
        ++rows;
        for (int64_t g = 0; g < H / 128; ++g) {
          ASSERT_EQ(to_bits(scales[g]), to_bits(want_scales[g]))
              << "kind " << kind << " group " << g << ": " << scales[g] << " vs " << want_scales[g];
          if (round_scale) {
            int e;
            std::frexp(static_cast<double>(scales[g]), &e);
            EXPECT_EQ(ue8m0_of_scale(scales[g]), e - 1 + 127) << scales[g];  // 2^(e-1) biased
          }
        }
        for (int64_t i = 0; i < H; ++i)
          ASSERT_EQ(q[i], want_q[i])
              << "kind " << kind << " element " << i << " x = " << bf16_to_f32(x[i]);
      }
    }
  }
  EXPECT_EQ(rows, 7 * 60 * 2);
}

TEST(Quantize, FloorAndPowerOfTwoScales) {
  EXPECT_EQ(fp8_scale_from_amax(0.0f, false), 1e-4f / 448.0f);
  EXPECT_EQ(fp8_scale_from_amax(448.0f, false), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(448.0f, true), 1.0f);                 // already a power of two
  EXPECT_EQ(fp8_scale_from_amax(449.0f, true), 2.0f);                 // rounds up
  EXPECT_EQ(fp8_scale_from_amax(0.0f, true), std::ldexp(1.0f, -22));  // 2.23e-7 -> 2^-22
  EXPECT_EQ(ue8m0_of_scale(1.0f), 127);
  EXPECT_EQ(ue8m0_of_scale(std::ldexp(1.0f, -22)), 105);
}

}  // namespace
}  // namespace epx::detail
