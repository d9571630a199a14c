// src/cpu/ht_region.h — the ht region of the cpu backend and what ht.cc (layout, dispatch) and
// ht_combine.cc share. The data flow and the exact semantics are in the comment of ht.cc.
//
// Region of one rank inside the symmetric buffer (cpu_ht_bytes; sections 64-byte aligned;
// Tm = max_tokens_per_rank, N nodes of G ranks, rows packed at the op's row size):
//   header       RegionHeader                      stamp, op tag, dtypes, T, rows, has_weights
//   send_counts  int32 [R]                         dispatch: tokens this rank sends to each rank
//   payload, a union of the two views:
//     dispatch   rows block (HtRows) of this rank's tokens:
//                topk_idx int64 [Tm, K] | topk_weights f32 [Tm, K] | x [Tm, H] (2H bytes a row
//                reserved) | scales [Tm, ceil(H/128)] 4-byte elements (f32 H/128 or i32
//                ceil(H/512))
//     combine    y bf16 [R*Tm, H] | topk_weights f32 [R*Tm, K]    (a rank receives <= R*Tm rows)
//   rail         N > 1 only: N - 1 dispatch chunks this rank received over the rail, one per other
//                node m (slot Topology::other_index(m, n)): the rows its node's ranks pull for
//                the sources (m, g) of this rank's local index g.
//
// Dispatch chunk (sent by (m, g) to (n, g) over the rail; capacity Tm rows):
//   HtChunkHeader {RegionHeader of the source (its stamp set to the call), num_rows}
//   send_counts  int32 [R]           the source's (not in cached mode)
//   rows block   HtRows              the source's tokens that go to some rank of node n, ascending
//   src_idx      int32 [Tm]          each row's source token
// Combine partial chunk (sent by the forwarder (n, g) back to the source (m, g); host memory on
// both sides, nobody else reads it; capacity Tm rows):
//   HtPartialHeader {RailStatus, num_rows}
//   headers      RegionHeader [G]    node n's combine headers (the source compares every rank's)
//   partial      f32 [Tm, H]         per chunk row: sum of y over node n's ranks, ascending
//   partial_weights f32 [Tm, K]      the same sum of the returned topk_weights
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "cpu/cpu_buffer.h"

namespace epx::detail {

enum HtOp : int32_t { kOpDispatch = 1, kOpCachedDispatch = 2, kOpCombine = 3 };
const char* ht_op_name(int32_t op);

// Written by the owner before the first barrier of an op, read by peers before the second.
// The per-call values every rank must pass alike are compared there (check_ht_headers).
struct RegionHeader {
  Stamp stamp;               // first: reset() clears it through the region's base pointer
  int32_t op;                // HtOp
  int32_t x_dtype;           // DType of x (dispatch)
  int32_t scale_dtype;       // DType of the scales, -1 without
  int32_t has_weights;       // topk_weights given
  int64_t num_tokens;        // T of this rank
  int64_t num_rows;          // combine: rows of y published (N of this rank)
  int64_t num_worst_tokens;  // dispatch: the call's (cached: the handle's)
  int32_t expert_alignment;  // dispatch (not cached)
  int32_t zero_copy;         // dispatch and combine
};

struct HtChunkHeader {
  RegionHeader source;
  int64_t num_rows;
};

struct HtPartialHeader {
  RailStatus status;
  int64_t num_rows;
};

// Offsets inside a block of dispatch rows of capacity Tm.
struct HtRows {
  size_t topk_idx, topk_weights, x, scales, bytes;
};

struct HtRegion {
  size_t send_counts, payload;  // the rows block of this rank's tokens starts at payload
  HtRows rows;
  size_t y, y_weights;  // combine view
  size_t rail;          // the received dispatch chunks (N > 1)
  size_t chunk_counts, chunk_rows, chunk_src_idx, chunk_bytes;      // a dispatch chunk
  size_t partial_headers, partial, partial_weights, partial_bytes;  // a partial chunk
  size_t bytes;                                                     // the region

  size_t chunk(int other_index) const { return rail + other_index * chunk_bytes; }
  size_t rail_chunk_bytes() const { return std::max(chunk_bytes, partial_bytes); }
};

HtRegion ht_region(const MoeShape& s, int R, Topology topology);

// Where rank r's pull finds source s's dispatch: s's own region when s is on r's node, else the
// chunk that r's forwarder for s (the rank of r's node with s's local index) received from s.
struct HtSource {
  const RegionHeader* header;
  const int32_t* send_counts;  // [R]
  const uint8_t* rows;         // a rows block (HtRows offsets)
  const int32_t* src_idx;      // source token of each row; null: row i is token i
  int64_t num_rows;

  int64_t token(int64_t row) const { return src_idx ? src_idx[row] : row; }
};
HtSource ht_source(const SymmetricMemory& mem, const HtRegion& reg, Topology topology, int s);

// Every rank must be in the same op with the same per-call values: OutOfStep for a rank at
// another call or op, InvalidArgument naming every value that differs with each rank's. All
// ranks read the same headers (`header_of(p)`: rank p's, for every p of the group), so all of
// them throw together.
void check_ht_headers(int rank, int num_ranks, int32_t op, const StepState& step,
                      const std::function<const RegionHeader*(int)>& header_of);
// After the pull: OutOfStep if a peer republished while this rank read (cpu_buffer.h, Stamp).
void recheck_ht_stamps(int rank, int num_ranks, int32_t op, const StepState& step,
                       const std::function<const RegionHeader*(int)>& header_of);

// The forwarder's routing of the rows it received over the rail, kept in its handle
// (HtHandle::backend_state) for the combine: rows[i] of the chunk from node m (slot
// other_index(m, n)) is row pos[i * G + g'] of rank (n, g')'s recv_x, or -1.
struct HtForwardRoute {
  std::vector<std::vector<int32_t>> pos;  // [N - 1][chunk rows * G]
};

// Copies the first `rows` rows of a [rows, cols] view with innermost stride 1 into packed rows.
void pack_rows(const TensorView& v, int64_t rows, uint8_t* dst);

// Asks for transparent huge pages on this rank's region (a hint; ignored where unsupported).
void advise_huge_pages(const SymmetricMemory& mem);

}  // namespace epx::detail
