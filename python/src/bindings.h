// python/src/bindings.h — the parts of the `epx._epx` module defined in their own files, each
// adding its classes and functions to the module; module.cc calls them at import.
#pragma once

#include <optional>

#include "epx/ll.h"
#include "torch_bridge.h"

namespace epx::python {

void bind_buffer(py::module_& m);      // buffer_bindings.cc: epx.Buffer's native part
void bind_a2a(py::module_& m);         // a2a_bindings.cc: epx.A2a's native part
void bind_dispatcher(py::module_& m);  // dispatcher_bindings.cc
void bind_timing(py::module_& m);      // timing.cc

// The overlapped ll combine's options from Python (buffer_bindings.cc): None, or the tuple
// (signals int32 tensor, block_rows, expected, num_sms, recv_count tensor or None) that
// epx.LlCombineOverlap is; `op` names the call in errors.
std::optional<LlCombineOverlap> ll_overlap_arg(py::handle overlap, const char* op);

}  // namespace epx::python
