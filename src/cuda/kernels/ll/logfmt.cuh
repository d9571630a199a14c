// src/cuda/kernels/ll/logfmt.cuh — the LogFMT-10 halves of the ll combine (use_logfmt; the
// format: core/logfmt.h, docs/semantics.md §2.3.1): the expert side encodes its rows into its
// combine slot, the source side decodes what it pulls before the k-ordered fma chain of
// combine.cuh. Both use core/logfmt.h's EPX_HD functions, which the cpu backend uses too, so the
// results are the cpu backend's bit for bit.
//
// Expert side (send half, every row the sources will pull, this rank's own included):
//   row (l, row) of y (the caller's, or comb_y(r, q) itself with zero_copy: in place)
//     -> comb_y(r, q)[l][row]: group g's 256-byte slot holds the cast group's 160 bytes (codes'
//        low bytes [128], then 16 uint16 of high bits and signs) or its raw 256 bytes
//     -> comb_meta(r, q)[l][row][g]: the group's meta word (kLogfmtRawMeta: raw)
//   A half-warp per (row, group), lane j holding channels 8j .. 8j + 7 (one 16-byte load): amax /
//   amin over the half-warp by shuffles, then lane j stores its 8 codes' low bytes (8 bytes at
//   8j) and its hs word (2 bytes at 128 + 2j). In place, a group's stores follow the shuffles,
//   which need every lane's load: nothing is overwritten before it was read.
// Source side (receive half, a group of n <= kLlCombineTokens tokens, their n * K selections):
//   for each chunk of groups [g0, g0 + gc), gc = kLlLogfmtMetaWords / (n * K):
//     1. the meta words of every selection's row in the chunk -> shared memory (one round trip);
//     2. threads take (token, 8-channel vector) items; per k, the row's bytes for that vector
//        (raw: 16 bytes at 16j; cast: 8 bytes at 8j and 2 at 128 + 2j of the group's slot), then
//        acc = __fmaf_rn(w, decoded, acc) in k order, and out = bf16(acc) (one rounding).
#pragma once

#include "core/logfmt.h"
#include "cuda/kernels/ll/common.cuh"

namespace epx::detail {

inline constexpr int kLlLogfmtMetaWords = 2048;  // meta words a combine CTA holds per chunk

// The table of core/logfmt.h in constant memory; each CTA copies it to shared memory, where the
// per-value lookups (any index per lane) are cheap.
static __constant__ float kLlLogfmtLog2Frac[128] = {EPX_LOGFMT_LOG2_FRAC};

// A LogFMT combine's shared memory is the kernel's dynamic shared memory (the launch passes
// ll_logfmt_smem_bytes with use_logfmt, 0 otherwise), not static: the plain combine then keeps
// its static size below 32 KB, the L1 / shared-memory carveout it had before LogFMT (moving these
// 10.5 KB out took ≈ 1.5 µs off the plain combine's row in DeepEP's harness, of the 5.5 µs it
// grew when LogFMT came; docs/perf.md §4.3). Layout:
// the table [128] f32, the meta words [kLlLogfmtMetaWords] u32, the rows' meta pointers
// [kLlCombineTokens * kLlMaxTopK].
inline constexpr size_t kLlLogfmtMetaOff = 128 * 4;
inline constexpr size_t kLlLogfmtRowsOff = kLlLogfmtMetaOff + 4 * kLlLogfmtMetaWords;
constexpr size_t ll_logfmt_smem_bytes() {
  return kLlLogfmtRowsOff + sizeof(uintptr_t) * kLlCombineTokens * kLlMaxTopK;
}

__device__ __forceinline__ float* ll_logfmt_table() {
  return reinterpret_cast<float*>(ll_dyn_smem());
}
__device__ __forceinline__ uint32_t* ll_logfmt_meta() {
  return reinterpret_cast<uint32_t*>(ll_dyn_smem() + kLlLogfmtMetaOff);
}
// s_mrow of the combine's receive (combine.cuh).
__device__ __forceinline__ uintptr_t* ll_logfmt_rows() {
  return reinterpret_cast<uintptr_t*>(ll_dyn_smem() + kLlLogfmtRowsOff);
}

// Every thread of the CTA calls it (a barrier).
__device__ __forceinline__ void ll_logfmt_load_table() {
  if (threadIdx.x < 128) ll_logfmt_table()[threadIdx.x] = kLlLogfmtLog2Frac[threadIdx.x];
  __syncthreads();
}

// Encodes `num_rows` rows: row m is y_row(m) (8 bf16 per lane: the vector at 8 * lane16 of
// group g) into comb_y / comb_meta rows slot_row(m) (index l * RT + row). The whole warp calls it
// (shuffles over half-warps); `in_place`: y_row(m) is comb_y's own row (zero_copy).
template <typename YRow>
__device__ void ll_logfmt_encode_rows(const LlSymm& symm, int q, int64_t num_rows,
                                      int64_t first_slot_row, int64_t slot_row_stride,
                                      bool in_place, YRow y_row) {
  constexpr int kBatch = 4;  // groups per half-warp loaded before any is encoded
  const LlLayout& g = symm.layout;
  const int64_t H = g.hidden, G = g.num_groups;
  const int half = (threadIdx.x >> 4) & 1, j = threadIdx.x & 15;
  const int warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int64_t num_items = num_rows * G;
  const float* table = ll_logfmt_table();
  uint16_t* const ybase = g.comb_y(symm.local, q);
  uint32_t* const mbase = g.comb_meta(symm.local, q);
  for (int64_t base = 2 * warp; base < num_items; base += int64_t{2} * num_warps * kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + half + int64_t{2} * num_warps * b;
      v[b] = make_uint4(0, 0, 0, 0);
      if (i < num_items) {
        const int64_t m = i / G, grp = i - m * G;
        v[b] = y_row(m, grp * kLogfmtGroup + 8 * j);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + half + int64_t{2} * num_warps * b;
      uint16_t h[8];
      memcpy(h, &v[b], 16);
      uint32_t amax = 0, amin = 0xFFFFu;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const uint32_t mag = h[c] & 0x7FFFu;
        amax = max(amax, mag);
        amin = min(amin, mag);
      }
#pragma unroll
      for (int off = 1; off < 16; off <<= 1) {  // within the half-warp
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        amin = min(amin, __shfl_xor_sync(0xffffffffu, amin, off));
      }
      if (i >= num_items) continue;  // (after the shuffles: every lane takes part in them)
      const int64_t m = i / G, grp = i - m * G;
      const int64_t slot_row = first_slot_row + m * slot_row_stride;
      char* dst = reinterpret_cast<char*>(ybase + slot_row * H + grp * kLogfmtGroup);
      const uint32_t meta = logfmt_meta(amax, amin);
      if (j == 0) mbase[slot_row * G + grp] = meta;
      if (meta == kLogfmtRawMeta) {
        if (!in_place) *reinterpret_cast<uint4*>(dst + 16 * j) = v[b];
        continue;
      }
      const LogfmtParams par = logfmt_params(meta, table);
      uint64_t low;
      uint32_t hs;
      logfmt_encode8(h, par, f32_div(1.0f, par.step), table, &low, &hs);
      *reinterpret_cast<uint2*>(dst + 8 * j) =
          make_uint2(static_cast<uint32_t>(low), static_cast<uint32_t>(low >> 32));
      *reinterpret_cast<uint16_t*>(dst + kLogfmtGroup + 2 * j) = static_cast<uint16_t>(hs);
    }
  }
}

// Steps 1-2 of the file comment for tokens [c0, c0 + n) whose selections' comb_y rows are
// s_src[tl * K + k] (0: skipped) with meta rows s_mrow[...] and weights s_w[...]. Every thread
// of the CTA calls it (barriers).
__device__ void ll_logfmt_reduce(const LlSymm& symm, int64_t c0, int n, const uintptr_t* s_src,
                                 const uintptr_t* s_mrow, const float* s_w, uint16_t* out,
                                 int64_t out_stride, bool out_vec16) {
  uint32_t* const s_meta = ll_logfmt_meta();
  const LlLayout& g = symm.layout;
  const int K = g.top_k;
  const int64_t G = g.num_groups;
  const int num_sel = n * K;
  const int64_t per_chunk = max(1, kLlLogfmtMetaWords / num_sel);
  const float* table = ll_logfmt_table();
  for (int64_t g0 = 0; g0 < G; g0 += per_chunk) {
    const int gc = static_cast<int>(min(per_chunk, G - g0));
    // 1.
    for (int idx = threadIdx.x; idx < num_sel * gc; idx += blockDim.x) {
      const int sel = idx / gc, gg = idx - sel * gc;
      const auto* mrow = reinterpret_cast<const uint32_t*>(s_mrow[sel]);
      s_meta[idx] = mrow ? ld_landed<uint32_t>(mrow + g0 + gg) : 0u;
    }
    __syncthreads();
    // 2.
    const int64_t nvc = int64_t{gc} * (kLogfmtGroup / 8);
    for (int64_t it = threadIdx.x; it < n * nvc; it += blockDim.x) {
      const int tl = static_cast<int>(it / nvc);
      const int64_t vv = it - tl * nvc;
      const int gl = static_cast<int>(vv >> 4), j = static_cast<int>(vv & 15);
      const int64_t byte_off = (g0 + gl) * kLogfmtRawBytes;
      const uintptr_t* src = s_src + tl * K;
      const uint32_t* meta = s_meta + tl * K * gc + gl;  // selection k's: meta[k * gc]
      // Raw: 8 bf16; cast: {low bytes (x, y), hs (z)}.
      auto load = [&](int k) {
        const char* grp = reinterpret_cast<const char*>(src[k]) + byte_off;
        if (meta[k * gc] == kLogfmtRawMeta) return ld_landed<uint4>(grp + 16 * j);
        const uint2 lo = ld_landed<uint2>(grp + 8 * j);
        return make_uint4(lo.x, lo.y, ld_landed<uint16_t>(grp + kLogfmtGroup + 2 * j), 0);
      };
      auto decode = [&](int k, const uint4& val, float* f) {
        if (meta[k * gc] == kLogfmtRawMeta) return ll_bf16x8_to_f32(val, f);
        const uint64_t low = static_cast<uint64_t>(val.y) << 32 | val.x;
        logfmt_decode8(low, val.z, logfmt_params(meta[k * gc], table), f);
      };
      float acc[8];
      ll_reduce8<kLlLoadBatch>(K, src, s_w + tl * K, load, decode, acc);
      if (out) {
        const uint4 packed = f32_to_bf16_vec<uint4>(acc);
        ll_st8(out + (c0 + tl) * out_stride + 8 * ((g0 + gl) * 16 + j), packed, out_vec16);
      }
    }
    __syncthreads();  // s_meta is rewritten by the next chunk
  }
}

}  // namespace epx::detail
