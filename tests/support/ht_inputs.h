// tests/support/ht_inputs.h — random inputs of the ht tests (tests/unit/ht_test.cc): raw bytes,
// strided and column-major views, and bf16 values whose float32 sums depend on their order (so a
// combine that sums in another order than docs/semantics.md §1.6 fixes shows up).
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "epx/tensor.h"

namespace epx::testing {

// n random bytes, 8 per draw.
std::vector<uint8_t> random_bytes(size_t n, std::mt19937_64& rng);

// A [rows, cols] matrix stored with a row pitch (elements) >= cols, or column-major; the padding
// holds garbage.
struct Strided {
  std::vector<uint8_t> bytes;
  TensorView view;
};
Strided make_strided(const std::vector<uint8_t>& packed, int64_t rows, int64_t cols, DType dtype,
                     int64_t pad, bool col_major, std::mt19937_64& rng);

// Cheap random bf16: magnitudes 2^-7..2^8, either sign, 1 in 64 a signed zero (0.0f + -0.0f
// rounds to +0, which the combine order must reproduce).
std::vector<uint16_t> fast_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng);

// bf16 that make float32 sums depend on their order: few distinct magnitudes 2^-24..2^24 (so
// a + -a + small cancels one way and absorbs `small` the other), either sign, 1 in 64 a signed
// zero.
std::vector<uint16_t> wide_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng);

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace epx::testing
