#include "cpu/cpu_buffer.h"

namespace epx::detail {

CpuBuffer::CpuBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config,
                     uint64_t id)
    : BufferImpl(group, shape, config, id) {
  const int R = group.size();
  if (config.enable_ht) ht_mem_ = transport().allocate(cpu_ht_bytes(shape, R));
  if (config.enable_ll) ll_mem_ = transport().allocate(cpu_ll_bytes(shape, R));
}

std::string Stamp::describe() const {
  const uint64_t c = call.load(std::memory_order_acquire);
  if (c == 0) return "no call of this generation (it is writing another operation, or reset)";
  return cat("call #", c, " (generation ", generation.load(std::memory_order_relaxed), ")");
}

void StepState::require_in_step(const char* op, const char* reset) const {
  EPX_CHECK(refused.empty(), ErrorCode::kOutOfStep, op,
            ": refused, since an earlier operation timed out (", refused,
            "); expected every rank to call ", reset, " first");
}

void check_stamps(const char* op, int rank, int num_ranks, uint64_t gen, uint64_t call,
                  const std::function<const Stamp&(int)>& stamp_of,
                  const std::function<std::string(int)>& peer_op) {
  std::string differ;
  for (int p = 0; p < num_ranks; ++p) {
    if (p == rank || stamp_of(p).is(gen, call)) continue;
    differ += cat(differ.empty() ? "" : "; ", "rank ", p, " published ", peer_op(p), " ",
                  stamp_of(p).describe());
  }
  EPX_CHECK(differ.empty(), ErrorCode::kOutOfStep, op, ": ranks out of step: this rank (", rank,
            ") is at call #", call, " (generation ", gen, "), ", differ,
            "; expected every rank at the same call (every rank calls the same operations in "
            "the same order; after a Timeout every rank calls the reset)");
}

void recheck_stamps(const char* op, int rank, int num_ranks, uint64_t gen, uint64_t call,
                    const std::function<const Stamp&(int)>& stamp_of) {
  std::atomic_thread_fence(std::memory_order_acquire);  // every copy above before the re-read
  for (int p = 0; p < num_ranks; ++p) {
    EPX_CHECK(p == rank || stamp_of(p).is(gen, call), ErrorCode::kOutOfStep, op, ": rank ", p,
              " published its next operation while this rank (", rank, ") was reading call #",
              call, " (ranks out of step); the rows read are discarded");
  }
}

// Every rank out of its earlier operations (each waits up to twice the group's timeout: a
// straggler still inside one times out of it first), then the same epoch everywhere.
uint64_t CpuBuffer::resync(const char* what) {
  return transport().resync(what, transport().all_members(), 2 * group.timeout());
}

void CpuBuffer::reset() {
  const uint64_t epoch = resync("reset");
  ht_step_.reset(epoch);
  if (ht_mem_) static_cast<Stamp*>(ht_mem_->local())->call.store(0, std::memory_order_release);
  if (ll_mem_) reset_ll_state(epoch);
}

size_t CpuBuffer::bytes_allocated() const {
  return (ht_mem_ ? ht_mem_->bytes() : 0) + (ll_mem_ ? ll_mem_->bytes() : 0);
}

std::unique_ptr<BufferImpl> make_cpu_buffer(const Group& group, const MoeShape& shape,
                                            const BufferConfig& config, uint64_t id) {
  return std::make_unique<CpuBuffer>(group, shape, config, id);
}

}  // namespace epx::detail
