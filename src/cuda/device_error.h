// src/cuda/device_error.h — the signalling vocabulary the cuda modes share (docs/semantics.md
// §4): what a kernel reports to the host (DeviceOp, DeviceErrorCode, DeviceWait and the fields
// they name), the record it reports in, the per-rank device state its waits use, and the
// WaitContext every kernel's params carry. One header for ht, ll and a2a: kernels (through
// kernels/sync.cuh, the memory-ordering helpers and the bounded wait) and host objects
// (device_object.h, which reads the record) name the same values.
//
// The record lives in mapped pinned host memory and is written once per error by the first
// device thread that claims it.
//
// Protocol: a thread that detects an error claims the device-side word DeviceState::error_claim
// with atomicCAS (device memory: host-memory atomics are not native over PCIe), writes the fields
// of DeviceErrorRecord, __threadfence_system(), then stores `code` last. The host reads `code`
// (volatile); non-zero means the fields are complete. After raising, the host clears both
// (DeviceObject::rearm). Timeouts also set DeviceState::abort so every other wait of the kernel
// stops promptly.
#pragma once

#include <cstdint>

namespace epx::detail {

// DeviceErrorRecord::op: the operation whose kernel reported (device_op_name: its name in
// messages). ht 1-5, a2a 16-18, ll 32-33, the device-copy rail 48.
enum DeviceOp : uint32_t {
  kOpNone = 0,
  kOpHtLayout = 1,
  kOpHtNotify = 2,  // ht count exchange (first half of an exact / worst-case dispatch)
  kOpHtDispatch = 3,
  kOpHtCombine = 4,
  kOpBarrier = 5,
  kOpA2aDispatch = 16,
  kOpA2aCombine = 17,
  kOpA2aResync = 18,  // a2a set_active_ranks
  kOpLlDispatch = 32,
  kOpLlCombine = 33,
  kOpRailExchange = 48,  // RailTransport::exchange of the device-copy rail (device_copy_rail.h)
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
  // a2a: a peer used another geometry in the same call. a = field (A2aGeometryField) << 32 |
  // this rank's value (as uint32), b = the peer's value, peer = the peer.
  kDevErrA2aGeometry = 16,
  // a2a set_active_ranks: an active peer applies another mask. a = this rank's active mask, b =
  // the peer's, peer = the peer.
  kDevErrA2aMask = 17,
  // ll: a source used other quantisation options in the same dispatch. a = the source's format
  // (use_fp8 | round_scale << 1 | use_nvfp4 << 2) | its NVFP4 global scale's bits << 32 (0
  // without use_nvfp4), b = this rank's, peer = the source.
  kDevErrLlFormat = 32,
  // ll combine: topk_idx selects expert b more often than its rank received from this rank (a =
  // token * 64 + k, peer = the expert's rank): not the dispatch's topk_idx. The selection is
  // skipped.
  kDevErrLlCombineRows = 33,
  // ll combine: a rank used another combine format (use_logfmt | overlap << 1) in the same
  // combine. a = that rank's, b = this rank's, peer = that rank.
  kDevErrLlCombineFormat = 34,
  // ll overlapped combine: overlap.recv_count[a] (b >> 32) differs from the handle's rows of
  // local expert a (b & 0xFFFFFFFF).
  kDevErrLlOverlapCount = 35,
  // ll overlapped combine: source `peer`'s topk_idx row a (its token) does not select expert b,
  // which the dispatch delivered to this rank: not the dispatch's topk_idx. The row is not sent.
  kDevErrLlOverlapRoute = 36,
  // ll combine (row map): topk_idx[a / 64][a % 64] selects expert b, which the dispatch that made
  // the handle did not deliver there from this rank (peer = the expert's rank): not the
  // dispatch's topk_idx. The selection is skipped.
  kDevErrLlCombineNotSent = 37,
  // device-copy rail: the partner (peer) posted another exchange than this rank's (ranks out of
  // step). a = the partner's leg tag << 32 | its exchange number, b = this rank's, the same way.
  kDevErrRailStep = 48,
  // device-copy rail: the partner (peer) posted a = bytes for this rank, which receives b bytes.
  kDevErrRailBytes = 49,
};

// The per-call values an ht count exchange message carries (HtCountMsg::call) and compares.
enum HtCallField : uint32_t {
  kHtCallFormat = 0,     // ht_call_format(): x dtype, scales dtype, zero_copy, topk_weights given
  kHtCallWorst = 1,      // num_worst_tokens (folded to 32 bits)
  kHtCallAlignment = 2,  // expert_alignment
};
// x dtype in bits 0-7, scales dtype + 1 in bits 8-15 (0: none), zero_copy bit 16, topk_weights
// given bit 17; the operation (HtCallKind) in bits 24-31 of the word the cached dispatch and the
// combine compare on arrival (the count exchange's is the exact / worst-case dispatch's, 0).
enum HtCallKind : uint32_t { kHtCallExchange = 0, kHtCallCached = 1, kHtCallCombine = 2 };
inline uint32_t ht_call_format(int x_dtype, int scale_dtype, bool zero_copy, bool has_weights,
                               HtCallKind kind = kHtCallExchange) {
  return static_cast<uint32_t>(x_dtype & 0xff) | static_cast<uint32_t>((scale_dtype + 1) & 0xff)
         << 8 | (zero_copy ? 1u << 16 : 0u) | (has_weights ? 1u << 17 : 0u) |
         static_cast<uint32_t>(kind) << 24;
}

// kDevErrA2aGeometry: which value differs.
enum A2aGeometryField : int64_t {
  kGeomRuntimeMax = 0,     // dispatch: runtime_max_tokens_per_rank
  kGeomRowBytes = 1,       // dispatch: + payload index: bytes per token of the payload
  kGeomCombineHidden = 9,  // combine: H of y
  kGeomCombineDtype = 10,  // combine: DType of y
};

// kDevErrTimeout: what was awaited (DeviceErrorRecord::a; device_wait_name: the generic words,
// each mode's host object may word it for its protocol).
enum DeviceWait : uint32_t {
  kWaitReady = 1,     // the peer finishing its previous operation (its region free again)
  kWaitCounts = 2,    // the peer's token counts (count exchange)
  kWaitRows = 3,      // rows from the peer (dispatch / combine data)
  kWaitBarrier = 4,   // the peer arriving at a device barrier
  kWaitBulkCopy = 5,  // this rank's own bulk load (ht staged pull reducer) never landed
  // ll overlapped combine: the GEMM's signal of (local expert peer, block a >> 32) never reached
  // the value wanted (the record's peer is the expert, not a rank).
  kWaitSignal = 6,
  kWaitRailPost = 7,    // device-copy rail: the partner posting its chunk of this exchange
  kWaitRailCopied = 8,  // device-copy rail: the partner copying this rank's chunk
};

struct DeviceErrorRecord {
  uint32_t code;  // DeviceErrorCode; written last
  uint32_t op;    // DeviceOp
  int32_t rank;   // the rank that detected it
  int32_t peer;   // the peer waited for, or -1
  int64_t a;
  int64_t b;
};

// Per-rank device state of one mode's region (device memory, zeroed at allocation; ll and a2a
// use only abort and error_claim).
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
  // The first timeout after another error claimed the record (kernels/sync.cuh record_timeout):
  // its fields as DeviceErrorRecord's (what = a), so the host can say which wait timed out.
  uint32_t lost_claim;
  uint32_t lost_what;
  int32_t lost_peer;
  uint32_t lost_what_hi;
  int64_t lost_b;
};

// Everything a bounded wait and the error path need; part of every kernel's params
// (DeviceObject::wait_context fills it; kernels/sync.cuh: wait_flag, record_error).
struct WaitContext {
  DeviceState* state;
  DeviceErrorRecord* error;  // mapped pinned host memory (device pointer)
  uint64_t timeout_ns;
  int32_t rank;
  uint32_t op;  // DeviceOp
};

// The names of DeviceOp and DeviceWait values in host messages.
const char* device_op_name(uint32_t op);
const char* device_wait_name(uint32_t what);

}  // namespace epx::detail
