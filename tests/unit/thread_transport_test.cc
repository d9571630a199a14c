// The host side of the cuda backend's one-GPU test mode (Group::cuda_shared_device): a thread
// transport whose blocks come from a caller-given allocator and which reports that allocator's
// backend and device. The allocator here is fake (host memory tagged cuda:0), so no GPU is
// needed; the real one (cudaMalloc) is exercised by the *OneGpu* tests of the GPU tier.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.h"
#include "support/harness.h"
#include "support/scoped_env.h"
#include "transport/transport.h"

namespace epx {
namespace {

detail::ThreadMemory fake_device_memory(std::atomic<int>* num_blocks) {
  detail::ThreadMemory m;
  m.backend = Backend::kCuda;
  m.device = Device::cuda(0);
  m.allocate = [num_blocks](size_t bytes) {
    ++*num_blocks;
    return std::shared_ptr<void>(std::calloc(1, bytes + 16), [num_blocks](void* p) {
      --*num_blocks;
      std::free(p);
    });
  };
  return m;
}

void run(int R, std::chrono::milliseconds timeout, std::atomic<int>* blocks,
         const std::function<void(detail::Transport&)>& body) {
  const std::string name = testing::unique_group_name("fake-cuda");
  std::vector<std::thread> threads;
  std::vector<std::string> errors(R);
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        auto t = detail::make_thread_transport(r, R, name, timeout, fake_device_memory(blocks),
                                               "Group::cuda_shared_device");
        body(*t);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < R; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(ThreadTransport, BlocksFromTheGivenAllocatorReachEveryPeer) {
  std::atomic<int> blocks{0};
  run(4, std::chrono::seconds(10), &blocks, [](detail::Transport& t) {
    EXPECT_EQ(t.backend(), Backend::kCuda);
    EXPECT_EQ(t.device(), Device::cuda(0));
    auto mem = t.allocate(64);
    static_cast<int*>(mem->local())[0] = 100 + t.rank();
    t.barrier("test");
    for (int p = 0; p < t.size(); ++p) EXPECT_EQ(static_cast<int*>(mem->peer(p))[0], 100 + p);
    t.barrier("test (done)");
  });
  EXPECT_EQ(blocks.load(), 0);  // every block freed once the last rank dropped it
}

TEST(ThreadTransport, MissingRankTimesOutNamingIt) {
  std::atomic<int> blocks{0};
  const std::string name = testing::unique_group_name("fake-cuda-timeout");
  std::string error;
  std::thread late([&] {
    try {
      auto t = detail::make_thread_transport(1, 3, name, std::chrono::milliseconds(200),
                                             fake_device_memory(&blocks),
                                             "Group::cuda_shared_device");
    } catch (const Error&) {
    }
  });
  try {
    detail::make_thread_transport(0, 3, name, std::chrono::milliseconds(200),
                                  fake_device_memory(&blocks), "Group::cuda_shared_device");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    error = e.what();
  }
  late.join();
  EXPECT_NE(error.find("Group::cuda_shared_device (join)"), std::string::npos) << error;
  EXPECT_NE(error.find("[2]"), std::string::npos) << error;  // rank 2 never came
}

#ifdef EPX_WITH_CUDA
// The environment the one-GPU mode needs is checked before any CUDA call (so also without a GPU):
// enough hardware queues, and eager kernel loading (a lazily loaded kernel's first launch may
// wait for a peer's spinning kernel: docs/design.md §5, 80deb94). Restores the variables
// (testing::ScopedEnv).
using testing::ScopedEnv;

std::string shared_device_error(ErrorCode* code) {
  try {
    Group::cuda_shared_device(0, 2, testing::unique_group_name("env"), 0);
  } catch (const Error& e) {
    *code = e.code();
    return e.what();
  }
  return "";
}

TEST(ThreadTransport, CudaSharedDeviceNeedsEagerLoading) {
  ScopedEnv connections("CUDA_DEVICE_MAX_CONNECTIONS", "32");
  for (const char* mode : {"LAZY", ""}) {
    ScopedEnv loading("CUDA_MODULE_LOADING", mode);
    ErrorCode code = ErrorCode::kInternal;
    const std::string error = shared_device_error(&code);
    EXPECT_EQ(code, ErrorCode::kInvalidArgument) << error;
    EXPECT_NE(error.find("CUDA_MODULE_LOADING is '" + std::string(mode) + "'"), std::string::npos)
        << error;
    EXPECT_NE(error.find("set CUDA_MODULE_LOADING=EAGER"), std::string::npos) << error;
  }
}

TEST(ThreadTransport, CudaSharedDeviceNeedsHardwareQueues) {
  ScopedEnv connections("CUDA_DEVICE_MAX_CONNECTIONS", "2");
  ScopedEnv loading("CUDA_MODULE_LOADING", "EAGER");
  ErrorCode code = ErrorCode::kInternal;
  const std::string error = shared_device_error(&code);  // 2 ranks need min(32, 6) queues
  EXPECT_EQ(code, ErrorCode::kInvalidArgument) << error;
  EXPECT_NE(error.find("CUDA_DEVICE_MAX_CONNECTIONS is 2"), std::string::npos) << error;
  EXPECT_NE(error.find("need at least 6"), std::string::npos) << error;
}
#endif

#ifndef EPX_WITH_CUDA
TEST(ThreadTransport, CudaSharedDeviceIsUnsupportedWithoutCuda) {
  try {
    Group::cuda_shared_device(0, 1, "x", 0);
    FAIL() << "expected Unsupported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  }
}
#endif

}  // namespace
}  // namespace epx
