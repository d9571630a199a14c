#include "epx/error.h"

namespace epx {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kOutOfCapacity: return "out_of_capacity";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kCuda: return "cuda";
    case ErrorCode::kNccl: return "nccl";
    case ErrorCode::kInternal: return "internal";
    case ErrorCode::kOutOfStep: return "out_of_step";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string("epx ") + error_code_name(code) + ": " + message),
      code_(code) {}

}  // namespace epx
