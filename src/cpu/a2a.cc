// STUB — replaced by the a2a implementation.
#include "core/check.h"
#include "core/buffer_impl.h"

namespace epx::detail {
size_t cpu_a2a_bytes(const A2aShape&, int) { return 4096; }
std::unique_ptr<A2aImpl> make_cpu_a2a(const Group&, const A2aShape&) { throw_error(ErrorCode::kUnsupported, "a2a: not implemented yet"); }
}  // namespace epx::detail
