// src/cuda/device_object.h — the lifecycle every cuda mode object shares: CudaHt (ht.h), CudaLl
// (ll.cu) and CudaA2a (a2a.cu) each own one DeviceObject. It holds
//   - the device (current for set-up, teardown and re-arming) and its multiprocessor count;
//   - the mode's symmetric region (collective allocation) and where its DeviceState lies;
//   - the device-error record in mapped pinned host memory (device_error.h) and the WaitContext
//     every kernel's params carry;
//   - the "unusable" state a timeout leaves (ht, ll; a2a's lives in epx::A2a), with the sentence
//     require_usable raises (OutOfStep: ht until Buffer::reset, ll until ll_clean / reset);
//   - the decode every mode shares: reading the record, the Timeout message (built from the
//     mode's words for what was awaited), the out-of-range expert id message, unknown codes,
//     re-arming the record and reading the abort word;
//   - the teardown order (close).
// What stays in each mode's check(): the order it raises its codes in, its own codes
// (kDevErrHt*, kDevErrLl*, kDevErrA2a*, kDevErrOutOfCapacity) and its words for the waits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "cuda/device_error.h"
#include "epx/error.h"
#include "epx/group.h"
#include "transport/transport.h"

namespace epx::detail {

class DeviceObject {
 public:
  // On group's device: its multiprocessor count, the group's timeout and a zeroed error record.
  // `where` names the object in CUDA errors of the set-up ("Buffer", "A2a").
  DeviceObject(const Group& group, const char* where);
  // Frees what close() did not (a mode constructor that threw): no synchronisation, no barrier.
  ~DeviceObject();
  DeviceObject(const DeviceObject&) = delete;
  DeviceObject& operator=(const DeviceObject&) = delete;

  int device() const { return device_; }
  int multiprocessors() const { return multiprocessors_; }
  uint64_t timeout_ns() const { return timeout_ns_; }

  // ---- the symmetric region
  // Collective (every rank, in the same order): `bytes` of symmetric memory, zeroed. The mode's
  // DeviceState (claim and abort words) lies at `state_off`.
  void allocate_region(size_t bytes, size_t state_off);
  size_t bytes() const { return mem_ ? mem_->bytes() : 0; }
  char* local() const { return static_cast<char*>(mem_->local()); }
  char* peer(int p) const { return static_cast<char*>(mem_->peer(p)); }
  DeviceState* device_state() const { return state_; }

  // ---- the error record
  // What kernels of operation `op` (DeviceOp) wait and report with.
  WaitContext wait_context(uint32_t op) const {
    return WaitContext{state_, error_dev_, timeout_ns_, group_.rank(), op};
  }
  DeviceErrorRecord* error_on_device() const { return error_dev_; }
  // The code of the record (kDevErrNone: none); a volatile read, no ordering.
  uint32_t recorded_code() const {
    return static_cast<volatile DeviceErrorRecord*>(error_host_)->code;
  }
  // The record, once the device completed it (its fields read after `code`, acquire); none
  // when no error was recorded.
  std::optional<DeviceErrorRecord> recorded() const;
  // After raising a record that leaves the device state consistent: clears it and the
  // device-side claim word so the device can report the next error (synchronous copy; error
  // paths only).
  void rearm();
  // Whether a wait of this rank set the abort word (device memory, synchronous copy; error
  // paths only): after rearm(), a timeout whose own report was lost because an earlier error
  // held the record. `where` names the operation in a CUDA error.
  bool abort_raised(const char* where) const;
  // The host side only (`code`): no record (ll_clean, after zeroing the device state; a2a
  // set_active_ranks, whose kernel clears the device side).
  void clear_record();

  // ---- what every mode raises alike (e: a record; its op names the operation)
  // A timeout as one mode words it: "<op>: rank R waited <ms> ms for <awaited> (rank P<seen>);
  // <unusable>".
  struct Timeout {
    std::string awaited;       // what rank e.rank waited for from rank e.peer
    const char* unusable;      // what the timeout leaves of the object
    int timeout_multiple = 1;  // the wait's bound in group timeouts (a2a set_active_ranks: 2)
    std::string seen = {};     // after the peer (ht: the flag's values)
    std::string earlier = {};  // a lost timeout's: the error that claimed the record first
  };
  [[noreturn]] void raise_timeout(const DeviceErrorRecord& e, const Timeout& t) const;
  // Timeout::seen of a flag wait: ", flag W wanted, S seen" ("" for kWaitBulkCopy).
  static std::string flag_values(const DeviceErrorRecord& e);
  // A wait timed out after error `first` had claimed the record (abort_raised): the timeout's
  // record, from the DeviceState fields kernels/sync.cuh's record_timeout keeps (op and rank of
  // `first`; peer -1 and what 0 when no timeout was kept, e.g. after a reset).
  DeviceErrorRecord lost_timeout(const DeviceErrorRecord& first) const;
  // kDevErrBadExpert: InvalidArgument naming the value and where it was; every other code:
  // Internal "unknown device error code" (the mode's check() raises its own codes before).
  [[noreturn]] static void raise_common(const DeviceErrorRecord& e, int64_t num_experts);

  // ---- unusable after an error (ht, ll)
  // From now on require_usable(op) raises `code` "<op>: <refusal>" (ht, ll: OutOfStep until
  // their reset; a2a: Internal until set_active_ranks).
  void set_unusable(ErrorCode code, std::string refusal) {
    refusal_code_ = code;
    refusal_ = std::move(refusal);
  }
  void set_usable() { refusal_.clear(); }
  bool usable() const { return refusal_.empty(); }
  void require_usable(const char* op) const;
  // Collective reset (ht reset, ll_clean): wait for this rank's kernels (bounded); resync every
  // rank, each waiting up to twice the timeout (a straggler still inside an operation times out
  // of it first); zero the region's first `control_bytes`; no record; `host_reset` (the mode's
  // host mirrors and call counters); usable again; a barrier named `done`, so that nobody
  // signals into a region not yet reset.
  void reset_region(const char* op, const char* done, size_t control_bytes,
                    const std::function<void()>& host_reset);
  // reset_region over the ranks this rank does not mask (the ll rank masks, enable_shrink; docs/
  // semantics.md §2.6): `mask` is this rank's mask word in the region (bit p = rank p, past
  // `control_bytes`, kept). Both barriers run over the unmasked ranks and mask, in `mask`, those
  // that do not arrive within twice the timeout instead of raising Timeout
  // (Transport::barrier_or_missing); no resync: those ranks passed the same barriers.
  void reset_region_masked(const char* op, const char* done, size_t control_bytes,
                           unsigned long long* mask, const std::function<void()>& host_reset);

  // ---- teardown, in this order, on this object's device (the caller's device restored after):
  // wait for the device (kernels are bounded, so this returns; then nothing of this rank uses
  // the region); the transport's destruction barrier named `barrier` unless null (it waits only
  // where ranks share a GPU: Transport::destruction_barrier); release the region (the transport
  // frees it once every rank released it: no barrier elsewhere, so ranks may destroy their
  // objects at different times, as Python's garbage collector does); `free_rest` (the mode's
  // other memory); free the error record. Never throws.
  void close(const char* barrier, const std::function<void()>& free_rest = {}) noexcept;

 private:
  Group group_;
  int device_ = 0;
  int multiprocessors_ = 0;
  uint64_t timeout_ns_ = 0;
  std::shared_ptr<SymmetricMemory> mem_;
  DeviceState* state_ = nullptr;
  DeviceErrorRecord* error_host_ = nullptr;  // mapped pinned memory
  DeviceErrorRecord* error_dev_ = nullptr;
  std::string refusal_;  // non-empty: unusable
  ErrorCode refusal_code_ = ErrorCode::kInternal;
};

}  // namespace epx::detail
