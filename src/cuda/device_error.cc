// src/cuda/device_error.cc — the names of the signalling vocabulary (device_error.h) in host
// messages, shared by the cuda modes.
#include "cuda/device_error.h"

namespace epx::detail {

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
    case kOpA2aDispatch:
      return "a2a dispatch";
    case kOpA2aCombine:
      return "a2a combine";
    case kOpA2aResync:
      return "a2a set_active_ranks";
    case kOpLlDispatch:
      return "ll_dispatch";
    case kOpLlCombine:
      return "ll_combine";
    case kOpRailExchange:
      return "rail exchange";
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
    case kWaitSignal:
      return "the expert GEMM's signal";
    case kWaitRailPost:
      return "its rail partner's chunk of this exchange";
    case kWaitRailCopied:
      return "its rail partner to copy this rank's chunk";
    default:
      return "the peer";
  }
}

}  // namespace epx::detail
