// tests/support/routing.h — routing and data generators shared by tests and epx-bench
// (STYLE: the same adversarial cases everywhere).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace epx::testing {

enum class Routing {
  kUniform,      // K distinct experts, uniform
  kSkewed,       // Zipf-like expert popularity, ~10% of selections -1
  kAllToOne,     // every token selects expert `target` in slot 0, the rest -1
  kEmptyRank,    // no token selects an expert of the last rank
  kAllMinusOne,  // every selection -1
  kDuplicates,   // uniform, but some rows repeat the previous slot's expert
};
const char* routing_name(Routing r);
Routing routing_from_name(const std::string& name);  // throws std::invalid_argument
std::vector<Routing> all_routings();

// topk_idx [T, K] row-major for `rank` (ranks differ through the rng stream).
std::vector<int64_t> make_topk_idx(Routing routing, int64_t num_tokens, int top_k,
                                   int num_experts, int num_ranks, std::mt19937_64& rng,
                                   int target_expert = 0);
// topk_weights [T, K] in (0, 1], 0 where topk_idx is -1.
std::vector<float> make_topk_weights(const std::vector<int64_t>& topk_idx, std::mt19937_64& rng);
// n random bf16 values (bit patterns), normal(0, 1) times a random per-row magnitude.
std::vector<uint16_t> make_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng);
// rows x cols float16 bit patterns over the whole format, drawn per value: mostly ordinary
// magnitudes (2^-6 .. 2^8), the top binade (32768 .. 65504: two of one sign overflow), subnormals
// and zeros, and rarely +-inf or a NaN of any payload.
std::vector<uint16_t> make_f16(int64_t rows, int64_t cols, std::mt19937_64& rng);
// [T, H] bf16: make_bf16's rows plus, by row index (t % 9), adversarial kinds for the
// quantisation paths: zeros, huge incl. +-inf, tiny and subnormal, NaN, random bit patterns, mixed
// groups (-0, one huge value); with nan_groups also a group of NaNs only followed by one of NaN and
// -0 only (their amax is +0: no value counts).
std::vector<uint16_t> make_x(int64_t T, int64_t H, std::mt19937_64& rng, bool nan_groups = false);
// n random bytes.
std::vector<uint8_t> make_bytes(size_t n, std::mt19937_64& rng);

}  // namespace epx::testing
