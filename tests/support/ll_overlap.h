// tests/support/ll_overlap.h — the stand-in expert GEMM of the overlapped ll combine's tests
// (docs/semantics.md §2.7): which parts of y it stores, in which order, and which signal each
// part raises. Shared by the cpu tier (tests/unit/ll_overlap_test.cc: a host thread plays the
// GEMM) and the GPU tier (tests/gpu/ll_overlap_gpu_test.cu: a kernel plays it), so both raise
// the signals the same way.
//
// Signal forms (the forks' producers):
//   blocks  (DeepEP antgroup-opt's comp_signal, DeepGEMM): block_rows > 0, one signal per
//           (local expert l, block b of block_rows rows), index l * blocks + b; the GEMM adds 1
//           per stored N tile, so a signal is reached at `parts` = ceil(H / block_n).
//   experts (hybrid-ep's src_signals, the cute-dsl masked GEMM): block_rows = 0, one signal per
//           expert, index l; each of the expert's `parts` CTAs adds 1 once its rows are stored.
// Either way a signal has `parts` parts, each a slice of the block's columns (blocks form) or of
// its rows (experts form), each followed by one release add of 1; expected = parts.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/ll_cases.h"

namespace epx::testing {

struct OverlapForm {
  int64_t block_rows = 0;  // 0: the experts form
  int parts = 1;           // adds per signal = expected
  std::string describe() const;
};

// One part of the stand-in GEMM: rows [row_begin, row_end) x columns [col_begin, col_end) of
// local expert l, then signals[signal] += 1 (release), after a delay of delay_ns.
struct OverlapGemmPart {
  int32_t l;
  int32_t signal;
  int64_t row_begin, row_end, col_begin, col_end;
  int64_t delay_ns;
};

// One case: the ll case (problem, routing, hook, zero_copy, out, rounds), the signal form, the
// send's SM budget (LlCombineOverlap::num_sms) and whether recv_count is passed (and checked).
struct OverlapCase {
  LlCase c;
  OverlapForm form;
  int num_sms = 0;
  bool check_count = false;
  std::string describe() const;
};

// The error tests' case: T = T_max tokens on every rank of p, two batches (a failing round and
// the round after ll_clean).
OverlapCase two_round_case(const LlProblem& p, uint64_t seed, const OverlapForm& form);

// The lowest signal whose block has rows (what a GEMM that never raises it leaves waiting), or
// -1.
int first_signal_with_rows(const std::vector<int32_t>& recv_count, int64_t rows_per_expert,
                           int64_t block_rows);

// Signals per local expert (ceil(RT / block_rows), or 1) — the library's count.
int64_t overlap_blocks(int64_t rows_per_expert, int64_t block_rows);

// Every part of a rank's GEMM (experts with recv_count[l] rows, H columns), in a random order of
// `rng`, each with a delay in [0, max_delay_ns]; experts without rows have no parts (their
// signals are never raised: the combine must not wait for them). `skip_signal` >= 0: the parts
// of that signal are left out (a signal never raised).
std::vector<OverlapGemmPart> overlap_gemm_parts(const std::vector<int32_t>& recv_count,
                                                int64_t rows_per_expert, int64_t hidden,
                                                const OverlapForm& form, std::mt19937_64& rng,
                                                int64_t max_delay_ns, int skip_signal = -1);

}  // namespace epx::testing
