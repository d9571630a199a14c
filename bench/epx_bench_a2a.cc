// bench/epx_bench_a2a.cc — epx-bench a2a: fixed-geometry all-to-all with the payloads an engine
// sends (FlashInfer MoeAlltoAll style), then combine from the workspace.
//
// Workload on every rank (M = runtime_max_tokens_per_rank = T, equal on all ranks):
//   payload 0  hidden       bf16  [T, H]   the token
//   payload 1  expert ids   int32 [T, K]   topk_idx (padding rows sanitised to -1)
//   payload 2  weights      f32   [T, K]
//   dispatch -> recv_i [R, M, ...], recv_counts [R]
//   combine: y [R, M, H] bf16 written into combine_payload_view (payload_in_workspace = true),
//            y = fill_hash_bf16 rows (every row, padding included), out [T, H] bf16
// Rows: (token, distinct destination rank) pairs. Dispatch bytes per row = 2H + 8K; combine
// bytes per row = 2H (see epx_bench.h for cross/recv).
// Timing: the a2a state machine alternates dispatch and combine, so cpu times each step of
// (dispatch, write y, combine) separately; cuda times the pair (the a2a target, docs/perf.md §3).
// --check compares with tests/support/oracle_a2a.h before and after timing.
#include <cstring>

#include "bench/epx_bench.h"
#include "core/check.h"
#include "support/oracle_a2a.h"

namespace epx::bench {

namespace {

struct A2aBytes {
  double dispatch_cross = 0, dispatch_recv = 0, combine_cross = 0, combine_recv = 0;
};

// Group means per rank, from every rank's routing.
A2aBytes a2a_bytes(const Options& opt, int R, int64_t T) {
  const int L = opt.num_experts / R;
  const double dispatch_row = 2.0 * opt.hidden + 8.0 * opt.top_k;
  const double combine_row = 2.0 * opt.hidden;
  A2aBytes b;
  for (int s = 0; s < R; ++s) {
    const RankData d = make_rank_data(opt, s, R, T, kSaltA2a, false);
    for (int64_t t = 0; t < T; ++t) {
      for (int dst : ranks_of(d.topk_idx.data() + t * opt.top_k, opt.top_k, L)) {
        // Row (s, t) lands on rank dst; its combine row comes back to s.
        b.dispatch_recv += dispatch_row;
        b.combine_recv += combine_row;
        if (dst != s) {
          b.dispatch_cross += dispatch_row;
          b.combine_cross += combine_row;
        }
      }
    }
  }
  b.dispatch_cross /= R;
  b.dispatch_recv /= R;
  b.combine_cross /= R;
  b.combine_recv /= R;
  return b;
}

// The oracle's problem with every rank's inputs (with_data: payloads and y of all ranks, only for
// --check; otherwise just this rank's).
testing::A2aProblem make_problem(const Ctx& ctx, int64_t T, bool all_ranks) {
  const Options& o = ctx.opt;
  const int R = ctx.num_ranks();
  testing::A2aProblem p;
  p.num_ranks = R;
  p.top_k = o.top_k;
  p.num_experts = o.num_experts;
  p.max_tokens_per_rank = std::max<int64_t>(T, 1);
  p.runtime_max = T;
  using Spec = testing::A2aPayloadSpec;
  p.payloads = {Spec{DType::kBF16, {o.hidden}, Spec::Fill::kRandom},
                Spec{DType::kI32, {o.top_k}, Spec::Fill::kExpertIds},
                Spec{DType::kF32, {o.top_k}, Spec::Fill::kWeights}};
  p.invalid_expert_id = -1;
  p.expert_id_payload_index = 1;
  p.hidden = o.hidden;
  p.combine_dtype = DType::kBF16;
  p.num_tokens.assign(R, T);
  p.topk_idx.resize(R);
  p.payload.resize(R);
  p.combine_y.resize(R);
  for (int r = 0; r < R; ++r) {
    if (!all_ranks && r != ctx.rank()) continue;
    const RankData d = make_rank_data(o, r, R, T, kSaltA2a, true);
    p.topk_idx[r].assign(d.topk_idx.begin(), d.topk_idx.end());
    auto& pl = p.payload[r];
    pl.resize(3);
    pl[0].resize(d.x.size() * 2);
    std::memcpy(pl[0].data(), d.x.data(), pl[0].size());
    pl[1].resize(p.topk_idx[r].size() * 4);
    std::memcpy(pl[1].data(), p.topk_idx[r].data(), pl[1].size());
    pl[2].resize(d.topk_weights.size() * 4);
    std::memcpy(pl[2].data(), d.topk_weights.data(), pl[2].size());
    const int64_t y_elems = static_cast<int64_t>(R) * T * o.hidden;
    p.combine_y[r].resize(y_elems * 2);
    fill_hash_bf16(reinterpret_cast<uint16_t*>(p.combine_y[r].data()), y_elems,
                   (o.seed << 20) ^ (static_cast<uint64_t>(r) << 8) ^ kSaltA2a);
  }
  return p;
}

// Host copies of a dispatch result (for the oracle comparison on cuda). A2aDispatchResult holds
// views, so the copies' storage is kept beside it.
struct HostDispatch {
  std::vector<Tensor> storage;
  A2aDispatchResult result;
};

HostDispatch to_host(const A2aDispatchResult& r) {
  HostDispatch h;
  for (const auto& v : r.recv) h.storage.push_back(host_copy(v));
  h.storage.push_back(host_copy(r.recv_counts));
  for (size_t i = 0; i + 1 < h.storage.size(); ++i) h.result.recv.push_back(h.storage[i]);
  h.result.recv_counts = h.storage.back();
  return h;
}

// The check of a row that covers both ops.
Check both(const Check& a, const Check& b) {
  Check c = a;
  c.run = a.run || b.run;
  if (c.ok()) c.failure = b.failure;
  return c;
}

}  // namespace

void run_a2a(Ctx& ctx, int64_t T) {
  const Options& o = ctx.opt;
  const int R = ctx.num_ranks(), rank = ctx.rank();
  progress(ctx, "a2a T=" + std::to_string(T) + ": building inputs");
  testing::A2aProblem p = make_problem(ctx, T, o.check);
  A2a a2a(ctx.group, p.shape());
  const int64_t sym_bytes = static_cast<int64_t>(a2a.bytes_allocated());

  // This rank's inputs on the device.
  std::vector<Tensor> payloads;
  for (size_t i = 0; i < p.payloads.size(); ++i) {
    std::vector<int64_t> shape{T};
    for (int64_t d : p.payloads[i].row_shape) shape.push_back(d);
    payloads.push_back(upload(p.payload[rank][i].data(), p.payloads[i].dtype, shape, ctx.device));
  }
  Tensor topk = upload(p.topk_idx[rank], DType::kI32, {T, o.top_k}, ctx.device);
  A2aDispatchArgs args;
  args.topk_idx = topk;
  for (const Tensor& t : payloads) args.payloads.push_back(t);
  args.runtime_max_tokens_per_rank = T;
  args.invalid_expert_id = p.invalid_expert_id;
  args.expert_id_payload_index = p.expert_id_payload_index;
  args.stream = ctx.stream;
  const std::vector<uint8_t>& y_host = p.combine_y[rank];

  A2aDispatchResult recv;
  Tensor out;
  auto dispatch = [&] { recv = a2a.dispatch(args); };
  auto write_y = [&] {
    // The MoE kernel's part: after dispatch finished (peers no longer read our combine region),
    // before combine. The copy is host-synchronous, so combine is enqueued after it.
    stream_synchronize(ctx.device, ctx.stream);
    TensorView view = a2a.combine_payload_view(T, o.hidden, DType::kBF16);
    copy_into(view, y_host.data(), y_host.size());
  };
  auto combine = [&] {
    TensorView view = a2a.combine_payload_view(T, o.hidden, DType::kBF16);
    out = a2a.combine(view, T, /*payload_in_workspace=*/true, ctx.stream, ctx.alloc);
  };

  Check check_dispatch, check_combine;
  testing::A2aExpected expected;
  auto verify = [&](const char* when) {
    device_synchronize(ctx.device);
    const HostDispatch host = to_host(recv);
    const std::string d = testing::a2a_compare_dispatch(p, rank, expected, host.result,
                                                        /*check_unspecified_zero=*/false);
    if (!d.empty()) check_dispatch.fail(std::string(when) + ": " + d);
    const std::string c = testing::a2a_compare_combine(p, rank, expected, host_copy(out));
    if (!c.empty()) check_combine.fail(std::string(when) + ": " + c);
  };
  if (o.check) {
    progress(ctx, "a2a T=" + std::to_string(T) + ": checking against the oracle");
    expected = testing::a2a_oracle(p, rank);
    check_dispatch.run = check_combine.run = true;
    dispatch();
    write_y();
    combine();
    verify("first call");
  }

  progress(ctx,
           "a2a T=" + std::to_string(T) + ": timing " + std::to_string(ctx.iters) + " iterations");
  const A2aBytes bytes = a2a_bytes(o, R, T);
  if (ctx.is_cuda()) {
    if (!o.check) {  // put y into the workspace once (the timed pairs leave it there)
      dispatch();
      write_y();
      combine();
    }
    const Timing pair = time_op(ctx, [&] {
      dispatch();
      combine();
    });
    if (o.check) {
      dispatch();
      write_y();
      combine();
      verify("after timing");
    }
    add_result(ctx, "a2a.dispatch+combine", T, pair, bytes.dispatch_cross + bytes.combine_cross,
               bytes.dispatch_recv + bytes.combine_recv, sym_bytes,
               both(check_dispatch, check_combine));
    return;
  }
  const std::vector<Timing> t =
      time_sequence(ctx, {dispatch, write_y, combine}, {true, false, true});
  if (o.check) verify("after timing");  // the last iteration's outputs
  add_result(ctx, "a2a.dispatch", T, t[0], bytes.dispatch_cross, bytes.dispatch_recv, sym_bytes,
             check_dispatch);
  add_result(ctx, "a2a.combine", T, t[2], bytes.combine_cross, bytes.combine_recv, sym_bytes,
             check_combine);
  add_result(ctx, "a2a.dispatch+combine", T, t[3], bytes.dispatch_cross + bytes.combine_cross,
             bytes.dispatch_recv + bytes.combine_recv, sym_bytes,
             both(check_dispatch, check_combine));
}

}  // namespace epx::bench
