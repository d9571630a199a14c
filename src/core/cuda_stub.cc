// Built only without CUDA: every CUDA service reports Unsupported.
#include "core/check.h"
#include "core/cuda_runtime_shim.h"

namespace epx::detail {

bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
bool cuda_stream_is_capturing(Stream, int) { return false; }
void cuda_stream_wait_stream(Stream, Stream, int) {
  throw_error(ErrorCode::kUnsupported, "stream order: epx was built without CUDA");
}
std::shared_ptr<void> cuda_alloc_shared(size_t, int) {
  throw_error(ErrorCode::kUnsupported, "cuda allocation: epx was built without CUDA");
}

}  // namespace epx::detail

#include "transport/nccl_transport.h"

namespace epx::detail {

static const char* kNoCuda = "epx was built without CUDA and NCCL (the cuda backend is unavailable)";

UniqueId nccl_new_unique_id() { throw_error(ErrorCode::kUnsupported, cat("new_unique_id: ", kNoCuda)); }
std::shared_ptr<Transport> make_nccl_transport(int, int, const UniqueId&, int,
                                               std::chrono::milliseconds) {
  throw_error(ErrorCode::kUnsupported, cat("Group::cuda: ", kNoCuda));
}
std::shared_ptr<Transport> make_nccl_transport_from_comm(void*, int, std::chrono::milliseconds) {
  throw_error(ErrorCode::kUnsupported, cat("Group::cuda_from_comm: ", kNoCuda));
}
std::shared_ptr<Transport> make_cuda_shared_device_transport(int, int, const std::string&, int,
                                                             GroupOptions*) {
  throw_error(ErrorCode::kUnsupported, cat("Group::cuda_shared_device: ", kNoCuda));
}

}  // namespace epx::detail

#include "core/buffer_impl.h"

namespace epx::detail {

std::unique_ptr<BufferImpl> make_cuda_buffer(const Group&, const MoeShape&, const BufferConfig&,
                                             uint64_t) {
  throw_error(ErrorCode::kUnsupported, cat("Buffer: ", kNoCuda));
}
std::unique_ptr<A2aImpl> make_cuda_a2a(const Group&, const A2aShape&) {
  throw_error(ErrorCode::kUnsupported, cat("A2a: ", kNoCuda));
}
int cuda_ll_num_ctas(const Group&, const MoeShape&) {
  throw_error(ErrorCode::kUnsupported, cat("Buffer: ", kNoCuda));
}
size_t cuda_ht_bytes(const MoeShape&, int, int) { throw_error(ErrorCode::kUnsupported, cat("bytes_needed(ht, cuda): ", kNoCuda)); }
size_t cuda_ll_bytes(const MoeShape&, int, int) { throw_error(ErrorCode::kUnsupported, cat("bytes_needed(ll, cuda): ", kNoCuda)); }
size_t cuda_a2a_bytes(const A2aShape&, int) { throw_error(ErrorCode::kUnsupported, cat("workspace_bytes(cuda): ", kNoCuda)); }

}  // namespace epx::detail

#include "core/quant_cuda.h"

namespace epx::detail {

[[noreturn]] static void no_cuda_kernels(const char* op) {
  throw_error(ErrorCode::kUnsupported, cat(op, " of cuda tensors: ", kNoCuda));
}

void cuda_quantize_fp8(const TensorView&, bool, const TensorView&, const TensorView&, int64_t,
                       Stream) {
  no_cuda_kernels("quantize_fp8");
}
void cuda_quantize_nvfp4(const TensorView&, float, const TensorView&, const TensorView&, Stream) {
  no_cuda_kernels("quantize_nvfp4");
}
void cuda_ue8m0_to_column_major(const TensorView&, const TensorView&, Stream) {
  no_cuda_kernels("ue8m0_to_column_major");
}
void cuda_nvfp4_block_scale_interleave(const TensorView&, const Nvfp4InterleaveShape&,
                                       const TensorView&, Stream) {
  no_cuda_kernels("nvfp4_block_scale_interleave");
}
void cuda_narrow_topk_idx(const TensorView&, const TensorView&, Stream) {
  no_cuda_kernels("narrow_topk_idx");
}
void cuda_expert_load_add_local_ids(const TensorView&, const TensorView&, Stream) {
  no_cuda_kernels("expert load recording");
}
void cuda_expert_load_add_global_ids(const TensorView&, const TensorView&, int, const TensorView&,
                                     Stream) {
  no_cuda_kernels("expert load recording");
}
void cuda_expert_load_add_counts(const TensorView&, const TensorView&, Stream) {
  no_cuda_kernels("expert load recording");
}
void cuda_expert_load_zero(const TensorView&, Stream, bool) {
  no_cuda_kernels("expert load reset");
}
std::vector<int64_t> cuda_expert_load_read(const TensorView&, Stream) {
  no_cuda_kernels("expert load read");
}

}  // namespace epx::detail
