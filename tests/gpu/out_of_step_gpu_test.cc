// Out-of-step ranks on the cuda backend, one GPU, 3 ranks as threads (docs/semantics.md §4.3):
// the straggler scenarios of tests/support/out_of_step.h for ht, ht cached, ll and ll with hooks,
// each output compared byte for byte with the cpu backend's fault-free run of the same step. A
// straggler's peers time out in their kernels (or in the ht count exchange), the Timeout surfaces
// at the next call or check(), every later call of that mode is refused (OutOfStep) until
// Buffer::reset() (ht) / reset() (ll: ll_clean's path), and the step after the reset is exact.
// (The Dispatcher's scenario runs on the cpu tier only: its errors surface at its next call, and
// it has no check() to end a step with.)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>

#include "epx/epx.h"
#include "gpu/gpu_support.h"
#include "support/out_of_step.h"

namespace epx {
namespace {

using namespace std::chrono_literals;
using testing::StepMode;

constexpr auto kTimeout = 400ms;

testing::StepIo cuda_step_io(const Group& g) {
  testing::StepIo io;
  const int dev = gpu_testing::device_of(g);
  io.upload = [dev](const void* p, size_t bytes, DType dtype, const std::vector<int64_t>& shape) {
    return gpu_testing::to_device(p, bytes, dtype, shape, dev);
  };
  io.download = [](const TensorView& t) { return gpu_testing::to_host_bytes(t); };
  io.allocator = gpu_testing::poison_allocator(0xA5);
  io.stream = gpu_testing::rank_stream();
  return io;
}

// The ranks run in a child process (run_cuda_ranks_one_gpu): the report is read there, on rank
// 0 once every rank finished, and becomes rank 0's exit status.
int run_one_gpu(StepMode mode) {
  GroupOptions options;
  options.timeout = kTimeout;
  int rc = 0;
  bool failed = false;  // the child's copy is the one written and read
  testing::run_out_of_step_scenario(
      mode, kTimeout,
      [&](const std::function<void(const Group&)>& body) {
        rc = gpu_testing::run_cuda_ranks_one_gpu(
            testing::kOutOfStepRanks, 0,
            [&](const Group& g) {
              body(g);
              return g.rank() == 0 && failed ? 1 : 0;
            },
            options);
      },
      cuda_step_io,
      [&](const testing::ScenarioReport& report) {
        std::printf("%s\n", report.summary(mode).c_str());
        std::fflush(stdout);
        for (const auto& f : report.failures)
          std::fprintf(stderr, "%s: %s\n", testing::step_mode_name(mode), f.c_str());
        failed = !report.failures.empty() || report.failed_steps == 0;
      });
  return rc;
}

TEST(OutOfStepGpu, HtStragglersOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(run_one_gpu(StepMode::kHt), 0);
}
TEST(OutOfStepGpu, HtCachedStragglersOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(run_one_gpu(StepMode::kHtCached), 0);
}
TEST(OutOfStepGpu, LlStragglersOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(run_one_gpu(StepMode::kLl), 0);
}
TEST(OutOfStepGpu, LlHookStragglersOneGpu) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(run_one_gpu(StepMode::kLlHook), 0);
}

}  // namespace
}  // namespace epx
