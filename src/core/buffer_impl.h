// src/core/buffer_impl.h — what a backend implements behind epx::Buffer and epx::A2a.
//
// The public classes validate every argument (src/core/*_validate.cc) before calling in here, so
// implementations may assume well-formed inputs: shapes, dtypes, devices and ranges checked,
// topk ids in [-1, E) where the host can see them (the cuda backend checks device tensors on the
// device).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/quant.h"
#include "epx/a2a.h"
#include "epx/buffer.h"

namespace epx::detail {

// n rounded up to a multiple of `alignment`: the section offsets of the backends' buffer layouts.
inline size_t align_up(size_t n, size_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

// A contiguous `dtype` view of `shape` at byte `offset` of `block`, sharing its storage.
inline Tensor carve(const Tensor& block, size_t offset, DType dtype,
                    const std::vector<int64_t>& shape) {
  Tensor t;
  static_cast<TensorView&>(t) = TensorView::contiguous(
      block.data ? static_cast<char*>(block.data) + offset : nullptr, dtype, shape, block.device);
  t.storage = block.storage;
  return t;
}

// An ll dispatch's outputs from TWO allocations, whatever the format: a torch allocation costs
// ≈ 2.4 us of host time, and a dispatch makes its outputs before its launch, so each one is on the
// path of an engine's host-bound decode step (docs/perf.md §4.5). `alloc(dtype, shape)` makes a
// contiguous block.
// - The data block: recv_x, then (fp8, NVFP4) recv_scales at the next 128-byte boundary. The
//   expert GEMM reads both; either keeps the block alive.
// - The handle block, int64: layout_range int64 [L, R] at its start, src_info int32 [L, RT] right
//   after it, recv_count int32 [L] at the next 128-byte boundary (a GEMM's masked_m, aligned as
//   an allocation of its own would be for vector loads).
// The formats' shapes and strides: docs/semantics.md §2.1 (fp8 scales column-major in the last two
// dims; NVFP4 through set_ll_nvfp4_views).
template <typename Alloc>
void allocate_ll_dispatch_outputs(LlDispatchResult& res, const Alloc& alloc,
                                  const LlDispatchArgs& args, int64_t L, int64_t R, int64_t RT,
                                  int64_t H) {
  auto bytes = [](DType dt, const std::vector<int64_t>& shape) {
    return TensorView::contiguous(nullptr, dt, shape).nbytes();
  };
  const DType x_dtype = args.use_nvfp4 ? DType::kU8 : args.use_fp8 ? DType::kF8E4M3 : DType::kBF16;
  const std::vector<int64_t> x_shape =
      args.use_nvfp4 ? ll_nvfp4_x_storage(L, RT, H) : std::vector<int64_t>{L, RT, H};
  DType s_dtype = DType::kU8;
  std::vector<int64_t> s_shape;
  const int64_t cols = args.use_ue8m0 ? (H / 128 + 3) / 4 : H / 128;
  if (args.use_nvfp4) {
    s_dtype = DType::kF8E4M3;
    s_shape = ll_nvfp4_scale_storage(L, RT, H);
  } else if (args.use_fp8) {
    s_dtype = args.use_ue8m0 ? DType::kI32 : DType::kF32;
    s_shape = {L, cols, RT};
  }
  if (s_shape.empty()) {
    res.recv_x = alloc(x_dtype, x_shape);
  } else {
    const size_t s_off = align_up(bytes(x_dtype, x_shape), 128);
    const int64_t total = static_cast<int64_t>(s_off + bytes(s_dtype, s_shape));
    const Tensor block = alloc(DType::kU8, std::vector<int64_t>{total});
    res.recv_x = carve(block, 0, x_dtype, x_shape);
    res.recv_scales = carve(block, s_off, s_dtype, s_shape);
    if (args.use_nvfp4) {
      set_ll_nvfp4_views(res.recv_x, res.recv_scales);
    } else {
      res.recv_scales.shape = {L, RT, cols};
      res.recv_scales.strides = {cols * RT, 1, RT};
    }
  }
  LlHandle& h = res.handle;
  const int64_t range_words = L * R;
  const int64_t count_words = static_cast<int64_t>(align_up(range_words + (L * RT + 1) / 2, 16));
  const Tensor block = alloc(DType::kI64, std::vector<int64_t>{count_words + (L + 1) / 2});
  h.layout_range = carve(block, 0, DType::kI64, {L, R});
  h.src_info = carve(block, 8 * range_words, DType::kI32, {L, RT});
  res.recv_count = carve(block, 8 * count_words, DType::kI32, {L});
}

class BufferImpl {
 public:
  BufferImpl(const Group& group, const MoeShape& shape, const BufferConfig& config, uint64_t id)
      : group(group), shape(shape), config(config), id(id) {}
  virtual ~BufferImpl() = default;

  virtual size_t bytes_allocated() const = 0;
  virtual Device device() const = 0;
  virtual void check() = 0;

  virtual HtLayout ht_layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc) = 0;
  virtual HtDispatchResult ht_dispatch(const HtDispatchArgs& args, const Allocator& alloc) = 0;
  virtual HtCombineResult ht_combine(const HtCombineArgs& args, const Allocator& alloc) = 0;
  // [rows of the handle, H] bf16 view of this rank's combine staging (zero-copy combine).
  virtual TensorView ht_combine_buffer(const HtHandle& handle) const = 0;

  virtual LlDispatchResult ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) = 0;
  virtual LlCombineResult ll_combine(const LlCombineArgs& args, const Allocator& alloc) = 0;
  virtual TensorView ll_next_combine_buffer(const LlHandle& handle) = 0;
  virtual void ll_clean() = 0;
  // The ll rank mask (validated by epx::Buffer: enable_shrink, rank, tensor).
  virtual void ll_update_mask(int rank, bool mask, Stream stream) = 0;
  virtual void ll_query_mask(const TensorView& mask_status, Stream stream) = 0;
  virtual void ll_clean_mask(Stream stream) = 0;
  // Collective: ht and ll back in step after a Timeout (docs/semantics.md §4.3).
  virtual void reset() = 0;

  const Group group;
  const MoeShape shape;
  const BufferConfig config;
  const uint64_t id;
};

class A2aImpl {
 public:
  A2aImpl(const Group& group, const A2aShape& shape) : group(group), shape(shape) {}
  virtual ~A2aImpl() = default;
  virtual size_t bytes_allocated() const = 0;
  virtual void check() = 0;
  virtual A2aDispatchResult dispatch(const A2aDispatchArgs& args) = 0;
  virtual TensorView combine_payload_view(int64_t runtime_max, int64_t hidden, DType dtype) = 0;
  virtual Tensor combine(const TensorView& y, int64_t runtime_max, bool payload_in_workspace,
                         Stream stream, const Allocator& alloc) = 0;
  // Rank mask, bit p = rank p active (validated by epx::A2a: this rank's bit is set). Applies it
  // and resynchronises with the other active ranks (include/epx/a2a.h, set_active_ranks).
  virtual void set_active_ranks(uint64_t active_mask, Stream stream) = 0;
  virtual A2aDropCounts dropped_counts() = 0;
  virtual void reset_dropped_counts(Stream stream) = 0;

  // Bit p = rank p (kMaxRanks = 64 ranks at most, so one word).
  static uint64_t all_ranks_mask(int num_ranks) {
    return num_ranks >= 64 ? ~uint64_t{0} : (uint64_t{1} << num_ranks) - 1;
  }

  const Group group;
  const A2aShape shape;
  // The dispatch -> combine -> dispatch state machine (checked by epx::A2a).
  bool dispatched = false;
  int64_t last_runtime_max = 0;
  int64_t last_num_tokens = 0;
  // The current rank mask (set by epx::A2a once the backend applied it).
  uint64_t active_mask = all_ranks_mask(group.size());
  // Non-empty after a Timeout (or a failed set_active_ranks): why. dispatch/combine refuse to
  // run until set_active_ranks succeeds.
  std::string failed;
};

// Backend factories. The cuda ones throw Unsupported in a build without CUDA.
std::unique_ptr<BufferImpl> make_cpu_buffer(const Group& group, const MoeShape& shape,
                                            const BufferConfig& config, uint64_t id);
std::unique_ptr<BufferImpl> make_cuda_buffer(const Group& group, const MoeShape& shape,
                                             const BufferConfig& config, uint64_t id);
std::unique_ptr<A2aImpl> make_cpu_a2a(const Group& group, const A2aShape& shape);
std::unique_ptr<A2aImpl> make_cuda_a2a(const Group& group, const A2aShape& shape);

// The CTAs the cuda ll kernels resolve for `shape` on `group` (every rank must resolve the same:
// the Buffer's agreement compares it). Unsupported in a build without CUDA.
int cuda_ll_num_ctas(const Group& group, const MoeShape& shape);

// Symmetric bytes per rank of each mode, per backend (each backend owns its buffer layout). The
// cpu ones on `num_nodes` nodes (Group::num_nodes(); > 1 adds the rail's chunks, design §13).
size_t cpu_ht_bytes(const MoeShape& shape, int num_ranks, int num_nodes = 1);
size_t cpu_ll_bytes(const MoeShape& shape, int num_ranks, int num_nodes = 1);
size_t cpu_a2a_bytes(const A2aShape& shape, int num_ranks);
// cuda ht on num_nodes > 1 (virtual nodes of one GPU): the node-local region of R / N ranks, the
// rail chunks and the rail's control words (src/cuda/ht_nodes.h).
size_t cuda_ht_bytes(const MoeShape& shape, int num_ranks, int num_nodes = 1);
// cuda ll on num_nodes > 1 likewise (src/cuda/ll_nodes.h).
size_t cuda_ll_bytes(const MoeShape& shape, int num_ranks, int num_nodes = 1);
size_t cuda_a2a_bytes(const A2aShape& shape, int num_ranks);

}  // namespace epx::detail
