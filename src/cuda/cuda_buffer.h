// src/cuda/cuda_buffer.h — the cuda backend behind epx::Buffer: a shell over the mode objects it
// owns, CudaHt (src/cuda/ht.h, ht.cu; when BufferConfig::enable_ht; across nodes CudaHtNodes,
// ht_nodes.h, over a node-local CudaHt) and CudaLl (src/cuda/ll.cu; when enable_ll; across
// nodes CudaLlNodes, ll_nodes.h, over a node-local CudaLl), each with its symmetric region, its device-error record and its launchers.
//
// Errors found on the device (timeouts, out-of-range expert ids, worst-case overflow) are raised
// by the next host call on the buffer or by check().
#pragma once

#include <cstdint>
#include <memory>

#include "core/buffer_impl.h"
#include "cuda/tuning.h"

namespace epx::detail {

class CudaHt;       // src/cuda/ht.h
class CudaHtNodes;  // src/cuda/ht_nodes.h
class CudaLl;       // src/cuda/ll.cu
class CudaLlNodes;  // src/cuda/ll_nodes.h

class CudaBuffer final : public BufferImpl {
 public:
  CudaBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config, uint64_t id);
  ~CudaBuffer() override;

  size_t bytes_allocated() const override;
  Device device() const override { return Device::cuda(device_); }
  void check() override;

  HtLayout ht_layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc) override;
  HtDispatchResult ht_dispatch(const HtDispatchArgs& args, const Allocator& alloc) override;
  HtCombineResult ht_combine(const HtCombineArgs& args, const Allocator& alloc) override;
  TensorView ht_combine_buffer(const HtHandle& handle) const override;

  LlDispatchResult ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) override;
  LlCombineResult ll_combine(const LlCombineArgs& args, const Allocator& alloc) override;
  TensorView ll_next_combine_buffer(const LlHandle& handle) override;
  void ll_clean() override;
  void ll_update_mask(int rank, bool mask, Stream stream) override;
  void ll_query_mask(const TensorView& mask_status, Stream stream) override;
  void ll_clean_mask(Stream stream) override;
  void reset() override;

  // The ht kernels' CTA split (benchmarks print it); enable_ht only.
  const HtTuning& tuning() const;

 private:
  void require_ht(const char* op) const;  // InvalidArgument without enable_ht


  int device_ = 0;
  std::unique_ptr<CudaHt> ht_;  // enable_ht on one node: the ht mode (ht.cu)
  // enable_ht across nodes (virtual nodes of one GPU, Group::cuda_shared_device): ht_nodes.cu
  std::unique_ptr<CudaHtNodes> ht_nodes_;
  std::shared_ptr<CudaLl> ll_;  // enable_ll on one node: the ll mode (ll.cu)
  // enable_ll across nodes (virtual nodes of one GPU): ll_nodes.cu
  std::unique_ptr<CudaLlNodes> ll_nodes_;
};

}  // namespace epx::detail
