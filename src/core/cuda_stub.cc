// Built only without CUDA: every CUDA service reports Unsupported.
#include "core/check.h"
#include "core/cuda_runtime_shim.h"

namespace epx::detail {

bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
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
size_t cuda_ht_bytes(const MoeShape&, int) { throw_error(ErrorCode::kUnsupported, cat("bytes_needed(ht, cuda): ", kNoCuda)); }
size_t cuda_ll_bytes(const MoeShape&, int) { throw_error(ErrorCode::kUnsupported, cat("bytes_needed(ll, cuda): ", kNoCuda)); }
size_t cuda_a2a_bytes(const A2aShape&, int) { throw_error(ErrorCode::kUnsupported, cat("workspace_bytes(cuda): ", kNoCuda)); }

}  // namespace epx::detail
