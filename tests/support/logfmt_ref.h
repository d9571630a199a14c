// tests/support/logfmt_ref.h — an independent implementation of LogFMT-10 as docs/semantics.md
// §2.3.1 defines it, for the tests and the ll oracle (tests/support/oracle_ll.h): no code shared
// with src/core/logfmt.h. Its log2 table and exp2 coefficients are computed here in long double
// and rounded to float; the bf16 magnitude is split with frexp (core: on the bits); 2^n is applied
// with ldexpf (core: by hand). Every float operation the spec lists is one binary32 operation, in
// the spec's order (the build passes -ffp-contract=off), so the results must equal core's bit for
// bit.
#pragma once

#include <cstdint>

namespace epx::testing {

// One group of 128 channels as the spec encodes and decodes it.
struct LogfmtRefGroup {
  bool cast = false;
  uint32_t meta = 0xFFFFFFFFu;  // amax << 16 | amin (cast), else 0xFFFFFFFF
  float lb = 0, step = 0;       // cast only
  uint16_t code[128] = {};      // cast only: 9-bit magnitude codes
  float value[128] = {};        // the decoded values (raw: the bf16 values), signs applied
};

LogfmtRefGroup logfmt_ref_group(const uint16_t* x);

// The decoded values of a row of `hidden` bf16 values (hidden % 128 == 0).
void logfmt_ref_row(const uint16_t* x, int64_t hidden, float* out);

// Bytes a row puts on the wire under LogFMT: per group 4 (meta) + 160 (cast) or 256 (raw).
int64_t logfmt_ref_row_bytes(const uint16_t* x, int64_t hidden);

// The spec's constants, computed here: log2(1 + k/128) (k < 128) and ln(2)^k / k! (k <= 9).
float logfmt_ref_log2_frac(int k);
float logfmt_ref_exp2_coef(int k);

// The spec's exp2x(t) and log2b(bf16 magnitude bits), for the property tests.
float logfmt_ref_exp2(float t);
float logfmt_ref_log2(uint32_t mag);

}  // namespace epx::testing
