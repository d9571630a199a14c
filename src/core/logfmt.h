// src/core/logfmt.h — LogFMT-10, the ll combine's compressed row format (docs/semantics.md
// §2.3.1): one definition for the cpu backend and the cuda kernels (host + device), so both
// decode the same bits and the combine's results agree bit for bit.
//
// A row of H bf16 values is cut into groups of 128 channels. Per group, on the integer bits:
//   mag_i = x_i & 0x7FFF, sign_i = x_i >> 15, amax = max mag_i, amin = min mag_i
//   the group is CAST iff amax < 0x3F80 (every |x_i| < 1: no Inf, no NaN) and amin < amax;
//   otherwise it stays RAW (its 128 bf16 values unchanged).
// A cast group keeps a 9-bit magnitude code and the sign of every value (10 bits each):
//   log2b(m)  = float(E) + kLogfmtLog2Frac[F]       m = 2^E * (1 + F/128), subnormals normalised
//   la = log2b(amax),  lb = amin ? max(log2b(amin), la - 32) : la - 32
//   step = (la - lb) / 510,  inv = 1 / step
//   code_i = 0 if mag_i == 0, else clamp(floor((log2b(mag_i) - lb) * inv + 1.5), 0, 511)
//   value(code) = 0 if code == 0, else exp2x(lb + float(code - 1) * step)     (sign re-applied)
// Every float operation above is one IEEE binary32 operation rounded to nearest even, in the
// order written (f32_add / f32_sub / f32_mul / f32_div below: never contracted into an fma, on the
// device __f*_rn); exp2x is logfmt_exp2. The meta word of a group is amax << 16 | amin (cast) or
// kLogfmtRawMeta (raw); la, lb and step are recomputed from it on both sides.
//
// Bytes of a group in a row (the row keeps its 2H-byte slot; group g at byte 256 g):
//   cast: bytes [0, 128): byte i = code_i & 0xFF; bytes [128, 160): 16 little-endian uint16,
//         word j = (code_{8j+i} >> 8 for bit i) | (sign_{8j+i} for bit 8 + i), i = 0..7
//   raw:  bytes [0, 256): the bf16 values
// plus the 4-byte meta word kept beside the rows: 164 bytes per cast group (DeepEP's LogFMT-10:
// hidden * 10 / 8 + hidden / 128 * 4 per row), 260 per raw group, 256 for plain bf16.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/numeric.h"

namespace epx::detail {

inline constexpr int kLogfmtGroup = 128;         // channels per group
inline constexpr int kLogfmtCastBytes = 160;     // bytes of a cast group (codes + signs)
inline constexpr int kLogfmtRawBytes = 256;      // bytes of a raw group (= the group's slot)
inline constexpr int kLogfmtMetaBytes = 4;       // the meta word of a group
inline constexpr uint32_t kLogfmtMaxCode = 511;  // 9-bit magnitude codes
inline constexpr float kLogfmtSteps = 510.0f;    // codes 1 .. 511 span [lb, la]
inline constexpr float kLogfmtClip = 32.0f;      // lb >= la - 32 (2^32 of dynamic range)
inline constexpr uint32_t kLogfmtRawMeta = 0xFFFFFFFFu;  // meta word of a raw group
inline constexpr uint32_t kLogfmtOne = 0x3F80u;          // bf16 magnitude bits of 1.0

// log2(1 + F/128) for F = 0 .. 127, each the float nearest to the exact value (ties cannot
// occur; tests/unit/logfmt_test.cc checks every entry in long double). One list for the host
// array below and the device copy (src/cuda/kernels/ll/logfmt.cuh).
// clang-format off
#define EPX_LOGFMT_LOG2_FRAC                                                                     \
  0x0p+0f, 0x1.6fe50cp-7f, 0x1.6e7968p-6f, 0x1.11cd1ep-5f, 0x1.6bad38p-5f, 0x1.c4dfacp-5f,       \
  0x1.0eb38ap-4f, 0x1.3aa2fep-4f, 0x1.663f7p-4f, 0x1.918a16p-4f, 0x1.bc8424p-4f, 0x1.e72ec2p-4f, \
  0x1.08c588p-3f, 0x1.1dcd1ap-3f, 0x1.32ae9ep-3f, 0x1.476aap-3f, 0x1.5c01a4p-3f, 0x1.70742ep-3f, \
  0x1.84c2bep-3f, 0x1.98eddp-3f, 0x1.acf5e2p-3f, 0x1.c0db6cp-3f, 0x1.d49ee4p-3f, 0x1.e840bep-3f, \
  0x1.fbc16cp-3f, 0x1.0790aep-2f, 0x1.11307ep-2f, 0x1.1ac05cp-2f, 0x1.24407ap-2f, 0x1.2db11p-2f, \
  0x1.37124cp-2f, 0x1.406464p-2f, 0x1.49a784p-2f, 0x1.52dbep-2f, 0x1.5c01a4p-2f, 0x1.6518fep-2f, \
  0x1.6e221cp-2f, 0x1.771d2cp-2f, 0x1.800a56p-2f, 0x1.88e9c8p-2f, 0x1.91bba8p-2f, 0x1.9a8024p-2f, \
  0x1.a3376p-2f, 0x1.abe188p-2f, 0x1.b47ecp-2f, 0x1.bd0f2ep-2f, 0x1.c592fap-2f, 0x1.ce0a4ap-2f,  \
  0x1.d6753ep-2f, 0x1.ded3fep-2f, 0x1.e726aap-2f, 0x1.ef6d68p-2f, 0x1.f7a856p-2f, 0x1.ffd79ap-2f, \
  0x1.03fda8p-1f, 0x1.0809dp-1f, 0x1.0c105p-1f, 0x1.10113cp-1f, 0x1.140cap-1f, 0x1.18028cp-1f,   \
  0x1.1bf312p-1f, 0x1.1fde3ep-1f, 0x1.23c41ep-1f, 0x1.27a4cp-1f, 0x1.2b8034p-1f, 0x1.2f5688p-1f, \
  0x1.3327c6p-1f, 0x1.36f4p-1f, 0x1.3abb4p-1f, 0x1.3e7d94p-1f, 0x1.423b08p-1f, 0x1.45f3aap-1f,   \
  0x1.49a784p-1f, 0x1.4d56a6p-1f, 0x1.510118p-1f, 0x1.54a6e8p-1f, 0x1.584822p-1f, 0x1.5be4dp-1f, \
  0x1.5f7dp-1f, 0x1.6310b8p-1f, 0x1.66a008p-1f, 0x1.6a2afap-1f, 0x1.6db196p-1f, 0x1.7133eap-1f,  \
  0x1.74b1fep-1f, 0x1.782bdcp-1f, 0x1.7ba19p-1f, 0x1.7f1322p-1f, 0x1.82809ep-1f, 0x1.85ea0cp-1f, \
  0x1.894f74p-1f, 0x1.8cb0e4p-1f, 0x1.900e62p-1f, 0x1.9367f6p-1f, 0x1.96bdaep-1f, 0x1.9a0f8ep-1f, \
  0x1.9d5dap-1f, 0x1.a0a7eep-1f, 0x1.a3ee8p-1f, 0x1.a7315ep-1f, 0x1.aa709p-1f, 0x1.adac1ep-1f,   \
  0x1.b0e412p-1f, 0x1.b41874p-1f, 0x1.b74948p-1f, 0x1.ba769cp-1f, 0x1.bda072p-1f, 0x1.c0c6d4p-1f, \
  0x1.c3e9cap-1f, 0x1.c7095ap-1f, 0x1.ca258ep-1f, 0x1.cd3e6ap-1f, 0x1.d053f6p-1f, 0x1.d3663cp-1f, \
  0x1.d6753ep-1f, 0x1.d98106p-1f, 0x1.dc899ap-1f, 0x1.df8f02p-1f, 0x1.e29142p-1f, 0x1.e59064p-1f, \
  0x1.e88c6cp-1f, 0x1.eb856p-1f, 0x1.ee7b48p-1f, 0x1.f16e28p-1f, 0x1.f45e08p-1f, 0x1.f74afp-1f,  \
  0x1.fa34e2p-1f, 0x1.fd1be4p-1f
// clang-format on

inline constexpr float kLogfmtLog2Frac[128] = {EPX_LOGFMT_LOG2_FRAC};

// ln(2)^k / k!, k = 0 .. 9, each the nearest float: the Taylor polynomial of 2^f on [0, 1).
inline constexpr float kLogfmtExp2C0 = 0x1p+0f, kLogfmtExp2C1 = 0x1.62e43p-1f,
                       kLogfmtExp2C2 = 0x1.ebfbep-3f, kLogfmtExp2C3 = 0x1.c6b08ep-5f,
                       kLogfmtExp2C4 = 0x1.3b2ab6p-7f, kLogfmtExp2C5 = 0x1.5d87fep-10f,
                       kLogfmtExp2C6 = 0x1.430912p-13f, kLogfmtExp2C7 = 0x1.ffcbfcp-17f,
                       kLogfmtExp2C8 = 0x1.62c022p-20f, kLogfmtExp2C9 = 0x1.b5253ep-24f;

// One binary32 operation each, rounded to nearest even, never fused with a neighbour (nvcc would
// contract a * b + c into an fma by default; the host build passes -ffp-contract=off).
EPX_HD float f32_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
EPX_HD float f32_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
EPX_HD float f32_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
EPX_HD float f32_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// log2 of a finite, non-zero bf16 magnitude `mag` (bits 1 .. 0x7F7F): float(E) + table[F] with
// mag = 2^E * (1 + F/128); a subnormal F' * 2^-133 is first written that way. `table` is
// kLogfmtLog2Frac (host) or a copy of it (device shared memory). Any other 16-bit `mag` (a meta
// word of a rank that did not encode, after a use_logfmt mismatch) gives some finite value.
EPX_HD float logfmt_log2(uint32_t mag, const float* table) {
  int32_t e = static_cast<int32_t>(mag >> 7 & 0x1FFu);
  uint32_t f = mag & 0x7Fu;
  if (e == 0) {  // subnormal: f * 2^-133 = 2^(p - 133) * (f / 2^p), p = f's highest set bit
    int p = 6;
    while (p > 0 && ((f >> p) & 1u) == 0) --p;
    f = (f << (7 - p)) & 0x7Fu;
    e = p - 6;  // e - 127 = p - 133
  }
  return f32_add(static_cast<float>(e - 127), table[f]);
}

// 2^t for a finite t <= 0 (LogFMT decodes t in [la - 32, la], la < 0): n = floor(t), f = t - n
// (exact), q = Horner of kLogfmtExp2C9 .. C0 in f (q = q * f, then + C_k: two roundings a step),
// then q * 2^n: exact where the result is normal, else (q * 2^(n + 126)) * 2^-126 (one rounding
// into the subnormals); 0 below n = -252.
EPX_HD float logfmt_exp2(float t) {
#if defined(__CUDA_ARCH__)
  const float n = floorf(t);
#else
  const float n = std::floor(t);
#endif
  const float f = f32_sub(t, n);
  float q = kLogfmtExp2C9;
  q = f32_add(f32_mul(q, f), kLogfmtExp2C8);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C7);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C6);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C5);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C4);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C3);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C2);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C1);
  q = f32_add(f32_mul(q, f), kLogfmtExp2C0);
  const int32_t ni = static_cast<int32_t>(n);
  if (ni > 127) return bits_f32(0x7F800000u);
  if (ni >= -126) return f32_mul(q, bits_f32(static_cast<uint32_t>(ni + 127) << 23));
  if (ni >= -252) {
    const float partial = f32_mul(q, bits_f32(static_cast<uint32_t>(ni + 253) << 23));
    return f32_mul(partial, bits_f32(1u << 23));  // * 2^-126
  }
  return 0.0f;
}

// A cast group's log-domain grid, from its meta word (cast groups only).
struct LogfmtParams {
  float lb;    // log2 of the value of code 1
  float step;  // log2 distance between neighbouring codes
};

EPX_HD bool logfmt_casts(uint32_t amax, uint32_t amin) {
  return amax < kLogfmtOne && amin < amax;
}

EPX_HD uint32_t logfmt_meta(uint32_t amax, uint32_t amin) {
  return logfmt_casts(amax, amin) ? amax << 16 | amin : kLogfmtRawMeta;
}

EPX_HD LogfmtParams logfmt_params(uint32_t meta, const float* table) {
  const uint32_t amax = meta >> 16, amin = meta & 0xFFFFu;
  const float la = logfmt_log2(amax, table);
  const float clip = f32_sub(la, kLogfmtClip);
  float lb = clip;
  if (amin != 0) {
    const float l = logfmt_log2(amin, table);
    lb = l > clip ? l : clip;
  }
  return {lb, f32_div(f32_sub(la, lb), kLogfmtSteps)};
}

// The 9-bit code of magnitude `mag` in a cast group; inv = f32_div(1, g.step).
EPX_HD uint32_t logfmt_code(uint32_t mag, const LogfmtParams& g, float inv, const float* table) {
  if (mag == 0) return 0;
  const float y = f32_add(f32_mul(f32_sub(logfmt_log2(mag, table), g.lb), inv), 1.5f);
  if (!(y >= 1.0f)) return 0;
  if (y >= static_cast<float>(kLogfmtMaxCode)) return kLogfmtMaxCode;
  return static_cast<uint32_t>(y);  // y in [1, 511): truncation is floor
}

// The magnitude code `code` stands for.
EPX_HD float logfmt_value(uint32_t code, const LogfmtParams& g) {
  if (code == 0) return 0.0f;
  return logfmt_exp2(f32_add(g.lb, f32_mul(static_cast<float>(code - 1), g.step)));
}

// Channels 8j .. 8j + 7 of a cast group: `h` their bf16 bits -> the codes' low bytes (byte i of
// *low = channel 8j + i) and the word *hs (high code bits in bits 0-7, signs in bits 8-15).
EPX_HD void logfmt_encode8(const uint16_t* h, const LogfmtParams& g, float inv, const float* table,
                           uint64_t* low, uint32_t* hs) {
  uint64_t lo = 0;
  uint32_t w = 0;
  for (int i = 0; i < 8; ++i) {
    const uint32_t code = logfmt_code(h[i] & 0x7FFFu, g, inv, table);
    lo |= static_cast<uint64_t>(code & 0xFFu) << (8 * i);
    w |= (code >> 8) << i | static_cast<uint32_t>(h[i] >> 15) << (8 + i);
  }
  *low = lo;
  *hs = w;
}

// The inverse of logfmt_encode8: the 8 decoded values, signs re-applied (code 0 with sign 1 is
// -0.0f).
EPX_HD void logfmt_decode8(uint64_t low, uint32_t hs, const LogfmtParams& g, float* out) {
  for (int i = 0; i < 8; ++i) {
    const uint32_t code = static_cast<uint32_t>(low >> (8 * i) & 0xFFu) | ((hs >> i) & 1u) << 8;
    const float v = logfmt_value(code, g);
    out[i] = (hs >> (8 + i)) & 1u ? -v : v;
  }
}

// Bytes a group of this meta word puts on the wire (its data plus the meta word).
EPX_HD int logfmt_wire_bytes(uint32_t meta) {
  return (meta == kLogfmtRawMeta ? kLogfmtRawBytes : kLogfmtCastBytes) + kLogfmtMetaBytes;
}

// ---- host: whole groups and rows (the cpu backend, the oracles) ------------------------------

// Encodes the 128 bf16 values `x` into the group slot `dst` (256 bytes; `x` may be `dst`: the
// group is read first). Returns the meta word.
inline uint32_t logfmt_encode_group(const uint16_t* x, uint8_t* dst) {
  uint16_t h[kLogfmtGroup];
  std::memcpy(h, x, sizeof(h));
  uint32_t amax = 0, amin = 0xFFFFu;
  for (uint16_t v : h) {
    const uint32_t m = v & 0x7FFFu;
    amax = m > amax ? m : amax;
    amin = m < amin ? m : amin;
  }
  const uint32_t meta = logfmt_meta(amax, amin);
  if (meta == kLogfmtRawMeta) {
    std::memcpy(dst, h, sizeof(h));
    return meta;
  }
  const LogfmtParams g = logfmt_params(meta, kLogfmtLog2Frac);
  const float inv = f32_div(1.0f, g.step);
  for (int j = 0; j < kLogfmtGroup / 8; ++j) {
    uint64_t low;
    uint32_t hs;
    logfmt_encode8(h + 8 * j, g, inv, kLogfmtLog2Frac, &low, &hs);
    const uint16_t word = static_cast<uint16_t>(hs);
    std::memcpy(dst + 8 * j, &low, 8);  // little endian: byte i = channel 8j + i
    std::memcpy(dst + kLogfmtGroup + 2 * j, &word, 2);
  }
  return meta;
}

// The 128 values a group slot `src` with meta word `meta` stands for, as float32.
inline void logfmt_decode_group(uint32_t meta, const uint8_t* src, float* out) {
  if (meta == kLogfmtRawMeta) {
    for (int i = 0; i < kLogfmtGroup; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = bf16_to_f32(h);
    }
    return;
  }
  const LogfmtParams g = logfmt_params(meta, kLogfmtLog2Frac);
  for (int j = 0; j < kLogfmtGroup / 8; ++j) {
    uint64_t low;
    uint16_t word;
    std::memcpy(&low, src + 8 * j, 8);
    std::memcpy(&word, src + kLogfmtGroup + 2 * j, 2);
    logfmt_decode8(low, word, g, out + 8 * j);
  }
}

// A row of `hidden` bf16 values (hidden % 128 == 0) into its 2 * hidden byte slot `dst` (may be
// `x` itself) and hidden / 128 meta words.
inline void logfmt_encode_row(const uint16_t* x, int64_t hidden, uint8_t* dst, uint32_t* meta) {
  for (int64_t g = 0; g < hidden / kLogfmtGroup; ++g)
    meta[g] = logfmt_encode_group(x + g * kLogfmtGroup, dst + g * kLogfmtRawBytes);
}

inline void logfmt_decode_row(const uint8_t* src, const uint32_t* meta, int64_t hidden,
                              float* out) {
  for (int64_t g = 0; g < hidden / kLogfmtGroup; ++g)
    logfmt_decode_group(meta[g], src + g * kLogfmtRawBytes, out + g * kLogfmtGroup);
}

}  // namespace epx::detail
