// bench/epx_bench_ht.cc — epx-bench ht: high-throughput dispatch (bf16 / fp8; exact and cached)
// and combine (bf16).
//
// Workload on every rank (T tokens, G = H / 128, N = rows this rank receives):
//   ht_dispatch(x [T, H] bf16, topk_idx [T, K] int64, topk_weights [T, K] f32)      exact mode:
//     layout and count exchange inside, one host wait to learn N
//   ht_dispatch(x [T, H] fp8 e4m3, x_scales [T, G] f32, ...)  x quantised on the host with
//     core/numeric.h (quantize_row_fp8), scales moved with their rows
//   ht_dispatch(..., handle) cached mode: same routing, no layout or count exchange (how DeepEP's
//     reference figures were taken)
//   ht_combine(y [N, H] bf16, handle of the first dispatch) -> out [T, H] bf16
//     y = fill_hash_bf16 rows (a pure function of the rank), no weights, no bias
// Rows: (token, distinct destination rank) pairs. Dispatch bytes per row: bf16 2H,
// fp8 H + 4G; combine 2H. (see epx_bench.h for cross/recv)
// Timing: each op repeated on its own (ht ops may be called in any order).
// --check compares with tests/support/oracle_ht.h before and after timing.
#include <cstring>

#include "bench/epx_bench.h"
#include "core/check.h"
#include "core/numeric.h"
#include "support/oracle_ht.h"

namespace epx::bench {

namespace {

struct HtBytes {
  double cross_rows = 0, recv_rows = 0;  // group means per rank
  std::vector<int64_t> num_recv;         // N of every rank
};

HtBytes ht_rows(const std::vector<RankData>& data, int R, int L, int K) {
  HtBytes b;
  b.num_recv.assign(R, 0);
  for (int s = 0; s < R; ++s) {
    const int64_t T = static_cast<int64_t>(data[s].topk_idx.size()) / K;
    for (int64_t t = 0; t < T; ++t) {
      for (int d : ranks_of(data[s].topk_idx.data() + t * K, K, L)) {
        b.num_recv[d]++;
        b.recv_rows += 1;
        if (d != s) b.cross_rows += 1;
      }
    }
  }
  b.cross_rows /= R;
  b.recv_rows /= R;
  return b;
}

// Rank d's combine input [N_d, H].
std::vector<uint16_t> make_y(const Options& o, int d, int64_t num_rows) {
  std::vector<uint16_t> y(static_cast<size_t>(num_rows * o.hidden));
  fill_hash_bf16(y.data(), num_rows * o.hidden,
                 (o.seed << 20) ^ (static_cast<uint64_t>(d) << 8) ^ kSaltHt);
  return y;
}

struct Fp8Rows {
  std::vector<uint8_t> x;     // [T, H] e4m3
  std::vector<float> scales;  // [T, G]
};

Fp8Rows quantize(const std::vector<uint16_t>& x, int64_t T, int64_t H) {
  Fp8Rows q;
  const int64_t G = H / 128;
  q.x.resize(static_cast<size_t>(T * H));
  q.scales.resize(static_cast<size_t>(T * G));
  for (int64_t t = 0; t < T; ++t)
    detail::quantize_row_fp8(x.data() + t * H, H, /*round_scale=*/false, q.x.data() + t * H,
                             q.scales.data() + t * G);
  return q;
}

// Compares a dispatch result with the oracle; cached mode has only recv_x (and scales).
void check_dispatch(Check& c, const char* when, const testing::HtExpectedDispatch& want,
                    const HtDispatchResult& got, bool fp8, bool cached) {
  auto cmp = [&](const std::string& r) {
    if (!r.empty()) c.fail(std::string(when) + ": " + r);
  };
  cmp(compare_tensor("recv_x", got.recv_x, want.recv_x));
  if (fp8) cmp(compare_tensor("recv_x_scales", got.recv_x_scales, want.recv_scales));
  if (cached) return;
  cmp(compare_tensor("recv_topk_idx", got.recv_topk_idx, want.recv_topk_idx));
  cmp(compare_tensor("recv_topk_weights", got.recv_topk_weights, want.recv_topk_weights));
  cmp(compare_tensor("recv_src_idx", got.recv_src_idx, want.recv_src_idx));
  if (got.num_recv_tokens_per_expert != want.num_recv_tokens_per_expert)
    c.fail(std::string(when) + ": num_recv_tokens_per_expert differs from the oracle");
  cmp(compare_tensor("handle.rank_prefix_matrix", got.handle.rank_prefix_matrix,
                     want.rank_prefix_matrix));
  cmp(compare_tensor("handle.send_pos", got.handle.send_pos, want.send_pos));
  cmp(compare_tensor("handle.is_token_in_rank", got.handle.is_token_in_rank,
                     want.is_token_in_rank));
}

}  // namespace

void run_ht(Ctx& ctx, int64_t T) {
  const Options& o = ctx.opt;
  const int R = ctx.num_ranks(), rank = ctx.rank(), K = o.top_k;
  const int L = o.num_experts / R;
  const int64_t H = o.hidden, G = H / 128;
  const std::string tag = "ht T=" + std::to_string(T);
  // The buffer first: a backend without ht says so (Unsupported) before inputs are built.
  MoeShape shape;
  shape.hidden = H;
  shape.top_k = K;
  shape.num_experts = o.num_experts;
  shape.max_tokens_per_rank = std::max<int64_t>(T, 1);
  Buffer buffer(ctx.group, shape);
  const int64_t sym_bytes = static_cast<int64_t>(buffer.bytes_allocated());

  progress(ctx, tag + ": building inputs");

  std::vector<RankData> data(R);
  for (int r = 0; r < R; ++r) data[r] = make_rank_data(o, r, R, T, kSaltHt, o.check || r == rank);
  const HtBytes rows = ht_rows(data, R, L, K);

  Tensor topk = upload(data[rank].topk_idx, DType::kI64, {T, K}, ctx.device);
  Tensor weights = upload(data[rank].topk_weights, DType::kF32, {T, K}, ctx.device);

  std::vector<bool> fp8s;
  if (o.dtype != DTypeChoice::kFp8) fp8s.push_back(false);
  if (o.dtype != DTypeChoice::kBf16) {
    if (H % 128 == 0) {
      fp8s.push_back(true);
    } else {
      progress(ctx, tag + ": fp8 skipped (H = " + std::to_string(H) + " is not a multiple of 128)");
    }
  }

  HtHandle combine_handle;  // of the first dispatch, for combine
  bool have_handle = false;
  for (bool fp8 : fp8s) {
    const char* dt = fp8 ? "fp8" : "bf16";
    Fp8Rows q;
    Tensor x, scales;
    if (fp8) {
      q = quantize(data[rank].x, T, H);
      x = upload(q.x, DType::kF8E4M3, {T, H}, ctx.device);
      scales = upload(q.scales, DType::kF32, {T, G}, ctx.device);
    } else {
      x = upload(data[rank].x, DType::kBF16, {T, H}, ctx.device);
    }
    HtDispatchArgs args;
    args.x = x;
    args.x_scales = scales;
    args.topk_idx = topk;
    args.topk_weights = weights;
    args.stream = ctx.stream;
    HtDispatchResult recv, cached;
    auto dispatch = [&] { recv = buffer.ht_dispatch(args, ctx.alloc); };
    HtDispatchArgs cargs;
    cargs.x = x;
    cargs.x_scales = scales;
    cargs.stream = ctx.stream;
    auto dispatch_cached = [&] { cached = buffer.ht_dispatch(cargs, ctx.alloc); };

    Check check_exact, check_cached;
    testing::HtExpectedDispatch want;
    if (o.check) {
      progress(ctx, tag + " " + dt + ": checking dispatch against the oracle");
      testing::HtProblem p;
      p.num_ranks = R;
      p.ranks_per_node = ctx.group.ranks_per_node();
      p.num_experts = o.num_experts;
      p.top_k = K;
      p.hidden = H;
      p.x_row_bytes = fp8 ? H : 2 * H;
      p.scale_row_bytes = fp8 ? 4 * G : 0;
      std::vector<testing::HtRankInput> inputs(R);
      for (int r = 0; r < R; ++r) {
        testing::HtRankInput& in = inputs[r];
        in.num_tokens = T;
        in.topk_idx = data[r].topk_idx;
        in.has_topk_weights = true;
        in.topk_weights = data[r].topk_weights;
        if (fp8) {
          Fp8Rows qr = r == rank ? q : quantize(data[r].x, T, H);
          in.x = std::move(qr.x);
          in.scales.resize(qr.scales.size() * 4);
          std::memcpy(in.scales.data(), qr.scales.data(), in.scales.size());
        } else {
          in.x.resize(data[r].x.size() * 2);
          std::memcpy(in.x.data(), data[r].x.data(), in.x.size());
        }
      }
      want = testing::ht_oracle_dispatch(p, inputs, rank);
      check_exact.run = check_cached.run = true;
      dispatch();
      cargs.handle = &recv.handle;
      dispatch_cached();
      device_synchronize(ctx.device);
      check_dispatch(check_exact, "first call", want, recv, fp8, false);
      check_dispatch(check_cached, "first call", want, cached, fp8, true);
    } else {
      dispatch();
    }
    cargs.handle = &recv.handle;
    if (!have_handle) {
      combine_handle = recv.handle;
      have_handle = true;
    }

    progress(ctx, tag + " " + dt + ": timing " + std::to_string(ctx.iters) + " iterations");
    const double row_bytes = fp8 ? static_cast<double>(H + 4 * G) : 2.0 * H;
    const Timing t_exact = time_op(ctx, dispatch);
    cargs.handle = &recv.handle;  // the last exact dispatch's (same routing)
    const Timing t_cached = time_op(ctx, dispatch_cached);
    if (o.check) {
      device_synchronize(ctx.device);
      check_dispatch(check_exact, "after timing", want, recv, fp8, false);
      check_dispatch(check_cached, "after timing", want, cached, fp8, true);
    }
    add_result(ctx, std::string("ht.dispatch ") + dt, T, t_exact, rows.cross_rows * row_bytes,
               rows.recv_rows * row_bytes, sym_bytes, check_exact);
    add_result(ctx, std::string("ht.dispatch ") + dt + " cached", T, t_cached,
               rows.cross_rows * row_bytes, rows.recv_rows * row_bytes, sym_bytes, check_cached);

    // Cached, zero-copy: recv_x (and scales) are views of the buffer (HtDispatchArgs::zero_copy).
    HtDispatchArgs zargs = cargs;
    zargs.zero_copy = true;
    HtDispatchResult zc;
    auto dispatch_zc = [&] { zc = buffer.ht_dispatch(zargs, ctx.alloc); };
    Check check_zc;
    if (o.check) {
      check_zc.run = true;
      dispatch_zc();
      device_synchronize(ctx.device);
      check_dispatch(check_zc, "first call", want, zc, fp8, true);
    }
    const Timing t_zc = time_op(ctx, dispatch_zc);
    if (o.check) {  // the view of the last call: no ht op ran since
      device_synchronize(ctx.device);
      check_dispatch(check_zc, "after timing", want, zc, fp8, true);
    }
    add_result(ctx, std::string("ht.dispatch ") + dt + " cached zero-copy", T, t_zc,
               rows.cross_rows * row_bytes, rows.recv_rows * row_bytes, sym_bytes, check_zc);
  }

  // ---- combine, with the handle of the first dispatch ----
  // parse() refuses the options that would leave no dispatch (--dtype fp8 with H % 128 != 0).
  if (!have_handle)
    throw Error(ErrorCode::kInternal, "epx-bench ht: no dispatch ran, so there is no handle to "
                                      "combine with");
  const std::vector<uint16_t> y_host = make_y(o, rank, rows.num_recv[rank]);
  Tensor y = upload(y_host, DType::kBF16, {rows.num_recv[rank], H}, ctx.device);
  HtCombineArgs cargs;
  cargs.y = y;
  cargs.handle = &combine_handle;
  cargs.stream = ctx.stream;
  HtCombineResult combined;
  auto combine = [&] { combined = buffer.ht_combine(cargs, ctx.alloc); };
  Check check_combine;
  std::vector<uint16_t> want_out;
  if (o.check) {
    progress(ctx, tag + ": checking combine against the oracle");
    testing::HtProblem p;
    p.num_ranks = R;
    p.ranks_per_node = ctx.group.ranks_per_node();
    p.num_experts = o.num_experts;
    p.top_k = K;
    p.hidden = H;
    p.x_row_bytes = 2 * H;
    std::vector<testing::HtRankInput> inputs(R);
    std::vector<testing::HtCombineRankInput> cin(R);
    for (int r = 0; r < R; ++r) {
      inputs[r].num_tokens = T;
      inputs[r].topk_idx = data[r].topk_idx;
      inputs[r].has_topk_weights = true;
      inputs[r].topk_weights = data[r].topk_weights;
      inputs[r].x.resize(data[r].x.size() * 2);
      std::memcpy(inputs[r].x.data(), data[r].x.data(), inputs[r].x.size());
      cin[r].y = r == rank ? y_host : make_y(o, r, rows.num_recv[r]);
    }
    want_out = testing::ht_oracle_combine(p, inputs, cin, rank).out;
    check_combine.run = true;
    combine();
    device_synchronize(ctx.device);
    const std::string c = compare_tensor("out", combined.out, want_out);
    if (!c.empty()) check_combine.fail("first call: " + c);
  }
  progress(ctx, tag + " combine: timing " + std::to_string(ctx.iters) + " iterations");
  const Timing t_combine = time_op(ctx, combine);
  if (o.check) {
    device_synchronize(ctx.device);
    const std::string c = compare_tensor("out", combined.out, want_out);
    if (!c.empty()) check_combine.fail("after timing: " + c);
  }
  add_result(ctx, "ht.combine", T, t_combine, rows.cross_rows * 2.0 * H, rows.recv_rows * 2.0 * H,
             sym_bytes, check_combine);

  // Zero-copy combine: y written once into ht_combine_buffer, which the peers read.
  const TensorView view = buffer.ht_combine_buffer(combine_handle);
  copy_into(view, y_host.data(), y_host.size() * 2);
  HtCombineArgs zargs = cargs;
  zargs.y = view;
  zargs.zero_copy = true;
  auto combine_zc = [&] { combined = buffer.ht_combine(zargs, ctx.alloc); };
  Check check_zc;
  if (o.check) {
    check_zc.run = true;
    combine_zc();
    device_synchronize(ctx.device);
    const std::string c = compare_tensor("out", combined.out, want_out);
    if (!c.empty()) check_zc.fail("first call: " + c);
  }
  const Timing t_zc = time_op(ctx, combine_zc);
  if (o.check) {
    device_synchronize(ctx.device);
    const std::string c = compare_tensor("out", combined.out, want_out);
    if (!c.empty()) check_zc.fail("after timing: " + c);
  }
  add_result(ctx, "ht.combine zero-copy", T, t_zc, rows.cross_rows * 2.0 * H,
             rows.recv_rows * 2.0 * H, sym_bytes, check_zc);
}

}  // namespace epx::bench
