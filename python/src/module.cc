// python/src/module.cc — the `epx._epx` extension: groups, errors and the torch bridge set-up.
//
// Data flow at import: epx/_torch.py calls _init_torch(...) once with torch.empty, from_dlpack,
// the dtype tables and the Python exception classes; from then on every epx::Error raised in C++
// reaches Python as the class registered for its code (epx.InvalidArgument, ...) with the C++
// message unchanged. The C++ core stays torch-free: this module sees torch only through Python
// objects handed to it, and through the C table of epx._epx_torch (torch_aten_api.h) where that
// module is built: _torch.py then calls _init_torch_aten(capsule) as well.
#include <pybind11/stl.h>

#include <chrono>
#include <string>

#include "bindings.h"
#include "core/env.h"
#include "epx/epx.h"
#include "torch_aten_build.h"  // generated: EPX_TORCH_ATEN_BUILT, EPX_TORCH_ATEN_NOTE
#include "torch_bridge.h"

namespace {

namespace py = pybind11;
using namespace epx;
using namespace epx::python;

GroupOptions make_options(int64_t timeout_ms, int num_sms, int ranks_per_node) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.num_sms = num_sms;
  o.ranks_per_node = ranks_per_node;
  return o;
}

void init_torch(py::object empty, py::object from_dlpack, py::object device_ctor,
                py::dict dtype_code, py::list dtype_of, py::list error_classes) {
  TorchApi& api = torch_api();
  if (dtype_of.size() != kNumDTypes || error_classes.size() != kNumErrorCodes) {
    throw_epx(ErrorCode::kInternal, "_init_torch: expected " + std::to_string(kNumDTypes) +
                                        " dtypes and " + std::to_string(kNumErrorCodes) +
                                        " error classes");
  }
  api.empty = std::move(empty);
  api.from_dlpack = std::move(from_dlpack);
  api.device_ctor = device_ctor;
  api.cpu_device = device_ctor("cpu");
  api.dtype_code = std::move(dtype_code);
  for (int i = 0; i < kNumDTypes; ++i) api.dtype_of[i] = dtype_of[i];
  for (int i = 0; i < kNumErrorCodes; ++i) api.error_class[i] = error_classes[i];
  api.ready = true;
}

// (data pointer, dtype name, shape, strides, device) of a view, for the tests.
py::object view_tuple(const TensorView& v) {
  py::tuple shape(v.ndim), strides(v.ndim);
  for (int i = 0; i < v.ndim; ++i) {
    shape[i] = py::int_(v.shape[i]);
    strides[i] = py::int_(v.strides[i]);
  }
  return py::make_tuple(reinterpret_cast<uintptr_t>(v.data), dtype_name(v.dtype), shape, strides,
                        v.device.str());
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const Error& e) {
    TorchApi& api = torch_api();
    const int code = static_cast<int>(e.code());
    PyObject* cls = api.ready && code >= 0 && code < kNumErrorCodes ? api.error_class[code].ptr()
                                                                    : PyExc_RuntimeError;
    PyErr_SetString(cls, e.what());
  }
}

}  // namespace

PYBIND11_MODULE(_epx, m) {
  m.doc() = "epx C++ core (torch-free); use the `epx` package, not this module directly";
  py::register_exception_translator(&translate);

  m.def("_init_torch", &init_torch, py::arg("empty"), py::arg("from_dlpack"),
        py::arg("device_ctor"), py::arg("dtype_code"), py::arg("dtype_of"),
        py::arg("error_classes"));

  // The ATen path (docs/design.md §12): whether CMake built epx._epx_torch next to this module
  // and, when not, why (cmake/torch_aten.cmake); EPX_TORCH_BRIDGE as src/core/env.cc reads it
  // (-1 unset, 0, 1; InvalidArgument for another value); the registration; the tests' switch.
  m.attr("torch_aten_built") = static_cast<bool>(EPX_TORCH_ATEN_BUILT);
  m.attr("torch_aten_note") = EPX_TORCH_ATEN_NOTE;
  m.def("_torch_aten_env", []() { return detail::env_torch_bridge(); });
  m.def("_init_torch_aten", &register_aten_api, py::arg("capsule"));
  m.def("_torch_aten_active", &aten_enabled);
  m.def("_set_torch_aten", &set_aten_enabled, py::arg("on"),
        "Use the registered ATen path (True) or the attribute path and new_empty (False); "
        "returns the previous state. Tests and benchmarks only.");
  // What to_view() reads from `tensor` (data pointer, dtype, shape, strides, device) or the
  // error it raises, what the ATen path alone reads, and an output as torch_allocator() makes
  // it (cuda_index -1: cpu): the tests comparing the two paths (test_torch_aten.py).
  m.def("_tensor_view", [](py::handle tensor, const std::string& what) {
    return view_tuple(to_view(tensor, what.c_str()));
  });
  m.def("_aten_view", [](py::handle tensor) {  // None: the ATen path is off or declines it
    TensorView v;
    return aten_view(tensor, v) ? view_tuple(v) : py::none();
  });
  m.def("_torch_empty", [](int dtype, const std::vector<int64_t>& shape, int cuda_index) {
    const Device device = cuda_index < 0 ? Device::cpu() : Device::cuda(cuda_index);
    return to_torch(torch_allocator()(static_cast<DType>(dtype), shape, device));
  });

#if defined(EPX_WITH_CUDA)
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  py::list codes;
  for (int i = 0; i < kNumErrorCodes; ++i) codes.append(error_code_name(static_cast<ErrorCode>(i)));
  m.attr("error_code_names") = codes;
  py::list dtypes;
  for (int i = 0; i < kNumDTypes; ++i) dtypes.append(dtype_name(static_cast<DType>(i)));
  m.attr("dtype_names") = dtypes;
  // The valid ranges of a group's timeout and num_sms (epx/group.h), shared with the environment
  // (EPX_TIMEOUT_MS, EPX_NUM_SMS) and checked by epx.Group before it calls C++.
  m.attr("DEFAULT_TIMEOUT_MS") = kDefaultGroupTimeoutMs;
  m.attr("MAX_TIMEOUT_MS") = kMaxGroupTimeoutMs;
  m.attr("MAX_NUM_SMS") = kMaxGroupNumSms;

  // Raises the error of `code` with `message` through the same path C++ errors take (tests).
  m.def("_raise", [](int code, const std::string& message) {
    throw Error(static_cast<ErrorCode>(code), message);
  });

  py::class_<Group>(m, "Group", "An EP group. Creation is collective.")
      .def_static(
          "cpu_processes",
          [](int rank, int size, const std::string& name, int64_t timeout_ms, int num_sms,
             int ranks_per_node) {
            py::gil_scoped_release nogil;
            return Group::cpu_processes(rank, size, name,
                                        make_options(timeout_ms, num_sms, ranks_per_node));
          },
          py::arg("rank"), py::arg("size"), py::arg("name"), py::arg("timeout_ms") = 0,
          py::arg("num_sms") = 0, py::arg("ranks_per_node") = 0)
      .def_static(
          "cpu_threads",
          [](int rank, int size, const std::string& name, int64_t timeout_ms, int num_sms,
             int ranks_per_node) {
            py::gil_scoped_release nogil;
            return Group::cpu_threads(rank, size, name,
                                      make_options(timeout_ms, num_sms, ranks_per_node));
          },
          py::arg("rank"), py::arg("size"), py::arg("name"), py::arg("timeout_ms") = 0,
          py::arg("num_sms") = 0, py::arg("ranks_per_node") = 0)
      .def_static(
          "cuda",
          [](int rank, int size, const py::bytes& id, int device, int64_t timeout_ms, int num_sms,
             int ranks_per_node) {
            std::string raw = id;
            UniqueId uid;
            if (raw.size() != uid.bytes.size()) {
              throw_epx(ErrorCode::kInvalidArgument, "Group.cuda: argument 'unique_id' has " +
                                                         std::to_string(raw.size()) +
                                                         " bytes, expected 128");
            }
            std::copy(raw.begin(), raw.end(), uid.bytes.begin());
            py::gil_scoped_release nogil;
            return Group::cuda(rank, size, uid, device,
                               make_options(timeout_ms, num_sms, ranks_per_node));
          },
          py::arg("rank"), py::arg("size"), py::arg("unique_id"), py::arg("device"),
          py::arg("timeout_ms") = 0, py::arg("num_sms") = 0, py::arg("ranks_per_node") = 0)
      .def_static(
          "cuda_from_comm",
          [](uintptr_t comm, int device, int64_t timeout_ms, int num_sms, int ranks_per_node) {
            py::gil_scoped_release nogil;
            return Group::cuda_from_comm(reinterpret_cast<void*>(comm), device,
                                         make_options(timeout_ms, num_sms, ranks_per_node));
          },
          py::arg("nccl_comm"), py::arg("device"), py::arg("timeout_ms") = 0,
          py::arg("num_sms") = 0, py::arg("ranks_per_node") = 0)
      .def_property_readonly("rank", &Group::rank)
      .def_property_readonly("size", &Group::size)
      .def_property_readonly("backend",
                             [](const Group& g) { return std::string(backend_name(g.backend())); })
      .def_property_readonly(
          "timeout_ms", [](const Group& g) { return static_cast<int64_t>(g.timeout().count()); })
      .def_property_readonly("num_sms", [](const Group& g) { return g.options().num_sms; })
      .def_property_readonly("ranks_per_node", &Group::ranks_per_node)
      .def_property_readonly("num_nodes", &Group::num_nodes)
      .def("barrier", &Group::barrier, py::call_guard<py::gil_scoped_release>())
      .def(
          "agree",
          [](const Group& g, const std::string& op, const py::list& values,
             const std::vector<int64_t>& extra) {
            std::vector<AgreeValue> v;
            for (const py::handle item : values) {
              const py::tuple t = py::reinterpret_borrow<py::object>(item).cast<py::tuple>();
              if (t.size() != 2)
                throw_epx(ErrorCode::kInvalidArgument,
                          op + ": Group.agree takes (name, int) pairs");
              v.push_back({t[0].cast<std::string>(), t[1].cast<int64_t>(),
                           py::isinstance<py::bool_>(t[1])});
            }
            py::gil_scoped_release nogil;
            return g.agree(op, v, extra);
          },
          py::arg("op"), py::arg("values"), py::arg("extra") = std::vector<int64_t>{},
          "Collective: raises InvalidArgument on every rank naming each (name, value) that "
          "differs across ranks; returns every rank's `extra` values, rank-major.");

  m.def("new_unique_id", []() {
    UniqueId id = new_unique_id();
    return py::bytes(id.bytes.data(), id.bytes.size());
  });

  // epx.nvfp4_block_scale_interleave's native part (epx/nvfp4.h): sf a u8 / fp8 / bf16 tensor
  // [rows, cols] or [B, rows, cols] (the Python function views other one-byte dtypes as u8).
  m.def(
      "nvfp4_block_scale_interleave",
      [](py::handle sf, uintptr_t stream) {
        const TensorView v = to_view(sf, "nvfp4_block_scale_interleave: argument 'sf'");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out =
              nvfp4_block_scale_interleave(v, torch_allocator(), reinterpret_cast<Stream>(stream));
        }
        return to_torch(out);
      },
      py::arg("sf"), py::arg("stream") = 0);

  bind_buffer(m);
  bind_a2a(m);
  bind_dispatcher(m);
  bind_timing(m);
}
