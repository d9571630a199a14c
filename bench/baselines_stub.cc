// Built without CUDA: the baselines do not exist on the cpu backend.
#include "bench/baselines.h"

#include "epx/error.h"

namespace epx::bench {

static Error no_cuda(const char* what) {
  return Error(ErrorCode::kUnsupported,
               std::string(what) + ": needs the cuda backend (epx was built without CUDA)");
}
Timing time_on_device(const Group&, void*, int, int, const std::function<void()>&, TimeMethod) {
  throw no_cuda("time_on_device");
}
Timing nccl_all_to_all(const Group&, size_t, int, int, TimeMethod) {
  throw no_cuda("nccl_all_to_all");
}
Timing nvlink_copy_ceiling(const Group&, size_t, int, int, int, TimeMethod) {
  throw no_cuda("nvlink_copy_ceiling");
}

}  // namespace epx::bench
