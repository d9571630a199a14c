// Failure paths of construction on the cpu backend: a rank that never arrives, dies first, dies
// after creating its segment or after the Buffer was made, segments of different sizes — each
// raises the typed error on the surviving ranks, and no POSIX shared-memory segment of the group
// stays in /dev/shm. Absurd sizes are OutOfCapacity naming the shape fields and the bytes, before
// anything is mapped.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer_impl.h"
#include "epx/a2a.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "support/harness.h"
#include "transport/transport.h"

namespace epx {
namespace {

using namespace std::chrono_literals;

// The entries of /dev/shm that belong to the group `name` ("<name>.ctl", "<name>.<seq>.<rank>").
std::vector<std::string> shm_entries(const std::string& name) {
  std::vector<std::string> out;
  DIR* d = opendir("/dev/shm");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    const std::string f = e->d_name;
    if (f.rfind(name + ".", 0) == 0) out.push_back(f);
  }
  closedir(d);
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

GroupOptions short_timeout(std::chrono::milliseconds ms = 1000ms) {
  GroupOptions o;
  o.timeout = ms;
  return o;
}

// Outcomes of a forked rank, readable after it exited (a killed rank leaves kNotSet).
enum Outcome : int32_t {
  kNotSet = 0,
  kOk,
  kTimeout,
  kInvalid,
  kCapacity,
  kInternal,
  kOther,
  kNoError
};

Outcome outcome_of(const Error& e) {
  switch (e.code()) {
    case ErrorCode::kTimeout:
      return kTimeout;
    case ErrorCode::kInvalidArgument:
      return kInvalid;
    case ErrorCode::kOutOfCapacity:
      return kCapacity;
    case ErrorCode::kInternal:
      return kInternal;
    default:
      return kOther;
  }
}

// Forks R ranks of a cpu_processes group named `name` and runs body(rank, group) in each; returns
// every rank's outcome (the body's return value; kNotSet for a rank that died). A rank whose group
// creation fails records that error's outcome.
std::vector<Outcome> run_ranks(int R, const std::string& name, GroupOptions o,
                               const std::function<Outcome(int, const Group&)>& body) {
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(mem, MAP_FAILED);
  auto* out = static_cast<int32_t*>(mem);
  for (int r = 0; r < R; ++r) out[r] = kNotSet;
  launch_local(
      R,
      [&](int r) {
        try {
          Group g = Group::cpu_processes(r, R, name, o);
          out[r] = body(r, g);
        } catch (const Error& e) {
          out[r] = outcome_of(e);
        }
        return 0;
      },
      std::chrono::seconds(60));
  std::vector<Outcome> result(R);
  for (int r = 0; r < R; ++r) result[r] = static_cast<Outcome>(out[r]);
  munmap(mem, 4096);
  return result;
}

// Runs f and returns its outcome (kNoError when it did not throw).
template <typename F>
Outcome attempt(F&& f) {
  try {
    f();
    return kNoError;
  } catch (const Error& e) {
    return outcome_of(e);
  }
}

const MoeShape kShape{256, 2, 4, 16};

A2aShape small_a2a() {
  A2aShape s;
  s.max_tokens_per_rank = 16;
  s.top_k = 2;
  s.num_experts = 4;
  s.payload_bytes_per_token = {512};
  s.combine_bytes_per_token = 512;
  return s;
}

// ---- the group itself ---------------------------------------------------------------------------

TEST(FailurePaths, JoinTimeoutLeavesNoSegment) {
  const std::string name = testing::unique_group_name("join");
  try {
    Group::cpu_processes(0, 2, name, short_timeout(200ms));
    FAIL() << "expected Timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("ranks [1]"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

// A rank that arrives after the others gave up fails too, and neither leaves a segment.
TEST(FailurePaths, LateJoinerAfterTimeoutLeavesNoSegment) {
  const std::string name = testing::unique_group_name("late");
  Outcome late = kNotSet;
  std::thread t([&] {
    std::this_thread::sleep_for(500ms);
    late = attempt([&] { Group::cpu_processes(1, 2, name, short_timeout(200ms)); });
  });
  const Outcome early = attempt([&] { Group::cpu_processes(0, 2, name, short_timeout(200ms)); });
  t.join();
  EXPECT_EQ(early, kTimeout);
  EXPECT_EQ(late, kTimeout);
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

TEST(FailurePaths, SuccessfulGroupsAndBuffersLeaveNoSegment) {
  const std::string name = testing::unique_group_name("ok");
  auto out = run_ranks(2, name, short_timeout(5000ms), [](int, const Group& g) {
    Buffer b(g, kShape);
    A2a a(g, small_a2a());
    g.barrier();
    return kOk;
  });
  EXPECT_EQ(out, std::vector<Outcome>({kOk, kOk}));
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

// ---- Buffer / A2a construction with a missing or dead peer ------------------------------------

TEST(FailurePaths, BufferWithRankThatNeverArrivesLeavesNoSegment) {
  const std::string name = testing::unique_group_name("buf-never");
  auto out = run_ranks(2, name, short_timeout(), [](int r, const Group& g) {
    if (r == 1) return kOk;  // never constructs the Buffer
    try {
      Buffer b(g, kShape);
      return kNoError;
    } catch (const Error& e) {
      const bool names_rank = std::string(e.what()).find("ranks [1]") != std::string::npos;
      return names_rank ? outcome_of(e) : kOther;
    }
  });
  EXPECT_EQ(out, std::vector<Outcome>({kTimeout, kOk}));
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

TEST(FailurePaths, BufferWithRankKilledFirstLeavesNoSegment) {
  for (bool ll : {false, true}) {
    const std::string name = testing::unique_group_name(ll ? "buf-kill-ll" : "buf-kill");
    auto out = run_ranks(3, name, short_timeout(), [ll](int r, const Group& g) {
      if (r == 2) raise(SIGKILL);
      BufferConfig c;
      c.enable_ll = ll;
      return attempt([&] { Buffer b(g, MoeShape{256, 2, 6, 16}, c); });
    });
    EXPECT_EQ(out, std::vector<Outcome>({kTimeout, kTimeout, kNotSet})) << "ll " << ll;
    EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
  }
}

TEST(FailurePaths, A2aWithRankThatNeverArrivesOrDiesLeavesNoSegment) {
  for (bool kill : {false, true}) {
    const std::string name = testing::unique_group_name(kill ? "a2a-kill" : "a2a-never");
    auto out = run_ranks(2, name, short_timeout(), [kill](int r, const Group& g) {
      if (r == 1) {
        if (kill) raise(SIGKILL);
        return kOk;
      }
      return attempt([&] { A2a a(g, small_a2a()); });
    });
    EXPECT_EQ(out[0], kTimeout) << "kill " << kill;
    EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
  }
}

// A peer killed after it created its segment of the allocation (before the first barrier): it
// can unlink nothing, the survivors unlink its segment name too. The survivor calls the
// transport's allocate itself (a Buffer first agrees on its shape, where it would time out
// before allocating).
TEST(FailurePaths, PeerKilledAfterCreatingItsSegmentLeavesNoSegment) {
  const std::string name = testing::unique_group_name("seg-kill");
  auto out = run_ranks(2, name, short_timeout(), [&](int r, const Group& g) {
    if (r == 1) {
      // What ProcessTransport::allocate does first: "/<name>.<seq>.<rank>", sized.
      const std::string seg = "/" + name + ".0.1";
      const int fd = shm_open(seg.c_str(), O_CREAT | O_RDWR, 0600);
      if (fd >= 0 && ftruncate(fd, 1 << 16) == 0) raise(SIGKILL);
      return kOther;
    }
    return attempt([&] { g.transport()->allocate(1 << 16); });
  });
  EXPECT_EQ(out, std::vector<Outcome>({kTimeout, kNotSet}));
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

// A peer killed once the Buffer exists: the survivor's next op times out, and destroying the
// Buffer and the group leaves nothing behind.
TEST(FailurePaths, PeerKilledAfterConstructionLeavesNoSegment) {
  const std::string name = testing::unique_group_name("op-kill");
  auto out = run_ranks(2, name, short_timeout(), [](int r, const Group& g) {
    Buffer b(g, kShape);
    if (r == 1) raise(SIGKILL);
    std::vector<uint16_t> x(4 * 256, 0);
    std::vector<int64_t> idx = {0, 1, 2, 3, 0, 2, 1, 3};
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {4, 256});
    a.topk_idx = TensorView::contiguous(idx.data(), DType::kI64, {4, 2});
    return attempt([&] { b.ht_dispatch(a); });
  });
  EXPECT_EQ(out, std::vector<Outcome>({kTimeout, kNotSet}));
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

// Ranks whose allocations differ in size (another shape there): InvalidArgument on every rank
// (never a mapping past the end of a smaller segment, which would be SIGBUS), nothing left.
TEST(FailurePaths, DifferentAllocationSizesAreInvalidArgumentOnEveryRank) {
  const std::string name = testing::unique_group_name("sizes");
  auto out = run_ranks(3, name, short_timeout(2000ms), [](int r, const Group& g) {
    const size_t bytes = r == 2 ? (1 << 20) : 4096;
    try {
      g.transport()->allocate(bytes);
      return kNoError;
    } catch (const Error& e) {
      const bool says = std::string(e.what()).find(
                            "expected every rank to allocate the same "
                            "size") != std::string::npos;
      return says ? outcome_of(e) : kOther;
    }
  });
  EXPECT_EQ(out, std::vector<Outcome>({kInvalid, kInvalid, kInvalid}));
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

// ---- absurd sizes: OutOfCapacity before anything is mapped -------------------------------------

void expect_capacity(const std::function<void()>& fn, const std::vector<std::string>& has,
                     const std::string& label) {
  try {
    fn();
    ADD_FAILURE() << label << ": expected OutOfCapacity";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfCapacity) << label << ": " << e.what();
    for (const auto& s : has)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << label << ": '" << s << "' not in: " << e.what();
  }
}

TEST(FailurePaths, AbsurdBufferSizesAreOutOfCapacityNamingFieldsAndBytes) {
  const std::string limit = "more than the 1099511627776 bytes (1 TiB) one allocation may take";
  const int64_t kT40 = int64_t{1} << 40;
  testing::run_threads(2, [&](const Group& g) {
    // max_tokens_per_rank 2^40: the exact bytes (the layout cannot overflow).
    const MoeShape tokens{128, 2, 4, kT40};
    expect_capacity([&] { Buffer b(g, tokens); },
                    {"Buffer: shape.max_tokens_per_rank = 1099511627776 and shape.hidden = 128",
                     "need " + std::to_string(detail::cpu_ht_bytes(tokens, 2)) +
                         " bytes of symmetric memory per rank for ht on 2 ranks (cpu backend)",
                     limit, "expected a smaller shape.max_tokens_per_rank or shape.hidden"},
                    "ht T 2^40");
    // hidden huge: the byte count itself overflows 64 bits.
    const MoeShape hidden{int64_t{1} << 62, 2, 4, 1 << 20};
    expect_capacity([&] { Buffer b(g, hidden); },
                    {"shape.hidden = 4611686018427387904",
                     "need more than 2^64 bytes (the byte count overflows 64 bits)", limit},
                    "ht hidden 2^62");
    // ll: T_max x hidden x experts.
    BufferConfig ll;
    ll.enable_ht = false;
    ll.enable_ll = true;
    const MoeShape experts{7168, 8, 1 << 20, 4096};
    expect_capacity([&] { Buffer b(g, experts, ll); },
                    {"shape.max_tokens_per_rank = 4096, shape.hidden = 7168 and "
                     "shape.num_experts = 1048576",
                     "need " + std::to_string(detail::cpu_ll_bytes(experts, 2)) + " bytes",
                     "for ll on 2 ranks", limit},
                    "ll experts");
    g.barrier();  // both ranks got here without a collective: nothing was allocated
  });
  // Just over the limit, exactly: the exact byte count; bytes_needed says the same.
  const MoeShape over{8192, 8, 8, int64_t{1} << 26};
  ASSERT_GT(detail::cpu_ht_bytes(over, 1), size_t{1} << 40);
  expect_capacity([&] { (void)Buffer::bytes_needed(Mode::kHt, over, 1, Backend::kCpu); },
                  {"Buffer::bytes_needed: ",
                   "need " + std::to_string(detail::cpu_ht_bytes(over, 1)) + " bytes"},
                  "bytes_needed over");
  const MoeShape under{8192, 8, 8, int64_t{1} << 24};
  EXPECT_EQ(Buffer::bytes_needed(Mode::kHt, under, 1, Backend::kCpu),
            detail::cpu_ht_bytes(under, 1));
  const MoeShape big_ll{7168, 8, 1 << 20, 4096};
  expect_capacity([&] { (void)Buffer::bytes_needed(Mode::kLl, big_ll, 64, Backend::kCpu); },
                  {"Buffer::bytes_needed: ", "for ll on 64 ranks"}, "bytes_needed ll");
}

TEST(FailurePaths, AbsurdA2aSizesAreOutOfCapacityNamingFieldsAndBytes) {
  testing::run_threads(1, [](const Group& g) {
    A2aShape s = small_a2a();
    s.max_tokens_per_rank = int64_t{1} << 40;
    expect_capacity(
        [&] { A2a a(g, s); },
        {"A2a: shape.max_tokens_per_rank = 1099511627776, "
         "shape.payload_bytes_per_token = [512] and shape.combine_bytes_per_token = 512",
         "need " + std::to_string(detail::cpu_a2a_bytes(s, 1)) +
             " bytes of symmetric memory per rank for a2a on 1 rank (cpu backend)",
         "1099511627776 bytes (1 TiB)"},
        "a2a T 2^40");
    A2aShape wide = small_a2a();
    wide.payload_bytes_per_token = {size_t{1} << 62, size_t{1} << 62, 8};
    expect_capacity(
        [&] { A2a a(g, wide); },
        {"shape.payload_bytes_per_token = [4611686018427387904, 4611686018427387904, 8]",
         "need more than 2^64 bytes"},
        "a2a payload 2^62");
    expect_capacity([&] { (void)A2a::workspace_bytes(wide, 4, Backend::kCpu); },
                    {"A2a::workspace_bytes: "}, "workspace_bytes");
  });
}

// On the process transport the check comes before any segment exists; allocate() itself refuses
// more than the limit too.
TEST(FailurePaths, AbsurdSizesMapNothing) {
  const std::string name = testing::unique_group_name("absurd");
  auto out = run_ranks(2, name, short_timeout(2000ms), [](int, const Group& g) {
    const Outcome buffer = attempt([&] { Buffer b(g, MoeShape{128, 2, 4, int64_t{1} << 40}); });
    const Outcome alloc = attempt([&] { g.transport()->allocate((size_t{1} << 40) + 1); });
    g.barrier();  // the group still works: nothing collective was started
    return buffer == alloc ? buffer : kOther;
  });
  EXPECT_EQ(out, std::vector<Outcome>({kCapacity, kCapacity}));
  EXPECT_TRUE(shm_entries(name).empty()) << joined(shm_entries(name));
}

}  // namespace
}  // namespace epx
