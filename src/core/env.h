// src/core/env.h — the one place epx reads environment variables.
//   EPX_TIMEOUT_MS   default bound on every wait for a peer (30000)
//   EPX_NUM_SMS      default SM budget of the cuda kernels (0 = auto)
#pragma once

#include <chrono>

namespace epx::detail {

std::chrono::milliseconds env_default_timeout();
int env_default_num_sms();

}  // namespace epx::detail
