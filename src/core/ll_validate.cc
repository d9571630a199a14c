// STUB — replaced by the ll validation.
#include "core/validate.h"

namespace epx::detail {
void validate_ll_dispatch(const BufferImpl&, const LlDispatchArgs&) {}
void validate_ll_combine(const BufferImpl&, const LlCombineArgs&) {}
void validate_ll_handle(const BufferImpl&, const LlHandle&, const char*) {}
}  // namespace epx::detail
