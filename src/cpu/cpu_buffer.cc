#include "cpu/cpu_buffer.h"

#include <algorithm>
#include <cstring>

#include "cpu/ht_region.h"
#include "cpu/ll_region.h"

namespace epx::detail {

CpuBuffer::CpuBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config,
                     uint64_t id)
    : BufferImpl(group, shape, config, id), topology_(Topology::of(group)) {
  const int R = group.size();
  if (config.enable_ht) {
    const HtRegion reg = ht_region(shape, R, topology_);
    ht_mem_ = transport().allocate(reg.bytes);
    if (topology_.hierarchical())
      ht_rail_ = make_cpu_rail(group.transport(), topology_, reg.rail_chunk_bytes());
  }
  if (config.enable_ll) {
    state_of(ll_state_).shrink = config.enable_shrink;
    ll_mem_ = transport().allocate(cpu_ll_region_bytes(shape, R, topology_));
    if (topology_.hierarchical())
      ll_rail_ =
          make_cpu_rail(group.transport(), topology_, cpu_ll_rail_chunk_bytes(shape, R, topology_));
  }
}

void RailStatus::set(const Error& e) {
  code = 1 + static_cast<int32_t>(e.code());
  const size_t n = std::min(sizeof(message) - 1, std::strlen(e.what()));
  std::memcpy(message, e.what(), n);
  message[n] = 0;
}

void RailStatus::raise_if_failed(const char* op, int sender, int node) const {
  if (code == 0) return;
  throw_error(
      static_cast<ErrorCode>(code - 1),
      cat(op, ": rank ", sender, " (node ", node, "), which forwards this rank's rows ",
          "there, failed in this call: ", std::string(message, strnlen(message, sizeof(message)))));
}

void raise_forwarder_errors(const char* op, Topology topology, int rank,
                            const std::function<const RailStatus&(int)>& status_of) {
  const int n = topology.node_of(rank);
  for (int m = 0; m < topology.num_nodes; ++m)
    if (m != n) status_of(m).raise_if_failed(op, topology.rank_of(m, topology.local_of(rank)), m);
}

const float* next_partial_row(const char* op, int m, int64_t& cursor, int64_t num_rows,
                              const float* rows, int64_t width) {
  EPX_CHECK(cursor < num_rows, ErrorCode::kInternal, op, ": node ", m,
            " returned fewer partial rows than this rank's tokens that went there");
  return rows + cursor++ * width;
}

std::exception_ptr run_noting_error(const std::function<void()>& body,
                                    const std::vector<RailStatus*>& statuses) {
  try {
    body();
    return nullptr;
  } catch (const Error& e) {
    for (RailStatus* s : statuses) s->set(e);
    return std::current_exception();
  }
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

void check_stamps_range(const char* op, int rank, int first, int last, uint64_t gen, uint64_t call,
                        const std::function<const Stamp&(int)>& stamp_of,
                        const std::function<std::string(int)>& peer_op, uint64_t skip) {
  std::string differ;
  for (int p = first; p < last; ++p) {
    if (p == rank || (skip >> p & 1) || stamp_of(p).is(gen, call)) continue;
    differ += cat(differ.empty() ? "" : "; ", "rank ", p, " published ", peer_op(p), " ",
                  stamp_of(p).describe());
  }
  EPX_CHECK(differ.empty(), ErrorCode::kOutOfStep, op, ": ranks out of step: this rank (", rank,
            ") is at call #", call, " (generation ", gen, "), ", differ,
            "; expected every rank at the same call (every rank calls the same operations in "
            "the same order; after a Timeout every rank calls the reset)");
}

void recheck_stamps_range(const char* op, int rank, int first, int last, uint64_t gen,
                          uint64_t call, const std::function<const Stamp&(int)>& stamp_of,
                          uint64_t skip) {
  std::atomic_thread_fence(std::memory_order_acquire);  // every copy above before the re-read
  for (int p = first; p < last; ++p) {
    EPX_CHECK(p == rank || (skip >> p & 1) || stamp_of(p).is(gen, call), ErrorCode::kOutOfStep, op,
              ": rank ", p, " published its next operation while this rank (", rank,
              ") was reading call #", call, " (ranks out of step); the rows read are discarded");
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
  if (ht_rail_) ht_rail_->reset();
  if (ll_mem_) reset_ll_state(epoch);
}

size_t CpuBuffer::bytes_allocated() const {
  return (ht_mem_ ? ht_mem_->bytes() : 0) + (ll_mem_ ? ll_mem_->bytes() : 0) +
         (ht_rail_ ? ht_rail_->bytes_allocated() : 0) +
         (ll_rail_ ? ll_rail_->bytes_allocated() : 0);
}

std::unique_ptr<BufferImpl> make_cpu_buffer(const Group& group, const MoeShape& shape,
                                            const BufferConfig& config, uint64_t id) {
  return std::make_unique<CpuBuffer>(group, shape, config, id);
}

}  // namespace epx::detail
