// The environment variables epx reads (core/env.h): defaults, the valid ranges, and invalid values
// ("abc", "-5", "0" where 0 is rejected, trailing garbage, overflow) as InvalidArgument naming the
// variable, the value and the range — from the accessors and at group creation, which checks
// every variable. GroupOptions takes the same ranges.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/env.h"
#include "epx/error.h"
#include "epx/group.h"
#include "support/harness.h"
#include "support/scoped_env.h"

namespace epx::detail {
namespace {

using testing::ScopedEnv;

// Runs f, expecting InvalidArgument whose message contains every fragment.
template <typename F>
void expect_invalid(F&& f, const std::vector<std::string>& fragments, const std::string& ctx) {
  try {
    f();
    ADD_FAILURE() << ctx << ": expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << ctx << ": " << e.what();
    for (const std::string& s : fragments)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << ctx << ": '" << s << "' not in: " << e.what();
  }
}

// A one-rank group (threads: nothing else to wait for) under the current environment.
Group one_rank_group(GroupOptions o = {}) {
  return Group::cpu_threads(0, 1, epx::testing::unique_group_name("env"), o);
}

struct BadValue {
  const char* name;
  const char* value;
  const char* range;  // a fragment of the expected range in the message
};

// Every variable with values that must be rejected.
const std::vector<BadValue>& bad_values() {
  static const std::vector<BadValue> v = {
      {"EPX_TIMEOUT_MS", "abc", "expected an integer 1..86400000 (milliseconds; unset: 30000)"},
      {"EPX_TIMEOUT_MS", "-5", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", "0", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", "1500ms", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", " 1500", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", "1500 ", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", "+1500", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", "1e3", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", "86400001", "expected an integer 1..86400000"},
      {"EPX_TIMEOUT_MS", "99999999999999999999999", "expected an integer 1..86400000"},
      {"EPX_NUM_SMS", "-3", "expected an integer 0..1024 (0 or unset: auto)"},
      {"EPX_NUM_SMS", "many", "expected an integer 0..1024"},
      {"EPX_NUM_SMS", "1025", "expected an integer 0..1024"},
      {"EPX_NUM_SMS", "16x", "expected an integer 0..1024"},
      {"EPX_PDL", "off", "expected 1 (programmatic dependent launch for the ht and ll kernels), 0"},
      {"EPX_PDL", "2", "expected 1"},
      {"EPX_PDL", "1 ", "expected 1"},
      {"EPX_PDL", "true", "expected 1"},
      {"EPX_ONE_GPU_SIDE_STREAMS", "yes", "expected 1 (the one-GPU test mode"},
      {"EPX_LL_TRACE_FROM", "0", "expected an integer 1..1000000000000000 (the first"},
      {"EPX_LL_TRACE_FROM", "-1", "expected an integer 1..1000000000000000"},
      {"EPX_LL_TRACE_FROM", "1000000000000001", "expected an integer 1..1000000000000000"},
      {"EPX_LL_TRACE_FROM", "10k", "expected an integer 1..1000000000000000"},
      {"EPX_LL_ABLATE", "65536", "expected an integer 0..65535 (LlAblate bits"},
      {"EPX_LL_ABLATE", "-1", "expected an integer 0..65535"},
      {"EPX_LL_ABLATE", "0x4", "expected an integer 0..65535"},
  };
  return v;
}

TEST(Env, DefaultsWhenUnsetOrEmpty) {
  for (const char* name :
       {"EPX_TIMEOUT_MS", "EPX_NUM_SMS", "EPX_PDL", "EPX_ONE_GPU_SIDE_STREAMS",
        "CUDA_DEVICE_MAX_CONNECTIONS", "EPX_LL_TRACE_DUMP", "EPX_LL_TRACE_FROM",
        "EPX_LL_ABLATE"}) {
    for (std::optional<std::string> v :
         {std::optional<std::string>(), std::optional<std::string>("")}) {
      ScopedEnv e(name, v);
      EXPECT_EQ(env_default_timeout().count(), 30000) << name;
      EXPECT_EQ(env_default_num_sms(), 0) << name;
      EXPECT_EQ(env_pdl(), -1) << name;
      EXPECT_FALSE(env_one_gpu_side_streams()) << name;
      EXPECT_EQ(env_cuda_device_max_connections(), 8) << name;
      EXPECT_EQ(env_ll_trace_dump(), "") << name;
      EXPECT_EQ(env_ll_trace_from(), 1) << name;
      EXPECT_EQ(env_ll_ablate(), 0) << name;
      EXPECT_NO_THROW(check_environment("test")) << name;
    }
  }
}

TEST(Env, ValidValuesAtTheEdgesOfTheirRanges) {
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::string("1"));
    EXPECT_EQ(env_default_timeout().count(), 1);
  }
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::string("86400000"));
    EXPECT_EQ(env_default_timeout().count(), 86400000);
  }
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::string("1500"));
    EXPECT_EQ(env_default_timeout().count(), 1500);
  }
  {
    ScopedEnv e("EPX_NUM_SMS", std::string("0"));
    EXPECT_EQ(env_default_num_sms(), 0);
  }
  {
    ScopedEnv e("EPX_NUM_SMS", std::string("1024"));
    EXPECT_EQ(env_default_num_sms(), 1024);
  }
  {
    ScopedEnv e("EPX_PDL", std::string("1"));
    EXPECT_EQ(env_pdl(), 1);
  }
  {
    ScopedEnv e("EPX_PDL", std::string("0"));
    EXPECT_EQ(env_pdl(), 0);
  }
  {
    ScopedEnv e("EPX_ONE_GPU_SIDE_STREAMS", std::string("1"));
    EXPECT_TRUE(env_one_gpu_side_streams());
  }
  {
    ScopedEnv e("EPX_ONE_GPU_SIDE_STREAMS", std::string("0"));
    EXPECT_FALSE(env_one_gpu_side_streams());
  }
  {
    ScopedEnv e("CUDA_DEVICE_MAX_CONNECTIONS", std::string("32"));
    EXPECT_EQ(env_cuda_device_max_connections(), 32);
  }
  {
    ScopedEnv e("EPX_LL_TRACE_DUMP", std::string("/tmp/ll trace"));
    EXPECT_EQ(env_ll_trace_dump(), "/tmp/ll trace");  // any path, as given
  }
  {
    ScopedEnv e("EPX_LL_TRACE_FROM", std::string("1000000000000000"));
    EXPECT_EQ(env_ll_trace_from(), kMaxLlTraceFrom);
  }
  {
    ScopedEnv e("EPX_LL_ABLATE", std::string("65535"));
    EXPECT_EQ(env_ll_ablate(), kMaxLlAblate);
  }
  {
    ScopedEnv e("EPX_LL_ABLATE", std::string("6"));
    EXPECT_EQ(env_ll_ablate(), 6);
  }
}

// The accessors (and check_environment) name the variable, the value and the range.
TEST(Env, InvalidValuesAreInvalidArgumentNamingVariableValueAndRange) {
  for (const BadValue& b : bad_values()) {
    ScopedEnv e(b.name, std::string(b.value));
    const std::string ctx = std::string(b.name) + "='" + b.value + "'";
    expect_invalid([] { check_environment("Group::test"); },
                   {"Group::test: ", "environment variable ", b.name,
                    std::string("'") + b.value + "'", b.range},
                   ctx);
  }
  for (const char* v : {"0", "33", "abc", "-1", "8 "}) {
    ScopedEnv e("CUDA_DEVICE_MAX_CONNECTIONS", std::string(v));
    expect_invalid([] { (void)env_cuda_device_max_connections(); },
                   {"environment variable CUDA_DEVICE_MAX_CONNECTIONS is '", std::string(v) + "'",
                    "expected an integer 1..32"},
                   v);
  }
}

// At group creation, whatever the options say: the typed error, never a silent default.
TEST(Env, GroupCreationRejectsEveryInvalidVariable) {
  for (const BadValue& b : bad_values()) {
    ScopedEnv e(b.name, std::string(b.value));
    const std::string ctx = std::string(b.name) + "='" + b.value + "'";
    expect_invalid([] { (void)one_rank_group(); },
                   {"Group::cpu_threads: environment variable ", b.name,
                    std::string("is '") + b.value + "'", b.range},
                   ctx);
    GroupOptions explicit_options;
    explicit_options.timeout = std::chrono::milliseconds(500);
    explicit_options.num_sms = 4;
    expect_invalid([&] { (void)one_rank_group(explicit_options); }, {b.name, b.range},
                   ctx + " with explicit options");
  }
  // Processes too (the Python package's path).
  ScopedEnv e("EPX_TIMEOUT_MS", std::string("abc"));
  expect_invalid(
      [] { (void)Group::cpu_processes(0, 1, epx::testing::unique_group_name("envp")); },
      {"Group::cpu_processes: environment variable EPX_TIMEOUT_MS is 'abc', expected an integer "
       "1..86400000"},
      "cpu_processes");
}

TEST(Env, GroupTakesValidValues) {
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::string("1500"));
    EXPECT_EQ(one_rank_group().timeout().count(), 1500);
    GroupOptions o;
    o.timeout = std::chrono::milliseconds(700);  // the options win over the environment
    EXPECT_EQ(one_rank_group(o).timeout().count(), 700);
  }
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::nullopt);
    EXPECT_EQ(one_rank_group().timeout().count(), kDefaultGroupTimeoutMs);
  }
  {
    ScopedEnv e("EPX_NUM_SMS", std::string("24"));
    EXPECT_EQ(one_rank_group().options().num_sms, 24);
  }
}

// GroupOptions: the same ranges as the environment (0 = the default).
TEST(Env, GroupOptionsOutOfRangeAreInvalidArguments) {
  ScopedEnv e("EPX_TIMEOUT_MS", std::nullopt);
  for (int64_t ms : {int64_t{-5}, int64_t{-1}, kMaxGroupTimeoutMs + 1, int64_t{1} << 40}) {
    GroupOptions o;
    o.timeout = std::chrono::milliseconds(ms);
    expect_invalid([&] { (void)one_rank_group(o); },
                   {"Group::cpu_threads: GroupOptions::timeout is " + std::to_string(ms) +
                    " ms, expected 1..86400000 ms, or 0 for the default (EPX_TIMEOUT_MS, "
                    "else 30000)"},
                   std::to_string(ms));
  }
  for (int sms : {-1, -100, kMaxGroupNumSms + 1}) {
    GroupOptions o;
    o.num_sms = sms;
    expect_invalid([&] { (void)one_rank_group(o); },
                   {"Group::cpu_threads: GroupOptions::num_sms is " + std::to_string(sms) +
                    ", expected 0..1024 (0 = EPX_NUM_SMS, else auto)"},
                   std::to_string(sms));
  }
  GroupOptions edge;
  edge.timeout = std::chrono::milliseconds(kMaxGroupTimeoutMs);
  edge.num_sms = kMaxGroupNumSms;
  Group g = one_rank_group(edge);
  EXPECT_EQ(g.timeout().count(), kMaxGroupTimeoutMs);
  EXPECT_EQ(g.options().num_sms, kMaxGroupNumSms);
}

// Every rank of a group with a bad variable raises (no rank is left waiting for the others).
TEST(Env, EveryRankOfAGroupRaises) {
  ScopedEnv e("EPX_TIMEOUT_MS", std::string("-5"));
  const std::string name = epx::testing::unique_group_name("env-all");
  std::vector<std::thread> threads;
  std::vector<int> invalid(3, 0);
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        (void)Group::cpu_threads(r, 3, name);
      } catch (const Error& err) {
        invalid[r] = err.code() == ErrorCode::kInvalidArgument;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(invalid, std::vector<int>({1, 1, 1}));
}

}  // namespace
}  // namespace epx::detail
