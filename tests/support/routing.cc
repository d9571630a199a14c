#include "support/routing.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "core/numeric.h"

namespace epx::testing {

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kAllToOne: return "all_to_one";
    case Routing::kEmptyRank: return "empty_rank";
    case Routing::kAllMinusOne: return "all_minus_one";
    case Routing::kDuplicates: return "duplicates";
  }
  return "?";
}

std::vector<Routing> all_routings() {
  return {Routing::kUniform,   Routing::kSkewed,      Routing::kAllToOne,
          Routing::kEmptyRank, Routing::kAllMinusOne, Routing::kDuplicates};
}

Routing routing_from_name(const std::string& name) {
  for (Routing r : all_routings())
    if (name == routing_name(r)) return r;
  throw std::invalid_argument("unknown routing '" + name +
                              "', expected uniform, skewed, all_to_one, empty_rank, "
                              "all_minus_one or duplicates");
}

// K distinct experts from [0, n) (or fewer if n < K; the rest -1).
static void pick_distinct(int64_t* row, int K, int n, std::mt19937_64& rng) {
  for (int k = 0; k < K; ++k) {
    if (k >= n) {
      row[k] = -1;
      continue;
    }
    while (true) {
      int64_t e = std::uniform_int_distribution<int>(0, n - 1)(rng);
      if (std::find(row, row + k, e) == row + k) {
        row[k] = e;
        break;
      }
    }
  }
}

std::vector<int64_t> make_topk_idx(Routing routing, int64_t T, int K, int E, int R,
                                   std::mt19937_64& rng, int target_expert) {
  std::vector<int64_t> idx(static_cast<size_t>(T * K), -1);
  const int L = E / R;
  for (int64_t t = 0; t < T; ++t) {
    int64_t* row = idx.data() + t * K;
    switch (routing) {
      case Routing::kUniform: pick_distinct(row, K, E, rng); break;
      case Routing::kEmptyRank:
        pick_distinct(row, K, R > 1 ? E - L : E, rng);
        if (R == 1) std::fill(row, row + K, -1);
        break;
      case Routing::kSkewed: {
        // Popularity ~ 1 / (e + 1)^1.2: a few hot experts.
        std::vector<double> w(E);
        for (int e = 0; e < E; ++e) w[e] = 1.0 / std::pow(e + 1.0, 1.2);
        std::discrete_distribution<int> pick(w.begin(), w.end());
        for (int k = 0; k < K; ++k) {
          int64_t e;
          int tries = 0;
          do e = pick(rng);
          while (std::find(row, row + k, e) != row + k && ++tries < 64);
          row[k] = (tries >= 64 || std::uniform_real_distribution<>(0, 1)(rng) < 0.1) ? -1 : e;
        }
        break;
      }
      case Routing::kAllToOne: row[0] = target_expert % E; break;
      case Routing::kAllMinusOne: break;
      case Routing::kDuplicates:
        pick_distinct(row, K, E, rng);
        for (int k = 1; k < K; ++k)
          if (std::uniform_int_distribution<int>(0, 2)(rng) == 0) row[k] = row[k - 1];
        break;
    }
  }
  return idx;
}

std::vector<float> make_topk_weights(const std::vector<int64_t>& idx, std::mt19937_64& rng) {
  std::vector<float> w(idx.size());
  std::uniform_real_distribution<float> u(0.01f, 1.0f);
  for (size_t i = 0; i < idx.size(); ++i) w[i] = idx[i] < 0 ? 0.0f : u(rng);
  return w;
}

std::vector<uint16_t> make_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-6, 6);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = std::ldexp(1.0f, mag(rng));
    for (int64_t c = 0; c < cols; ++c) v[r * cols + c] = detail::f32_to_bf16(n(rng) * m);
  }
  return v;
}

std::vector<uint16_t> make_f16(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  for (uint16_t& x : v) {
    const uint32_t sign = rng() % 2 ? 0x8000u : 0u, mant = rng() & 0x3FFu;
    const uint64_t kind = rng() % 256;
    uint32_t exp = 0;  // biased: 0 subnormal, 31 inf / NaN
    if (kind < 216) {
      exp = 9 + rng() % 15;  // 2^-6 .. 2^8
    } else if (kind < 228) {
      exp = 30;  // 2^15 ..
    } else if (kind < 252) {
      exp = 0;
    } else {
      exp = 31;
    }
    const uint32_t m = exp != 31 ? mant : kind < 254 ? 0u : (mant | 1u);  // inf, or a NaN
    x = static_cast<uint16_t>(sign | exp << 10 | m);
  }
  return v;
}

std::vector<uint16_t> make_x(int64_t T, int64_t H, std::mt19937_64& rng, bool nan_groups) {
  using detail::f32_to_bf16;
  std::vector<uint16_t> x = make_bf16(T, H, rng);
  std::uniform_int_distribution<int> bit(0, 1);
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* row = x.data() + t * H;
    switch (t % 9) {
      case 0:
        std::fill(row, row + H, uint16_t{0});
        break;
      case 1:  // huge: exponents near the top, some +-inf
        for (int64_t h = 0; h < H; ++h)
          row[h] =
              static_cast<uint16_t>((bit(rng) << 15) | (0xFC + (rng() % 3)) << 7 | (rng() & 0x7F));
        row[rng() % H] = 0x7F80;
        row[rng() % H] = 0xFF80;
        break;
      case 2:  // tiny: subnormal and smallest normals (amax below the 1e-4 floor)
        for (int64_t h = 0; h < H; ++h)
          row[h] = static_cast<uint16_t>((bit(rng) << 15) | ((rng() % 3) << 7) | (rng() & 0x7F));
        break;
      case 3:  // NaNs in a normal row
        for (int i = 0; i < 5; ++i) row[rng() % H] = (i % 2) ? 0x7FC0 : 0xFFC1;
        break;
      case 4:  // random bit patterns: every class of value
        for (int64_t h = 0; h < H; ++h) row[h] = static_cast<uint16_t>(rng());
        break;
      case 5:  // mixed groups: a zero group, one huge value, -0.0
        std::fill(row, row + std::min<int64_t>(H, 16), uint16_t{0x8000});
        row[H - 1] = f32_to_bf16(3.0e5f);
        break;
      case 6:  // nan_groups: a group of NaNs only, then one of NaN and -0 only (amax +0)
        if (!nan_groups) break;
        for (int64_t h = 0; h < std::min<int64_t>(H, 128); ++h)
          row[h] = h % 3 ? uint16_t{0x7FC0} : uint16_t{0xFFC1};
        for (int64_t h = 128; h < std::min<int64_t>(H, 256); ++h)
          row[h] = h % 2 ? uint16_t{0x7FC0} : uint16_t{0x8000};
        break;
      default:
        break;  // random normal rows
    }
  }
  return x;
}

std::vector<uint8_t> make_bytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

}  // namespace epx::testing
