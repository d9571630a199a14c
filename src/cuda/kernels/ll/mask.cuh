// src/cuda/kernels/ll/mask.cuh — the caller's side of the ll rank mask (enable_shrink,
// docs/semantics.md §2.6): ll_update_mask, ll_query_mask and ll_clean_mask as one single-thread
// kernel on the caller's stream, so they are ordered with the ll kernels around them (and
// capturable). The mask word is LlMask::masked of this rank's region (ll_layout.cuh), bit p =
// rank p; this rank's ll kernels also set bits in it (atomicOr) when a wait times out, hence the
// atomics here.
//   kLlMaskSet / kLlMaskClear   bit `rank` set / cleared
//   kLlMaskClearAll             every bit cleared
//   kLlMaskQuery                out[p * out_stride] = bit p (int32 0 / 1), p < num_ranks
#pragma once

#include <cstdint>

namespace epx::detail {

enum LlMaskOp : int32_t { kLlMaskSet = 0, kLlMaskClear = 1, kLlMaskClearAll = 2, kLlMaskQuery = 3 };

struct LlMaskParams {
  unsigned long long* mask;  // this rank's LlMask::masked
  int32_t op;                // LlMaskOp
  int32_t rank;              // kLlMaskSet / kLlMaskClear
  int32_t* out;              // kLlMaskQuery: int32 [num_ranks], element stride out_stride
  int64_t out_stride;
  int32_t num_ranks;
};

}  // namespace epx::detail

namespace epx::ll {

__global__ void mask(detail::LlMaskParams p) {
  using namespace detail;
  switch (p.op) {
    case kLlMaskSet:
      atomicOr(p.mask, 1ull << p.rank);
      break;
    case kLlMaskClear:
      atomicAnd(p.mask, ~(1ull << p.rank));
      break;
    case kLlMaskClearAll:
      atomicExch(p.mask, 0ull);
      break;
    default: {
      const unsigned long long m = *reinterpret_cast<volatile unsigned long long*>(p.mask);
      for (int q = 0; q < p.num_ranks; ++q)
        p.out[q * p.out_stride] = static_cast<int32_t>(m >> q & 1);
    }
  }
}

}  // namespace epx::ll
