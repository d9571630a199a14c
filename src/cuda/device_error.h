// src/cuda/device_error.h — how kernels report failures to the host (docs/semantics.md §4): a
// record in mapped pinned host memory, written once per error by the first device thread that
// claims it.
//
// Protocol: a thread that detects an error claims the device-side word HtState::error_claim with
// atomicCAS (device memory: host-memory atomics are not native over PCIe), writes the fields of
// DeviceErrorRecord, __threadfence_system(), then stores `code` last. The host reads `code`
// (volatile); non-zero means the fields are complete. After raising, the host clears both.
// Timeouts also set HtState::abort so every other wait of the kernel stops promptly.
#pragma once

#include <cstdint>

namespace epx::detail {

enum DeviceOp : uint32_t {
  kOpNone = 0,
  kOpHtLayout = 1,
  kOpHtNotify = 2,  // ht count exchange (first half of an exact / worst-case dispatch)
  kOpHtDispatch = 3,
  kOpHtCombine = 4,
  kOpBarrier = 5,
};

enum DeviceErrorCode : uint32_t {
  kDevErrNone = 0,
  kDevErrTimeout = 1,        // a = what was awaited (DeviceWait), b = wanted << 32 | seen
                             // (flag waits; the parity for kWaitBulkCopy)
  kDevErrBadExpert = 2,      // a = token index * 64 + k, b = expert id seen
  kDevErrOutOfCapacity = 3,  // a = rows needed (N), b = rows available (num_worst_tokens)
  // ht count exchange: a source's per-call values differ from this rank's (HtCallField; the
  // first that differs). a = field << 32 | the source's word, b = this rank's word, peer = the
  // source. Every rank meets at least one source that differs, so every rank raises.
  kDevErrHtCallDiffers = 4,
};

// The per-call values an ht count exchange message carries (HtCountMsg::call) and compares.
enum HtCallField : uint32_t {
  kHtCallFormat = 0,     // ht_call_format(): x dtype, scales dtype, zero_copy, topk_weights given
  kHtCallWorst = 1,      // num_worst_tokens (folded to 32 bits)
  kHtCallAlignment = 2,  // expert_alignment
};
// x dtype in bits 0-7, scales dtype + 1 in bits 8-15 (0: none), zero_copy bit 16, topk_weights
// given bit 17.
inline uint32_t ht_call_format(int x_dtype, int scale_dtype, bool zero_copy, bool has_weights) {
  return static_cast<uint32_t>(x_dtype & 0xff) | static_cast<uint32_t>((scale_dtype + 1) & 0xff)
         << 8 | (zero_copy ? 1u << 16 : 0u) | (has_weights ? 1u << 17 : 0u);
}

enum DeviceWait : uint32_t {
  kWaitReady = 1,     // the peer finishing its previous operation (its region free again)
  kWaitCounts = 2,    // the peer's token counts (count exchange)
  kWaitRows = 3,      // rows from the peer (dispatch / combine data)
  kWaitBarrier = 4,   // the peer arriving at a device barrier
  kWaitBulkCopy = 5,  // this rank's own bulk load (ht staged pull reducer) never landed
};

struct DeviceErrorRecord {
  uint32_t code;  // DeviceErrorCode; written last
  uint32_t op;    // DeviceOp
  int32_t rank;   // the rank that detected it
  int32_t peer;   // the peer waited for, or -1
  int64_t a;
  int64_t b;
};

// Per-rank device state of one buffer (device memory, zeroed at allocation).
struct DeviceState {
  uint32_t seq;          // operations completed on this rank (all ranks advance in lock-step)
  uint32_t finished;     // CTAs of the running operation that have finished (last-CTA pattern)
  uint32_t abort;        // set by a timed-out wait: every other wait of this rank stops
  uint32_t error_claim;  // first device error wins the host record
  uint32_t engine_op;    // ht combine with copy engines: the op its side-stream steps signal
  // ht zero-copy dispatch: the op whose ready signal was deferred (when ready_pending_set). The
  // next ht op's first kernel publishes it at its start (publish_deferred_ready): by stream order
  // every read of the zero-copy recv_x queued before that op has finished.
  uint32_t ready_pending;
  uint32_t ready_pending_set;  // 1 while ready_pending holds a value (any op number, 0 included)
  // ht dispatch: batches drawn so far by the sender warps (the next drawn batch is G + send_next,
  // G = sender warps: batch gw is warp gw's first); the dispatch's finishing CTA sets it to 0.
  uint32_t send_next;
};

const char* device_op_name(uint32_t op);

// After the host raised a non-fatal record: clears the record and the device-side claim word so
// the device can report the next error (synchronous cudaMemcpy on `device`; error paths only).
void rearm_device_error(volatile DeviceErrorRecord* record, uint32_t* claim_on_device, int device);
const char* device_wait_name(uint32_t what);

}  // namespace epx::detail
