// tests/gpu/ht_reference.h — what the GPU ht tests add to the naive oracle: a case (HtCase), the
// inputs of every rank generated from the case seed in every process, in the oracle's input form,
// and the same case through the cpu backend (cpu_backend_ht below).
//
// The expected results come from the one ht oracle, tests/support/oracle_ht.h (docs/semantics.md
// §1, straight loops), that the cpu unit tests and epx-bench --check use too: the GPU tests compare
// the cuda backend with it bit for bit, and with the cpu backend where that implements ht.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "support/oracle_ht.h"
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
  int ranks_per_node = 0;  // GroupOptions::ranks_per_node of the cpu backend and the oracle
  uint64_t seed = 1;
  std::string describe() const;
  int64_t row_bytes() const { return hidden * (fp8 ? 1 : 2); }
  int num_scales() const { return fp8 ? static_cast<int>(ue8m0 ? hidden / 512 : hidden / 128) : 0; }
  // The oracle's problem for this case; num_worst_tokens > 0: worst-case mode.
  testing::HtProblem problem(int64_t num_worst_tokens = 0) const;
};

// Inputs of every rank in the oracle's form: x rows and scale rows as bytes (scales are 4-byte
// elements), topk ids int64 whatever topk_i32 says (the upload narrows them), topk_weights drawn
// even when !weights (has_topk_weights = weights). `salt` varies x (and scales) only, keeping the
// routing (cached mode).
std::vector<testing::HtRankInput> make_ht_inputs(const HtCase& c, uint64_t salt = 0);

// Combine inputs of every rank after the exact dispatch of `in`: y [N_r, H] bf16 and, where asked,
// weights [N_r, K] and biases [T_r, H].
std::vector<testing::HtCombineRankInput> make_combine_inputs(
    const HtCase& c, const std::vector<testing::HtRankInput>& in, bool weights, bool bias0,
    bool bias1, uint64_t salt);

// The same case through the cpu backend (R threads in this process), its outputs in the oracle's
// result form. nullopt (with `why`) when the cpu backend does not implement ht yet.
struct CpuHtResult {
  std::vector<testing::HtExpectedDispatch> dispatch;
  std::vector<testing::HtExpectedCombine> combine;
};
std::optional<CpuHtResult> cpu_backend_ht(const HtCase& c,
                                          const std::vector<testing::HtRankInput>& in,
                                          const std::vector<testing::HtCombineRankInput>& y,
                                          std::string* why);

// The outputs of rank r where the cpu backend differs from the oracle's `want` / `want_c` (bit for
// bit; recv_topk_weights only where the case gives weights); empty when they agree.
std::vector<std::string> cpu_backend_differences(const HtCase& c, const CpuHtResult& cpu, int r,
                                                 const testing::HtExpectedDispatch& want,
                                                 const testing::HtExpectedCombine& want_c);

}  // namespace epx::gpu_testing
