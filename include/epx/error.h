// epx/error.h — the one exception type of the public API (docs/semantics.md §4).
//
// Every failure surfaces as epx::Error with a code and a message that names the argument, the
// value seen and what was expected. Device-side failures (timeouts, out-of-range expert ids) are
// recorded on the device and raised by the next host call on the same buffer, or by check().
#pragma once

#include <stdexcept>
#include <string>

namespace epx {

enum class ErrorCode {
  kInvalidArgument,  // bad shape, dtype, stride, device, value range
  kUnsupported,      // valid request this build/backend cannot honour
  kOutOfCapacity,    // T > T_max, N > num_worst_tokens, T > runtime_max, buffer too small
  kTimeout,          // a peer never arrived at a collective point within the group's timeout
  kCuda,             // a CUDA runtime/driver call failed
  kNccl,             // an NCCL call failed
  kInternal,         // a bug in epx, or a peer that aborted the collective
  kOutOfStep,        // ranks at different collective calls (a peer at another operation or call
                     // number), or an object that refuses operations after a Timeout until its
                     // collective reset (docs/semantics.md §4.3)
};

// Stable lower-case name of a code ("invalid_argument", "timeout", ...).
const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace epx
