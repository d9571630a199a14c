// src/cpu/ht_combine.cc — ht_combine of the cpu reference backend (docs/semantics.md §1.6); the
// region is in ht_region.h.
//
// Data flow on rank r = (n, g), N nodes x G ranks (N = 1: the flat combine, no forward stage):
//   publish   rank d publishes y[0, N_d) (and topk_weights[0, N_d)); barrier.
//   forward   N > 1: rank r, the forwarder of the sources (m, g) of every other node m, sums for
//             each row i of the chunk it received from (m, g) at dispatch the y rows of its node's
//             ranks (HtForwardRoute of its handle) into partial_m[i] (float32, from 0.0f, ranks
//             ascending), sends the partials back to (m, g) over the rail and receives the
//             partials of its own tokens from every (m, g) (chunk i = its tokens that went to m,
//             ascending).
//   reduce    rank r reduces each of its tokens: its node's y rows read directly, then the other
//             nodes' partials, nodes ascending; barrier.
//
// Exact semantics (the cuda backend reproduces them bit for bit): out[t][h] = f32_to_bf16(acc)
// with float32 acc computed in exactly this order, n = this rank's node:
//   acc = 0.0f;
//   if bias0: acc += bf16_to_f32(bias0[t][h]);  if bias1: acc += bf16_to_f32(bias1[t][h]);
//   for d in node n ascending with send_pos[t][d] >= 0:
//     acc += bf16_to_f32(y_d[send_pos[t][d]][h])
//   for m = 0..N-1, m != n, where t went to some rank of m:
//     p = 0.0f;
//     for d in node m ascending with send_pos[t][d] >= 0:  p += bf16_to_f32(y_d[...][h])
//     acc += p
// combined_topk_weights[t][k]: the same order over w_d[send_pos[t][d]][k], without biases.
// (f32_to_bf16: round to nearest even, numeric.h.) With one node this is the flat order: acc =
// 0.0f + biases + y of d = 0..R-1 ascending. A token that went nowhere gets 0.0f + biases.
// Starting from 0.0f matters: 0.0f + -0.0f is +0.0f, so a kernel that starts from bias0 (or from
// the first y row) differs on signed zeros; a sum that starts from +0.0f is never -0.0f, so
// adding the partial of a node a token did not reach (+0.0f) would change nothing either.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/host_view.h"
#include "core/numeric.h"
#include "core/validate.h"
#include "cpu/ht_region.h"

namespace epx::detail {
namespace {

void add_bf16_row(float* __restrict acc, const uint16_t* __restrict row, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] += bf16_to_f32(row[h]);
}

void add_f32_row(float* __restrict acc, const float* __restrict row, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] += row[h];
}

void round_row(uint16_t* __restrict out, const float* __restrict acc, int64_t n) {
  for (int64_t h = 0; h < n; ++h) out[h] = f32_to_bf16(acc[h]);
}

// Rank d's combine rows must be the N_d of the handle's dispatch (every rank passes its handle of
// the same dispatch).
void check_peer_rows(const RegionHeader& peer, const int32_t* prefix, int R, int d) {
  EPX_CHECK_ARG(peer.num_rows == prefix[(R - 1) * R + d], "ht_combine: argument 'handle' says ",
                "rank ", d, " received ", prefix[(R - 1) * R + d], " tokens but rank ", d,
                " combines ", peer.num_rows,
                " rows, expected every rank to pass the handle of the same dispatch");
}

}  // namespace

// The combine's y section of this rank's region: the rows ht_combine publishes (zero-copy: the
// caller wrote them there). Free between a dispatch's closing barrier and the combine.
TensorView CpuBuffer::ht_combine_buffer(const HtHandle& handle) const {
  ht_step_.require_in_step("ht_combine_buffer", "reset()");
  const HtRegion reg = ht_region(shape, group.size(), topology_);
  return TensorView::contiguous(static_cast<uint8_t*>(ht_mem_->local()) + reg.y, DType::kBF16,
                                {ht_handle_rows(handle), shape.hidden});
}

// Across nodes, the forward stage: the partials of the rows this rank forwarded at dispatch,
// reduced over its node's ranks and sent back over the rail; the partials of this rank's tokens
// from every other node arrive in `partials` (slot other_index(m, n)). A failure here (a node
// peer out of step, a handle that does not match) goes into the partials' status, so the
// sources raise it too; the exchange runs regardless.
void CpuBuffer::send_ht_partials(const HtCombineArgs& a, uint64_t call,
                                 std::vector<uint8_t*>& partials) {
  const int R = group.size(), r = group.rank(), K = shape.top_k;
  const int n = topology_.node_of(r), G = topology_.ranks_per_node;
  const int64_t H = shape.hidden;
  const HtRegion reg = ht_region(shape, R, topology_);
  const SymmetricMemory& mem = *ht_mem_;
  auto peer = [&](int p) { return static_cast<const uint8_t*>(mem.peer(p)); };
  auto header_of = [&](int p) { return reinterpret_cast<const RegionHeader*>(peer(p)); };
  std::vector<RailChunk> sends, recvs;
  std::vector<RailStatus*> statuses;
  for (int m = 0; m < topology_.num_nodes; ++m) {
    if (m == n) continue;
    const int slot = Topology::other_index(m, n);
    uint8_t* chunk = ht_sends_.chunk(slot, reg.partial_bytes);
    statuses.push_back(&reinterpret_cast<HtPartialHeader*>(chunk)->status);
    statuses.back()->set_ok();
    sends.push_back({m, chunk, reg.partial_bytes});
    partials.push_back(ht_recvs_.chunk(slot, reg.partial_bytes));
    recvs.push_back({m, partials.back(), reg.partial_bytes});
  }
  const std::exception_ptr error = run_noting_error(
      [&] {
        const int first = topology_.rank_of(n, 0), last = first + G;
        check_stamps_range(
            "ht_combine", r, first, last, ht_step_.generation, call,
            [&](int p) -> const Stamp& { return header_of(p)->stamp; },
            [&](int p) { return std::string(ht_op_name(header_of(p)->op)); });
        const auto* route = static_cast<const HtForwardRoute*>(a.handle->backend_state.get());
        EPX_CHECK(route != nullptr && route->pos.size() == sends.size(), ErrorCode::kInternal,
                  "ht_combine: the handle has no forwarding route for ", sends.size(),
                  " other nodes");
        const int32_t* prefix = a.handle->rank_prefix_matrix.ptr<int32_t>();
        for (int p = first; p < last; ++p) check_peer_rows(*header_of(p), prefix, R, p);
        for (size_t i = 0; i < sends.size(); ++i) {
          auto* chunk = static_cast<uint8_t*>(sends[i].data);
          const std::vector<int32_t>& pos = route->pos[i];
          const int64_t rows = static_cast<int64_t>(pos.size()) / G;
          reinterpret_cast<HtPartialHeader*>(chunk)->num_rows = rows;
          for (int g = 0; g < G; ++g)
            std::memcpy(chunk + reg.partial_headers + g * sizeof(RegionHeader),
                        header_of(first + g), sizeof(RegionHeader));
          auto* partial = reinterpret_cast<float*>(chunk + reg.partial);
          auto* partial_w = reinterpret_cast<float*>(chunk + reg.partial_weights);
          std::fill(partial, partial + rows * H, 0.0f);
          std::fill(partial_w, partial_w + rows * K, 0.0f);
          for (int64_t row = 0; row < rows; ++row) {
            for (int g = 0; g < G; ++g) {
              const int32_t p = pos[row * G + g];
              if (p < 0) continue;
              const RegionHeader& h = *header_of(first + g);
              EPX_CHECK_ARG(p < h.num_rows, "ht_combine: the handle routes a row to row ", p,
                            " of rank ", first + g, ", which has ", h.num_rows,
                            " rows; expected every rank to pass the handle of the same dispatch");
              const uint8_t* region = peer(first + g);
              add_bf16_row(partial + row * H,
                           reinterpret_cast<const uint16_t*>(region + reg.y) + int64_t{p} * H, H);
              if (!a.topk_weights.defined()) continue;
              add_f32_row(partial_w + row * K,
                          reinterpret_cast<const float*>(region + reg.y_weights) + int64_t{p} * K,
                          K);
            }
          }
        }
      },
      statuses);
  ht_rail_->exchange("ht_combine (rail)", sends, recvs, a.stream);
  if (error) std::rethrow_exception(error);
}

HtCombineResult CpuBuffer::ht_combine(const HtCombineArgs& a, const Allocator& alloc) try {
  const uint64_t call = ht_step_.begin("ht_combine", "reset()");
  const int R = group.size(), r = group.rank(), K = shape.top_k;
  const int n = topology_.node_of(r), G = topology_.ranks_per_node;
  const int64_t H = shape.hidden;
  const HtHandle& handle = *a.handle;
  const int64_t T = handle.num_tokens, N = handle.num_recv_tokens;
  const HtRegion reg = ht_region(shape, R, topology_);
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

  // ---- forward: the other nodes' partials of this rank's tokens (across nodes) ----------------
  std::vector<uint8_t*> partials;  // [N - 1], slot other_index(m, n)
  std::exception_ptr forward_error;
  if (topology_.hierarchical())
    forward_error = run_noting_error([&] { send_ht_partials(a, call, partials); }, {});

  // ---- reduce ----------------------------------------------------------------------------------
  return pull_then_barrier(transport(), "ht_combine (pull)", [&] {
    if (forward_error) std::rethrow_exception(forward_error);
    auto partial_of = [&](int m) { return partials[Topology::other_index(m, n)]; };
    raise_forwarder_errors("ht_combine", topology_, r, [&](int m) -> const RailStatus& {
      return reinterpret_cast<const HtPartialHeader*>(partial_of(m))->status;
    });
    // Every rank's header: this node's in their regions, the others' in their node's partials.
    auto header_of = [&](int p) {
      const int m = topology_.node_of(p);
      if (m == n) return reinterpret_cast<const RegionHeader*>(region(p));
      return reinterpret_cast<const RegionHeader*>(partial_of(m) + reg.partial_headers) +
             topology_.local_of(p);
    };
    check_ht_headers(r, R, kOpCombine, ht_step_, header_of);
    const int32_t* prefix = handle.rank_prefix_matrix.ptr<int32_t>();
    const int first = topology_.rank_of(n, 0), last = first + G;  // this node's ranks
    for (int d = first; d < last; ++d) check_peer_rows(*header_of(d), prefix, R, d);
    const int32_t* send_pos = handle.send_pos.ptr<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int d = first; d < last; ++d)
        EPX_CHECK_ARG(send_pos[t * R + d] < header_of(d)->num_rows, "ht_combine: argument ",
                      "'handle' has send_pos[", t, "][", d, "] = ", send_pos[t * R + d],
                      " but rank ", d, " has ", header_of(d)->num_rows,
                      " rows, expected the handle of this dispatch");

    HtCombineResult res;
    res.out = alloc(DType::kBF16, {T, H}, Device::cpu());
    if (has_weights) res.combined_topk_weights = alloc(DType::kF32, {T, K}, Device::cpu());
    auto* out = res.out.ptr<uint16_t>();
    auto* cw = has_weights ? res.combined_topk_weights.ptr<float>() : nullptr;
    std::vector<float> acc(static_cast<size_t>(H)), acc_w(static_cast<size_t>(K));
    std::vector<int64_t> partial_row(topology_.num_nodes, 0);  // next row of each node's partials
    const auto* b0 = a.bias0.defined() ? a.bias0.ptr<uint16_t>() : nullptr;
    const auto* b1 = a.bias1.defined() ? a.bias1.ptr<uint16_t>() : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(acc_w.begin(), acc_w.end(), 0.0f);
      if (b0) add_bf16_row(acc.data(), b0 + t * a.bias0.strides[0], H);
      if (b1) add_bf16_row(acc.data(), b1 + t * a.bias1.strides[0], H);
      for (int d = first; d < last; ++d) {
        const int32_t pos = send_pos[t * R + d];
        if (pos < 0) continue;
        add_bf16_row(acc.data(), reinterpret_cast<const uint16_t*>(region(d) + reg.y) + pos * H, H);
        if (cw)
          add_f32_row(acc_w.data(),
                      reinterpret_cast<const float*>(region(d) + reg.y_weights) + pos * K, K);
      }
      for (int m = 0; m < topology_.num_nodes; ++m) {
        bool went = false;
        for (int d = m * G; d < (m + 1) * G && m != n; ++d) went |= send_pos[t * R + d] >= 0;
        if (!went) continue;
        const uint8_t* chunk = partial_of(m);
        const int64_t rows = reinterpret_cast<const HtPartialHeader*>(chunk)->num_rows;
        const int64_t i = partial_row[m];
        add_f32_row(acc.data(),
                    next_partial_row("ht_combine", m, partial_row[m], rows,
                                     reinterpret_cast<const float*>(chunk + reg.partial), H),
                    H);
        if (cw)
          add_f32_row(acc_w.data(),
                      reinterpret_cast<const float*>(chunk + reg.partial_weights) + i * K, K);
      }
      round_row(out + t * H, acc.data(), H);
      if (cw) std::copy(acc_w.begin(), acc_w.end(), cw + t * K);
    }
    recheck_ht_stamps(r, R, kOpCombine, ht_step_, header_of);
    return res;
  });
} catch (const Error& e) {
  ht_step_.failed(e);
  throw;
}

}  // namespace epx::detail
