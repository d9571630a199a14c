// STUB — replaced by the ht implementation.
#include "core/check.h"
#include "cpu/cpu_buffer.h"

namespace epx::detail {
size_t cpu_ht_bytes(const MoeShape&, int) { return 4096; }
HtLayout CpuBuffer::ht_layout(const TensorView&, Stream, const Allocator&) { throw_error(ErrorCode::kUnsupported, "ht_layout: not implemented yet"); }
HtDispatchResult CpuBuffer::ht_dispatch(const HtDispatchArgs&, const Allocator&) { throw_error(ErrorCode::kUnsupported, "ht_dispatch: not implemented yet"); }
HtCombineResult CpuBuffer::ht_combine(const HtCombineArgs&, const Allocator&) { throw_error(ErrorCode::kUnsupported, "ht_combine: not implemented yet"); }
}  // namespace epx::detail
