// src/transport/nccl_check.h — NCCL return codes as epx::Error (kNccl) naming the call, the
// operation and NCCL's last error. For the NCCL transport and the NCCL rail (CUDA builds only).
#pragma once

#include <nccl.h>

#include <string>

#include "core/check.h"

namespace epx::detail {

[[noreturn]] inline void throw_nccl(ncclResult_t r, const char* call, const char* where) {
  const char* last = ncclGetLastError(nullptr);
  throw_error(ErrorCode::kNccl, cat(where, ": ", call, " failed: ", ncclGetErrorString(r),
                                    (last && last[0]) ? cat(" (", last, ")") : std::string()));
}

// EPX_NCCL_CHECK(ncclSend(...), "ht_dispatch (rail)") throws Nccl naming the call and `where`.
#define EPX_NCCL_CHECK(call, where)                                             \
  do {                                                                          \
    ncclResult_t epx_r_ = (call);                                               \
    if (epx_r_ != ncclSuccess) ::epx::detail::throw_nccl(epx_r_, #call, where); \
  } while (0)

}  // namespace epx::detail
