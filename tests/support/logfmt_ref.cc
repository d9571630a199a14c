// tests/support/logfmt_ref.cc — LogFMT-10 from docs/semantics.md §2.3.1, written from the text
// (see logfmt_ref.h for what differs in the means, never in the results).
#include "support/logfmt_ref.h"

#include <array>
#include <cmath>
#include <cstring>

namespace epx::testing {

namespace {

float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

const std::array<float, 128>& log2_table() {
  static const std::array<float, 128> table = [] {
    std::array<float, 128> t{};
    for (int k = 0; k < 128; ++k) t[k] = static_cast<float>(std::log2(1.0L + k / 128.0L));
    return t;
  }();
  return table;
}

const std::array<float, 10>& exp2_coefs() {
  static const std::array<float, 10> coefs = [] {
    std::array<float, 10> c{};
    long double power = 1.0L, factorial = 1.0L;
    const long double ln2 = std::log(2.0L);
    for (int k = 0; k < 10; ++k) {
      if (k > 0) {
        power *= ln2;
        factorial *= k;
      }
      c[k] = static_cast<float>(power / factorial);
    }
    return c;
  }();
  return coefs;
}

}  // namespace

float logfmt_ref_log2_frac(int k) {
  return log2_table()[k];
}
float logfmt_ref_exp2_coef(int k) {
  return exp2_coefs()[k];
}

// m = 2^E (1 + F/128): frexp gives m = fr * 2^ex, fr in [0.5, 1), so E = ex - 1 and
// F = (2 fr - 1) * 128 (an integer: a bf16 has 7 fraction bits, subnormals fewer).
float logfmt_ref_log2(uint32_t mag) {
  int ex = 0;
  const float fr = std::frexp(bf16_value(static_cast<uint16_t>(mag)), &ex);
  const int F = static_cast<int>((2.0f * fr - 1.0f) * 128.0f);
  const float E = static_cast<float>(ex - 1);
  return E + log2_table()[F];
}

float logfmt_ref_exp2(float t) {
  const float n = std::floor(t);
  const float f = t - n;
  const auto& c = exp2_coefs();
  float q = c[9];
  for (int k = 8; k >= 0; --k) {
    const float p = q * f;
    q = p + c[k];
  }
  return std::ldexp(q, static_cast<int>(n));  // one rounding where the result is subnormal
}

LogfmtRefGroup logfmt_ref_group(const uint16_t* x) {
  LogfmtRefGroup g;
  uint32_t amax = 0, amin = 0xFFFF;
  for (int i = 0; i < 128; ++i) {
    const uint32_t m = x[i] & 0x7FFFu;
    if (m > amax) amax = m;
    if (m < amin) amin = m;
  }
  g.cast = amax < 0x3F80u && amin < amax;  // |x| < 1 everywhere and not all magnitudes equal
  if (!g.cast) {
    for (int i = 0; i < 128; ++i) g.value[i] = bf16_value(x[i]);
    return g;
  }
  g.meta = amax << 16 | amin;
  const float la = logfmt_ref_log2(amax);
  const float clip = la - 32.0f;
  g.lb = clip;
  if (amin != 0) g.lb = std::fmax(logfmt_ref_log2(amin), clip);
  const float span = la - g.lb;
  g.step = span / 510.0f;
  const float inv = 1.0f / g.step;
  for (int i = 0; i < 128; ++i) {
    const uint32_t m = x[i] & 0x7FFFu;
    uint32_t code = 0;
    if (m != 0) {
      const float d = logfmt_ref_log2(m) - g.lb;
      const float scaled = d * inv;
      const float y = scaled + 1.5f;
      code = y >= 511.0f ? 511u : y >= 1.0f ? static_cast<uint32_t>(std::floor(y)) : 0u;
    }
    g.code[i] = static_cast<uint16_t>(code);
    float v = 0.0f;
    if (code != 0) {
      const float offset = static_cast<float>(code - 1) * g.step;
      v = logfmt_ref_exp2(g.lb + offset);
    }
    g.value[i] = (x[i] & 0x8000u) ? -v : v;
  }
  return g;
}

void logfmt_ref_row(const uint16_t* x, int64_t hidden, float* out) {
  for (int64_t g = 0; g < hidden / 128; ++g) {
    const LogfmtRefGroup r = logfmt_ref_group(x + g * 128);
    std::memcpy(out + g * 128, r.value, sizeof(r.value));
  }
}

int64_t logfmt_ref_row_bytes(const uint16_t* x, int64_t hidden) {
  int64_t bytes = 0;
  for (int64_t g = 0; g < hidden / 128; ++g)
    bytes += 4 + (logfmt_ref_group(x + g * 128).cast ? 160 : 256);
  return bytes;
}

}  // namespace epx::testing
