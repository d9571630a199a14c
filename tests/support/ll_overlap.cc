#include "support/ll_overlap.h"

#include <algorithm>

namespace epx::testing {

std::string OverlapForm::describe() const {
  return block_rows > 0 ? "blocks of " + std::to_string(block_rows) + " rows, " +
                              std::to_string(parts) + " N tiles"
                        : "experts, " + std::to_string(parts) + " CTAs";
}

std::string OverlapCase::describe() const {
  return c.describe() + " overlap: " + form.describe() + " num_sms=" + std::to_string(num_sms) +
         (check_count ? " recv_count" : "");
}

OverlapCase two_round_case(const LlProblem& p, uint64_t seed, const OverlapForm& form) {
  OverlapCase oc;
  oc.c.p = p;
  oc.c.fixed_tokens.assign(p.num_ranks, p.max_tokens);
  oc.c.num_iters = 2;
  oc.c.seed = seed;
  oc.form = form;
  return oc;
}

int first_signal_with_rows(const std::vector<int32_t>& recv_count, int64_t rows_per_expert,
                           int64_t block_rows) {
  for (size_t l = 0; l < recv_count.size(); ++l)
    if (recv_count[l] > 0) return static_cast<int>(l * overlap_blocks(rows_per_expert, block_rows));
  return -1;
}

int64_t overlap_blocks(int64_t rows_per_expert, int64_t block_rows) {
  return block_rows > 0 ? (rows_per_expert + block_rows - 1) / block_rows : 1;
}

std::vector<OverlapGemmPart> overlap_gemm_parts(const std::vector<int32_t>& recv_count,
                                                int64_t rows_per_expert, int64_t hidden,
                                                const OverlapForm& form, std::mt19937_64& rng,
                                                int64_t max_delay_ns, int skip_signal) {
  const int64_t blocks = overlap_blocks(rows_per_expert, form.block_rows);
  std::vector<OverlapGemmPart> parts;
  std::uniform_int_distribution<int64_t> delay(0, max_delay_ns);
  for (int l = 0; l < static_cast<int>(recv_count.size()); ++l) {
    const int64_t n = recv_count[l];
    const int64_t block = form.block_rows > 0 ? form.block_rows : n;
    for (int64_t b = 0; b * block < n; ++b) {
      const int signal = static_cast<int>(l * blocks + b);
      if (signal == skip_signal) continue;
      const int64_t r0 = b * block, r1 = std::min(n, r0 + block);
      for (int i = 0; i < form.parts; ++i) {
        OverlapGemmPart p{l, signal, r0, r1, 0, hidden, 0};
        if (form.block_rows > 0) {  // N tiles: a slice of the columns (8-aligned)
          const int64_t tile = (hidden / 8 + form.parts - 1) / form.parts * 8;
          p.col_begin = std::min(hidden, i * tile);
          p.col_end = std::min(hidden, (i + 1) * tile);
        } else {  // CTAs of the expert: a slice of its rows
          const int64_t rows = (r1 - r0 + form.parts - 1) / form.parts;
          p.row_begin = std::min(r1, r0 + i * rows);
          p.row_end = std::min(r1, r0 + (i + 1) * rows);
        }
        p.delay_ns = delay(rng);
        parts.push_back(p);
      }
    }
  }
  std::shuffle(parts.begin(), parts.end(), rng);
  return parts;
}

}  // namespace epx::testing
