// src/cpu/ht.cc — the ht mode of the cpu reference backend (docs/semantics.md §1).
//
// Data flow. Every collective op is "publish, barrier, pull, barrier" (cpu_buffer.h). A rank that
// fails after the first barrier (worst-case overflow, a handle that does not match its peers, an
// allocator error) still takes part in the closing barrier, then throws: its peers never hang.
//   ht_layout    local, no communication: counts from topk_idx.
//   ht_dispatch  rank s publishes T_s, send_counts[d] (its tokens that go to d), topk_idx (as
//                int64), topk_weights, x rows and scale rows; barrier. Rank r builds
//                rank_prefix_matrix from every rank's send_counts ([s][d] = sum of send_counts_q[d]
//                over q <= s), N = rank_prefix_matrix[R-1][r], then for s = 0..R-1, t = 0..T_s-1
//                copies (memcpy) the row of every token that goes to r: recv row of (s, t) =
//                rank_prefix_matrix[s-1][r] + #{t' < t of s that go to r}; barrier.
//                send_pos[t][d] on rank s is the same number seen from the sender.
//   cached       x and scales only are published; the receiver takes the row order from the
//                handle (rows [prefix[s-1][r], prefix[s][r]) come from s, token recv_src_idx[row]).
//   ht_combine   rank d publishes y[0, N_d) (and topk_weights[0, N_d)); barrier; rank s reduces
//                out[t] from y_d[send_pos[t][d]] over d ascending; barrier.
//
// Region of one rank inside the symmetric buffer (cpu_ht_bytes(shape, R) bytes; sections 64-byte
// aligned; Tm = max_tokens_per_rank; rows packed at the op's row size):
//   header       RegionHeader                      op tag, dtypes, T, rows, has_weights
//   send_counts  int32 [R]                         dispatch: tokens this rank sends to each rank
//   payload, a union of the two views:
//     dispatch   topk_idx int64 [Tm, K] | topk_weights f32 [Tm, K] | x [Tm, H] (2H bytes a row
//                reserved) | scales [Tm, ceil(H/128)] 4-byte elements (f32 H/128 or i32
//                ceil(H/512))
//     combine    y bf16 [R*Tm, H] | topk_weights f32 [R*Tm, K]    (a rank receives <= R*Tm rows)
//
// Exact semantics (the cuda backend reproduces them bit for bit):
//   layout      num_tokens_per_rank[d] = #{t: some topk_idx[t][k] lives on d};
//               num_tokens_per_expert[e] = #{(t, k): topk_idx[t][k] == e} (duplicates count twice)
//   dispatch    recv_topk_idx[row][k] = e - r*L if expert e = topk_idx[t][k] lives on r, else -1;
//               recv_topk_weights[row][k] = the weight where local, else 0.0f;
//               num_recv_tokens_per_expert[l] = round_up(#{(row, k): recv_topk_idx == l},
//               expert_alignment) (exact mode only). Worst-case rows [N, num_worst_tokens):
//               recv_x and scales 0, recv_topk_idx -1, weights 0, recv_src_idx -1.
//   combine     out[t][h] = f32_to_bf16(acc) with float32 acc computed in exactly this order:
//                 acc = 0.0f; if bias0: acc += bf16_to_f32(bias0[t][h]);
//                 if bias1: acc += bf16_to_f32(bias1[t][h]);
//                 for d = 0..R-1 with send_pos[t][d] >= 0:
//                   acc += bf16_to_f32(y_d[send_pos[t][d]][h])
//               combined_topk_weights[t][k] = acc with acc = 0.0f; for d ascending as above:
//                 acc += w_d[send_pos[t][d]][k]
//               (f32_to_bf16: round to nearest even, numeric.h). A token that went nowhere gets
//               0.0f + biases. Starting from 0.0f matters: 0.0f + -0.0f is +0.0f, so a kernel
//               that starts from bias0 (or from the first y row) differs on signed zeros.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/agree.h"
#include "core/check.h"
#include "core/host_view.h"
#include "core/numeric.h"
#include "core/validate.h"
#include "cpu/cpu_buffer.h"

namespace epx::detail {
namespace {

enum HtOp : int32_t { kOpDispatch = 1, kOpCachedDispatch = 2, kOpCombine = 3 };

const char* op_name(int32_t op) {
  switch (op) {
    case kOpDispatch:
      return "ht_dispatch";
    case kOpCachedDispatch:
      return "ht_dispatch (cached)";
    case kOpCombine:
      return "ht_combine";
  }
  return "another operation";
}

// Written by the owner before the first barrier of an op, read by peers before the second.
// The per-call values every rank must pass alike are compared there (check_peer_headers).
struct RegionHeader {
  Stamp stamp;          // first: reset() clears it through the region's base pointer
  int32_t op;           // HtOp
  int32_t x_dtype;      // DType of x (dispatch)
  int32_t scale_dtype;  // DType of the scales, -1 without
  int32_t has_weights;  // topk_weights given
  int64_t num_tokens;   // T of this rank
  int64_t num_rows;     // combine: rows of y published (N of this rank)
  int64_t num_worst_tokens;  // dispatch: the call's (cached: the handle's)
  int32_t expert_alignment;  // dispatch (not cached)
  int32_t zero_copy;         // dispatch and combine
};

struct HtRegion {
  size_t send_counts, topk_idx, topk_weights, x, scales;  // dispatch view
  size_t y, y_weights;                                    // combine view
  size_t bytes;
};

HtRegion ht_region(const MoeShape& s, int R) {
  const size_t Tm = static_cast<size_t>(s.max_tokens_per_rank);
  const size_t K = static_cast<size_t>(s.top_k), H = static_cast<size_t>(s.hidden);
  HtRegion g{};
  size_t off = align_up(sizeof(RegionHeader), 64);
  g.send_counts = off;
  off += align_up(4 * static_cast<size_t>(R), 64);
  const size_t payload = off;
  g.topk_idx = off;
  off += align_up(Tm * K * 8, 64);
  g.topk_weights = off;
  off += align_up(Tm * K * 4, 64);
  g.x = off;
  off += align_up(Tm * H * 2, 64);
  g.scales = off;
  off += align_up(Tm * 4 * ((H + 127) / 128), 64);
  const size_t dispatch_end = off;
  off = payload;
  g.y = off;
  off += align_up(static_cast<size_t>(R) * Tm * H * 2, 64);
  g.y_weights = off;
  off += align_up(static_cast<size_t>(R) * Tm * K * 4, 64);
  g.bytes = std::max(dispatch_end, off);
  return g;
}

// Copies the first `rows` rows of a [rows, cols] view with innermost stride 1 into packed rows.
void pack_rows(const TensorView& v, int64_t rows, uint8_t* dst) {
  const size_t row_bytes = static_cast<size_t>(v.shape[1]) * dtype_size(v.dtype);
  const size_t pitch_bytes = static_cast<size_t>(v.strides[0]) * dtype_size(v.dtype);
  if (rows <= 0 || row_bytes == 0) return;
  if (pitch_bytes == row_bytes) {
    std::memcpy(dst, v.data, row_bytes * static_cast<size_t>(rows));
    return;
  }
  const auto* src = static_cast<const uint8_t*>(v.data);
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(dst + t * row_bytes, src + t * pitch_bytes, row_bytes);
}

// Copies a [rows, cols] view of 4-byte elements with any strides into packed rows.
void pack_words(const TensorView& v, int64_t rows, uint32_t* dst) {
  const int64_t cols = v.shape[1];
  const auto* src = static_cast<const uint32_t*>(v.data);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < cols; ++c) dst[t * cols + c] = src[t * v.strides[0] + c * v.strides[1]];
}

Tensor alloc_tensor(const Allocator& alloc, DType dtype, std::vector<int64_t> shape) {
  return alloc(dtype, shape, Device::cpu());
}

std::string show_given(int64_t v) { return v ? "given" : "absent"; }

// Rank p's header, at the start of its region.
const RegionHeader* peer_header(const SymmetricMemory& mem, int p) {
  return static_cast<const RegionHeader*>(mem.peer(p));
}

// After the pull: OutOfStep if a peer republished while this rank read (cpu_buffer.h, Stamp).
void recheck_peer_stamps(const SymmetricMemory& mem, int R, int32_t op, const StepState& step) {
  recheck_stamps(op_name(op), mem.rank(), R, step.generation, step.calls,
                 [&](int p) -> const Stamp& { return peer_header(mem, p)->stamp; });
}

// Every rank must be in the same op with the same per-call values: all ranks read the same
// headers, so all of them throw together, naming every value that differs with each rank's.
void check_peer_headers(const SymmetricMemory& mem, int R, int32_t op, const StepState& step) {
  auto header = [&](int p) { return peer_header(mem, p); };
  check_stamps(
      op_name(op), mem.rank(), R, step.generation, step.calls,
      [&](int p) -> const Stamp& { return header(p)->stamp; },
      [&](int p) { return std::string(op_name(header(p)->op)); });
  for (int p = 0; p < R; ++p) {
    EPX_CHECK(header(p)->op == op, ErrorCode::kOutOfStep, op_name(op), ": rank ", p, " called ",
              op_name(header(p)->op), " at the same call #", step.calls,
              " instead; every rank must call the same operations in the same order");
  }
  struct Field {
    const char* what;
    int64_t (*get)(const RegionHeader&);
    ShowValue show;
  };
  std::vector<Field> fields;
  if (op != kOpCombine) {
    fields.push_back({"the dtype of argument 'x'",
                      [](const RegionHeader& h) -> int64_t { return h.x_dtype; }, show_dtype});
    fields.push_back({"the dtype of argument 'x_scales'",
                      [](const RegionHeader& h) -> int64_t { return h.scale_dtype; }, show_dtype});
    fields.push_back({op == kOpCachedDispatch ? "num_worst_tokens (of argument 'handle')"
                                              : "argument 'num_worst_tokens'",
                      [](const RegionHeader& h) { return h.num_worst_tokens; }, show_int});
  }
  if (op == kOpDispatch) {
    fields.push_back({"argument 'expert_alignment'",
                      [](const RegionHeader& h) -> int64_t { return h.expert_alignment; },
                      show_int});
  }
  if (op != kOpCachedDispatch) {
    fields.push_back({"argument 'topk_weights' (given or absent)",
                      [](const RegionHeader& h) -> int64_t { return h.has_weights; }, show_given});
  }
  fields.push_back({"argument 'zero_copy'",
                    [](const RegionHeader& h) -> int64_t { return h.zero_copy; }, show_bool});
  std::string message;
  std::vector<int64_t> values(R);
  for (const Field& f : fields) {
    for (int p = 0; p < R; ++p) values[p] = f.get(*header(p));
    if (all_equal(values)) continue;
    message += cat(message.empty() ? "" : "; ", f.what, " differs across ranks: ",
                   per_rank_values(values, f.show));
  }
  EPX_CHECK_ARG(message.empty(), op_name(op), ": ", message, "; expected the same on every rank");
}

// Asks for transparent huge pages on this rank's region (a hint; ignored where unsupported).
// First touches of 4 KiB pages are what the cpu ht ops spend most time on otherwise: the region is
// large (R * Tm * H * 2 bytes for combine) and written by its owner only.
void advise_huge_pages(const SymmetricMemory& mem) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(mem.local()) + page - 1) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(mem.local()) + mem.bytes()) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

void add_bf16_row(float* __restrict acc, const uint16_t* __restrict row, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] += bf16_to_f32(row[h]);
}

void round_row(uint16_t* __restrict out, const float* __restrict acc, int64_t n) {
  for (int64_t h = 0; h < n; ++h) out[h] = f32_to_bf16(acc[h]);
}

}  // namespace

size_t cpu_ht_bytes(const MoeShape& shape, int num_ranks) {
  return ht_region(shape, num_ranks).bytes;
}

HtLayout CpuBuffer::ht_layout(const TensorView& topk_idx, Stream, const Allocator& alloc) {
  const int R = group.size(), E = shape.num_experts, K = shape.top_k, L = E / R;
  const int64_t T = topk_idx.shape[0];
  HtLayout out;
  out.num_tokens_per_rank = alloc_tensor(alloc, DType::kI32, {R});
  out.num_tokens_per_expert = alloc_tensor(alloc, DType::kI32, {E});
  out.is_token_in_rank = alloc_tensor(alloc, DType::kBool, {T, R});
  auto* per_rank = out.num_tokens_per_rank.ptr<int32_t>();
  auto* per_expert = out.num_tokens_per_expert.ptr<int32_t>();
  auto* in_rank = out.is_token_in_rank.ptr<bool>();
  std::fill(per_rank, per_rank + R, 0);
  std::fill(per_expert, per_expert + E, 0);
  for (int64_t t = 0; t < T; ++t) {
    bool* row = in_rank + t * R;
    std::fill(row, row + R, false);
    for (int k = 0; k < K; ++k) {
      const int64_t e = topk_at(topk_idx, t, k);
      if (e < 0) continue;
      ++per_expert[e];
      row[e / L] = true;
    }
    for (int d = 0; d < R; ++d) per_rank[d] += row[d] ? 1 : 0;
  }
  return out;
}

HtDispatchResult CpuBuffer::ht_dispatch(const HtDispatchArgs& a, const Allocator& alloc) try {
  const uint64_t call =
      ht_step_.begin(a.handle ? "ht_dispatch (cached)" : "ht_dispatch", "reset()");
  const int R = group.size(), r = group.rank(), K = shape.top_k;
  const int L = shape.num_experts / R;
  const int64_t H = shape.hidden, T = a.x.shape[0];
  const HtRegion reg = ht_region(shape, R);
  SymmetricMemory& mem = *ht_mem_;
  auto region = [&](int p) { return static_cast<uint8_t*>(mem.peer(p)); };
  const bool cached = a.handle != nullptr;
  const bool fp8 = a.x.dtype == DType::kF8E4M3;
  const DType scale_dtype = fp8 ? a.x_scales.dtype : DType::kF32;
  const int64_t scale_cols = fp8 ? a.x_scales.shape[1] : 0;
  const size_t x_row_bytes = static_cast<size_t>(H) * dtype_size(a.x.dtype);
  const size_t scale_row_bytes = static_cast<size_t>(scale_cols) * 4;

  // ---- publish -------------------------------------------------------------------------------
  advise_huge_pages(mem);
  uint8_t* mine = region(r);
  auto* header = reinterpret_cast<RegionHeader*>(mine);
  header->stamp.begin_publish();
  header->op = cached ? kOpCachedDispatch : kOpDispatch;
  header->x_dtype = static_cast<int32_t>(a.x.dtype);
  header->scale_dtype = fp8 ? static_cast<int32_t>(scale_dtype) : -1;
  header->has_weights = a.topk_weights.defined() ? 1 : 0;
  header->num_tokens = T;
  header->num_rows = 0;
  header->num_worst_tokens = cached ? a.handle->num_worst_tokens : a.num_worst_tokens;
  header->expert_alignment = cached ? 0 : a.expert_alignment;
  header->zero_copy = a.zero_copy ? 1 : 0;
  pack_rows(a.x, T, mine + reg.x);
  if (fp8) pack_words(a.x_scales, T, reinterpret_cast<uint32_t*>(mine + reg.scales));
  if (!cached) {
    auto* counts = reinterpret_cast<int32_t*>(mine + reg.send_counts);
    auto* idx = reinterpret_cast<int64_t*>(mine + reg.topk_idx);
    auto* w = reinterpret_cast<float*>(mine + reg.topk_weights);
    std::fill(counts, counts + R, 0);
    std::vector<char> goes(R);
    for (int64_t t = 0; t < T; ++t) {
      std::fill(goes.begin(), goes.end(), 0);
      for (int k = 0; k < K; ++k) {
        const int64_t e = topk_at(a.topk_idx, t, k);
        idx[t * K + k] = e;
        if (e >= 0) goes[e / L] = 1;
        if (header->has_weights) w[t * K + k] = element<float>(a.topk_weights, t, k);
      }
      for (int d = 0; d < R; ++d) counts[d] += goes[d];
    }
  }
  header->stamp.end_publish(ht_step_.generation, call);
  transport().barrier(cached ? "ht_dispatch (cached, publish)" : "ht_dispatch (publish)");

  // ---- pull ------------------------------------------------------------------------------------
  return pull_then_barrier(transport(), "ht_dispatch (pull)", [&] {
    check_peer_headers(mem, R, header->op, ht_step_);
    HtDispatchResult res;
    // Receive rows per source, from the exchanged counts or from the handle.
    std::vector<int32_t> prefix(static_cast<size_t>(R) * R);
    if (cached) {
      std::copy_n(a.handle->rank_prefix_matrix.ptr<int32_t>(), R * R, prefix.begin());
    } else {
      for (int d = 0; d < R; ++d) {
        int32_t run = 0;
        for (int s = 0; s < R; ++s) {
          run += reinterpret_cast<const int32_t*>(region(s) + reg.send_counts)[d];
          prefix[s * R + d] = run;
        }
      }
    }
    auto begin_of = [&](int s, int d) { return s == 0 ? 0 : prefix[(s - 1) * R + d]; };
    const int64_t N = prefix[(R - 1) * R + r];
    const int64_t worst = cached ? a.handle->num_worst_tokens : a.num_worst_tokens;
    if (cached) {
      EPX_CHECK_ARG(N == a.handle->num_recv_tokens, "ht_dispatch: argument 'handle' receives ",
                    a.handle->num_recv_tokens, " tokens but its rank_prefix_matrix says ", N,
                    ", expected a handle returned by ht_dispatch");
    }
    EPX_CHECK(worst == 0 || N <= worst, ErrorCode::kOutOfCapacity, "ht_dispatch: rank ", r,
              " receives N = ", N, " tokens, more than argument 'num_worst_tokens' = ", worst,
              "; raise num_worst_tokens to at least ", N, " (rows are never dropped)");
    const int64_t rows = worst > 0 ? worst : N;

    res.recv_x = alloc_tensor(alloc, a.x.dtype, {rows, H});
    auto* recv_x = res.recv_x.ptr<uint8_t>();
    uint8_t* recv_scales = nullptr;
    if (fp8) {
      res.recv_x_scales = alloc_tensor(alloc, scale_dtype, {rows, scale_cols});
      recv_scales = res.recv_x_scales.ptr<uint8_t>();
    }

    if (cached) {
      const int32_t* src_idx = a.handle->recv_src_idx.ptr<int32_t>();
      for (int s = 0; s < R; ++s) {
        const uint8_t* peer = region(s);
        const int64_t peer_tokens = reinterpret_cast<const RegionHeader*>(peer)->num_tokens;
        for (int64_t row = begin_of(s, r); row < prefix[s * R + r]; ++row) {
          const int64_t t = src_idx[row];
          EPX_CHECK_ARG(t >= 0 && t < peer_tokens,
                        "ht_dispatch: argument 'handle' has recv_src_idx[", row, "] = ", t,
                        " but rank ", s, " dispatched ", peer_tokens,
                        " tokens, expected the handle of a dispatch with the same routing");
          std::memcpy(recv_x + row * x_row_bytes, peer + reg.x + t * x_row_bytes, x_row_bytes);
          if (fp8)
            std::memcpy(recv_scales + row * scale_row_bytes,
                        peer + reg.scales + t * scale_row_bytes, scale_row_bytes);
        }
      }
      std::memset(recv_x + N * x_row_bytes, 0, (rows - N) * x_row_bytes);
      if (fp8) std::memset(recv_scales + N * scale_row_bytes, 0, (rows - N) * scale_row_bytes);
      res.handle = *a.handle;
      recheck_peer_stamps(mem, R, header->op, ht_step_);
      return res;
    }

    const bool has_weights = header->has_weights != 0;
    const bool idx64 = a.topk_idx.dtype == DType::kI64;
    res.recv_topk_idx = alloc_tensor(alloc, a.topk_idx.dtype, {rows, K});
    if (has_weights) res.recv_topk_weights = alloc_tensor(alloc, DType::kF32, {rows, K});
    res.recv_src_idx = alloc_tensor(alloc, DType::kI32, {rows});
    auto* recv_w = has_weights ? res.recv_topk_weights.ptr<float>() : nullptr;
    auto* src_idx = res.recv_src_idx.ptr<int32_t>();
    std::vector<int64_t> per_expert(L, 0);
    const int64_t lo = static_cast<int64_t>(r) * L, hi = lo + L;
    int64_t row = 0;
    for (int s = 0; s < R; ++s) {
      const uint8_t* peer = region(s);
      const int64_t peer_tokens = reinterpret_cast<const RegionHeader*>(peer)->num_tokens;
      const auto* idx = reinterpret_cast<const int64_t*>(peer + reg.topk_idx);
      const auto* w = reinterpret_cast<const float*>(peer + reg.topk_weights);
      for (int64_t t = 0; t < peer_tokens; ++t) {
        const int64_t* sel = idx + t * K;
        bool goes = false;
        for (int k = 0; k < K; ++k) goes |= sel[k] >= lo && sel[k] < hi;
        if (!goes) continue;
        std::memcpy(recv_x + row * x_row_bytes, peer + reg.x + t * x_row_bytes, x_row_bytes);
        if (fp8)
          std::memcpy(recv_scales + row * scale_row_bytes, peer + reg.scales + t * scale_row_bytes,
                      scale_row_bytes);
        for (int k = 0; k < K; ++k) {
          const bool local = sel[k] >= lo && sel[k] < hi;
          const int64_t l = local ? sel[k] - lo : -1;
          if (idx64)
            res.recv_topk_idx.ptr<int64_t>()[row * K + k] = l;
          else
            res.recv_topk_idx.ptr<int32_t>()[row * K + k] = static_cast<int32_t>(l);
          if (recv_w) recv_w[row * K + k] = local ? w[t * K + k] : 0.0f;
          if (local) ++per_expert[l];
        }
        src_idx[row] = static_cast<int32_t>(t);
        ++row;
      }
      EPX_CHECK(row == prefix[s * R + r], ErrorCode::kInternal, "ht_dispatch: rank ", r, " pulled ",
                row, " rows up to rank ", s, ", its counts say ", prefix[s * R + r]);
    }
    // Worst-case padding rows.
    std::memset(recv_x + N * x_row_bytes, 0, (rows - N) * x_row_bytes);
    if (fp8) std::memset(recv_scales + N * scale_row_bytes, 0, (rows - N) * scale_row_bytes);
    for (int64_t i = N * K; i < rows * K; ++i) {
      if (idx64)
        res.recv_topk_idx.ptr<int64_t>()[i] = -1;
      else
        res.recv_topk_idx.ptr<int32_t>()[i] = -1;
      if (recv_w) recv_w[i] = 0.0f;
    }
    std::fill(src_idx + N, src_idx + rows, -1);
    if (worst == 0) {
      const int64_t align = a.expert_alignment;
      for (int l = 0; l < L; ++l)
        res.num_recv_tokens_per_expert.push_back(
            static_cast<int>((per_expert[l] + align - 1) / align * align));
    }

    // The handle: this rank's side of the routing.
    HtHandle& h = res.handle;
    h.rank_prefix_matrix = alloc_tensor(alloc, DType::kI32, {R, R});
    std::copy(prefix.begin(), prefix.end(), h.rank_prefix_matrix.ptr<int32_t>());
    h.recv_src_idx = res.recv_src_idx;
    h.is_token_in_rank = alloc_tensor(alloc, DType::kBool, {T, R});
    h.send_pos = alloc_tensor(alloc, DType::kI32, {T, R});
    auto* in_rank = h.is_token_in_rank.ptr<bool>();
    auto* send_pos = h.send_pos.ptr<int32_t>();
    const auto* my_idx = reinterpret_cast<const int64_t*>(mine + reg.topk_idx);
    std::vector<int32_t> next(R);
    for (int d = 0; d < R; ++d) next[d] = begin_of(r, d);
    std::vector<char> goes(R);
    for (int64_t t = 0; t < T; ++t) {
      std::fill(goes.begin(), goes.end(), 0);
      for (int k = 0; k < K; ++k)
        if (my_idx[t * K + k] >= 0) goes[my_idx[t * K + k] / L] = 1;
      for (int d = 0; d < R; ++d) {
        in_rank[t * R + d] = goes[d] != 0;
        send_pos[t * R + d] = goes[d] ? next[d]++ : -1;
      }
    }
    h.num_tokens = T;
    h.num_recv_tokens = N;
    h.num_worst_tokens = worst;
    h.top_k = K;
    h.buffer_id = id;
    recheck_peer_stamps(mem, R, header->op, ht_step_);
    return res;
  });
} catch (const Error& e) {
  ht_step_.failed(e);
  throw;
}

// The combine's y section of this rank's region: the rows ht_combine publishes (zero-copy: the
// caller wrote them there). Free between a dispatch's closing barrier and the combine.
TensorView CpuBuffer::ht_combine_buffer(const HtHandle& handle) const {
  ht_step_.require_in_step("ht_combine_buffer", "reset()");
  const HtRegion reg = ht_region(shape, group.size());
  return TensorView::contiguous(static_cast<uint8_t*>(ht_mem_->local()) + reg.y, DType::kBF16,
                                {ht_handle_rows(handle), shape.hidden});
}

HtCombineResult CpuBuffer::ht_combine(const HtCombineArgs& a, const Allocator& alloc) try {
  const uint64_t call = ht_step_.begin("ht_combine", "reset()");
  const int R = group.size(), r = group.rank(), K = shape.top_k;
  const int64_t H = shape.hidden;
  const HtHandle& handle = *a.handle;
  const int64_t T = handle.num_tokens, N = handle.num_recv_tokens;
  const HtRegion reg = ht_region(shape, R);
  SymmetricMemory& mem = *ht_mem_;
  auto region = [&](int p) { return static_cast<uint8_t*>(mem.peer(p)); };
  const bool has_weights = a.topk_weights.defined();

  // ---- publish: y rows [0, N) and their weights ------------------------------------------------
  advise_huge_pages(mem);
  uint8_t* mine = region(r);
  auto* header = reinterpret_cast<RegionHeader*>(mine);
  header->stamp.begin_publish();
  header->op = kOpCombine;
  header->x_dtype = static_cast<int32_t>(DType::kBF16);
  header->scale_dtype = -1;
  header->has_weights = has_weights ? 1 : 0;
  header->num_tokens = T;
  header->num_rows = N;
  header->num_worst_tokens = 0;
  header->expert_alignment = 0;
  header->zero_copy = a.zero_copy ? 1 : 0;
  if (!a.zero_copy) pack_rows(a.y, N, mine + reg.y);  // zero-copy: y is in place (validated)
  if (has_weights) {
    auto* w = reinterpret_cast<float*>(mine + reg.y_weights);
    for (int64_t i = 0; i < N; ++i)
      for (int k = 0; k < K; ++k) w[i * K + k] = element<float>(a.topk_weights, i, k);
  }
  header->stamp.end_publish(ht_step_.generation, call);
  transport().barrier("ht_combine (publish)");

  // ---- pull and reduce -------------------------------------------------------------------------
  return pull_then_barrier(transport(), "ht_combine (pull)", [&] {
    check_peer_headers(mem, R, kOpCombine, ht_step_);
    const int32_t* prefix = handle.rank_prefix_matrix.ptr<int32_t>();
    std::vector<const uint16_t*> y(R);
    std::vector<const float*> w(R);
    std::vector<int64_t> peer_rows(R);
    for (int d = 0; d < R; ++d) {
      peer_rows[d] = reinterpret_cast<const RegionHeader*>(region(d))->num_rows;
      EPX_CHECK_ARG(peer_rows[d] == prefix[(R - 1) * R + d], "ht_combine: argument 'handle' says ",
                    "rank ", d, " received ", prefix[(R - 1) * R + d], " tokens but rank ", d,
                    " combines ", peer_rows[d],
                    " rows, expected every rank to pass the handle of the same dispatch");
      y[d] = reinterpret_cast<const uint16_t*>(region(d) + reg.y);
      w[d] = reinterpret_cast<const float*>(region(d) + reg.y_weights);
    }
    const int32_t* send_pos = handle.send_pos.ptr<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int d = 0; d < R; ++d)
        EPX_CHECK_ARG(send_pos[t * R + d] < peer_rows[d], "ht_combine: argument 'handle' has ",
                      "send_pos[", t, "][", d, "] = ", send_pos[t * R + d], " but rank ", d,
                      " has ", peer_rows[d], " rows, expected the handle of this dispatch");

    HtCombineResult res;
    res.out = alloc_tensor(alloc, DType::kBF16, {T, H});
    auto* out = res.out.ptr<uint16_t>();
    std::vector<float> acc(static_cast<size_t>(H));
    const auto* b0 = a.bias0.defined() ? a.bias0.ptr<uint16_t>() : nullptr;
    const auto* b1 = a.bias1.defined() ? a.bias1.ptr<uint16_t>() : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (b0) add_bf16_row(acc.data(), b0 + t * a.bias0.strides[0], H);
      if (b1) add_bf16_row(acc.data(), b1 + t * a.bias1.strides[0], H);
      for (int d = 0; d < R; ++d) {
        const int32_t pos = send_pos[t * R + d];
        if (pos >= 0) add_bf16_row(acc.data(), y[d] + static_cast<int64_t>(pos) * H, H);
      }
      round_row(out + t * H, acc.data(), H);
    }
    if (has_weights) {
      res.combined_topk_weights = alloc_tensor(alloc, DType::kF32, {T, K});
      auto* cw = res.combined_topk_weights.ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        for (int k = 0; k < K; ++k) {
          float sum = 0.0f;
          for (int d = 0; d < R; ++d) {
            const int32_t pos = send_pos[t * R + d];
            if (pos >= 0) sum += w[d][static_cast<int64_t>(pos) * K + k];
          }
          cw[t * K + k] = sum;
        }
      }
    }
    recheck_peer_stamps(mem, R, kOpCombine, ht_step_);
    return res;
  });
} catch (const Error& e) {
  ht_step_.failed(e);
  throw;
}

}  // namespace epx::detail
