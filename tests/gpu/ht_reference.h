// tests/gpu/ht_reference.h — inputs for every rank of an ht case, generated from one seed in
// every process, and the naive expected results written straight from docs/semantics.md §1 (loops,
// no cleverness). The GPU tests compare the cuda backend with these bit for bit, and with the cpu
// backend where it implements ht (cpu_backend_ht below).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "support/routing.h"

namespace epx::gpu_testing {

struct HtCase {
  int num_ranks = 2;
  int64_t hidden = 256;
  int top_k = 8;
  int num_experts = 32;
  std::vector<int64_t> num_tokens;  // per rank
  testing::Routing routing = testing::Routing::kUniform;
  bool fp8 = false;       // x fp8 e4m3 with scales, else bf16
  bool ue8m0 = false;     // fp8 scales as int32 [T, H/512], else float32 [T, H/128]
  bool topk_i32 = false;  // topk_idx int32, else int64
  bool weights = true;    // topk_weights given
  int alignment = 1;
  bool x_padded = false;  // x rows 32 bytes apart more than their size (strided x)
  uint64_t seed = 1;
  std::string describe() const;
  int64_t row_bytes() const { return hidden * (fp8 ? 1 : 2); }
  int num_scales() const { return fp8 ? static_cast<int>(ue8m0 ? hidden / 512 : hidden / 128) : 0; }
};

struct HtRankInput {
  int64_t num_tokens = 0;
  std::vector<int64_t> topk_idx;  // [T, K]
  std::vector<float> topk_weights;
  std::vector<uint8_t> x;        // [T, row_bytes]
  std::vector<uint32_t> scales;  // [T, num_scales] (4-byte elements, bits)
};

// Inputs of every rank; `salt` varies x (and scales) only, keeping the routing (cached mode).
std::vector<HtRankInput> make_ht_inputs(const HtCase& c, uint64_t salt = 0);

struct HtExpectedDispatch {
  int64_t num_recv = 0;                        // N
  std::vector<uint8_t> recv_x;                 // [N, row_bytes]
  std::vector<uint32_t> recv_scales;           // [N, num_scales]
  std::vector<int64_t> recv_topk_idx;          // [N, K]
  std::vector<float> recv_topk_weights;        // [N, K]
  std::vector<int32_t> recv_src_idx;           // [N]
  std::vector<int> num_recv_per_expert;        // [L], aligned
  std::vector<int32_t> rank_prefix_matrix;     // [R, R]
  std::vector<int32_t> send_pos;               // [T, R] of this rank's tokens
  std::vector<uint8_t> is_token_in_rank;       // [T, R]
  std::vector<int32_t> num_tokens_per_rank;    // [R]
  std::vector<int32_t> num_tokens_per_expert;  // [E]
};
std::vector<HtExpectedDispatch> expected_ht_dispatch(const HtCase& c,
                                                     const std::vector<HtRankInput>& in);

struct HtCombineInput {
  std::vector<uint16_t> y;  // [N, H] bf16
  bool has_weights = false;
  std::vector<float> weights;   // [N, K] when has_weights
  std::vector<uint16_t> bias0;  // [T, H] (empty: none)
  std::vector<uint16_t> bias1;
};
std::vector<HtCombineInput> make_combine_inputs(const HtCase& c,
                                                const std::vector<HtExpectedDispatch>& d,
                                                bool weights, bool bias0, bool bias1,
                                                uint64_t salt);

struct HtExpectedCombine {
  std::vector<uint16_t> out;    // [T, H]
  std::vector<float> combined;  // [T, K] (when weights)
};
std::vector<HtExpectedCombine> expected_ht_combine(const HtCase& c,
                                                   const std::vector<HtRankInput>& in,
                                                   const std::vector<HtExpectedDispatch>& d,
                                                   const std::vector<HtCombineInput>& y);

// The same case through the cpu backend (R threads in this process). nullopt (with `why`) when
// the cpu backend does not implement ht yet.
struct CpuHtResult {
  std::vector<HtExpectedDispatch> dispatch;
  std::vector<HtExpectedCombine> combine;
};
std::optional<CpuHtResult> cpu_backend_ht(const HtCase& c, const std::vector<HtRankInput>& in,
                                          const std::vector<HtCombineInput>& y, std::string* why);

}  // namespace epx::gpu_testing
