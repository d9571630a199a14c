// GPU tier: the cuda ll backend (src/cuda/ll.cu) against the naive oracle of docs/semantics.md §2
// (tests/support/oracle_ll.h, which the cpu backend also matches bit for bit), on R = 1, 2, 4 and 8
// forked ranks, one GPU each. Skipped, with the reason, where fewer GPUs are visible.
//
// Every check compares every defined element bit for bit: recv_x bytes (fp8, bf16 or NVFP4 e2m1
// pairs) and recv_scales (f32 or packed UE8M0, column-major; NVFP4 e4m3, interleaved) of every
// valid row, recv_count, src_info,
// layout_range, the cumulative stats and combine's out. Outputs are poisoned before the library
// writes them (allocator outputs and a given out are filled with 0xFF; graph outputs before every
// replay); y rows past the received counts are NaN, so a wrong row read shows up in out.
// Problems (inputs and expected outputs) are generated in the parent and inherited through fork.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/tuning.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "gpu/gpu_support.h"
#include "support/ll_cases.h"
#include "support/oracle_ll.h"
#include "support/routing.h"
#include "transport/nccl_transport.h"

namespace epx {
namespace {

using gpu_testing::host_copy;
using gpu_testing::host_ll_dispatch;
using gpu_testing::RankStream;
using gpu_testing::run_cuda_ranks;
using gpu_testing::to_host_bytes;
using gpu_testing::upload_rows;
using gpu_testing::upload_topk;
using testing::LlExpectedDispatch;
using testing::LlProblem;
using testing::LlRankInput;
using testing::Routing;

using Case = testing::LlCase;
using Batch = testing::LlBatch;

// ---- problems (generated in the parent; cases and batches: tests/support/ll_cases.h) -----------

Case random_case(int R, uint64_t seed) {
  return testing::random_ll_case(R, seed, 0.4);
}

// ---- device helpers ----------------------------------------------------------------------------

using gpu_testing::poison_allocator;

std::string check_out(const LlProblem& p, const std::vector<uint16_t>& want,
                      const TensorView& out) {
  std::vector<std::vector<uint8_t>> keep;
  return testing::check_ll_combine(p, want, host_copy(out, keep));
}

BufferConfig ll_only() {
  BufferConfig c;
  c.enable_ht = false;
  c.enable_ll = true;
  return c;
}

// Runs case c on this rank with its own Buffer; returns "" or the first failure.
std::string run_rank(const Case& c, const std::vector<Batch>& batches, const Group& g,
                     cudaStream_t stream) {
  const LlProblem& p = c.p;
  const int r = g.rank(), L = p.num_local_experts(), dev = gpu_testing::device_of(g);
  const int64_t H = p.hidden, RT = p.rows_per_expert();
  Buffer buf(g, p.moe_shape(), ll_only());
  const Allocator alloc = poison_allocator();
  std::string err;
  auto fail = [&](const std::string& where, const std::string& what) {
    if (err.empty() && !what.empty()) err = "rank " + std::to_string(r) + " " + where + ": " + what;
  };
  const int nb = c.num_batches;
  for (int iter = 0; iter < c.num_iters && err.empty(); ++iter) {
    std::vector<const Batch*> bs;
    for (int b = 0; b < nb; ++b) bs.push_back(&batches[iter * nb + b]);
    std::vector<Tensor> keep;  // device inputs alive until the hooks ran
    std::vector<Tensor> stats(nb);
    std::vector<LlDispatchResult> d(nb);
    for (int b = 0; b < nb; ++b) {
      LlDispatchArgs a = gpu_testing::ll_dispatch_inputs(c, bs[b]->in[r], dev, keep);
      a.use_nvfp4 = p.use_nvfp4;
      if (p.use_nvfp4 && c.seed % 2) {  // g as a device tensor (element 0 read) or a host value
        keep.push_back(gpu_testing::to_device(std::vector<float>{p.global_scale, -1.0f},
                                              DType::kF32, {2}, dev));
        a.x_global_scale = keep.back();
      } else if (p.use_nvfp4) {
        a.global_scale = p.global_scale;
      }
      a.return_recv_hook = c.hook;
      if (c.stats) {
        stats[b] = gpu_testing::to_device(bs[b]->stats0[r], DType::kI32, {L}, dev);
        a.cumulative_local_expert_recv_stats = stats[b];
      }
      a.stream = stream;
      d[b] = buf.ll_dispatch(a, alloc);
      if (static_cast<bool>(d[b].hook) != c.hook) fail("dispatch", "hook presence is wrong");
    }
    if (c.hook)
      for (int i = 0; i < nb; ++i) d[c.reverse_hooks ? nb - 1 - i : i].hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    for (int b = 0; b < nb; ++b) {
      const std::string where = "iter " + std::to_string(iter) + " batch " + std::to_string(b);
      std::vector<std::vector<uint8_t>> hk;
      fail(where + " dispatch",
           testing::check_ll_dispatch(p, bs[b]->want[r], host_ll_dispatch(d[b], hk)));
      if (c.stats) {
        const std::vector<int32_t> got = gpu_testing::to_host<int32_t>(stats[b]);
        for (int l = 0; l < L; ++l)
          if (got[l] != bs[b]->stats0[r][l] + bs[b]->want[r].recv_count[l])
            fail(where + " stats",
                 "cumulative_local_expert_recv_stats[" + std::to_string(l) +
                     "] = " + std::to_string(got[l]) + ", expected " +
                     std::to_string(bs[b]->stats0[r][l] + bs[b]->want[r].recv_count[l]));
      }
    }
    // Combine every batch, then run the hooks.
    std::vector<LlCombineResult> cr(nb);
    for (int b = 0; b < nb; ++b) {
      const int64_t T = bs[b]->in[r].num_tokens;
      LlCombineArgs a = gpu_testing::ll_combine_inputs(c, bs[b]->in[r],
                                                       c.zero_copy ? nullptr : &bs[b]->y[r], dev,
                                                       keep);
      a.handle = &d[b].handle;
      const size_t y_bytes = bs[b]->y[r].size() * 2;
      if (c.zero_copy) {
        TensorView v = buf.ll_next_combine_buffer(d[b].handle);
        if (v.dtype != DType::kBF16 || v.ndim != 3 || v.shape[0] != L || v.shape[1] != RT ||
            v.shape[2] != H || v.device != Device::cuda(dev) || !v.is_contiguous())
          fail("next_combine_buffer", "view is " + v.describe());
        gpu_testing::upload_on_rank_stream(v.data, bs[b]->y[r].data(), y_bytes, stream);
        a.zero_copy = true;
      }
      if (c.out_given) {
        keep.push_back(gpu_testing::device_allocator()(DType::kBF16, {std::max<int64_t>(T, 1), H},
                                                       Device::cuda(dev)));
        // Poisoned on the combine's stream: a legacy-stream memset is not ordered with this
        // non-blocking stream and could land after the combine wrote (seen once on 2xH200).
        CUDA_OK(cudaMemsetAsync(keep.back().data, 0xFF, keep.back().nbytes(), stream));
        a.out = TensorView::contiguous(keep.back().data, DType::kBF16, {T, H}, Device::cuda(dev));
      }
      a.return_recv_hook = c.hook;
      a.use_logfmt = p.use_logfmt;
      a.stream = stream;
      cr[b] = buf.ll_combine(a, alloc);
      if (static_cast<bool>(cr[b].hook) != c.hook) fail("combine", "hook presence is wrong");
      if (c.out_given && cr[b].out.data != a.out.data)
        fail("combine", "out given but the result does not alias it");
    }
    if (c.hook)
      for (int i = 0; i < nb; ++i) cr[c.reverse_hooks ? nb - 1 - i : i].hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    for (int b = 0; b < nb; ++b)
      fail("iter " + std::to_string(iter) + " batch " + std::to_string(b) + " combine",
           check_out(p, bs[b]->want_out[r], cr[b].out));
  }
  return err;
}

// `body` on R forked GPU ranks, or on R ranks sharing GPU 0 when `one_gpu`.
int run_ranks(int R, bool one_gpu, const std::function<int(const Group&)>& body,
              GroupOptions options = {}) {
  return one_gpu ? gpu_testing::run_cuda_ranks_one_gpu(R, 0, body, options)
                 : run_cuda_ranks(R, body, options);
}

// Runs `cases` on R forked GPU ranks, or on R ranks sharing GPU 0 when `one_gpu` (one group; one
// Buffer per case). Returns the number of failing cases over all ranks; failures are printed.
int run_cases(int R, const std::vector<Case>& cases, const std::vector<std::vector<Batch>>& data,
              bool one_gpu = false, GroupOptions options = {}) {
  const auto body = [&](const Group& g) {
    const RankStream rs(cudaStreamNonBlocking);
    const cudaStream_t stream = rs.get();
    int bad = 0;
    for (size_t i = 0; i < cases.size() && bad < 3; ++i) {
      std::string err;
      try {
        err = run_rank(cases[i], data[i], g, stream);
      } catch (const std::exception& e) {
        err = std::string("exception: ") + e.what();
      }
      if (!err.empty()) {
        std::fprintf(stderr, "case %zu (%s): %s\n", i, cases[i].describe().c_str(), err.c_str());
        ++bad;  // three diagnoses are enough; the peers time out
      }
    }
    return bad;
  };
  return run_ranks(R, one_gpu, body, options);
}

// ---- random and fixed cases ---------------------------------------------------------------

class LlGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlGpu, RandomCasesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  std::vector<Case> cases;
  std::vector<std::vector<Batch>> data;
  const int n = R == 1 ? 12 : 24;
  for (int i = 0; i < n; ++i) {
    cases.push_back(random_case(R, 1000 * R + i));
    data.push_back(testing::make_ll_batches(cases.back()));
  }
  EXPECT_EQ(run_cases(R, cases, data), 0);
}

// Edge shapes: DeepSeek-like H with T = T_max on every rank and two batches in flight (every
// routing), K > E (rows end in -1), T_max = 1024 with K = 16 and different T per rank, rows wider
// than the send's prefetch (H = 16512).
TEST_P(LlGpu, FixedCasesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  std::vector<Case> cases;
  uint64_t seed = 500000 + R;
  for (Routing routing : testing::all_routings()) {
    Case c;
    c.p = {R, 7, 7168, 8, 16 * R, true, true, routing != Routing::kSkewed};
    c.routing = routing;
    c.hook = true;
    c.reverse_hooks = routing == Routing::kDuplicates;
    c.num_batches = 2;
    c.fixed_tokens.assign(R, 7);
    c.seed = seed++;
    cases.push_back(c);
    Case k;
    k.p = {R, 64, 128, 16, 4 * R, false, false, false};  // K > E
    k.routing = routing;
    k.zero_copy = true;
    k.out_given = true;
    k.seed = seed++;
    cases.push_back(k);
  }
  Case big;
  big.p = {R, 1024, 256, 16, 32 * R, true, false, false};
  big.fixed_tokens.assign(R, 333);  // R = 1: {1024}; else {1024, 333, 333, ...}
  big.fixed_tokens[0] = 1024;
  big.stats = true;
  big.num_iters = 2;
  big.seed = seed++;
  cases.push_back(big);
  big.p.use_fp8 = false;
  big.fixed_tokens.assign(R, 1024);  // R = 1: {517}; else {0, 1024, 1024, ...}
  big.fixed_tokens[0] = R == 1 ? 517 : 0;
  big.hook = true;
  big.zero_copy = true;
  big.seed = seed++;
  cases.push_back(big);
  // Rows wider than the send's prefetch (kLlXPrefetch = 2 vectors of 8 per thread of 512: H <=
  // 8192), fp8 with UE8M0 scales and bf16: the rest of each row is loaded in the send's loop.
  Case wide;
  wide.p = {R, 5, 16512, 8, 8 * R, true, true, true};
  wide.seed = seed++;
  cases.push_back(wide);
  wide.p = {R, 5, 16512, 8, 8 * R, false, false, false};
  wide.hook = true;
  wide.seed = seed++;
  cases.push_back(wide);
  // x's and y's rows not 16-byte aligned (row stride H + 1), no hook, copy mode: the fused
  // dispatch's send loads x element by element (kernels/ll/dispatch.cuh, x_vec16 false; at
  // H = 7168 its prefetch holds the whole row); this rank's rows of y go through its combine
  // buffer, the pulls read aligned rows only (kernels/ll/combine.cuh copy_own); H = 7168: two
  // output vectors per thread.
  Case odd;
  odd.p = {R, 7, 7168, 8, 16 * R, true, false, false};
  odd.padded = odd.unaligned_y = odd.unaligned_x = true;
  odd.num_batches = 2;
  odd.seed = seed++;
  cases.push_back(odd);
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  EXPECT_EQ(run_cases(R, cases, data), 0);
}

// Three dispatches before their combines (no hooks): the third reuses the first one's slot, so
// the first combine reads the prefix counts and range tables (its slot's row map is the third
// dispatch's by then) and the other two the row map (kernels/ll/combine.cuh, kDirect); fp8 and
// copy mode with y's rows not 16-byte aligned, bf16 with zero_copy, LogFMT with duplicated
// experts in a row.
std::vector<Case> three_batch_cases(int R, uint64_t seed) {
  std::vector<Case> cases;
  for (int v = 0; v < 3; ++v) {
    Case c;
    c.p = {R, 32, 512, 8, 8 * R, v != 1, false, false};
    c.p.use_logfmt = v == 2;
    c.routing = v == 2 ? Routing::kDuplicates : Routing::kUniform;
    c.num_batches = 3;
    c.num_iters = 2;
    c.zero_copy = v == 1;
    c.padded = c.unaligned_y = v == 0;  // y's rows not 16-byte aligned (copy_own)
    c.seed = seed + v;
    cases.push_back(c);
  }
  return cases;
}

TEST_P(LlGpu, ThreeBatchesBeforeTheirCombinesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  const std::vector<Case> cases = three_batch_cases(R, 510000 + 10 * R);
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  EXPECT_EQ(run_cases(R, cases, data), 0);
}

// Few CTAs and many experts (kernels/ll/dispatch.cuh, the receive's units): C = 1 (one CTA takes
// every expert, its lists overflowing 512 entries) and 3 (units in groups of kLlUnitGroup) with
// T_max = 1024 and K = 16, at R = 1 and one-GPU R = 2 (the concatenated view); and E = 288 on the
// default C (more experts than CTAs; the slot view at R = 1).
TEST(LlGpuCtas, FewCtasAndManyExpertsMatchOracle) {
  EPX_REQUIRE_GPUS(1);
  for (const int R : {1, 2}) {
    for (const int sms : {1, 3, 0}) {
      std::vector<Case> cases;
      Case c;
      c.p = sms > 0 ? testing::LlProblem{R, 1024, 256, 16, 32 * R, true, false, false}
                    : testing::LlProblem{R, 128, 7168, 8, 288, true, true, false};
      c.fixed_tokens.assign(R, sms > 0 ? 1024 : 128);
      if (R > 1) c.fixed_tokens[1] = sms > 0 ? 517 : 77;
      c.stats = true;
      c.hook = sms == 3;
      c.num_iters = 2;
      c.seed = 900000 + 10 * R + sms;
      cases.push_back(c);
      GroupOptions options;
      options.num_sms = sms;
      std::vector<std::vector<Batch>> data;
      for (const Case& k : cases) data.push_back(testing::make_ll_batches(k));
      EXPECT_EQ(run_cases(R, cases, data, /*one_gpu=*/true, options), 0)
          << "R = " << R << ", num_sms = " << sms;
    }
  }
}

// use_logfmt (docs/semantics.md §2.3.1) against the oracle, whose LogFMT is the independent
// tests/support/logfmt_ref.h that the cpu backend matches bit for bit (tests/unit/ll_test.cc): so
// cuda == cpu. Every hook / zero_copy / out combination, H = 7168 and 384, K = 8 and 16, fp8 and
// bf16 dispatches, duplicates, T = 0 on rank 1, two rounds per buffer; then K = 32 over 256
// tokens (several meta chunks per token group, many CTAs). y rows take every LogFMT group kind
// (ll_cases.h make_logfmt_bf16).
std::vector<Case> logfmt_cases(int R, uint64_t seed) {
  std::vector<Case> cases;
  for (int v = 0; v < 8; ++v) {
    Case c;
    c.p = {R, 9, v % 2 ? 7168 : 384, v < 4 ? 8 : 16, 4 * R, v % 3 == 0, false, false, true};
    c.routing = v == 5 ? Routing::kDuplicates : Routing::kUniform;
    c.hook = v & 1;
    c.zero_copy = v & 2;
    c.out_given = v & 4;
    c.fixed_tokens.assign(R, 9);
    if (R > 1) c.fixed_tokens[1] = 0;
    c.num_iters = 2;
    c.seed = seed + v;
    cases.push_back(c);
  }
  Case big;
  big.p = {R, 256, 2048, 32, 8 * R, false, false, false, true};
  big.fixed_tokens.assign(R, 256);
  big.hook = true;
  big.zero_copy = true;
  big.seed = seed + 100;
  cases.push_back(big);
  return cases;
}

TEST_P(LlGpu, LogfmtCasesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  const std::vector<Case> cases = logfmt_cases(R, 800000 + 1000 * R);
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  EXPECT_EQ(run_cases(R, cases, data), 0);
}

// NVFP4 edge cases (tests/support/ll_cases.h: DeepSeek's H with two batches in flight, a partial
// 128-row scale tile, H = 128, saturating and flushing global scales, every routing; g as a
// device tensor or a host value): every value byte and interleaved scale equals the oracle's,
// which the cpu backend matches bit for bit (tests/unit/ll_test.cc Ll.Nvfp4CasesMatchOracle).
TEST_P(LlGpu, Nvfp4CasesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  const std::vector<Case> cases = testing::nvfp4_ll_cases(R, 800000 + 100 * R);
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  EXPECT_EQ(run_cases(R, cases, data), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlGpu, ::testing::Values(1, 2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

// R ranks as threads sharing GPU 0 (Group::cuda_shared_device, issue 8): EP4 and EP8 before
// machines with that many GPUs; num_sms auto = SMs / R keeps every rank's CTAs co-resident.
class LlOneGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlOneGpu, RandomCasesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(1);
  std::vector<Case> cases;
  std::vector<std::vector<Batch>> data;
  for (int i = 0; i < 10; ++i) {
    cases.push_back(random_case(R, 7000 * R + i));
    data.push_back(testing::make_ll_batches(cases.back()));
  }
  EXPECT_EQ(run_cases(R, cases, data, /*one_gpu=*/true), 0);
}

TEST_P(LlOneGpu, ThreeBatchesBeforeTheirCombinesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(1);
  const std::vector<Case> cases = three_batch_cases(R, 520000 + 10 * R);
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  EXPECT_EQ(run_cases(R, cases, data, /*one_gpu=*/true), 0);
}

TEST_P(LlOneGpu, LogfmtCasesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(1);
  const std::vector<Case> cases = logfmt_cases(R, 900000 + 1000 * R);
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  EXPECT_EQ(run_cases(R, cases, data, /*one_gpu=*/true), 0);
}

TEST_P(LlOneGpu, Nvfp4CasesMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(1);
  const std::vector<Case> cases = testing::nvfp4_ll_cases(R, 810000 + 100 * R);
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  EXPECT_EQ(run_cases(R, cases, data, /*one_gpu=*/true), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlOneGpu, ::testing::Values(2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

// ---- two batches in flight, every input overwritten once its call returned ------------------

// One event of a two-batch schedule: batch b's dispatch call, its hook, combine call, its hook.
enum class Ev { kD, kDh, kC, kCh };
struct Step {
  int b;
  Ev ev;
};

// Every legal order of two batches' events (per batch: dispatch, its hook, combine, its hook;
// the hooks only where that batch has them), batch 0 dispatching first (the slots follow the
// dispatch order): two-batch overlap and everything around it.
std::vector<std::vector<Step>> two_batch_schedules(bool hook0, bool hook1) {
  auto chain = [](int b, bool hook) {
    std::vector<Step> c{{b, Ev::kD}};
    if (hook) c.push_back({b, Ev::kDh});
    c.push_back({b, Ev::kC});
    if (hook) c.push_back({b, Ev::kCh});
    return c;
  };
  const std::vector<Step> a = chain(0, hook0), b = chain(1, hook1);
  std::vector<std::vector<Step>> out;
  std::vector<Step> cur;
  std::function<void(size_t, size_t)> rec = [&](size_t i, size_t j) {
    if (i == a.size() && j == b.size()) {
      out.push_back(cur);
      return;
    }
    if (i < a.size()) {
      cur.push_back(a[i]);
      rec(i + 1, j);
      cur.pop_back();
    }
    if (j < b.size() && i > 0) {
      cur.push_back(b[j]);
      rec(i, j + 1);
      cur.pop_back();
    }
  };
  rec(0, 0);
  return out;
}

std::string describe(const std::vector<Step>& sched) {
  static const char* names[] = {"D", "Dh", "C", "Ch"};
  std::string s;
  for (const Step& st : sched)
    s += std::string(s.empty() ? "" : " ") + names[static_cast<int>(st.ev)] + (st.b ? "B" : "A");
  return s;
}

// Runs `sched` on this rank with `buf` (batches bs[0], bs[1]; hooks per batch from `hooks`).
// Every input (x, topk_idx of dispatch; y, topk_idx, topk_weights of combine) is overwritten with
// 0x7F bytes on the stream right after the call that took it returned, as a caller that drops or
// reuses its tensors does: a later read of one shows up as a wrong row, a bad expert id or a huge
// value. Outputs are checked bit for bit against the oracle at the end.
std::string run_schedule(const Case& c, const Batch* bs[2], const std::vector<Step>& sched,
                         const bool hooks[2], Buffer& buf, const Group& g, cudaStream_t stream) {
  const LlProblem& p = c.p;
  const int r = g.rank(), K = p.top_k, L = p.num_local_experts(), dev = gpu_testing::device_of(g);
  const int64_t H = p.hidden, RT = p.rows_per_expert();
  const Allocator alloc = poison_allocator();
  std::vector<Tensor> inputs;  // overwritten after their call, freed at the end
  LlDispatchResult d[2];
  LlCombineResult cr[2];
  auto overwrite = [&](Tensor t) {
    CUDA_OK(cudaMemsetAsync(t.data, 0x7F, t.nbytes(), stream));
    inputs.push_back(std::move(t));
  };
  for (const Step& st : sched) {
    const LlRankInput& in = bs[st.b]->in[r];
    const int64_t T = in.num_tokens;
    switch (st.ev) {
      case Ev::kD: {
        int64_t stride = H;
        Tensor x = upload_rows(in.x, T, H, false, dev, &stride);
        Tensor topk = upload_topk(in.topk_idx, T, K, c.topk_i32, dev);
        LlDispatchArgs a;
        a.x = TensorView::contiguous(x.data, DType::kBF16, {T, H}, Device::cuda(dev));
        a.topk_idx = topk;
        a.use_fp8 = p.use_fp8;
        a.round_scale = p.round_scale;
        a.use_ue8m0 = p.use_ue8m0;
        a.return_recv_hook = hooks[st.b];
        a.stream = stream;
        d[st.b] = buf.ll_dispatch(a, alloc);
        overwrite(std::move(x));
        overwrite(std::move(topk));
        break;
      }
      case Ev::kDh:
        d[st.b].hook();
        break;
      case Ev::kC: {
        int64_t stride = H;
        Tensor y = upload_rows(bs[st.b]->y[r], L * RT, H, false, dev, &stride);
        Tensor topk = upload_topk(in.topk_idx, T, K, c.topk_i32, dev);
        Tensor w = gpu_testing::to_device(in.topk_weights, DType::kF32, {T, K}, dev);
        LlCombineArgs a;
        a.handle = &d[st.b].handle;
        a.y = TensorView::contiguous(y.data, DType::kBF16, {L, RT, H}, Device::cuda(dev));
        a.topk_idx = topk;
        a.topk_weights = w;
        a.return_recv_hook = hooks[st.b];
        a.stream = stream;
        cr[st.b] = buf.ll_combine(a, alloc);
        overwrite(std::move(y));
        overwrite(std::move(topk));
        overwrite(std::move(w));
        break;
      }
      case Ev::kCh:
        cr[st.b].hook();
        break;
    }
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  buf.check();
  for (int b = 0; b < 2; ++b) {
    std::vector<std::vector<uint8_t>> hk;
    std::string e = testing::check_ll_dispatch(p, bs[b]->want[r], host_ll_dispatch(d[b], hk));
    if (e.empty()) e = check_out(p, bs[b]->want_out[r], cr[b].out);
    if (!e.empty()) return "rank " + std::to_string(r) + " batch " + std::to_string(b) + ": " + e;
  }
  return "";
}

// Every schedule of two_batch_schedules for every hook combination, fp8 and bf16, on one Buffer
// per dtype (the schedules follow each other on it). Returns the failures (printed).
int two_batch_lifetime(int R, bool one_gpu) {
  std::vector<Case> cases;
  for (bool fp8 : {true, false}) {
    Case c;
    c.p = {R, 16, 512, 4, 4 * R, fp8, false, false};
    c.routing = Routing::kUniform;
    c.num_batches = 2;
    c.seed = 880000 + 10 * R + fp8;
    cases.push_back(c);
  }
  std::vector<std::vector<Batch>> data;
  for (const Case& c : cases) data.push_back(testing::make_ll_batches(c));
  const auto body = [&](const Group& g) {
    const RankStream rs(cudaStreamNonBlocking);
    int bad = 0, runs = 0;
    for (size_t i = 0; i < cases.size() && bad == 0; ++i) {
      Buffer buf(g, cases[i].p.moe_shape(), ll_only());
      const Batch* bs[2] = {&data[i][0], &data[i][1]};
      for (int hk = 0; hk < 4 && bad == 0; ++hk) {
        const bool hooks[2] = {(hk & 1) != 0, (hk & 2) != 0};
        for (const std::vector<Step>& sched : two_batch_schedules(hooks[0], hooks[1])) {
          std::string err;
          try {
            err = run_schedule(cases[i], bs, sched, hooks, buf, g, rs.get());
          } catch (const std::exception& e) {
            err = std::string("exception: ") + e.what();
          }
          ++runs;
          if (!err.empty()) {
            std::fprintf(stderr, "%s [%s]: %s\n", cases[i].describe().c_str(),
                         describe(sched).c_str(), err.c_str());
            ++bad;
            break;
          }
        }
      }
    }
    if (g.rank() == 0) std::printf("R = %d: %d schedules run, %d failed\n", g.size(), runs, bad);
    return bad;
  };
  return run_ranks(R, one_gpu, body);
}

TEST(LlGpuLifetime, TwoBatchesInFlightInputsOverwrittenAfterEachCall) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(two_batch_lifetime(1, false), 0);
}

class LlOneGpuLifetime : public ::testing::TestWithParam<int> {};

TEST_P(LlOneGpuLifetime, TwoBatchesInFlightInputsOverwrittenAfterEachCall) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(two_batch_lifetime(GetParam(), true), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlOneGpuLifetime, ::testing::Values(2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

// ---- CUDA graphs ---------------------------------------------------------------------------

// dispatch + combine captured once without hooks (fp8, UE8M0, stats, y copied into the zero-copy
// buffer inside the graph), once with both hooks (bf16, y from the caller), once without hooks
// with use_logfmt (fp8, the zero-copy buffer encoded in place at every replay) and once without
// hooks in NVFP4 with x_global_scale a device tensor rewritten before every replay (the kernel
// reads the replay's g), each replayed kReplays times on new inputs written into the captured
// input buffers; every replay checked. R ranks, one GPU each (R = 1: the graph paths on a
// one-GPU machine).
int graph_replays(int R) {
  constexpr int kReplays = 100, kModes = 4;
  Case cases[kModes];  // [2]: use_logfmt, zero_copy encoded in place; [3]: NVFP4
  cases[0].p = {R, 32, 256, 4, 8 * R, true, true, true};
  cases[1].p = {R, 32, 256, 4, 8 * R, false, false, false};
  cases[2].p = {R, 32, 256, 4, 8 * R, true, false, false, true};
  cases[3].p = {R, 32, 256, 4, 8 * R, false, false, false};
  cases[3].p.use_nvfp4 = true;
  const std::vector<Routing> all = testing::all_routings();
  std::vector<Batch> data[kModes];
  std::vector<float> gvals;  // NVFP4: replay i's g
  std::mt19937_64 rng(4242);
  for (int m = 0; m < kModes; ++m) {
    cases[m].fixed_tokens.assign(R, 32);
    cases[m].fixed_tokens[0] = 29;
    for (int i = 0; i <= kReplays; ++i) {  // batch 0: the eager warm-up call
      cases[m].routing = all[(i + m) % all.size()];
      if (cases[m].p.use_nvfp4) {
        cases[m].p.global_scale = std::ldexp(1.0f + (i % 7) / 8.0f, i % 11 - 3);
        gvals.push_back(cases[m].p.global_scale);
      }
      data[m].push_back(testing::make_ll_batch(cases[m], rng));
    }
  }
  const int rc = run_cuda_ranks(R, [&](const Group& g) {
    const int r = g.rank(), dev = r;
    const LlProblem& p0 = cases[0].p;
    const int K = p0.top_k, L = p0.num_local_experts();
    const int64_t H = p0.hidden, RT = p0.rows_per_expert(), T = cases[0].fixed_tokens[r];
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Buffer buf(g, p0.moe_shape(), ll_only());
    // Captured inputs and outputs: allocated before capture; the allocator hands out one tensor
    // per (dtype, shape) (created by the eager warm-up call).
    auto pool = std::make_shared<std::map<std::string, Tensor>>();
    const Allocator alloc = [pool](DType dt, const std::vector<int64_t>& s, Device d) {
      std::string key = dtype_name(dt);
      for (int64_t v : s) key.append(",").append(std::to_string(v));
      auto it = pool->find(key);
      if (it == pool->end()) it = pool->emplace(key, default_allocator()(dt, s, d)).first;
      return it->second;
    };
    Tensor x = default_allocator()(DType::kBF16, {T, H}, Device::cuda(dev));
    Tensor topk = default_allocator()(DType::kI64, {T, K}, Device::cuda(dev));
    Tensor w = default_allocator()(DType::kF32, {T, K}, Device::cuda(dev));
    Tensor y = default_allocator()(DType::kBF16, {L, RT, H}, Device::cuda(dev));
    Tensor out = default_allocator()(DType::kBF16, {T, H}, Device::cuda(dev));
    Tensor stats = default_allocator()(DType::kI32, {L}, Device::cuda(dev));
    Tensor gscale = default_allocator()(DType::kF32, {1}, Device::cuda(dev));
    int bad = 0;
    {
      for (int m = 0; m < kModes && bad == 0; ++m) {
        const bool hook = m == 1;
        const LlProblem& p = cases[m].p;
        int batch = 0;  // the batch upload() wrote
        auto upload = [&](const Batch& b) {
          const LlRankInput& in = b.in[r];
          batch = static_cast<int>(&b - data[m].data());
          if (p.use_nvfp4)
            CUDA_OK(cudaMemcpyAsync(gscale.data, &gvals[batch], 4, cudaMemcpyHostToDevice, stream));
          CUDA_OK(cudaMemcpyAsync(x.data, in.x.data(), 2 * T * H, cudaMemcpyHostToDevice, stream));
          CUDA_OK(cudaMemcpyAsync(topk.data, in.topk_idx.data(), 8 * T * K, cudaMemcpyHostToDevice,
                                  stream));
          CUDA_OK(cudaMemcpyAsync(w.data, in.topk_weights.data(), 4 * T * K, cudaMemcpyHostToDevice,
                                  stream));
          CUDA_OK(cudaMemcpyAsync(y.data, b.y[r].data(), 2 * L * RT * H, cudaMemcpyHostToDevice,
                                  stream));
          CUDA_OK(cudaMemsetAsync(stats.data, 0, 4 * L, stream));
          CUDA_OK(cudaMemsetAsync(out.data, 0xFF, out.nbytes(), stream));
          for (auto& [key, t] : *pool) CUDA_OK(cudaMemsetAsync(t.data, 0xFF, t.nbytes(), stream));
        };
        LlDispatchArgs da;
        da.x = x;
        da.topk_idx = topk;
        da.use_fp8 = p.use_fp8;
        da.round_scale = p.round_scale;
        da.use_ue8m0 = p.use_ue8m0;
        da.use_nvfp4 = p.use_nvfp4;
        if (p.use_nvfp4) da.x_global_scale = gscale;
        da.return_recv_hook = hook;
        if (!hook) da.cumulative_local_expert_recv_stats = stats;
        da.stream = stream;
        // One round: dispatch (+ hook), the "MoE" output, combine (+ hook); returns the handle.
        auto round = [&](LlDispatchResult& d) {
          d = buf.ll_dispatch(da, alloc);
          if (hook) d.hook();
          LlCombineArgs ca;
          ca.topk_idx = topk;
          ca.topk_weights = w;
          ca.handle = &d.handle;
          ca.out = out;
          ca.return_recv_hook = hook;
          ca.use_logfmt = p.use_logfmt;
          ca.stream = stream;
          if (!hook) {
            TensorView v = buf.ll_next_combine_buffer(d.handle);
            CUDA_OK(cudaMemcpyAsync(v.data, y.data, y.nbytes(), cudaMemcpyDeviceToDevice, stream));
            ca.zero_copy = true;
          } else {
            ca.y = y;
          }
          LlCombineResult c = buf.ll_combine(ca, alloc);
          if (hook) c.hook();
        };
        auto verify = [&](const Batch& b, const LlDispatchResult& d, const std::string& what) {
          std::string err;
          try {
            buf.check();
            std::vector<std::vector<uint8_t>> keep;
            err = testing::check_ll_dispatch(p, b.want[r], host_ll_dispatch(d, keep));
            const std::string cerr = check_out(p, b.want_out[r], out);
            if (!cerr.empty()) err += (err.empty() ? "" : "\n") + cerr;
            if (!hook) {
              const std::vector<int32_t> got = gpu_testing::to_host<int32_t>(stats);
              for (int l = 0; l < L; ++l)
                if (got[l] != b.want[r].recv_count[l] && err.empty())
                  err = "stats[" + std::to_string(l) + "] = " + std::to_string(got[l]);
            }
          } catch (const std::exception& e) {
            err = std::string("exception: ") + e.what();
          }
          if (!err.empty()) {
            ++bad;
            std::fprintf(stderr, "rank %d %s: %s\n", r, what.c_str(), err.c_str());
          }
        };
        // Eager warm-up (fills the pool), checked too.
        upload(data[m][0]);
        LlDispatchResult d0;
        round(d0);
        CUDA_OK(cudaStreamSynchronize(stream));
        verify(data[m][0], d0, hook ? "eager (hooks)" : "eager");
        // Capture.
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        LlDispatchResult dg;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        round(dg);
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        for (int i = 1; i <= kReplays && bad < 3; ++i) {
          upload(data[m][i]);
          CUDA_OK(cudaGraphLaunch(exec, stream));
          CUDA_OK(cudaStreamSynchronize(stream));
          verify(data[m][i], dg,
                 std::string(hook ? "hooks" : "no hooks") + " replay " + std::to_string(i));
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
    }
    cudaStreamDestroy(stream);
    return bad;
  });
  return rc;
}

TEST(LlGpuGraph, CaptureReplayedOnNewInputs) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(graph_replays(2), 0);
}

TEST(LlGpuGraph, CaptureReplayedOnNewInputsOneRank) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(graph_replays(1), 0);
}

// ---- errors (docs/semantics.md §4) -------------------------------------------------------

// A small one-batch problem for error tests.
Case small_case(int R, uint64_t seed) {
  Case c;
  c.p = {R, 16, 256, 4, 4 * R, true, false, false};
  c.fixed_tokens.assign(R, 11);
  c.seed = seed;
  return c;
}

// Rank 0 passes `dispatch_ids` to ll_dispatch and `combine_ids` to a zero_copy ll_combine, rank
// 1 its routing of `dropped`; after each call check() raises InvalidArgument on rank 0 naming
// 'topk_idx', the operation and every needle of that call, or raises nothing when the call has
// no needles (and never on rank 1); both outputs are `dropped`'s oracle; then a clean case of `c`
// on a new Buffer. Two GPUs, or (one_gpu) two ranks sharing GPU 0.
int routing_error_case(bool one_gpu, const Case& c, const Batch& dropped,
                       const std::vector<int64_t>& dispatch_ids,
                       const std::vector<int64_t>& combine_ids,
                       const std::vector<std::string>& dispatch_needles,
                       const std::vector<std::string>& combine_needles) {
  const std::vector<Batch> clean = testing::make_ll_batches(c);
  const int K = c.p.top_k;
  const auto body = [&](const Group& g) {
    const int r = g.rank(), dev = one_gpu ? 0 : r;
    const int64_t H = c.p.hidden, T = dropped.in[r].num_tokens;
    int failures = 0;
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
      ++failures;
    };
    auto expect = [&](Buffer& buf, const char* op, const std::vector<std::string>& needles) {
      const bool raise = r == 0 && !needles.empty();
      try {
        buf.check();
        if (raise) fail(std::string("check() after ") + op + " did not raise");
      } catch (const Error& e) {
        const std::string m = e.what();
        bool ok = raise && e.code() == ErrorCode::kInvalidArgument &&
                  m.find("'topk_idx'") != std::string::npos && m.find(op) != std::string::npos;
        for (const std::string& n : needles) ok = ok && m.find(n) != std::string::npos;
        if (!ok) fail("unexpected error: " + m);
      }
    };
    std::optional<RankStream> rs(std::in_place);
    const cudaStream_t stream = rs->get();
    Buffer buf(g, c.p.moe_shape(), ll_only());
    Tensor x = gpu_testing::to_device(dropped.in[r].x, DType::kBF16, {T, H}, dev);
    Tensor topk = upload_topk(r == 0 ? dispatch_ids : dropped.in[r].topk_idx, T, K, false, dev);
    Tensor ctopk = upload_topk(r == 0 ? combine_ids : dropped.in[r].topk_idx, T, K, false, dev);
    Tensor w = gpu_testing::to_device(dropped.in[r].topk_weights, DType::kF32, {T, K}, dev);
    LlDispatchArgs da;
    da.x = x;
    da.topk_idx = topk;
    da.use_fp8 = c.p.use_fp8;
    da.stream = stream;
    LlDispatchResult d = buf.ll_dispatch(da, poison_allocator());
    CUDA_OK(cudaStreamSynchronize(stream));
    expect(buf, "ll_dispatch", dispatch_needles);
    std::vector<std::vector<uint8_t>> keep;
    std::string err = testing::check_ll_dispatch(c.p, dropped.want[r], host_ll_dispatch(d, keep));
    if (!err.empty()) fail("dispatch: " + err);
    TensorView v = buf.ll_next_combine_buffer(d.handle);
    gpu_testing::upload_on_rank_stream(v.data, dropped.y[r].data(), dropped.y[r].size() * 2,
                                       stream);
    LlCombineArgs ca;
    ca.topk_idx = ctopk;
    ca.topk_weights = w;
    ca.handle = &d.handle;
    ca.zero_copy = true;
    ca.stream = stream;
    LlCombineResult cr = buf.ll_combine(ca, poison_allocator());
    CUDA_OK(cudaStreamSynchronize(stream));
    expect(buf, "ll_combine", combine_needles);
    err = check_out(c.p, dropped.want_out[r], cr.out);
    if (!err.empty()) fail("combine: " + err);
    rs.reset();
    // A clean case on a new buffer (and, with GPUs of their own, a new stream) afterwards.
    const RankStream s2;
    err = run_rank(c, clean, g, s2.get());
    if (!err.empty()) fail("clean case after the error: " + err);
    return failures;
  };
  return run_ranks(2, one_gpu, body);
}

// Out-of-range expert ids are found on the device and raised as InvalidArgument by the next
// call (check()); the selection is dropped, the collective completes and the buffer stays usable.
// Ids E and -7 on rank 0: InvalidArgument from ll_dispatch and from ll_combine (check()), the
// outputs are the oracle's with those selections dropped, then a clean case on a new Buffer.
int bad_expert_case(bool one_gpu) {
  const Case c = small_case(2, 31);
  std::mt19937_64 rng(32);
  Batch dropped = testing::make_ll_batch(c, rng);
  const int K = c.p.top_k;
  dropped.in[0].topk_idx[3 * K + 2] = -1;
  dropped.in[0].topk_idx[9 * K + 0] = -1;
  // What rank 0's routing means once the bad ids are dropped.
  testing::finish_ll_batch(c, dropped, rng);
  std::vector<int64_t> bad = dropped.in[0].topk_idx;  // what rank 0 passes
  bad[3 * K + 2] = c.p.num_experts;
  bad[9 * K + 0] = -7;
  return routing_error_case(one_gpu, c, dropped, bad, bad, {"'topk_idx'"}, {"'topk_idx'"});
}

// Ranks that disagree on use_nvfp4, then on the NVFP4 global scale (a device tensor on rank 0, a
// host value on rank 1): the receive finds it on the device; check() raises InvalidArgument on
// every rank naming the option and both ranks' values; ll_clean, then an agreeing NVFP4 case is
// exact. Two GPUs, or (one_gpu) two ranks sharing GPU 0.
int nvfp4_disagree_case(bool one_gpu) {
  const Case c = small_case(2, 41);
  Case agree = c;
  agree.p.use_fp8 = false;
  agree.p.use_nvfp4 = true;
  agree.p.global_scale = 3.0f;
  const std::vector<Batch> clean = testing::make_ll_batches(agree);
  const auto body = [&](const Group& g) {
    const int r = g.rank(), dev = one_gpu ? 0 : r;
    const int64_t H = c.p.hidden, T = 11;
    const int K = c.p.top_k;
    int failures = 0;
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
      ++failures;
    };
    const RankStream rs;
    Buffer buf(g, c.p.moe_shape(), ll_only());
    Tensor x = gpu_testing::to_device(clean[0].in[r].x, DType::kBF16, {T, H}, dev);
    Tensor topk = upload_topk(clean[0].in[r].topk_idx, T, K, false, dev);
    Tensor gs = gpu_testing::to_device(std::vector<float>{2.0f}, DType::kF32, {1}, dev);
    auto expect_differs = [&](LlDispatchArgs da, std::initializer_list<const char*> needles) {
      da.x = x;
      da.topk_idx = topk;
      da.use_fp8 = false;
      da.stream = rs.get();
      try {
        buf.ll_dispatch(da, poison_allocator());
        CUDA_OK(cudaStreamSynchronize(rs.get()));
        buf.check();
        fail(std::string("no error for ") + *needles.begin());
      } catch (const Error& e) {
        const std::string m = e.what();
        bool ok = e.code() == ErrorCode::kInvalidArgument;
        for (const char* n : needles) ok = ok && m.find(n) != std::string::npos;
        if (!ok) fail("unexpected error: " + m);
      }
      buf.ll_clean();
    };
    LlDispatchArgs a;
    a.use_nvfp4 = r == 0;
    if (r == 0) a.x_global_scale = gs;
    expect_differs(a, {"'use_nvfp4'", "rank 0 has true", "rank 1 has false"});
    a.use_nvfp4 = true;
    if (r == 1) a.global_scale = 0.5f;
    expect_differs(a, {"'x_global_scale'", "rank 0 has 2", "rank 1 has 0.5"});
    const std::string err = run_rank(agree, clean, g, rs.get());
    if (!err.empty()) fail("agreeing NVFP4 case after the errors: " + err);
    return failures;
  };
  return run_ranks(2, one_gpu, body);
}

TEST(LlGpuErrors, Nvfp4DisagreementIsInvalidArgument) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(nvfp4_disagree_case(false), 0);
}

TEST(LlGpuErrors, Nvfp4DisagreementIsInvalidArgumentOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(nvfp4_disagree_case(true), 0);
}

TEST(LlGpuErrors, BadExpertIdIsInvalidArgumentAndDropped) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(bad_expert_case(false), 0);
}

TEST(LlGpuErrors, BadExpertIdIsInvalidArgumentAndDroppedOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(bad_expert_case(true), 0);
}

// A combine whose topk_idx is not the dispatch's: rank 0 moves one selection of token 3 to an
// expert the dispatch did not deliver it to (another rank's, so the rank that checks it waited
// for it), rank 1 passes its own. check() raises InvalidArgument on rank 0 naming 'topk_idx' and
// the expert; the other selections are summed (token 3 without the moved one, compared with the
// oracle of the routing without it), and a checked round on a new Buffer afterwards is exact.
int combine_route_mismatch_case(bool one_gpu) {
  const Case c = small_case(2, 61);
  const int K = c.p.top_k, E = c.p.num_experts, L = E / 2;
  std::mt19937_64 rng(62);
  Batch dropped = testing::make_ll_batch(c, rng);
  // Token 3 of rank 0: its selection k = 1 moves to an expert of the other rank than its own.
  const int64_t was = dropped.in[0].topk_idx[3 * K + 1];
  int64_t moved = was < 0 ? 0 : ((was / L + 1) % 2) * L + (was % L);
  for (int k = 0; k < K; ++k)
    if (dropped.in[0].topk_idx[3 * K + k] == moved) moved = (moved + 1) % E;  // not in the row
  // The routing the outputs follow: the selection dropped.
  dropped.in[0].topk_idx[3 * K + 1] = -1;
  testing::finish_ll_batch(c, dropped, rng);
  std::vector<int64_t> ids = dropped.in[0].topk_idx;
  ids[3 * K + 1] = moved;
  return routing_error_case(one_gpu, c, dropped, dropped.in[0].topk_idx, ids, {},
                            {"expert " + std::to_string(moved) + " at [3, 1]"});
}

TEST(LlGpuErrors, CombineRouteNotTheDispatchsIsInvalidArgument) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(combine_route_mismatch_case(false), 0);
}

TEST(LlGpuErrors, CombineRouteNotTheDispatchsIsInvalidArgumentOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(combine_route_mismatch_case(true), 0);
}

// A peer that never calls ll_dispatch: the waiting rank's kernel gives up after the group
// timeout, the next call raises Timeout (naming the operation and the peer), later calls say the
// ll state is unusable; ll_clean() on every rank resets it and a checked round on the same
// Buffer works again. Two GPUs, or (one_gpu) two ranks sharing GPU 0.
int missing_peer_case(bool one_gpu) {
  const Case c = small_case(2, 41);
  const std::vector<Batch> data = testing::make_ll_batches(c);
  GroupOptions options;
  options.timeout = std::chrono::milliseconds(1500);
  const std::string done_path =
      "/tmp/epx-ll-timeout-" + std::to_string(getpid()) + (one_gpu ? "-1gpu" : "");
  std::remove(done_path.c_str());
  const auto body = [&](const Group& g) {
    const int r = g.rank(), dev = one_gpu ? 0 : r;
    const int64_t H = c.p.hidden, T = 11;
    int failures = 0;
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
      ++failures;
    };
    const RankStream rs;
    const cudaStream_t stream = rs.get();
    {
      Buffer buf(g, c.p.moe_shape(), ll_only());
      if (r == 1) {
        for (int i = 0; i < 3000 && access(done_path.c_str(), F_OK) != 0; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
      } else {
        Tensor x = gpu_testing::to_device(data[0].in[0].x, DType::kBF16, {T, H}, dev);
        Tensor topk = upload_topk(data[0].in[0].topk_idx, T, c.p.top_k, false, dev);
        LlDispatchArgs da;
        da.x = x;
        da.topk_idx = topk;
        da.stream = stream;
        const auto start = std::chrono::steady_clock::now();
        buf.ll_dispatch(da, gpu_testing::device_allocator());
        CUDA_OK(cudaStreamSynchronize(stream));
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        try {
          buf.check();
          fail("no Timeout");
        } catch (const Error& e) {
          const std::string m = e.what();
          if (e.code() != ErrorCode::kTimeout || m.find("ll_dispatch") == std::string::npos ||
              m.find("rank 1") == std::string::npos)
            fail("unexpected error " + m);
        }
        if (waited < 1.2 || waited > 10)
          fail("the kernel gave up after " + std::to_string(waited) + " s");
        try {
          buf.ll_dispatch(da, gpu_testing::device_allocator());
          fail("ll_dispatch after a timeout did not raise");
        } catch (const Error& e) {
          if (std::string(e.what()).find("unusable") == std::string::npos)
            fail(std::string("unexpected error ") + e.what());
        }
        std::fclose(std::fopen(done_path.c_str(), "w"));
      }
      buf.ll_clean();
      // The same buffer works again: one checked round.
      std::vector<std::vector<uint8_t>> keep;
      Tensor x = gpu_testing::to_device(data[0].in[r].x, DType::kBF16, {T, H}, dev);
      Tensor topk = upload_topk(data[0].in[r].topk_idx, T, c.p.top_k, false, dev);
      Tensor w =
          gpu_testing::to_device(data[0].in[r].topk_weights, DType::kF32, {T, c.p.top_k}, dev);
      LlDispatchArgs da;
      da.x = x;
      da.topk_idx = topk;
      da.use_fp8 = c.p.use_fp8;
      da.stream = stream;
      LlDispatchResult d = buf.ll_dispatch(da, poison_allocator());
      Tensor y = gpu_testing::to_device(data[0].y[r], DType::kBF16,
                                        {c.p.num_local_experts(), c.p.rows_per_expert(), H}, dev);
      LlCombineArgs ca;
      ca.y = y;
      ca.topk_idx = topk;
      ca.topk_weights = w;
      ca.handle = &d.handle;
      ca.stream = stream;
      LlCombineResult cr = buf.ll_combine(ca, poison_allocator());
      CUDA_OK(cudaStreamSynchronize(stream));
      buf.check();
      std::string err = testing::check_ll_dispatch(c.p, data[0].want[r], host_ll_dispatch(d, keep));
      err += check_out(c.p, data[0].want_out[r], cr.out);
      if (!err.empty()) fail("round after ll_clean: " + err);
    }
    return failures;
  };
  const int rc = run_ranks(2, one_gpu, body, options);
  std::remove(done_path.c_str());
  return rc;
}

TEST(LlGpuErrors, MissingPeerIsTimeoutAndLlCleanRecovers) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(missing_peer_case(false), 0);
}

TEST(LlGpuErrors, MissingPeerIsTimeoutAndLlCleanRecoversOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(missing_peer_case(true), 0);
}

void expect_error(const std::function<void()>& f, ErrorCode code, const char* needle, int* failures,
                  const char* what) {
  try {
    f();
    std::fprintf(stderr, "%s: no error\n", what);
    ++*failures;
  } catch (const Error& e) {
    if (e.code() != code || std::string(e.what()).find(needle) == std::string::npos) {
      std::fprintf(stderr, "%s: unexpected error %s\n", what, e.what());
      ++*failures;
    }
  }
}

// Host-side misuse of hooks and slots (the cpu backend's rules), T > T_max; then a checked
// round on the same buffer.
TEST(LlGpuErrors, HookMisuseAndCapacity) {
  EPX_REQUIRE_GPUS(1);
  const Case c = small_case(1, 51);
  const std::vector<Batch> data = testing::make_ll_batches(c);
  const int rc = run_cuda_ranks(1, [&](const Group& g) {
    const int64_t H = c.p.hidden, T = 11;
    const int K = c.p.top_k;
    int failures = 0;
    Buffer buf(g, c.p.moe_shape(), ll_only());
    Tensor x = gpu_testing::to_device(data[0].in[0].x, DType::kBF16, {T, H}, 0);
    Tensor topk = upload_topk(data[0].in[0].topk_idx, T, K, false, 0);
    Tensor w = gpu_testing::to_device(data[0].in[0].topk_weights, DType::kF32, {T, K}, 0);
    LlDispatchArgs da;
    da.x = x;
    da.topk_idx = topk;
    da.return_recv_hook = true;
    LlDispatchResult a = buf.ll_dispatch(da), b = buf.ll_dispatch(da);
    expect_error([&] { buf.ll_dispatch(da); }, ErrorCode::kInvalidArgument, "still holds",
                 &failures, "third dispatch");
    a.hook();
    expect_error([&] { a.hook(); }, ErrorCode::kInvalidArgument, "second time", &failures,
                 "hook twice");
    b.hook();
    LlCombineArgs ca;
    ca.topk_idx = topk;
    ca.topk_weights = w;
    ca.handle = &a.handle;
    ca.zero_copy = true;
    ca.return_recv_hook = true;
    LlCombineResult cr = buf.ll_combine(ca);
    expect_error([&] { buf.ll_combine(ca); }, ErrorCode::kInvalidArgument, "still holds", &failures,
                 "second combine on a slot");
    expect_error([&] { buf.ll_next_combine_buffer(a.handle); }, ErrorCode::kInvalidArgument,
                 "still holds", &failures, "next_combine_buffer on a busy slot");
    cr.hook();
    LlDispatchResult d = buf.ll_dispatch(da);
    buf.ll_clean();
    expect_error([&] { d.hook(); }, ErrorCode::kInvalidArgument, "ll_clean", &failures,
                 "hook after ll_clean");
    std::vector<uint16_t> big_x((c.p.max_tokens + 1) * H, 0x3F80);
    std::vector<int64_t> big_topk((c.p.max_tokens + 1) * K, 0);
    Tensor bx = gpu_testing::to_device(big_x, DType::kBF16, {c.p.max_tokens + 1, H}, 0);
    Tensor bt = gpu_testing::to_device(big_topk, DType::kI64, {c.p.max_tokens + 1, K}, 0);
    LlDispatchArgs big;
    big.x = bx;
    big.topk_idx = bt;
    expect_error([&] { buf.ll_dispatch(big); }, ErrorCode::kOutOfCapacity, "T_max", &failures,
                 "T > T_max");
    CUDA_OK(cudaDeviceSynchronize());
    buf.check();
    // A checked round on the same buffer.
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreate(&stream));
    da.return_recv_hook = false;
    da.use_fp8 = c.p.use_fp8;
    da.stream = stream;
    LlDispatchResult e = buf.ll_dispatch(da, poison_allocator());
    TensorView v = buf.ll_next_combine_buffer(e.handle);
    CUDA_OK(cudaMemcpyAsync(v.data, data[0].y[0].data(), data[0].y[0].size() * 2,
                            cudaMemcpyHostToDevice, stream));
    ca.handle = &e.handle;
    ca.return_recv_hook = false;
    ca.stream = stream;
    LlCombineResult ce = buf.ll_combine(ca, poison_allocator());
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    std::vector<std::vector<uint8_t>> keep;
    std::string err = testing::check_ll_dispatch(c.p, data[0].want[0], host_ll_dispatch(e, keep));
    err += check_out(c.p, data[0].want_out[0], ce.out);
    if (!err.empty()) {
      std::fprintf(stderr, "round after misuse: %s\n", err.c_str());
      ++failures;
    }
    cudaStreamDestroy(stream);
    return failures;
  });
  EXPECT_EQ(rc, 0);
}

// ---- lifetime ------------------------------------------------------------------------------

// Ranks destroy their Buffers at different points (Python's garbage collector does): rank 0 drops
// the round's extra Buffer before the next Buffer is made, rank 1 after that Buffer's dispatch and
// combine. Destruction is local, so the collectives still pair up and every round matches the
// oracle (before: the destruction barrier of rank 0 met rank 1's allocation, and the group timed
// out). Released windows are freed by a later allocation: the transport's window count stays
// bounded instead of growing by the Buffers of every round.
TEST(LlGpuLifetime, BuffersDestroyedAtDifferentTimesOnEachRank) {
  EPX_REQUIRE_GPUS(2);
  const Case c = small_case(2, 77);
  const std::vector<Batch> batches = testing::make_ll_batches(c);
  const int rc = run_cuda_ranks(2, [&](const Group& g) {
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const int64_t base = detail::nccl_window_count(*g.transport());
    BufferConfig both;  // ht and ll regions: two windows
    int bad = 0;
    for (int round = 0; round < 4 && bad == 0; ++round) {
      auto extra = std::make_unique<Buffer>(g, c.p.moe_shape(), both);
      if (g.rank() == 0) extra.reset();
      std::string err;
      try {
        err = run_rank(c, batches, g, stream);  // makes, uses and drops its own Buffer
      } catch (const std::exception& e) {
        err = std::string("exception: ") + e.what();
      }
      extra.reset();
      if (!err.empty()) {
        std::fprintf(stderr, "round %d: %s\n", round, err.c_str());
        ++bad;
      }
    }
    // One more collective allocation frees what every rank released; only its own window is left.
    { Buffer last(g, c.p.moe_shape(), ll_only()); }
    const int64_t left = detail::nccl_window_count(*g.transport());
    if (base < 0 || left != base + 1) {
      std::fprintf(stderr, "rank %d: %lld windows before, %lld after (expected %lld)\n", g.rank(),
                   static_cast<long long>(base), static_cast<long long>(left),
                   static_cast<long long>(base + 1));
      ++bad;
    }
    cudaStreamDestroy(stream);
    return bad;
  });
  EXPECT_EQ(rc, 0);
}

// ---- memory (targets: docs/perf.md §3) -------------------------------------------------------

// The standard workload (EP2, T_max = 128, H = 7168, K = 8, E = 256) within 1 GB per rank
// (DeepEP: 1.9 GB). Host arithmetic only.
TEST(LlGpuMemory, StandardWorkloadWithinOneGigabyte) {
  const MoeShape s{7168, 8, 256, 128};
  const size_t bytes = Buffer::bytes_needed(Mode::kLl, s, 2, Backend::kCuda);
  EXPECT_LE(bytes, size_t{1000} * 1000 * 1000);
  // The zero-copy combine buffers alone: 2 slots of [L, R * T_max, H] bf16.
  EXPECT_GE(bytes, size_t{2} * 128 * 256 * 7168 * 2);
}

TEST(LlGpuMemory, BytesAllocatedMatchBytesNeeded) {
  EPX_REQUIRE_GPUS(1);
  const MoeShape s{1024, 8, 64, 64};
  const int rc = run_cuda_ranks(1, [&](const Group& g) {
    Buffer buf(g, s, ll_only());
    return buf.bytes_allocated() == Buffer::bytes_needed(Mode::kLl, s, 1, Backend::kCuda) ? 0 : 1;
  });
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace epx
