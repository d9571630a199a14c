// tests/support/ht_inputs.cc — the ht tests' random inputs (see ht_inputs.h).
#include "support/ht_inputs.h"

#include <algorithm>
#include <array>

namespace epx::testing {

std::vector<uint8_t> random_bytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t b = rng();
    std::memcpy(&v[i], &b, std::min<size_t>(8, n - i));
  }
  return v;
}

Strided make_strided(const std::vector<uint8_t>& packed, int64_t rows, int64_t cols, DType dtype,
                     int64_t pad, bool col_major, std::mt19937_64& rng) {
  const size_t es = dtype_size(dtype);
  Strided s;
  const int64_t pitch = cols + pad;
  s.bytes = random_bytes(
      static_cast<size_t>(col_major ? rows * cols : rows * pitch) * es + es,  // never empty
      rng);
  for (int64_t t = 0; t < rows; ++t) {
    if (!col_major) {
      std::memcpy(&s.bytes[t * pitch * es], &packed[t * cols * es], cols * es);
      continue;
    }
    for (int64_t c = 0; c < cols; ++c)
      std::memcpy(&s.bytes[(c * rows + t) * es], &packed[(t * cols + c) * es], es);
  }
  s.view = TensorView::contiguous(s.bytes.data(), dtype, {rows, cols});
  s.view.strides = col_major ? std::array<int64_t, kMaxDims>{1, rows > 0 ? rows : 1}
                             : std::array<int64_t, kMaxDims>{pitch, 1};
  return s;
}

std::vector<uint16_t> fast_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) {
    const uint64_t b = rng();
    const uint16_t sign = (b & 1) ? 0x8000 : 0;
    v[i] = (b >> 1) % 64 == 0
               ? sign
               : static_cast<uint16_t>(sign | ((120 + (b >> 8) % 16) << 7) | ((b >> 16) & 0x7F));
  }
  return v;
}

std::vector<uint16_t> wide_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) {
    const uint64_t b = rng();
    const uint16_t sign = (b & 1) ? 0x8000 : 0;
    const int exponent = 127 + 12 * static_cast<int>((b >> 8) % 5) - 24;
    v[i] = (b >> 1) % 64 == 0
               ? sign
               : static_cast<uint16_t>(sign | (exponent << 7) | (((b >> 16) & 7) << 4));
  }
  return v;
}

}  // namespace epx::testing
