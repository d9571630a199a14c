// bench/epx_bench_ll.cc — epx-bench ll: low-latency dispatch (fp8, bf16 or NVFP4) and combine
// (bf16, and LogFMT-10).
//
// Workload on every rank (T tokens, T_max = T, L = E / R, RT = R * T_max, G = H / 128):
//   ll_dispatch(x [T, H] bf16, topk_idx [T, K] int64, use_fp8 / use_nvfp4) ->
//     recv_x [L, RT, H], recv_scales f32 [L, RT, G] (fp8; NVFP4: the e2m1 pairs and the
//     interleaved e4m3 scales of epx/ll.h), recv_count [L], handle
//   ll_combine(y [L, RT, H] bf16, topk_idx, topk_weights, handle) -> out [T, H] bf16
//     y = fill_hash_bf16 on the rows < recv_count[l] of each local expert, zeros elsewhere
// Rows: (token, distinct expert) pairs — a token selecting the same expert twice gets one row.
// Dispatch bytes per row (the row_B column): fp8 H + 4G (values + scales), bf16 2H, NVFP4
// H/2 + H/16 = 9H/16 (4032 at H = 7168; fp8 7392, bf16 14336); combine bytes per row 2H.
// ll.combine logfmt (use_logfmt, docs/semantics.md §2.3.1): y * 2^-4 (|y| < 0.5, so every group is
// cast, as in DeepEP's perf case); bytes per row = the mean over this rank's rows of what LogFMT
// puts on the wire (core/logfmt.h logfmt_wire_bytes: 164 per cast group, 260 per raw one; 1.25 H
// + H / 32 when all cast, 64 % of bf16's 2H). Computed from the encoding, not measured.
// Timing: repeated ll_dispatch (no hooks), then repeated ll_combine with the last handle; both
// legal in any order on every backend (ll double-buffers, see src/cpu/ll.cc).
// --check compares with tests/support/oracle_ll.h before and after timing.
#include <cstring>

#include "bench/epx_bench.h"
#include "core/check.h"
#include "core/logfmt.h"
#include "support/oracle_ll.h"

namespace epx::bench {

namespace {

// NVFP4's global scale: 448 * 6 / 8 (fill_hash_bf16's rows lie in (-8, 8)), equal on every rank.
constexpr float kNvfp4GlobalScale = 448.0f * 6.0f / 8.0f;

enum class LlQuant { kBf16, kFp8, kNvfp4 };

const char* ll_quant_name(LlQuant q) {
  return q == LlQuant::kBf16 ? "bf16" : q == LlQuant::kFp8 ? "fp8" : "nvfp4";
}

// counts[d][l]: rows local expert l of rank d receives, from every rank's routing.
std::vector<std::vector<int32_t>> ll_counts(const std::vector<RankData>& data, int R, int L,
                                            int K) {
  std::vector<std::vector<int32_t>> counts(R, std::vector<int32_t>(L, 0));
  for (const RankData& d : data) {
    const int64_t T = static_cast<int64_t>(d.topk_idx.size()) / K;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t* row = d.topk_idx.data() + t * K;
      for (int k = 0; k < K; ++k) {
        if (row[k] < 0 || std::find(row, row + k, row[k]) != row + k) continue;
        counts[row[k] / L][row[k] % L]++;
      }
    }
  }
  return counts;
}

struct LlBytes {
  double dispatch_cross = 0, dispatch_recv = 0, combine_cross = 0, combine_recv = 0;
};

// Group means per rank. dispatch_row: bytes of one dispatched row.
LlBytes ll_bytes(const std::vector<RankData>& data, int R, int L, int K, double dispatch_row,
                 double combine_row) {
  LlBytes b;
  for (int s = 0; s < R; ++s) {
    const int64_t T = static_cast<int64_t>(data[s].topk_idx.size()) / K;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t* row = data[s].topk_idx.data() + t * K;
      for (int k = 0; k < K; ++k) {
        if (row[k] < 0 || std::find(row, row + k, row[k]) != row + k) continue;
        const bool cross = row[k] / L != s;
        b.dispatch_recv += dispatch_row;
        b.combine_recv += combine_row;
        if (cross) {
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

// Rank d's expert outputs [L, RT, H]: hash rows below recv_count, zeros elsewhere.
std::vector<uint16_t> make_y(const Options& o, int d, int L, int64_t RT,
                             const std::vector<int32_t>& counts) {
  std::vector<uint16_t> y(static_cast<size_t>(L * RT * o.hidden), 0);
  for (int l = 0; l < L; ++l)
    fill_hash_bf16(y.data() + l * RT * o.hidden, counts[l] * o.hidden,
                   (o.seed << 20) ^ (static_cast<uint64_t>(d) << 12) ^ (l << 4) ^ kSaltLl);
  return y;
}

// y for the LogFMT combine: every value * 2^-4 (exact in bf16 for these magnitudes).
std::vector<uint16_t> logfmt_y(const std::vector<uint16_t>& y) {
  std::vector<uint16_t> out(y.size());
  for (size_t i = 0; i < y.size(); ++i)
    out[i] = detail::f32_to_bf16(detail::bf16_to_f32(y[i]) * 0.0625f);
  return out;
}

// Mean LogFMT wire bytes of the rows < counts[l] of y [L, RT, H] (2H when there are none).
double logfmt_row_bytes(const std::vector<uint16_t>& y, int64_t RT, int64_t H,
                        const std::vector<int32_t>& counts) {
  std::vector<uint16_t> row(H);
  std::vector<uint32_t> meta(H / detail::kLogfmtGroup);
  double bytes = 0, rows = 0;
  for (size_t l = 0; l < counts.size(); ++l) {
    for (int64_t r = 0; r < counts[l]; ++r, ++rows) {
      std::copy_n(y.begin() + (l * RT + r) * H, H, row.begin());
      detail::logfmt_encode_row(row.data(), H, reinterpret_cast<uint8_t*>(row.data()), meta.data());
      for (uint32_t m : meta) bytes += detail::logfmt_wire_bytes(m);
    }
  }
  return rows > 0 ? bytes / rows : 2.0 * H;
}

LlDispatchResult to_host(const LlDispatchResult& r) {
  LlDispatchResult h;
  h.recv_x = host_copy(r.recv_x);
  h.recv_scales = host_copy(r.recv_scales);
  h.recv_count = host_copy(r.recv_count);
  h.handle = r.handle;
  h.handle.src_info = host_copy(r.handle.src_info);
  h.handle.layout_range = host_copy(r.handle.layout_range);
  return h;
}

}  // namespace

void run_ll(Ctx& ctx, int64_t T) {
  const Options& o = ctx.opt;
  const int R = ctx.num_ranks(), rank = ctx.rank(), K = o.top_k;
  const int L = o.num_experts / R;
  const int64_t T_max = std::max<int64_t>(T, 1), RT = R * T_max, H = o.hidden;
  const std::string tag = "ll T=" + std::to_string(T);
  progress(ctx, tag + ": creating the buffer");

  MoeShape shape;
  shape.hidden = H;
  shape.top_k = K;
  shape.num_experts = o.num_experts;
  shape.max_tokens_per_rank = T_max;
  BufferConfig config;
  config.enable_ht = false;
  config.enable_ll = true;
  Buffer buffer(ctx.group, shape, config);
  const int64_t sym_bytes = static_cast<int64_t>(buffer.bytes_allocated());

  progress(ctx, tag + ": building inputs");
  // Every rank's routing (for counts and bytes); data for this rank, or all ranks with --check.
  std::vector<RankData> data(R);
  for (int r = 0; r < R; ++r) data[r] = make_rank_data(o, r, R, T, kSaltLl, o.check || r == rank);
  const auto counts = ll_counts(data, R, L, K);

  Tensor x = upload(data[rank].x, DType::kBF16, {T, H}, ctx.device);
  Tensor topk = upload(data[rank].topk_idx, DType::kI64, {T, K}, ctx.device);
  Tensor weights = upload(data[rank].topk_weights, DType::kF32, {T, K}, ctx.device);
  const std::vector<uint16_t> y_host = make_y(o, rank, L, RT, counts[rank]);
  Tensor y = upload(y_host, DType::kBF16, {L, RT, H}, ctx.device);
  const std::vector<uint16_t> y_lf_host = logfmt_y(y_host);
  Tensor y_lf = upload(y_lf_host, DType::kBF16, {L, RT, H}, ctx.device);
  const double lf_row_bytes = logfmt_row_bytes(y_lf_host, RT, H, counts[rank]);

  testing::LlProblem p;
  p.num_ranks = R;
  p.ranks_per_node = ctx.group.ranks_per_node();
  p.max_tokens = T_max;
  p.hidden = H;
  p.top_k = K;
  p.num_experts = o.num_experts;
  std::vector<testing::LlRankInput> inputs;
  std::vector<std::vector<uint16_t>> ys;
  std::vector<uint16_t> want_out, want_out_lf;
  if (o.check) {
    for (int r = 0; r < R; ++r) {
      testing::LlRankInput in;
      in.num_tokens = T;
      in.x = data[r].x;
      in.topk_idx = data[r].topk_idx;
      in.topk_weights = data[r].topk_weights;
      inputs.push_back(std::move(in));
      ys.push_back(r == rank ? y_host : make_y(o, r, L, RT, counts[r]));
    }
    want_out = testing::oracle_ll_combine(p, inputs, ys, rank);
    for (auto& yd : ys) yd = logfmt_y(yd);
    testing::LlProblem plf = p;
    plf.use_logfmt = true;
    want_out_lf = testing::oracle_ll_combine(plf, inputs, ys, rank);
    ys.clear();
  }

  const LlQuant quant = o.dtype == DTypeChoice::kBf16    ? LlQuant::kBf16
                        : o.dtype == DTypeChoice::kNvfp4 ? LlQuant::kNvfp4
                                                         : LlQuant::kFp8;  // standard: fp8
  {
    const char* dt = ll_quant_name(quant);
    p.use_fp8 = quant == LlQuant::kFp8;
    p.use_nvfp4 = quant == LlQuant::kNvfp4;
    p.global_scale = kNvfp4GlobalScale;
    LlDispatchArgs dargs;
    dargs.x = x;
    dargs.topk_idx = topk;
    dargs.use_fp8 = p.use_fp8;
    dargs.use_nvfp4 = p.use_nvfp4;
    if (p.use_nvfp4) dargs.global_scale = kNvfp4GlobalScale;
    dargs.stream = ctx.stream;
    LlDispatchResult recv;
    LlCombineResult combined, combined_lf;
    auto dispatch = [&] { recv = buffer.ll_dispatch(dargs, ctx.alloc); };
    auto combine_with = [&](bool logfmt) {
      LlCombineArgs cargs;
      cargs.y = logfmt ? y_lf : y;
      cargs.topk_idx = topk;
      cargs.topk_weights = weights;
      cargs.handle = &recv.handle;
      cargs.use_logfmt = logfmt;
      cargs.stream = ctx.stream;
      (logfmt ? combined_lf : combined) = buffer.ll_combine(cargs, ctx.alloc);
    };
    auto combine = [&] { combine_with(false); };
    auto combine_lf = [&] { combine_with(true); };

    Check check_dispatch, check_combine, check_lf;
    testing::LlExpectedDispatch want;
    auto verify = [&](const char* when) {
      device_synchronize(ctx.device);
      const std::string d = testing::check_ll_dispatch(p, want, to_host(recv));
      if (!d.empty()) check_dispatch.fail(std::string(when) + ": " + d);
      const std::string c = testing::check_ll_combine(p, want_out, host_copy(combined.out));
      if (!c.empty()) check_combine.fail(std::string(when) + ": " + c);
      const std::string lf = testing::check_ll_combine(p, want_out_lf, host_copy(combined_lf.out));
      if (!lf.empty()) check_lf.fail(std::string(when) + ": " + lf);
    };
    if (o.check) {
      progress(ctx, tag + " " + dt + ": checking against the oracle");
      want = testing::oracle_ll_dispatch(p, inputs, rank);
      check_dispatch.run = check_combine.run = check_lf.run = true;
      dispatch();
      combine();
      combine_lf();
      verify("first call");
    }

    progress(ctx, tag + " " + dt + ": timing " + std::to_string(ctx.iters) + " iterations");
    const double G = static_cast<double>(H / 128);
    const double row = quant == LlQuant::kFp8     ? H + 4 * G
                       : quant == LlQuant::kNvfp4 ? H / 2.0 + H / 16.0
                                                  : 2.0 * H;
    const LlBytes bytes = ll_bytes(data, R, L, K, row, 2.0 * H);
    const LlBytes lf_bytes = ll_bytes(data, R, L, K, 0, lf_row_bytes);
    Timing t_dispatch, t_combine, t_lf;
    if (ctx.is_cuda()) {
      t_dispatch = time_op(ctx, dispatch);
      t_combine = time_op(ctx, combine);
      t_lf = time_op(ctx, combine_lf);
    } else {
      const std::vector<Timing> t = time_sequence(ctx, {dispatch, combine});
      t_dispatch = t[0];
      t_combine = t[1];
      t_lf = time_sequence(ctx, {dispatch, combine_lf})[1];
    }
    if (o.check) verify("after timing");
    add_result(ctx, std::string("ll.dispatch ") + dt, T, t_dispatch, bytes.dispatch_cross,
               bytes.dispatch_recv, sym_bytes, check_dispatch, row);
    add_result(ctx, "ll.combine", T, t_combine, bytes.combine_cross, bytes.combine_recv, sym_bytes,
               check_combine, 2.0 * H);
    add_result(ctx, "ll.combine logfmt", T, t_lf, lf_bytes.combine_cross, lf_bytes.combine_recv,
               sym_bytes, check_lf, lf_row_bytes);
  }
}

}  // namespace epx::bench
