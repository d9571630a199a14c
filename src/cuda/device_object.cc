// src/cuda/device_object.cc — DeviceObject (device_object.h): the set-up, error record, decode
// and teardown the cuda modes share.
#include "cuda/device_object.h"

#include <cuda_runtime.h>

#include <atomic>

#include "core/check.h"
#include "cuda/cuda_check.h"

namespace epx::detail {

DeviceObject::DeviceObject(const Group& group, const char* where) : group_(group) {
  device_ = group.transport()->device().index;
  DeviceGuard guard(device_);
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device_),
                 where);
  timeout_ns_ = static_cast<uint64_t>(group.timeout().count()) * 1000000ull;
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(DeviceErrorRecord),
                               cudaHostAllocMapped | cudaHostAllocPortable),
                 where);
  *error_host_ = DeviceErrorRecord{};
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_host_, 0),
                 where);
}

DeviceObject::~DeviceObject() {
  mem_.reset();
  if (error_host_) cudaFreeHost(error_host_);
}

void DeviceObject::allocate_region(size_t bytes, size_t state_off) {
  mem_ = group_.transport()->allocate(bytes);  // collective; zeroed
  state_ = reinterpret_cast<DeviceState*>(local() + state_off);
}

std::optional<DeviceErrorRecord> DeviceObject::recorded() const {
  volatile DeviceErrorRecord* rec = error_host_;
  if (rec->code == kDevErrNone) return std::nullopt;
  std::atomic_thread_fence(std::memory_order_acquire);
  return DeviceErrorRecord{rec->code, rec->op, rec->rank, rec->peer, rec->a, rec->b};
}

void DeviceObject::rearm() {
  static_cast<volatile DeviceErrorRecord*>(error_host_)->code = kDevErrNone;
  DeviceGuard guard(device_);
  const uint32_t zero = 0;
  EPX_CUDA_CHECK(cudaMemcpy(&state_->error_claim, &zero, sizeof(zero), cudaMemcpyHostToDevice),
                 "check");
}

bool DeviceObject::abort_raised(const char* where) const {
  uint32_t aborted = 0;
  DeviceGuard guard(device_);
  EPX_CUDA_CHECK(cudaMemcpy(&aborted, &state_->abort, sizeof(aborted), cudaMemcpyDeviceToHost),
                 where);
  return aborted != 0;
}

void DeviceObject::clear_record() {
  static_cast<volatile DeviceErrorRecord*>(error_host_)->code = kDevErrNone;
}

void DeviceObject::raise_timeout(const DeviceErrorRecord& e, const Timeout& t) const {
  throw_error(ErrorCode::kTimeout,
              cat(device_op_name(e.op), ": rank ", e.rank, " waited ",
                  t.timeout_multiple * group_.timeout().count(), " ms for ", t.awaited, " (rank ",
                  e.peer, t.seen, ")", t.earlier, "; ", t.unusable));
}

std::string DeviceObject::flag_values(const DeviceErrorRecord& e) {
  if (e.a == kWaitBulkCopy) return "";
  const auto b = static_cast<uint64_t>(e.b);
  return cat(", flag ", b >> 32, " wanted, ", b & 0xffffffffu, " seen");
}

DeviceErrorRecord DeviceObject::lost_timeout(const DeviceErrorRecord& first) const {
  DeviceState st{};
  DeviceGuard guard(device_);
  EPX_CUDA_CHECK(cudaMemcpy(&st, state_, sizeof(st), cudaMemcpyDeviceToHost), "check");
  DeviceErrorRecord t{kDevErrTimeout, first.op, group_.rank(), -1, 0, 0};
  if (st.lost_claim) {
    t.peer = st.lost_peer;
    t.a = static_cast<int64_t>(static_cast<uint64_t>(st.lost_what_hi) << 32 | st.lost_what);
    t.b = st.lost_b;
  }
  return t;
}

void DeviceObject::raise_common(const DeviceErrorRecord& e, int64_t num_experts) {
  const char* op = device_op_name(e.op);
  if (e.code == kDevErrBadExpert) {
    throw_error(
        ErrorCode::kInvalidArgument,
        cat(op, ": argument 'topk_idx' has value ", e.b, " at [", e.a / 64, ", ", e.a % 64,
            "] (found on the device of rank ", e.rank, "), expected -1 or an expert id in [0, ",
            num_experts, "); that selection was dropped"));
  }
  throw_error(ErrorCode::kInternal, cat(op, ": unknown device error code ", e.code));
}

void DeviceObject::reset_region(const char* op, const char* done, size_t control_bytes,
                                const std::function<void()>& host_reset) {
  DeviceGuard guard(device_);
  EPX_CUDA_CHECK(cudaDeviceSynchronize(), op);  // every kernel is bounded
  group_.transport()->resync(op, group_.transport()->all_members(), 2 * group_.timeout());
  EPX_CUDA_CHECK(cudaMemset(local(), 0, control_bytes), op);
  EPX_CUDA_CHECK(cudaDeviceSynchronize(), op);
  clear_record();
  if (host_reset) host_reset();
  set_usable();
  group_.transport()->barrier(done);
}

void DeviceObject::reset_region_masked(const char* op, const char* done, size_t control_bytes,
                                       unsigned long long* mask,
                                       const std::function<void()>& host_reset) {
  DeviceGuard guard(device_);
  Transport& t = *group_.transport();
  EPX_CUDA_CHECK(cudaDeviceSynchronize(), op);  // every kernel is bounded
  unsigned long long masked = 0;
  EPX_CUDA_CHECK(cudaMemcpy(&masked, mask, sizeof(masked), cudaMemcpyDeviceToHost), op);
  auto barrier = [&](const char* what) {
    masked |= t.barrier_or_missing(what, t.all_members() & ~masked, 2 * group_.timeout());
    EPX_CUDA_CHECK(cudaMemcpy(mask, &masked, sizeof(masked), cudaMemcpyHostToDevice), op);
  };
  barrier(op);
  EPX_CUDA_CHECK(cudaMemset(local(), 0, control_bytes), op);
  EPX_CUDA_CHECK(cudaDeviceSynchronize(), op);
  clear_record();
  if (host_reset) host_reset();
  set_usable();
  barrier(done);  // nobody signals into a region not yet reset
}

void DeviceObject::require_usable(const char* op) const {
  EPX_CHECK(refusal_.empty(), refusal_code_, op, ": ", refusal_);
}

void DeviceObject::close(const char* barrier, const std::function<void()>& free_rest) noexcept {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  if (barrier && mem_) group_.transport()->destruction_barrier(barrier);
  mem_.reset();
  if (free_rest) free_rest();
  if (error_host_) cudaFreeHost(error_host_);
  error_host_ = nullptr;
  error_dev_ = nullptr;
  cudaSetDevice(previous);
}

}  // namespace epx::detail
