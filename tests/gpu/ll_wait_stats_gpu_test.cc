// GPU tier: wait-cost statistics of the cuda ll backend (docs/semantics.md §2.5):
// dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats, int64 [R] on the device, in
// nanoseconds (%globaltimer), accumulated per source rank by the receive half.
//
//   - Straggler: after a group barrier the last rank makes each call (dispatch, combine)
//   kWaitDelayMs
//     late; every other rank must add at least half of that to the straggler's element, and
//     little (< a quarter) everywhere else; a combine adds exactly 0 to a rank's own element (it
//     does not wait for its own rows). Two rounds on the same tensors (started at non-zero
//     values): the second accumulates on the first; the second round goes through
//     return_recv_hook (the hook, called right after the call, is the receive that waits). Guard
//     elements around the [R] views stay. On R ranks sharing GPU 0 (R = 2, 4, 8: every rank's
//     CTAs co-resident) and on two GPUs.
//   - R = 1: the own source costs little on dispatch and nothing on combine; with a hook called
//     kWaitDelayMs after the call the sleep is not counted (the data was there when the receive
//     began); the host checks (dtype, shape, contiguity, device) name the argument.
// Skipped, with the reason, where there is no GPU (or too few).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"
#include "gpu/gpu_support.h"
#include "support/wait_stats.h"

namespace epx {
namespace {

using gpu_testing::RankStream;
using testing::kWaitDelayMs;
using testing::kWaitDelayNs;
using testing::show_values;

constexpr int64_t kH = testing::kWaitHidden, kTMax = testing::kWaitMaxTokens;
constexpr int kK = testing::kWaitTopK;
constexpr int64_t kGuard = testing::kWaitGuard;
constexpr int64_t kTokens = 5;
const BufferConfig kLlOnly{/*enable_ht=*/false, /*enable_ll=*/true};

// One rank's device inputs: kTokens tokens of 1.0, token t selecting experts (t + k) % E,
// weights 0.5, y of 1.0 (so every combined element is 4 * 0.5 = 2.0, bf16 0x4000).
struct Inputs {
  int R, E, dev;
  Tensor x, topk, w, y;
  Inputs(int num_ranks, int device) : R(num_ranks), E(4 * num_ranks), dev(device) {
    std::vector<int64_t> ids(kTokens * kK);
    for (int64_t t = 0; t < kTokens; ++t)
      for (int k = 0; k < kK; ++k) ids[t * kK + k] = (t + k) % E;
    x = gpu_testing::to_device(std::vector<uint16_t>(kTokens * kH, 0x3F80), DType::kBF16,
                               {kTokens, kH}, dev);
    topk = gpu_testing::to_device(ids, DType::kI64, {kTokens, kK}, dev);
    w = gpu_testing::to_device(std::vector<float>(kTokens * kK, 0.5f), DType::kF32, {kTokens, kK},
                               dev);
    const int64_t L = E / R;
    y = gpu_testing::to_device(std::vector<uint16_t>(L * R * kTMax * kH, 0x3F80), DType::kBF16,
                               {L, R * kTMax, kH}, dev);
  }
  MoeShape shape() const { return MoeShape{kH, kK, E, kTMax}; }
  LlDispatchArgs dispatch_args(cudaStream_t stream) const {
    LlDispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.use_fp8 = false;
    a.stream = stream;
    return a;
  }
  LlCombineArgs combine_args(const LlHandle& h, cudaStream_t stream) const {
    LlCombineArgs a;
    a.y = y;
    a.topk_idx = topk;
    a.topk_weights = w;
    a.handle = &h;
    a.stream = stream;
    return a;
  }
};

// An int64 [R] device view with a guard element on each side, started at first + 1000 * s.
struct Stats {
  int R, dev;
  Tensor storage;
  Stats(int num_ranks, int device, int64_t first) : R(num_ranks), dev(device) {
    std::vector<int64_t> v(R + 2, kGuard);
    for (int s = 0; s < R; ++s) v[1 + s] = first + 1000 * s;
    storage = gpu_testing::to_device(v, DType::kI64, {R + 2}, dev);
  }
  TensorView view() const {
    return TensorView::contiguous(static_cast<int64_t*>(storage.data) + 1, DType::kI64, {R},
                                  Device::cuda(dev));
  }
  // The R values (after the rank's stream / device synchronised); "" or what is wrong with the
  // guards in *guards.
  std::vector<int64_t> values(std::string* guards = nullptr) const {
    const std::vector<int64_t> all = gpu_testing::to_host<int64_t>(storage);
    if (guards && (all.front() != kGuard || all.back() != kGuard))
      *guards = "an element outside the [R] view was written";
    return {all.begin() + 1, all.end() - 1};
  }
};

struct Failures {
  int rank;
  int count = 0;
  void add(const std::string& what) {
    std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
    ++count;
  }
};

// What one call added, against §2.5 on cuda, for a call in which rank `straggler` (-1: none)
// came kWaitDelayMs late: data that was there, or came on time, costs less than a quarter of it.
void check_added(Failures& f, const std::string& what, bool combine, int straggler,
                 const std::vector<int64_t>& before, const std::vector<int64_t>& after) {
  testing::WaitExpectation want;
  want.rank = f.rank;
  want.straggler = straggler;
  want.combine = combine;
  want.punctual_below = kWaitDelayNs / 4;
  const std::string err = testing::check_wait_added(what, want, before, after);
  if (!err.empty()) f.add(err);
}

// Two rounds (the second with hooks) of dispatch + combine where the last rank is kWaitDelayMs late
// for each call. Returns the number of failures.
int straggler_body(const Group& g) {
  const int R = g.size(), r = g.rank(), dev = gpu_testing::device_of(g);
  const int straggler = R > 1 ? R - 1 : -1;
  Failures f{r};
  const RankStream rs(cudaStreamNonBlocking);
  const cudaStream_t stream = rs.get();
  const Inputs in(R, dev);
  Buffer buf(g, in.shape(), kLlOnly);
  const Stats ds(R, dev, 7), cs(R, dev, 11);
  const std::vector<int64_t> ds0 = ds.values(), cs0 = cs.values();
  const Allocator alloc = gpu_testing::device_allocator();
  for (int round = 0; round < 2; ++round) {
    const bool hook = round == 1;
    const std::string tag = "round " + std::to_string(round) + (hook ? " (hooks)" : "");
    std::vector<int64_t> before = ds.values();
    g.barrier();
    if (r == straggler) std::this_thread::sleep_for(std::chrono::milliseconds(kWaitDelayMs));
    LlDispatchArgs da = in.dispatch_args(stream);
    da.dispatch_wait_recv_cost_stats = ds.view();
    da.return_recv_hook = hook;
    const LlDispatchResult d = buf.ll_dispatch(da, alloc);
    if (d.hook) d.hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    check_added(f, tag + " dispatch", false, straggler, before, ds.values());

    before = cs.values();
    g.barrier();
    if (r == straggler) std::this_thread::sleep_for(std::chrono::milliseconds(kWaitDelayMs));
    LlCombineArgs ca = in.combine_args(d.handle, stream);
    ca.combine_wait_recv_cost_stats = cs.view();
    ca.return_recv_hook = hook;
    const LlCombineResult c = buf.ll_combine(ca, alloc);
    if (c.hook) c.hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    check_added(f, tag + " combine", true, straggler, before, cs.values());
    const std::vector<uint16_t> out = gpu_testing::to_host<uint16_t>(c.out);
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i] != 0x4000) {
        f.add(tag + " combine out element " + std::to_string(i) + " = " + std::to_string(out[i]) +
              ", expected 0x4000 (2.0)");
        break;
      }
    }
  }
  std::string guards;
  const std::vector<int64_t> ds2 = ds.values(&guards), cs2 = cs.values(&guards);
  if (!guards.empty()) f.add(guards);
  if (straggler >= 0 && r != straggler) {
    // Two delays' worth on top of the starting values: accumulated, not overwritten.
    if (ds2[straggler] - ds0[straggler] < kWaitDelayNs)
      f.add("dispatch stats did not accumulate over two rounds: " + show_values(ds0) + " -> " +
            show_values(ds2));
    if (cs2[straggler] - cs0[straggler] < kWaitDelayNs)
      f.add("combine stats did not accumulate over two rounds: " + show_values(cs0) + " -> " +
            show_values(cs2));
  }
  return f.count;
}

class LlWaitStatsOneGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlWaitStatsOneGpu, StragglerColumnHoldsItsDelay) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(gpu_testing::run_cuda_ranks_one_gpu(GetParam(), 0, straggler_body), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlWaitStatsOneGpu, ::testing::Values(2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

TEST(LlWaitStatsGpu, StragglerColumnHoldsItsDelayTwoGpus) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(gpu_testing::run_cuda_ranks(2, straggler_body), 0);
}

// R = 1 on one GPU: no straggler (the rounds above with straggler -1), a hook called kWaitDelayMs
// after its call (the sleep is not a wait: the data was there when the receive began), and the
// host checks of the argument.
TEST(LlWaitStatsGpu, OneRank) {
  EPX_REQUIRE_GPUS(1);
  const int rc = gpu_testing::run_cuda_ranks(1, [](const Group& g) {
    int failures = straggler_body(g);
    Failures f{0};
    const int dev = gpu_testing::device_of(g);
    const RankStream rs(cudaStreamNonBlocking);
    const cudaStream_t stream = rs.get();
    const Inputs in(1, dev);
    Buffer buf(g, in.shape(), kLlOnly);
    const Stats ds(1, dev, 3), cs(1, dev, 4);
    const Allocator alloc = gpu_testing::device_allocator();
    LlDispatchArgs da = in.dispatch_args(stream);
    da.dispatch_wait_recv_cost_stats = ds.view();
    da.return_recv_hook = true;
    const LlDispatchResult d = buf.ll_dispatch(da, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    std::this_thread::sleep_for(std::chrono::milliseconds(kWaitDelayMs));
    d.hook();
    LlCombineArgs ca = in.combine_args(d.handle, stream);
    ca.combine_wait_recv_cost_stats = cs.view();
    ca.return_recv_hook = true;
    const LlCombineResult c = buf.ll_combine(ca, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    std::this_thread::sleep_for(std::chrono::milliseconds(kWaitDelayMs));
    c.hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    check_added(f, "late hook dispatch", false, -1, {3}, ds.values());
    check_added(f, "late hook combine", true, -1, {4}, cs.values());

    // Host checks: InvalidArgument naming the argument, before anything is launched.
    Tensor i32 = gpu_testing::to_device(std::vector<int32_t>(4, 0), DType::kI32, {4}, dev);
    Tensor i64 = gpu_testing::to_device(std::vector<int64_t>(4, 0), DType::kI64, {4}, dev);
    std::vector<int64_t> host(4, 0);
    struct Bad {
      TensorView view;
      const char* needle;
    };
    std::vector<Bad> bad = {
        {TensorView::contiguous(i32.data, DType::kI32, {1}, Device::cuda(dev)), "i64"},
        {TensorView::contiguous(i64.data, DType::kI64, {2}, Device::cuda(dev)), "[1]"},
        {TensorView::contiguous(i64.data, DType::kI64, {1, 1}, Device::cuda(dev)), "[1]"},
        {TensorView::contiguous(host.data(), DType::kI64, {1}), "cpu"},
    };
    const std::vector<int64_t> ds_before = ds.values(), cs_before = cs.values();
    for (const Bad& b : bad) {
      for (bool combine : {false, true}) {
        const char* name =
            combine ? "'combine_wait_recv_cost_stats'" : "'dispatch_wait_recv_cost_stats'";
        try {
          if (combine) {
            LlCombineArgs a = in.combine_args(d.handle, stream);
            a.combine_wait_recv_cost_stats = b.view;
            buf.ll_combine(a, alloc);
          } else {
            LlDispatchArgs a = in.dispatch_args(stream);
            a.dispatch_wait_recv_cost_stats = b.view;
            buf.ll_dispatch(a, alloc);
          }
          f.add(std::string(name) + " = " + b.view.describe() + ": no error");
        } catch (const Error& e) {
          const std::string m = e.what();
          if (e.code() != ErrorCode::kInvalidArgument || m.find(name) == std::string::npos ||
              m.find(b.needle) == std::string::npos)
            f.add(std::string(name) + " = " + b.view.describe() + ": unexpected error " + m);
        }
      }
    }
    // The buffer still works.
    const LlDispatchResult d2 = buf.ll_dispatch(in.dispatch_args(stream), alloc);
    buf.ll_combine(in.combine_args(d2.handle, stream), alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    if (gpu_testing::to_host<int64_t>(i64) != std::vector<int64_t>(4, 0) ||
        gpu_testing::to_host<int32_t>(i32) != std::vector<int32_t>(4, 0) ||
        host != std::vector<int64_t>(4, 0))
      f.add("a refused call wrote into the tensor it was given");
    if (ds.values() != ds_before || cs.values() != cs_before)
      f.add("calls without stats changed the earlier stats tensors");
    return failures + f.count;
  });
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace epx
