// LogFMT-10, the ll combine's row format (src/core/logfmt.h, docs/semantics.md §2.3.1), against
// the independent implementation of tests/support/logfmt_ref.h, bit for bit: the constants (each
// the nearest float, checked in long double), log2b on every bf16 magnitude, exp2x on millions of
// arguments, and whole groups of every kind (bytes, meta word, decoded values, wire bytes, in
// place). Then what the format promises: a decoded value within half a step (in log2) of the
// input, codes monotone in the magnitude, raw groups unchanged; and the worked example of the
// spec.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/logfmt.h"
#include "core/numeric.h"
#include "support/ll_cases.h"
#include "support/logfmt_ref.h"

namespace epx {
namespace {

using namespace detail;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The nearest float to `exact` (ties cannot occur here: the test fails if they do).
void expect_nearest(float f, long double exact, const char* what, int k) {
  const float up = std::nextafter(f, INFINITY), down = std::nextafter(f, -INFINITY);
  const long double err = std::fabs(static_cast<long double>(f) - exact);
  EXPECT_LT(err, std::fabs(static_cast<long double>(up) - exact)) << what << " " << k;
  EXPECT_LT(err, std::fabs(static_cast<long double>(down) - exact)) << what << " " << k;
}

TEST(Logfmt, ConstantsAreTheNearestFloats) {
  for (int k = 0; k < 128; ++k) {
    expect_nearest(kLogfmtLog2Frac[k], std::log2(1.0L + k / 128.0L), "log2 table", k);
    EXPECT_EQ(bits(kLogfmtLog2Frac[k]), bits(testing::logfmt_ref_log2_frac(k))) << k;
  }
  const float coefs[10] = {kLogfmtExp2C0, kLogfmtExp2C1, kLogfmtExp2C2, kLogfmtExp2C3,
                           kLogfmtExp2C4, kLogfmtExp2C5, kLogfmtExp2C6, kLogfmtExp2C7,
                           kLogfmtExp2C8, kLogfmtExp2C9};
  long double power = 1.0L, factorial = 1.0L;
  for (int k = 0; k < 10; ++k) {
    if (k > 0) power *= std::log(2.0L), factorial *= k;
    if (k > 0) expect_nearest(coefs[k], power / factorial, "exp2 coefficient", k);
    EXPECT_EQ(bits(coefs[k]), bits(testing::logfmt_ref_exp2_coef(k))) << k;
  }
}

TEST(Logfmt, Log2OfEveryBf16MagnitudeMatchesReference) {
  for (uint32_t mag = 1; mag <= 0x7F7Fu; ++mag) {
    const float got = logfmt_log2(mag, kLogfmtLog2Frac);
    ASSERT_EQ(bits(got), bits(testing::logfmt_ref_log2(mag))) << std::hex << mag;
    const long double exact = std::log2(static_cast<long double>(bf16_to_f32(mag)));
    // E + table[F] rounds twice at most: within a few ulps of log2 at |log2| <= 133.
    ASSERT_LE(std::fabs(got - exact), 4e-5L) << std::hex << mag;
  }
}

TEST(Logfmt, Exp2MatchesReferenceAndIsAccurate) {
  std::mt19937_64 rng(29);
  std::uniform_real_distribution<float> any(-260.0f, 0.0f), near(-1.0f, 0.0f);
  std::vector<float> ts = {0.0f,    -1.0f,   -126.0f, -126.5f, -127.0f,   -149.0f,
                           -149.5f, -150.0f, -252.0f, -253.0f, -0x1p-24f, -0x1.fffffep-1f};
  for (int i = 0; i < 1 << 21; ++i) ts.push_back(i % 2 ? any(rng) : near(rng));
  for (float t : ts) {
    const float got = logfmt_exp2(t);
    ASSERT_EQ(bits(got), bits(testing::logfmt_ref_exp2(t))) << t;
    const long double exact = std::exp2(static_cast<long double>(t));
    if (t >= -126.0f) ASSERT_LE(std::fabs(got / exact - 1.0L), 3e-7L) << t;  // ~2.5 ulp
  }
}

// Encodes a group with core, checks bytes, meta, decoded values and wire bytes against the
// reference; returns the reference's view.
testing::LogfmtRefGroup check_group(const uint16_t* x) {
  const testing::LogfmtRefGroup want = testing::logfmt_ref_group(x);
  uint8_t slot[kLogfmtRawBytes];
  std::memset(slot, 0xA5, sizeof(slot));
  const uint32_t meta = logfmt_encode_group(x, slot);
  EXPECT_EQ(meta, want.meta);
  EXPECT_EQ(meta != kLogfmtRawMeta, want.cast);
  EXPECT_EQ(logfmt_wire_bytes(meta), want.cast ? 164 : 260);
  if (want.cast) {
    for (int i = 0; i < 128; ++i) {
      uint16_t word;
      std::memcpy(&word, slot + 128 + 2 * (i / 8), 2);
      const uint32_t code = slot[i] | ((word >> (i % 8)) & 1u) << 8;
      EXPECT_EQ(code, want.code[i]) << "channel " << i;
      EXPECT_EQ((word >> (8 + i % 8)) & 1u, x[i] >> 15u) << "sign of channel " << i;
    }
    for (int i = kLogfmtCastBytes; i < kLogfmtRawBytes; ++i) EXPECT_EQ(slot[i], 0xA5) << i;
  } else {
    EXPECT_EQ(std::memcmp(slot, x, kLogfmtRawBytes), 0);
  }
  float got[128];
  logfmt_decode_group(meta, slot, got);
  for (int i = 0; i < 128; ++i)
    EXPECT_EQ(bits(got[i]), bits(want.value[i])) << "channel " << i << " x=0x" << std::hex << x[i];
  // In place: the same bytes.
  uint16_t in_place[128];
  std::memcpy(in_place, x, sizeof(in_place));
  EXPECT_EQ(logfmt_encode_group(in_place, reinterpret_cast<uint8_t*>(in_place)), meta);
  const int n = want.cast ? kLogfmtCastBytes : kLogfmtRawBytes;
  EXPECT_EQ(std::memcmp(in_place, slot, n), 0);
  return want;
}

TEST(Logfmt, GroupsOfEveryKindMatchReferenceBitForBit) {
  std::mt19937_64 rng(2929);
  const std::vector<uint16_t> rows = testing::make_logfmt_bf16(64, 128 * 64, rng);  // 4096 groups
  int cast = 0;
  for (size_t g = 0; g < rows.size(); g += 128) {
    cast += check_group(rows.data() + g).cast;
    if (::testing::Test::HasFailure()) FAIL() << "group " << g / 128;
  }
  // make_logfmt_bf16 draws 10 of 16 kinds as cast groups (the raw kinds 9, 10, 14, 15 and the
  // groups 0-8 whose scale reached 1): most, not all.
  EXPECT_GT(cast, 4096 / 2);
  EXPECT_LT(cast, 4096);
  // Edge groups: the largest cast magnitude, two magnitudes only, only subnormals, -0 and +0.
  std::vector<std::vector<uint16_t>> edges(5, std::vector<uint16_t>(128, 0));
  for (int i = 0; i < 128; ++i) {
    edges[0][i] = i % 2 ? 0x3F7F : 0x0001;                 // amax 0.99609375, amin 2^-133
    edges[1][i] = i % 2 ? 0xBE00 : 0x3DFF;                 // -0.125, 0.1245...: one step apart
    edges[2][i] = static_cast<uint16_t>(1 + i % 127);      // subnormals only
    edges[3][i] = i == 5 ? 0x3C00 : (i % 2 ? 0x8000 : 0);  // one value, +0 and -0
    edges[4][i] = i == 9 ? 0x3F80 : 0x3C00;                // 1.0: raw
  }
  for (const auto& e : edges) check_group(e.data());
  EXPECT_TRUE(testing::logfmt_ref_group(edges[3].data()).cast);
  EXPECT_FALSE(testing::logfmt_ref_group(edges[4].data()).cast);
}

TEST(Logfmt, DecodedValuesWithinHalfAStepAndCodesMonotone) {
  std::mt19937_64 rng(31);
  const std::vector<uint16_t> rows = testing::make_logfmt_bf16(16, 128 * 64, rng);
  for (size_t g0 = 0; g0 < rows.size(); g0 += 128) {
    const uint16_t* x = rows.data() + g0;
    const testing::LogfmtRefGroup r = testing::logfmt_ref_group(x);
    for (int i = 0; i < 128; ++i) {
      const float v = bf16_to_f32(x[i]);
      if (!r.cast) {
        EXPECT_EQ(bits(r.value[i]), bits(v));
        continue;
      }
      EXPECT_EQ(std::signbit(r.value[i]), std::signbit(v));
      if (v == 0.0f) {
        EXPECT_EQ(r.code[i], 0u);
        continue;
      }
      const long double l = std::log2(std::fabs(static_cast<long double>(v)));
      const long double half = r.step / 2.0L + 1e-5L;  // float rounding of la, lb, log2b, exp2x
      if (l < r.lb - half) {  // below the grid (lb clipped to la - 32): 0 or the first code
        EXPECT_LE(r.code[i], 1u);
        continue;
      }
      ASSERT_GE(r.code[i], 1u);
      const long double got = std::log2(std::fabs(static_cast<long double>(r.value[i])));
      EXPECT_LE(std::fabs(got - l), half) << "group " << g0 / 128 << " channel " << i;
    }
    for (int i = 0; i < 128 && r.cast; ++i)
      for (int j = 0; j < 128; ++j)
        if ((x[i] & 0x7FFF) < (x[j] & 0x7FFF)) ASSERT_LE(r.code[i], r.code[j]);
  }
}

// docs/semantics.md §2.3.1, worked example: amax 0.5, amin 2^-10.
TEST(Logfmt, WorkedExampleOfTheSpec) {
  std::vector<uint16_t> x(128, 0xBE80);  // -0.25
  x[0] = 0x3F00;                         // 0.5
  x[1] = 0x3A80;                         // 2^-10
  x[2] = 0x3DCD;                         // 0.10009765625
  const testing::LogfmtRefGroup r = check_group(x.data());
  ASSERT_TRUE(r.cast);
  EXPECT_EQ(r.meta, 0x3F003A80u);
  EXPECT_EQ(r.lb, -10.0f);
  EXPECT_EQ(r.step, 9.0f / 510.0f);
  EXPECT_EQ(r.code[0], 511u);
  EXPECT_EQ(r.code[1], 1u);
  EXPECT_EQ(r.code[2], 380u);
  EXPECT_EQ(r.code[3], 454u);
  EXPECT_EQ(r.value[0], 0.5f);
  EXPECT_EQ(r.value[1], 0x1p-10f);
  EXPECT_EQ(r.value[2], 0x1.9c7efp-4f);    // 0.100706994...
  EXPECT_EQ(r.value[3], -0x1.fdeab8p-3f);  // -0.248982846...
}

}  // namespace
}  // namespace epx
