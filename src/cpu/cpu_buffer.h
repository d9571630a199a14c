// src/cpu/cpu_buffer.h — the cpu reference backend behind epx::Buffer.
//
// Every operation is "publish, barrier, pull, barrier" over host shared memory: a rank writes its
// inputs into its own region of the symmetric buffer, waits until every rank has, reads what it
// needs from its peers' regions into its outputs, and waits again so no rank overwrites a region a
// peer may still read. Written the obviously correct way (it is the oracle of the GPU tests), with
// rows moved by memcpy. Streams are ignored: every call is synchronous.
//
// Mode files: ht.cc (ht_* and cpu_ht_bytes), ll.cc (ll_* and cpu_ll_bytes), each owning the layout
// of its region.
#pragma once

#include <exception>
#include <memory>
#include <type_traits>

#include "core/buffer_impl.h"
#include "transport/transport.h"

namespace epx::detail {

// The "pull, barrier" half of an operation: runs `pull`, then the closing barrier even when `pull`
// throws, so a rank that fails (a bad argument only the exchange reveals, an allocator error)
// never leaves its peers waiting; rethrows afterwards. Returns what `pull` returns.
template <typename Pull>
auto pull_then_barrier(Transport& transport, const char* what, Pull&& pull) -> decltype(pull()) {
  using Result = decltype(pull());
  std::exception_ptr error;
  if constexpr (std::is_void_v<Result>) {
    try {
      pull();
    } catch (...) {
      error = std::current_exception();
    }
    transport.barrier(what);
    if (error) std::rethrow_exception(error);
  } else {
    Result result{};
    try {
      result = pull();
    } catch (...) {
      error = std::current_exception();
    }
    transport.barrier(what);
    if (error) std::rethrow_exception(error);
    return result;
  }
}

struct CpuLlState;  // defined in ll.cc

class CpuBuffer final : public BufferImpl {
 public:
  CpuBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config, uint64_t id);

  size_t bytes_allocated() const override;
  Device device() const override { return Device::cpu(); }
  void check() override {}

  HtLayout ht_layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc) override;
  HtDispatchResult ht_dispatch(const HtDispatchArgs& args, const Allocator& alloc) override;
  HtCombineResult ht_combine(const HtCombineArgs& args, const Allocator& alloc) override;
  TensorView ht_combine_buffer(const HtHandle& handle) const override;

  LlDispatchResult ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) override;
  LlCombineResult ll_combine(const LlCombineArgs& args, const Allocator& alloc) override;
  TensorView ll_next_combine_buffer(const LlHandle& handle) override;
  void ll_clean() override;

 private:
  Transport& transport() const { return *group.transport(); }

  std::shared_ptr<SymmetricMemory> ht_mem_;  // cpu_ht_bytes(shape, R), when enable_ht
  std::shared_ptr<SymmetricMemory> ll_mem_;  // cpu_ll_bytes(shape, R), when enable_ll
  std::shared_ptr<CpuLlState> ll_state_;     // owned by ll.cc (created in ll.cc's helpers)
};

}  // namespace epx::detail
