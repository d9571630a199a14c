#include "cpu/cpu_buffer.h"

namespace epx::detail {

CpuBuffer::CpuBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config,
                     uint64_t id)
    : BufferImpl(group, shape, config, id) {
  const int R = group.size();
  if (config.enable_ht) ht_mem_ = transport().allocate(cpu_ht_bytes(shape, R));
  if (config.enable_ll) ll_mem_ = transport().allocate(cpu_ll_bytes(shape, R));
}

size_t CpuBuffer::bytes_allocated() const {
  return (ht_mem_ ? ht_mem_->bytes() : 0) + (ll_mem_ ? ll_mem_->bytes() : 0);
}

std::unique_ptr<BufferImpl> make_cpu_buffer(const Group& group, const MoeShape& shape,
                                            const BufferConfig& config, uint64_t id) {
  return std::make_unique<CpuBuffer>(group, shape, config, id);
}

}  // namespace epx::detail
