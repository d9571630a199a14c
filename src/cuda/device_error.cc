// src/cuda/device_error.cc — the host side of the device-error record (device_error.h), shared by
// the cuda modes.
#include "cuda/device_error.h"

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"

namespace epx::detail {

void rearm_device_error(volatile DeviceErrorRecord* record, uint32_t* claim_on_device, int device) {
  record->code = kDevErrNone;
  DeviceGuard guard(device);
  const uint32_t zero = 0;
  EPX_CUDA_CHECK(cudaMemcpy(claim_on_device, &zero, sizeof(zero), cudaMemcpyHostToDevice), "check");
}

const char* device_op_name(uint32_t op) {
  switch (op) {
    case kOpHtLayout:
      return "ht_layout";
    case kOpHtNotify:
      return "ht_dispatch (count exchange)";
    case kOpHtDispatch:
      return "ht_dispatch";
    case kOpHtCombine:
      return "ht_combine";
    case kOpBarrier:
      return "barrier";
    default:
      return "device operation";
  }
}

const char* device_wait_name(uint32_t what) {
  switch (what) {
    case kWaitReady:
      return "the peer to finish its previous operation";
    case kWaitCounts:
      return "the peer's token counts";
    case kWaitRows:
      return "rows from the peer";
    case kWaitBarrier:
      return "the peer at a barrier";
    case kWaitBulkCopy:
      return "its own bulk load to land (staged combine)";
    default:
      return "the peer";
  }
}

}  // namespace epx::detail
