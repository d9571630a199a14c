// src/core/env.h — the one place epx reads environment variables.
//   EPX_TIMEOUT_MS   default bound on every wait for a peer (30000)
//   EPX_NUM_SMS      default SM budget of the cuda kernels (0 = auto)
//   EPX_PDL          programmatic dependent launch of the cuda kernels (sm_90; never in the
//                    one-GPU test mode): 1 ht and ll; unset or any other value: none
//   EPX_ONE_GPU_SIDE_STREAMS  1: the one-GPU test mode (ranks sharing a GPU) also lets the copy
//                    engines copy the ht kept rows on a side stream per Buffer, as ranks with GPUs
//                    of their own do; otherwise the kernels move every row there. Opt-in because
//                    the driver may put a Buffer's side stream in the same hardware queue as a
//                    peer's stream, and work queued behind a peer's spinning kernel then stalls
//                    until the group timeout.
//   CUDA_DEVICE_MAX_CONNECTIONS  read (not set) by the one-GPU test mode (8 when unset, as CUDA;
//                    at most 32 count)
//   CUDA_MODULE_LOADING          read (not set) by the one-GPU test mode, which needs EAGER
#pragma once

#include <chrono>
#include <string>

namespace epx::detail {

std::chrono::milliseconds env_default_timeout();
int env_default_num_sms();
int env_cuda_device_max_connections();
std::string env_cuda_module_loading();  // CUDA_MODULE_LOADING as set ("" when unset: LAZY)
int env_pdl();         // EPX_PDL: -1 unset or empty, 1 when "1", 0 for any other value
bool env_one_gpu_side_streams();  // EPX_ONE_GPU_SIDE_STREAMS == "1"

}  // namespace epx::detail
