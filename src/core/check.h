// src/core/check.h — validation helpers shared by every backend. Messages name the operation,
// the argument, the value seen and what was expected (docs/semantics.md §4).
#pragma once

#include <initializer_list>
#include <sstream>
#include <string>

#include "epx/error.h"
#include "epx/tensor.h"

namespace epx::detail {

[[noreturn]] void throw_error(ErrorCode code, const std::string& message);

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

#define EPX_CHECK(cond, code, ...)                                                 \
  do {                                                                             \
    if (!(cond)) ::epx::detail::throw_error(code, ::epx::detail::cat(__VA_ARGS__)); \
  } while (0)
#define EPX_CHECK_ARG(cond, ...) EPX_CHECK(cond, ::epx::ErrorCode::kInvalidArgument, __VA_ARGS__)

// Each helper throws InvalidArgument "<op>: argument '<name>' ... expected ...".
void check_defined(const TensorView& t, const char* op, const char* name);
void check_dtype(const TensorView& t, const char* op, const char* name,
                 std::initializer_list<DType> allowed);
// Expected sizes per dim; -1 matches any size.
void check_shape(const TensorView& t, const char* op, const char* name,
                 std::initializer_list<int64_t> expected);
void check_device(const TensorView& t, const char* op, const char* name, Device expected);
void check_contiguous(const TensorView& t, const char* op, const char* name);
// Innermost stride 1 (rows may be padded).
void check_inner_contiguous(const TensorView& t, const char* op, const char* name);

std::string shape_str(const TensorView& t);

}  // namespace epx::detail
