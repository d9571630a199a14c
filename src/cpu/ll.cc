// STUB — replaced by the ll implementation.
#include "core/check.h"
#include "cpu/cpu_buffer.h"

namespace epx::detail {
size_t cpu_ll_bytes(const MoeShape&, int) { return 4096; }
LlDispatchResult CpuBuffer::ll_dispatch(const LlDispatchArgs&, const Allocator&) { throw_error(ErrorCode::kUnsupported, "ll_dispatch: not implemented yet"); }
LlCombineResult CpuBuffer::ll_combine(const LlCombineArgs&, const Allocator&) { throw_error(ErrorCode::kUnsupported, "ll_combine: not implemented yet"); }
TensorView CpuBuffer::ll_next_combine_buffer(const LlHandle&) { throw_error(ErrorCode::kUnsupported, "ll_next_combine_buffer: not implemented yet"); }
void CpuBuffer::ll_clean() {}
}  // namespace epx::detail
