// The CTA-count rules of the cuda overlapped ll combine (docs/design.md §7.6; kernels/ll/
// combine.cuh O4, cuda/tuning.h), host code run without a GPU: the send's S CTAs lie in [1, C]
// (C: the receive's CTAs); the S CTAs' shares of combine_ready add up to C, what a plain send's C
// CTAs add, so the receive's e * C wait and every later combine's hold whichever form each
// combine took; and where ranks share one GPU, the library's admission (ranks x S below the SMs)
// is exactly the co-residency the ranks' waits need: however far each rank got, a rank whose GEMM
// is still running finds a free SM for it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "cuda/kernels/ll/ll_layout.cuh"
#include "cuda/tuning.h"

namespace epx::detail {
namespace {

TEST(LlCtas, SendCtasLieWithinTheReceiveCtas) {
  for (int C = 1; C <= kLlMaxCtas; ++C)
    for (const int64_t block_rows : {int64_t{0}, int64_t{1}, int64_t{64}})
      for (int requested = 0; requested <= kLlMaxCtas + 2; ++requested) {
        const int S = resolve_ll_overlap_ctas(block_rows, requested, C);
        ASSERT_GE(S, 1) << "C " << C << " requested " << requested;
        ASSERT_LE(S, C) << "C " << C << " requested " << requested;
        if (requested >= 1 && requested <= C) ASSERT_EQ(S, requested) << "C " << C;
        if (requested == 0) ASSERT_EQ(S, std::min(C, block_rows > 0 ? 3 : 32)) << "C " << C;
      }
}

TEST(LlCtas, ReadySharesAddUpToTheReceiveCtas) {
  for (int C = 1; C <= kLlMaxCtas; ++C)
    for (int S = 1; S <= C; ++S) {
      uint32_t sum = 0, lo = UINT32_MAX, hi = 0;
      for (int i = 0; i < S; ++i) {
        const uint32_t share = ll_overlap_ready_share(C, S, i);
        sum += share;
        lo = std::min(lo, share);
        hi = std::max(hi, share);
      }
      ASSERT_EQ(sum, static_cast<uint32_t>(C)) << "C " << C << " S " << S;
      ASSERT_GE(lo, 1u) << "C " << C << " S " << S;  // every send CTA releases its rows
      ASSERT_LE(hi - lo, 1u) << "C " << C << " S " << S;
    }
}

// R ranks on one GPU of `sms` SMs, each with receives of C CTAs (the mode bounds C by its num_sms:
// SMs / R, or a given one with R x max(2, num_sms) <= SMs; so R C <= SMs) and sends of S <= C CTAs.
// A send spins until its own GEMM's signals, a receive (after its rank's send) until every rank's
// send is done: with k ranks receiving and R - k still sending, k C + (R - k) S SMs spin, and a
// GEMM still running needs one more (its CTAs never wait, one SM finishes it). The admission must
// hold exactly when every k < R leaves that SM.
TEST(LlCtas, SharedGpuAdmissionIsCoResidency) {
  for (int R = 1; R <= 8; ++R)
    for (int sms = 2 * R; sms <= 200; ++sms)
      for (int C = 1; C <= std::min(kLlMaxCtas, sms / R); ++C)
        for (int S = 1; S <= C; ++S) {
          bool runnable = true;
          for (int k = 0; k < R; ++k) runnable = runnable && k * C + (R - k) * S < sms;
          ASSERT_EQ(ll_overlap_fits_shared_gpu(R, S, sms), runnable)
              << "R " << R << " SMs " << sms << " C " << C << " S " << S;
        }
}

// The combine's token slices (kernels/ll/ll_layout.cuh ll_combine_slices): at T <= C / 2 a
// token's nv output vectors go to P CTAs; the T * P CTAs fit in C, the P slices
// (ll_combine_slice_begin, as the kernel takes them) tile [0, nv) exactly, and each keeps
// kLlCombineSliceVectors vectors; above C / 2, or where a row is narrower than two slices, one
// CTA per token (P = 1).
TEST(LlCtas, CombineSlicesTileEachTokensVectors) {
  for (int C = 1; C <= kLlMaxCtas; ++C)
    for (int64_t T = 0; T <= C + 1; ++T)
      for (const int64_t nv : {16, 255, 256, 896, 2064}) {
        const int P = ll_combine_slices(T, C, nv);
        ASSERT_GE(P, 1) << "C " << C << " T " << T << " nv " << nv;
        if (T == 0 || 2 * T > C || nv < 2 * kLlCombineSliceVectors) {
          ASSERT_EQ(P, 1) << "C " << C << " T " << T << " nv " << nv;
          continue;
        }
        ASSERT_LE(T * P, C) << "C " << C << " T " << T << " nv " << nv;
        ASSERT_EQ(P, std::min<int64_t>(C / T, nv / kLlCombineSliceVectors))
            << "C " << C << " T " << T << " nv " << nv;
        int64_t next = 0;  // the slices as the kernel computes them, in order
        for (int s = 0; s < P; ++s) {
          const int64_t begin = ll_combine_slice_begin(static_cast<int>(nv), s, P);
          const int64_t end = ll_combine_slice_begin(static_cast<int>(nv), s + 1, P);
          ASSERT_EQ(begin, next) << "C " << C << " T " << T << " nv " << nv << " slice " << s;
          ASSERT_GE(end - begin, kLlCombineSliceVectors) << "C " << C << " T " << T << " nv " << nv;
          next = end;
        }
        ASSERT_EQ(next, nv) << "C " << C << " T " << T << " nv " << nv;
      }
}

}  // namespace
}  // namespace epx::detail
