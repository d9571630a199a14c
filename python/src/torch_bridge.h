// python/src/torch_bridge.h — how tensors cross between PyTorch and the torch-free epx core.
//
// Data flow (no torch header is included anywhere in epx; the bridge speaks only the Python
// attribute protocol of torch.Tensor and DLPack):
//   torch.Tensor --to_view()--> epx::TensorView   data_ptr(), dtype, shape, stride(), device read
//                                                  through Python attributes; nothing is copied
//   epx op --Allocator--> template.new_empty(shape)  outputs come from PyTorch's allocator (the
//                                                  caching allocator on GPU; template: a cached
//                                                  0-element tensor of the dtype and device); the
//                                                  Tensor's storage holds a reference to it
//   epx::Tensor --to_torch()--> torch.Tensor       the allocated torch tensor itself, or
//                                                  as_strided() on it when the op returned a view
//                                                  with other strides (column-major scales)
//   epx::TensorView --view_to_torch()--> torch.Tensor  workspace views (a2a recv, ll zero-copy
//                                                  buffer) exported through a DLPack capsule that
//                                                  keeps the owning Buffer/A2a alive
// The GIL is released while an op runs; the allocator and the deleters take it back.
// Where epx._epx_torch is built and loaded (the ATen path, torch_aten_api.h), to_view() reads
// plain tensors and the allocator makes outputs through it instead of the Python calls above,
// with the same results; whatever it declines still takes the attribute path.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "epx/error.h"
#include "epx/tensor.h"

namespace epx::python {

namespace py = pybind11;

inline constexpr int kNumDTypes = 8;
inline constexpr int kNumErrorCodes = 8;

// What the Python package registers once at import (epx/_torch.py calls _epx._init_torch).
struct TorchApi {
  bool ready = false;
  py::object empty;        // torch.empty
  py::object from_dlpack;  // torch.utils.dlpack.from_dlpack
  py::dict dtype_code;     // torch.dtype -> int(epx::DType)
  std::array<py::object, kNumDTypes>
      dtype_of;            // epx::DType -> torch.dtype (fp8: uint8 on old torch)
  py::object cpu_device;   // torch.device("cpu")
  py::object device_ctor;  // torch.device
  std::array<py::object, kNumErrorCodes> error_class;  // epx::ErrorCode -> Python class
};

TorchApi& torch_api();

// torch.Tensor (or None: an absent optional argument) -> view. `what` names the argument in
// error messages ("ll_dispatch: argument 'x'").
TensorView to_view(py::handle tensor, const char* what);

// An Allocator returning torch tensors; safe to call without the GIL.
const Allocator& torch_allocator();

// Calls of torch_allocator() and the host nanoseconds spent in them (GIL taken back, new_empty,
// data_ptr) since the last reset: the allocation share of a Python call's cost
// (tests/python/bench_overhead.py). `reset`: zero both after reading. The first call starts the
// timing (until then the allocator reads no clock: ns stays 0; calls are always counted).
struct AllocStats {
  uint64_t calls = 0;
  uint64_t ns = 0;
};
AllocStats torch_alloc_stats(bool reset);

// How torch_allocator() makes a tensor when the ATen path is off: a cached 0-element template's
// new_empty(sizes) (true, the default) or torch.empty(sizes, dtype=, device=) (false;
// bench_overhead.py's A/B).
void set_torch_alloc_new_empty(bool on);

// The ATen path: registers the table in `capsule` (epx._epx_torch.aten_api(); InternalError for
// any other object or another EPX_ATEN_API_VERSION) and turns the path on. Called once, at
// import, by epx/_torch.py.
void register_aten_api(py::handle capsule);
// Whether to_view() and torch_allocator() use the registered table (false when none is):
// epx/_torch.py's aten_status() and the tests' A/B (set_aten_enabled(false): the attribute path
// and new_empty in the same process). set_aten_enabled returns the previous state.
bool aten_enabled();
bool set_aten_enabled(bool on);
// The ATen path's read of `tensor` alone: false when the path is off or declines the object
// (to_view() then reads it through the attribute path).
bool aten_view(py::handle tensor, TensorView& out);

// epx::Tensor -> torch.Tensor (None when undefined). Tensors that were not made by
// torch_allocator() are exported through DLPack, kept alive by `fallback_owner` (or their own
// storage when they have one).
py::object to_torch(const Tensor& tensor, const std::shared_ptr<void>& fallback_owner = nullptr);

// A non-owning view (workspace memory) -> torch.Tensor that keeps `owner` alive.
py::object view_to_torch(const TensorView& view, std::shared_ptr<void> owner);

// The torch.dtype of an epx dtype.
py::object torch_dtype(DType dtype);

// Raises the Python exception class registered for `code`.
[[noreturn]] void throw_epx(ErrorCode code, const std::string& message);

// The name of obj's type for messages ("torch.Tensor", "int"): never the object itself (a
// tensor's repr prints its contents).
std::string type_name(py::handle obj);

// The C++ object of the bound class T behind `obj` (None: null when `allow_none`), else
// InvalidArgument "<what> is a <type>, expected <expected>". Bindings take their handle
// arguments as py::handle and convert them here, so that a wrong object raises epx's typed error
// naming the argument instead of pybind's TypeError, which prints every argument's repr.
template <typename T>
std::shared_ptr<T> bound_arg(py::handle obj, const std::string& what, const std::string& expected,
                             bool allow_none = false) {
  if (obj.is_none() && allow_none) return nullptr;
  if (!obj.is_none() && py::isinstance<T>(obj)) return py::cast<std::shared_ptr<T>>(obj);
  throw_epx(ErrorCode::kInvalidArgument,
            what + " is " + (obj.is_none() ? std::string("None") : "a " + type_name(obj)) +
                ", expected " + expected);
}

}  // namespace epx::python
