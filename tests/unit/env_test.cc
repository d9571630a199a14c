// The environment variables epx reads (core/env.h): defaults, and values that are not numbers.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "core/env.h"
#include "support/scoped_env.h"

namespace epx::detail {
namespace {

using testing::ScopedEnv;

// EPX_PDL: unset (or empty) leaves each kernel family its default (-1); "1" turns PDL on; any
// other value turns it off — a value written to disable it ("off", "false", "2") never enables it.
TEST(Env, PdlIsOnlyOnForOneAndDefaultOnlyWhenUnset) {
  {
    ScopedEnv e("EPX_PDL", std::nullopt);
    EXPECT_EQ(env_pdl(), -1);
  }
  {
    ScopedEnv e("EPX_PDL", std::string());
    EXPECT_EQ(env_pdl(), -1);
  }
  {
    ScopedEnv e("EPX_PDL", std::string("1"));
    EXPECT_EQ(env_pdl(), 1);
  }
  for (const char* off : {"0", "off", "false", "no", "2", "-1", "1 ", "one"}) {
    ScopedEnv e("EPX_PDL", std::string(off));
    EXPECT_EQ(env_pdl(), 0) << "EPX_PDL='" << off << "'";
  }
}

TEST(Env, NumbersFallBackToDefaultsWhenNotNumbers) {
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::nullopt);
    EXPECT_EQ(env_default_timeout().count(), 30000);
  }
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::string("1500"));
    EXPECT_EQ(env_default_timeout().count(), 1500);
  }
  {
    ScopedEnv e("EPX_TIMEOUT_MS", std::string("soon"));
    EXPECT_EQ(env_default_timeout().count(), 30000);
  }
  {
    ScopedEnv e("EPX_NUM_SMS", std::string("24"));
    EXPECT_EQ(env_default_num_sms(), 24);
  }
  {
    ScopedEnv e("EPX_NUM_SMS", std::string("-3"));
    EXPECT_EQ(env_default_num_sms(), 0);
  }
}

}  // namespace
}  // namespace epx::detail
