#include "core/check.h"

namespace epx::detail {

void throw_error(ErrorCode code, const std::string& message) { throw Error(code, message); }

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

void check_defined(const TensorView& t, const char* op, const char* name) {
  EPX_CHECK_ARG(t.defined() && (t.data != nullptr || t.numel() == 0), op, ": argument '", name,
                "' is required but was not given");
}

void check_dtype(const TensorView& t, const char* op, const char* name,
                 std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string want;
  for (DType d : allowed) want += (want.empty() ? "" : " or ") + std::string(dtype_name(d));
  throw_error(ErrorCode::kInvalidArgument, cat(op, ": argument '", name, "' has dtype ",
                                               dtype_name(t.dtype), ", expected ", want));
}

void check_shape(const TensorView& t, const char* op, const char* name,
                 std::initializer_list<int64_t> expected) {
  bool ok = t.ndim == static_cast<int>(expected.size());
  int i = 0;
  for (int64_t e : expected) {
    if (ok && e >= 0 && t.shape[i] != e) ok = false;
    ++i;
  }
  if (ok) return;
  std::string want = "[";
  i = 0;
  for (int64_t e : expected) want += (i++ ? ", " : "") + (e < 0 ? std::string("*") : std::to_string(e));
  throw_error(ErrorCode::kInvalidArgument,
              cat(op, ": argument '", name, "' has shape ", shape_str(t), ", expected ", want, "]"));
}

void check_device(const TensorView& t, const char* op, const char* name, Device expected) {
  EPX_CHECK_ARG(t.device == expected, op, ": argument '", name, "' is on ", t.device.str(),
                ", expected ", expected.str());
}

void check_contiguous(const TensorView& t, const char* op, const char* name) {
  EPX_CHECK_ARG(t.is_contiguous(), op, ": argument '", name, "' must be contiguous, got ",
                t.describe());
}

void check_inner_contiguous(const TensorView& t, const char* op, const char* name) {
  EPX_CHECK_ARG(t.ndim == 0 || t.strides[t.ndim - 1] == 1 || t.shape[t.ndim - 1] <= 1, op,
                ": argument '", name, "' must have innermost stride 1, got ", t.describe());
}

}  // namespace epx::detail
