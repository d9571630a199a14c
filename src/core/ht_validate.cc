// STUB — replaced by the ht validation.
#include "core/validate.h"

namespace epx::detail {
void validate_ht_layout(const BufferImpl&, const TensorView&) {}
void validate_ht_dispatch(const BufferImpl&, const HtDispatchArgs&) {}
void validate_ht_combine(const BufferImpl&, const HtCombineArgs&) {}
}  // namespace epx::detail
