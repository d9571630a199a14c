#include "core/env.h"

#include <cstdlib>
#include <string>

#include "core/check.h"

namespace epx::detail {

namespace {

// The variable's value, or nullptr when unset or empty.
const char* env_value(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

[[noreturn]] void bad_value(const char* name, const char* value, const std::string& expected) {
  throw_error(ErrorCode::kInvalidArgument,
              cat("environment variable ", name, " is '", value, "', expected ", expected));
}

// A decimal integer in [lo, hi], digits only (no sign, spaces or suffix); `fallback` when unset.
int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback,
                const std::string& expected) {
  const char* v = env_value(name);
  if (!v) return fallback;
  int64_t x = 0;
  for (const char* p = v; *p; ++p) {
    if (*p < '0' || *p > '9') bad_value(name, v, expected);
    x = x * 10 + (*p - '0');
    if (x > hi) bad_value(name, v, expected);  // also stops before an overflow
  }
  if (x < lo) bad_value(name, v, expected);
  return x;
}

// "0", "1" or unset (-1).
int env_switch(const char* name, const std::string& expected) {
  const char* v = env_value(name);
  if (!v) return -1;
  const std::string s(v);
  if (s == "0") return 0;
  if (s == "1") return 1;
  bad_value(name, v, expected);
}

}  // namespace

std::chrono::milliseconds env_default_timeout() {
  return std::chrono::milliseconds(env_int(
      "EPX_TIMEOUT_MS", 1, kMaxTimeoutMs, kDefaultTimeoutMs,
      cat("an integer 1..", kMaxTimeoutMs, " (milliseconds; unset: ", kDefaultTimeoutMs, ")")));
}

int env_default_num_sms() {
  return static_cast<int>(env_int("EPX_NUM_SMS", 0, kMaxNumSms, 0,
                                  cat("an integer 0..", kMaxNumSms, " (0 or unset: auto)")));
}

int env_pdl() {
  // A value meant to disable PDL must never enable it: only "1" turns it on, and anything but
  // "0" or "1" is an error.
  return env_switch("EPX_PDL",
                    "1 (programmatic dependent launch for the ht and ll kernels), 0 or unset "
                    "(off, the default)");
}

std::string env_cuda_module_loading() {
  const char* v = std::getenv("CUDA_MODULE_LOADING");
  return v ? std::string(v) : std::string();
}

int env_cuda_device_max_connections() {
  return static_cast<int>(env_int("CUDA_DEVICE_MAX_CONNECTIONS", 1, 32, 8,
                                  "an integer 1..32 (CUDA's range; unset: 8)"));
}

bool env_one_gpu_side_streams() {
  return env_switch("EPX_ONE_GPU_SIDE_STREAMS",
                    "1 (the one-GPU test mode takes the side-stream paths), 0 or unset (it does "
                    "not)") == 1;
}

int env_torch_bridge() {
  return env_switch("EPX_TORCH_BRIDGE",
                    "1 or unset (the Python package reads tensors and makes outputs through ATen "
                    "where epx._epx_torch is built), 0 (through torch's Python methods)");
}

std::string env_ll_trace_dump() {
  const char* v = env_value("EPX_LL_TRACE_DUMP");
  return v ? std::string(v) : std::string();
}

int64_t env_ll_trace_from() {
  return env_int(
      "EPX_LL_TRACE_FROM", 1, kMaxLlTraceFrom, 1,
      cat("an integer 1..", kMaxLlTraceFrom, " (the first dispatch to record; unset: 1)"));
}

int env_ll_ablate() {
  return static_cast<int>(env_int(
      "EPX_LL_ABLATE", 0, kMaxLlAblate, 0,
      cat("an integer 0..", kMaxLlAblate, " (LlAblate bits of a -DEPX_DIAGNOSTICS=ON build, "
          "cuda/tuning.h; unset: 0)")));
}

void check_environment(const char* op) {
  try {
    (void)env_default_timeout();
    (void)env_default_num_sms();
    (void)env_pdl();
    (void)env_one_gpu_side_streams();
    (void)env_torch_bridge();
    (void)env_ll_trace_from();
    (void)env_ll_ablate();
  } catch (const Error& e) {
    rethrow_with_op(e, op);
  }
}

void rethrow_with_op(const Error& e, const char* op) {
  // "epx invalid_argument: <message>" -> "epx invalid_argument: <op>: <message>"
  std::string m = e.what();
  const std::string prefix = cat("epx ", error_code_name(e.code()), ": ");
  if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
  throw_error(e.code(), cat(op, ": ", m));
}

}  // namespace epx::detail
