#include "core/env.h"

#include <cstdlib>
#include <string>

namespace epx::detail {

static long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == '\0' && x >= 0) ? x : fallback;
}

std::chrono::milliseconds env_default_timeout() {
  return std::chrono::milliseconds(env_long("EPX_TIMEOUT_MS", 30000));
}

int env_default_num_sms() {
  return static_cast<int>(env_long("EPX_NUM_SMS", 0));
}

int env_pdl() {
  const char* v = std::getenv("EPX_PDL");
  if (!v || !*v) return -1;  // unset: each kernel family's default
  // Set: 1 turns PDL on; anything else ("0", "off", a typo) off — a value meant to disable it
  // must never enable it.
  return env_long("EPX_PDL", 0) == 1 ? 1 : 0;
}

std::string env_cuda_module_loading() {
  const char* v = std::getenv("CUDA_MODULE_LOADING");
  return v ? std::string(v) : std::string();
}

int env_cuda_device_max_connections() {
  const long v = env_long("CUDA_DEVICE_MAX_CONNECTIONS", 8);
  return static_cast<int>(v > 32 ? 32 : v);  // CUDA's limit
}

bool env_one_gpu_side_streams() {
  const char* v = std::getenv("EPX_ONE_GPU_SIDE_STREAMS");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace epx::detail
