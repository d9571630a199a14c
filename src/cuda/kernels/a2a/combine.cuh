// src/cuda/kernels/a2a/combine.cuh — a2a combine (docs/semantics.md §3.3): each rank pulls, for
// each of its tokens, the rows its destinations computed, and sums them in ascending rank order.
//
// Rank r, T tokens, M, hb = H * element size, C CTAs; call epoch e = ++state.combine_epoch[b].
// The routing (mask[t], slot[t][d]) is the one the preceding dispatch stored in the workspace.
//   1. Copy mode (payload_in_workspace false): rows y[s][j] for s != r, j < recv_counts[s] go
//      to the combine region, row (s * M + j) (what peer s will pull); rows for r itself are read
//      straight from y in step 4. The CTAs share each s's rows. In-workspace mode: nothing, the
//      MoE kernel already wrote the region ([R, M, H] contiguous).
//   2. CTA 0: combine_geom[r] = {H, dtype} on every peer. Every CTA: release +1 into
//      combine_flag[r] of every peer (common.cuh).
//   3. Every CTA waits combine_flag[d] >= e * C_d for every peer d: their regions hold their y.
//      CTA 0 checks every peer's H and dtype against its own (mismatch -> InvalidArgument record).
//   4. Reduce, EXACT ORDER of the cpu backend (src/cpu/a2a.cc), for token t, element h:
//        float acc = 0.0f;
//        for d = 0..R-1 ascending with bit d of mask[t]:
//          acc += float(y_d[r][slot[t][d]][h]);   // peer d's region, or y / the region for d = r
//        out[t][h] = round(acc) to y's element type kElem (core/numeric.h, one rounding):
//          bf16: f32_to_bf16 (f32x2_to_bf16x2 where a vector holds pairs: the same bits),
//          f16:  f32_to_f16 (the hardware's f32x2_to_f16x2, __floats2half2_rn, which the GPU
//                tier's NumericGpu.HardwareF16* checks against it on every input),
//          f32:  acc
//      Tokens are split into C contiguous chunks; a CTA walks (token, vector) pairs of its chunk
//      with kReduceUnroll pairs in flight per thread (one load per pair and destination).
// Rank mask (I = state.inactive_mask, the one the preceding dispatch used: set_active_ranks
// restarts the dispatch -> combine order): steps 2 and 3 skip the ranks of I; mask[t] holds no
// bit of I (dispatch cleared them), so step 4 never reads an inactive rank's region and a token
// routed only to inactive ranks gets +0.0; recv_counts[s] = 0 for s in I, so step 1 copies
// nothing for them.
// Reuse of the region: a peer's next dispatch completes only after this rank's next dispatch
// entered, i.e. after this combine finished reading (stream order); the MoE kernel (or the next
// combine's copy) writes the region only after that dispatch.
#pragma once

#include <cstring>

#include "core/numeric.h"
#include "cuda/kernels/a2a/common.cuh"

namespace epx::detail {

inline constexpr int kReduceUnroll = 4;

// The element type of y and out (DType kBF16 / kF16 / kF32; the launcher maps one to the other).
enum class A2aElem { kBf16, kF16, kF32 };

template <A2aElem kElem>
inline constexpr int kElemBytes = kElem == A2aElem::kF32 ? 4 : 2;

struct A2aCombineParams {
  const char* y;         // copy mode: the caller's y; row [s][j] at s * y_stride0 + j * y_stride1
  int64_t y_stride0;     // bytes
  int64_t y_stride1;     // bytes
  char* out;             // [T, H] contiguous
  int64_t hidden_bytes;  // hb: bytes of a row of y, of out and of the region
  int32_t hidden;        // H (geometry check)
  int32_t dtype;         // DType of y (geometry check)
  int32_t num_tokens;    // T of the preceding dispatch
  int32_t num_ranks;
  int32_t rank;
  int32_t runtime_max;  // M
  int32_t in_workspace;
  A2aSymm symm;
  WaitContext wait;
};

// One 16-bit element of y widened to f32 (exact).
template <A2aElem kElem>
__device__ __forceinline__ float a2a_widen(uint16_t h) {
  if constexpr (kElem == A2aElem::kBf16) {
    return bf16_to_f32(h);
  } else {
    return f16_to_f32(h);
  }
}

template <typename V, A2aElem kElem>
__device__ __forceinline__ void a2a_accumulate(float* acc, const V& v) {
  if constexpr (kElem == A2aElem::kF32) {
    float f[sizeof(V) / 4];
    memcpy(f, &v, sizeof(V));
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(V) / 4); ++i) acc[i] += f[i];
  } else {
    uint16_t h[sizeof(V) / 2];
    memcpy(h, &v, sizeof(V));
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(V) / 2); ++i) acc[i] += a2a_widen<kElem>(h[i]);
  }
}

template <typename V, A2aElem kElem>
__device__ __forceinline__ V a2a_round(const float* acc) {
  V v;
  if constexpr (kElem == A2aElem::kF32) {
    memcpy(&v, acc, sizeof(V));
  } else if constexpr (sizeof(V) % 4 == 0) {  // the hardware conversions, two at a time
    v = f32_to_16bit_vec<V, kElem == A2aElem::kF16>(acc);
  } else {  // V = uint16_t: one element
    const uint16_t h = kElem == A2aElem::kBf16
                           ? f32_to_bf16(acc[0])
                           : static_cast<uint16_t>(f32x2_to_f16x2(acc[0], 0.0f));  // hardware
    memcpy(&v, &h, sizeof(V));
  }
  return v;
}

// Step 1: this CTA's share of y's rows for peers into the region.
template <typename V>
__device__ void a2a_stage_y(const A2aCombineParams& p) {
  const A2aLayout& g = p.symm.layout;
  const int32_t* counts = g.counts(p.symm.local);
  char* region = g.combine(p.symm.local);
  const int64_t nv = p.hidden_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t M = p.runtime_max;
  for (int s = 0; s < p.num_ranks; ++s) {
    if (s == p.rank) continue;
    const int64_t count = ld_landed<int32_t>(counts + s);  // written by peer s
    const int64_t chunk = (count + gridDim.x - 1) / gridDim.x;
    const int64_t j_begin = min(static_cast<int64_t>(blockIdx.x) * chunk, count);
    const int64_t num_rows = min(j_begin + chunk, count) - j_begin;
    const char* src = p.y + s * p.y_stride0;
    char* dst = region + s * M * p.hidden_bytes;
    RowWalker w(nv, threadIdx.x);
    while (w.row < num_rows) {
      V val[kReduceUnroll];
      int64_t row[kReduceUnroll], vec[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        row[u] = j_begin + w.row;
        vec[u] = w.vec;
        if (w.row < num_rows) val[u] = ld_input<V>(src + row[u] * p.y_stride1 + vec[u] * sizeof(V));
        w.advance();
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        if (row[u] - j_begin >= num_rows) break;
        *reinterpret_cast<V*>(dst + row[u] * p.hidden_bytes + vec[u] * sizeof(V)) = val[u];
      }
    }
  }
}

template <typename V, A2aElem kElem>
__global__ void __launch_bounds__(kA2aThreads) a2a_combine_kernel(A2aCombineParams p) {
  static_assert(sizeof(V) % kElemBytes<kElem> == 0, "a2a combine: V must hold whole elements");
  constexpr int kElems = sizeof(V) / kElemBytes<kElem>;
  const int R = p.num_ranks, me = p.rank;
  const A2aSymm& symm = p.symm;
  const A2aLayout& g = symm.layout;
  const WaitContext& w = p.wait;
  A2aState* state = g.state(symm.local);
  const uint32_t e = a2a_next_epoch(state->combine_epoch);
  const uint64_t peers_skipped = state->inactive_mask | (uint64_t{1} << me);

  // 1-2. Publish this rank's y to its active peers.
  if (!p.in_workspace) a2a_stage_y<V>(p);
  if (blockIdx.x == 0 && threadIdx.x < R && !rank_skipped(peers_skipped, threadIdx.x)) {
    int32_t* geom = g.sync(symm.peers[threadIdx.x])->combine_geom[me];
    geom[0] = p.hidden;
    geom[1] = p.dtype;
  }
  __syncthreads();
  signal_ranks(R, peers_skipped, [&](int d) { return &g.sync(symm.peers[d])->combine_flag[me]; });

  // 3. Every active peer's region is ready.
  if (!wait_ranks(
          g.sync(symm.local)->combine_flag, R, peers_skipped,
          [&](int s) { return e * symm.peer_ctas[s]; }, w, kWaitRows))
    return;
  if (blockIdx.x == 0 && threadIdx.x < R && !rank_skipped(peers_skipped, threadIdx.x)) {
    const int d = threadIdx.x;
    const volatile int32_t* geom = g.sync(symm.local)->combine_geom[d];
    if (geom[0] != p.hidden)
      record_error(w, kDevErrA2aGeometry, d,
                   kGeomCombineHidden << 32 | static_cast<uint32_t>(p.hidden), geom[0]);
    else if (geom[1] != p.dtype)
      record_error(w, kDevErrA2aGeometry, d,
                   kGeomCombineDtype << 32 | static_cast<uint32_t>(p.dtype), geom[1]);
  }

  // 4. Reduce in ascending rank order.
  const int64_t T = p.num_tokens, M = p.runtime_max, hb = p.hidden_bytes;
  const int64_t chunk = (T + gridDim.x - 1) / gridDim.x;
  const int64_t t_begin = min(static_cast<int64_t>(blockIdx.x) * chunk, T);
  const int64_t num_rows = min(t_begin + chunk, T) - t_begin;
  const int64_t nv = hb / static_cast<int64_t>(sizeof(V));
  if (num_rows <= 0 || nv == 0) return;
  const uint64_t* masks = g.mask(symm.local);
  const int32_t* slots = g.slot(symm.local);
  const size_t block_off = static_cast<size_t>(me) * M;  // row of slot 0 in [r] of a region
  RowWalker walk(nv, threadIdx.x);
  while (walk.row < num_rows) {
    int64_t t[kReduceUnroll], vec[kReduceUnroll];
    uint64_t m[kReduceUnroll];
    uint64_t any = 0;
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      t[u] = t_begin + walk.row;
      vec[u] = walk.vec;
      m[u] = walk.row < num_rows ? __ldg(masks + t[u]) : 0;
      any |= m[u];
      walk.advance();
    }
    float acc[kReduceUnroll][kElems];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
      for (int i = 0; i < kElems; ++i) acc[u][i] = 0.0f;
    for (; any != 0; any &= any - 1) {
      const int d = __ffsll(static_cast<long long>(any)) - 1;
      V val[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        if (!((m[u] >> d) & 1u)) continue;
        const int64_t slot = __ldg(slots + t[u] * R + d);
        const int64_t at = vec[u] * static_cast<int64_t>(sizeof(V));
        if (d != me) {
          val[u] = ld_landed<V>(g.combine(symm.peers[d]) + (block_off + slot) * hb + at);
        } else if (p.in_workspace) {
          val[u] = ld_input<V>(g.combine(symm.local) + (block_off + slot) * hb + at);
        } else {
          val[u] = ld_input<V>(p.y + me * p.y_stride0 + slot * p.y_stride1 + at);
        }
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u)
        if ((m[u] >> d) & 1u) a2a_accumulate<V, kElem>(acc[u], val[u]);
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      if (t[u] - t_begin >= num_rows) break;
      *reinterpret_cast<V*>(p.out + t[u] * hb + vec[u] * sizeof(V)) = a2a_round<V, kElem>(acc[u]);
    }
  }
}

}  // namespace epx::detail
