// src/core/env.h — the one place epx reads environment variables. Every value is checked: a value
// outside the documented range throws InvalidArgument naming the variable, the value and the
// range (docs/semantics.md §4.1 has the table). Empty counts as unset. check_environment() runs at
// every group creation, so a bad value surfaces there even where the variable is read later.
//   EPX_TIMEOUT_MS   default bound on every wait for a peer: 1..kMaxTimeoutMs ms (unset: 30000);
//                    GroupOptions::timeout and the Python timeout take the same range
//   EPX_NUM_SMS      default SM budget of the cuda kernels: 0..kMaxNumSms (unset or 0 = auto);
//                    GroupOptions::num_sms and the Python num_sms take the same range
//   EPX_PDL          programmatic dependent launch of the cuda kernels (sm_90; never in the
//                    one-GPU test mode): 1 on for the ht and ll kernels, 0 or unset off (the
//                    default, cuda/launch.h)
//   EPX_ONE_GPU_SIDE_STREAMS  1: the one-GPU test mode (ranks sharing a GPU) also lets the copy
//                    engines copy the ht kept rows on a side stream per Buffer, as ranks with GPUs
//                    of their own do; otherwise (0 or unset) the kernels move every row there.
//                    Opt-in because the driver may put a Buffer's side stream in the same
//                    hardware queue as a peer's stream, and work queued behind a peer's spinning
//                    kernel then stalls until the group timeout.
//   EPX_TORCH_BRIDGE 0: the Python package reads input tensors and makes outputs through torch's
//                    Python methods even where epx._epx_torch (the ATen path, python/src/
//                    torch_aten.cc) is built; 1 or unset: through ATen there (read by
//                    epx/_torch.py at import through _epx; checked here at group creation)
//   EPX_LL_TRACE_DUMP  profiling builds (-DEPX_LL_TRACE=ON) only: a path; every ll dispatch's phase
//                    stamps are appended to <path>.rank<r> (kernels/ll/trace.cuh LlTraceRecord)
//   EPX_LL_TRACE_FROM  with it: the first dispatch of a buffer to record, 1..10^15 (unset: 1)
//   EPX_LL_ABLATE    diagnostics builds (-DEPX_DIAGNOSTICS=ON) only: LlAblate bits (cuda/tuning.h)
//                    applied to every ll launch of the process, 0..kMaxLlAblate (unset: 0)
//   CUDA_DEVICE_MAX_CONNECTIONS  read (not set) by the one-GPU test mode: 1..32 (8 when unset, as
//                    CUDA); checked when that mode's group is created
//   CUDA_MODULE_LOADING          read (not set) by the one-GPU test mode, which needs EAGER
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "epx/error.h"
#include "epx/group.h"

namespace epx::detail {

// The ranges the environment, GroupOptions and the Python package share.
inline constexpr int64_t kDefaultTimeoutMs = kDefaultGroupTimeoutMs;  // epx/group.h
inline constexpr int64_t kMaxTimeoutMs = kMaxGroupTimeoutMs;
inline constexpr int kMaxNumSms = kMaxGroupNumSms;
inline constexpr int64_t kMaxLlTraceFrom = 1000000000000000;  // EPX_LL_TRACE_FROM
inline constexpr int kMaxLlAblate = 0xFFFF;                     // EPX_LL_ABLATE

// Each throws InvalidArgument naming the variable when its value is out of range.
std::chrono::milliseconds env_default_timeout();
int env_default_num_sms();
int env_cuda_device_max_connections();
std::string env_cuda_module_loading();  // CUDA_MODULE_LOADING as set ("" when unset: LAZY)
int env_pdl();                          // EPX_PDL: -1 unset or empty, 1 when "1", 0 when "0"
bool env_one_gpu_side_streams();        // EPX_ONE_GPU_SIDE_STREAMS == "1"
int env_torch_bridge();                 // EPX_TORCH_BRIDGE: -1 unset or empty, 1 or 0
std::string env_ll_trace_dump();        // EPX_LL_TRACE_DUMP ("" when unset)
int64_t env_ll_trace_from();            // EPX_LL_TRACE_FROM (1 when unset)
int env_ll_ablate();                    // EPX_LL_ABLATE: LlAblate bits (0 when unset)

// Reads every EPX_* variable above and throws InvalidArgument for the first invalid one, its
// message starting with `op` (the group constructor). Called at every group creation.
void check_environment(const char* op);
// Throws `e` again with "<op>: " in front of its message.
[[noreturn]] void rethrow_with_op(const Error& e, const char* op);

}  // namespace epx::detail
