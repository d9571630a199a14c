// src/cuda/kernels/a2a/a2a_layout.cuh — the a2a symmetric workspace of the cuda backend: one
// struct, used on the host to size the allocation (cuda_a2a_bytes) and in the kernels to find
// every region. Host + device.
//
// Per rank (offsets identical on every rank; R ranks, max = A2aShape::max_tokens_per_rank,
// cap_i = payload_bytes_per_token[i], cap_c = combine_bytes_per_token, M = runtime max of a call):
//   header    A2aHeader                    construction only: the A2aShape and this rank's CTA
//                                          count, read by every peer once (shape agreement)
//   state     A2aState                     local: abort / error claim, per-CTA epochs
//   sync      A2aSync                      written by peers (slot p by rank p): entry, completion
//                                          counters, the geometry each peer used, set_active_ranks
//                                          rounds and masks; own_mask / own_generation: written
//                                          by this rank, read by its peers
//   counts    int32 [R]                    recv_counts[s], written by rank s (the recv_counts view)
//   mask      uint64 [max]                 local: routing of the last dispatch, bit d of token t
//                                          = t goes to rank d
//   slot      int32 [max, R]               local: slot_d(t) (row of t in d's [r] block) or -1
//   recv_i    [R, max, cap_i] capacity     rows written by the senders; for a call it is viewed as
//                                          [R, M, row_i] contiguous (row [s][j] at (s*M + j) *
//                                          row_i)
//   combine   [R, max, cap_c] capacity     this rank's MoE output y, viewed as [R, M, H]
//                                          contiguous; peers pull their rows from it
// Bytes per rank = R * max * (sum cap_i + cap_c) + max * (8 + 4R) + ~10 KB: FlashInfer's
// moe_a2a_get_workspace_size_per_rank(R, max, D, C) is R * max * (D + C) plus auxiliary state.
//
// Flags (never reset; every value is a per-call epoch advanced on the device, so repeated calls
// and CUDA-graph replays need no host work):
//   entered[p]        = the dispatch epoch rank p has entered (p's readers of its views are done)
//   dispatch_flag[p]  += 1 by each of p's C_p dispatch CTAs once its rows (and, from p's last
//                     CTA, recv_counts[p] and dispatch_geom[p]) landed here: e * C_p when complete
//   combine_flag[p]   += 1 by each of p's C_p combine CTAs once p's combine region holds y:
//                     e * C_p when complete
//   resync[p]         = 2g - 1 / 2g: rank p is in round 1 / 2 of its g-th set_active_ranks
//                     (resync.cuh); never reset
// Rank mask: state.inactive_mask (bit p = rank p inactive; zero-filled = every rank active) is
// written only by the resync kernel (set_active_ranks, stream-ordered) and read by every dispatch
// / combine kernel at its start, so CUDA-graph replays see the current mask.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/device_error.h"
#include "epx/a2a.h"
#include "transport/transport.h"

#if defined(__CUDACC__)
#define EPX_A2A_HD __host__ __device__ __forceinline__
#else
#define EPX_A2A_HD inline
#endif

namespace epx::detail {

inline constexpr int kMaxA2aCtas = 256;  // per kernel; each CTA keeps its own epoch counters
inline constexpr int kA2aThreads = 512;  // dispatch / combine CTA size (16 warps)
inline constexpr int kA2aWarps = kA2aThreads / 32;
inline constexpr int kA2aDefaultCtas = 64;  // auto tuning (see resolve_a2a_ctas in a2a.cu)

// DeviceErrorRecord::op / ::code values (kOpA2a*, kDevErrA2a*, A2aGeometryField): device_error.h.
inline constexpr int kA2aGeomWords = 1 + kMaxA2aPayloads;

// Construction: what every rank must agree on, and what each rank tells its peers.
struct A2aHeader {
  int64_t shape[4 + kMaxA2aPayloads];  // max_tokens, top_k, num_experts, combine bytes, payloads
  int64_t num_ctas;                    // CTAs of this rank's kernels (C_p in the flag targets)
  int64_t pad[3];
};

// Local only (zeroed at allocation).
struct A2aState {
  DeviceState dev;                       // abort + error_claim (seq / finished unused)
  uint32_t dispatch_epoch[kMaxA2aCtas];  // CTA b of every dispatch: ++dispatch_epoch[b]
  uint32_t combine_epoch[kMaxA2aCtas];   // CTA b of every combine: ++combine_epoch[b]
  uint64_t inactive_mask;                // bit p = rank p inactive (0 = all active)
  unsigned long long dropped_tokens;     // A2aDropCounts, advanced by the dispatch kernel
  unsigned long long dropped_selections;
};

// Written by peers: slot p by rank p; own_*: by this rank (see the file comment).
struct A2aSync {
  uint32_t entered[kMaxRanks];
  uint32_t dispatch_flag[kMaxRanks];
  uint32_t combine_flag[kMaxRanks];
  int32_t dispatch_geom[kMaxRanks][kA2aGeomWords];  // M, row bytes of each payload
  int32_t combine_geom[kMaxRanks][2];               // H, DType
  uint32_t resync[kMaxRanks];                       // set_active_ranks rounds (resync.cuh)
  uint64_t active_mask[kMaxRanks];                  // the mask rank p applies (set_active_ranks)
  uint64_t own_mask;        // the mask this rank applies in set_active_ranks call own_generation
  uint32_t own_generation;  // (release; 0: none yet) — peers read both (resync.cuh, round 1)
};

EPX_A2A_HD size_t a2a_round_up(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

struct A2aLayout {
  int num_ranks = 1;
  int num_payloads = 0;
  int64_t max_tokens = 0;
  size_t header_off = 0, state_off = 0, sync_off = 0, counts_off = 0, mask_off = 0, slot_off = 0;
  size_t recv_off[kMaxA2aPayloads] = {};
  size_t combine_off = 0, total_bytes = 0;

  // Host: the layout of `shape` on `num_ranks` ranks (shape already validated).
  static A2aLayout make(const A2aShape& shape, int num_ranks) {
    A2aLayout g;
    const size_t R = static_cast<size_t>(num_ranks);
    const size_t max = static_cast<size_t>(shape.max_tokens_per_rank);
    g.num_ranks = num_ranks;
    g.num_payloads = static_cast<int>(shape.payload_bytes_per_token.size());
    g.max_tokens = shape.max_tokens_per_rank;
    size_t off = 0;
    g.header_off = off;
    off += a2a_round_up(sizeof(A2aHeader), 256);
    g.state_off = off;
    off += a2a_round_up(sizeof(A2aState), 256);
    g.sync_off = off;
    off += a2a_round_up(sizeof(A2aSync), 256);
    g.counts_off = off;
    off += a2a_round_up(4 * R, 256);
    g.mask_off = off;
    off += a2a_round_up(8 * max, 256);
    g.slot_off = off;
    off += a2a_round_up(4 * max * R, 256);
    for (int i = 0; i < g.num_payloads; ++i) {
      g.recv_off[i] = off;
      off += a2a_round_up(R * max * shape.payload_bytes_per_token[i], 256);
    }
    g.combine_off = off;
    off += a2a_round_up(R * max * shape.combine_bytes_per_token, 256);
    g.total_bytes = off;
    return g;
  }

  EPX_A2A_HD A2aHeader* header(char* base) const {
    return reinterpret_cast<A2aHeader*>(base + header_off);
  }
  EPX_A2A_HD A2aState* state(char* base) const {
    return reinterpret_cast<A2aState*>(base + state_off);
  }
  EPX_A2A_HD A2aSync* sync(char* base) const { return reinterpret_cast<A2aSync*>(base + sync_off); }
  EPX_A2A_HD int32_t* counts(char* base) const {
    return reinterpret_cast<int32_t*>(base + counts_off);
  }
  EPX_A2A_HD uint64_t* mask(char* base) const {
    return reinterpret_cast<uint64_t*>(base + mask_off);
  }
  EPX_A2A_HD int32_t* slot(char* base) const { return reinterpret_cast<int32_t*>(base + slot_off); }
  EPX_A2A_HD char* recv(char* base, int payload) const { return base + recv_off[payload]; }
  EPX_A2A_HD char* combine(char* base) const { return base + combine_off; }
};

}  // namespace epx::detail
