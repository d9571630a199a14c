// python/src/dispatcher_bindings.cc — epx::Dispatcher (docs/semantics.md §7) for Python, a thin
// mirror.
//
// Data flow: dispatch_a(x, topk_idx, topk_weights) -> to_view() on each (GIL held) -> the C++
// stage with the GIL released (outputs come from torch_allocator(), which re-takes the GIL; hooks
// re-take it to run their Python callable) -> dispatch_b() -> the DispatchOutput fields as torch
// tensors: allocations map back to the torch tensors PyTorch made, workspace views (a2a receive
// rows, moe_output_view) leave through DLPack and keep the Dispatcher alive. combine_a(y) ->
// combine_b() -> out [T, H] bf16.
// The C++ Dispatcher keeps views of the inputs of the call in flight (ll combine reads the
// routing, a2a reads the inputs); this wrapper holds the Python objects from the dispatch_a that
// started a call until the combine_b that ends it, so PyTorch cannot free them in between.
// The stage machine, mode resolution, quantisation and load recording are all C++.
// Streams: every call takes the cudaStream_t (an int, 0 = legacy default) its C++ stage runs on;
// stage b and combine_a take None for "the stream of the previous stage" (dispatcher.h).
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings.h"
#include "epx/dispatcher.h"
#include "torch_bridge.h"

namespace epx::python {

namespace {

using DispatcherPtr = std::shared_ptr<Dispatcher>;

struct PyDispatcher {
  DispatcherPtr native;
  DispatcherConfig config;
  int num_ranks = 1;
  // Inputs of the call in flight (dispatch_a .. combine_b) and the combine input.
  py::object x, topk_idx, topk_weights, y;
};

// A registered Python callable; runs with the GIL taken, is released with the GIL taken.
struct PyHook {
  std::shared_ptr<py::object> fn;
  void operator()() const {
    py::gil_scoped_acquire gil;
    (*fn)();
  }
};

PyHook make_py_hook(py::object fn) {
  return PyHook{std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  })};
}

[[noreturn]] void bad_choice(const char* arg, const std::string& value, const char* expected) {
  throw_epx(ErrorCode::kInvalidArgument, std::string("Dispatcher: argument '") + arg + "' is '" +
                                             value + "', expected " + expected);
}

DispatcherBackend parse_backend(const std::string& s) {
  if (s == "deepep") return DispatcherBackend::kDeepEp;
  if (s == "a2a") return DispatcherBackend::kA2a;
  bad_choice("backend", s, "'deepep' or 'a2a'");
}

// Names come from the C++ name functions, so Python and C++ spell them the same way.
DispatchMode parse_mode(const std::string& s) {
  for (DispatchMode m : {DispatchMode::kNormal, DispatchMode::kLowLatency, DispatchMode::kAuto})
    if (s == dispatch_mode_name(m)) return m;
  bad_choice("mode", s, "'normal', 'low_latency' or 'auto'");
}

DispatchQuant parse_quant(const std::string& s) {
  for (DispatchQuant q :
       {DispatchQuant::kBf16, DispatchQuant::kFp8, DispatchQuant::kFp8Ue8m0, DispatchQuant::kNvfp4})
    if (s == dispatch_quant_name(q)) return q;
  bad_choice("quant", s, "'bf16', 'fp8', 'fp8_ue8m0' or 'nvfp4'");
}

ForwardMode parse_forward_mode(const std::string& s) {
  if (s == "extend") return ForwardMode::kExtend;
  if (s == "decode") return ForwardMode::kDecode;
  bad_choice("forward_mode", s, "'extend' or 'decode'");
}

std::optional<Stream> as_stream(std::optional<uintptr_t> stream) {
  if (!stream) return std::nullopt;
  return reinterpret_cast<Stream>(*stream);
}

bool stage_is(const PyDispatcher& d, const char* stage) {
  return std::string(d.native->stage_name()) == stage;
}

void dispatch_a(PyDispatcher& d, py::object x, py::object topk_idx, py::object topk_weights,
                const std::string& forward_mode, std::optional<float> global_scale,
                uintptr_t stream) {
  const TensorView xv = to_view(x, "Dispatcher.dispatch_a: argument 'x'");
  const TensorView iv = to_view(topk_idx, "Dispatcher.dispatch_a: argument 'topk_idx'");
  const TensorView wv = to_view(topk_weights, "Dispatcher.dispatch_a: argument 'topk_weights'");
  const ForwardMode fm = parse_forward_mode(forward_mode);
  const bool was_initial = stage_is(d, "initial");
  auto keep = [&] {
    // Only a call that started (stage advanced) replaces the inputs of the call in flight.
    if (was_initial && stage_is(d, "after_dispatch_a")) {
      d.x = std::move(x);
      d.topk_idx = std::move(topk_idx);
      d.topk_weights = std::move(topk_weights);
    }
  };
  try {
    py::gil_scoped_release nogil;
    d.native->dispatch_a(xv, iv, wv, fm, global_scale, reinterpret_cast<Stream>(stream));
  } catch (...) {
    keep();  // a hook that raised leaves the call started
    throw;
  }
  keep();
}

py::tuple dispatch_b(PyDispatcher& d, std::optional<uintptr_t> stream) {
  DispatchOutput out;
  {
    py::gil_scoped_release nogil;
    out = d.native->dispatch_b(as_stream(stream));
  }
  const auto owner = std::static_pointer_cast<void>(d.native);
  const char* format = output_format_name(out.format);
  py::object idx = to_torch(out.topk_idx, owner), weights = to_torch(out.topk_weights, owner);
  if (out.format == OutputFormat::kLl) {  // ll experts see the caller's own routing tensors
    idx = d.topk_idx;
    weights = d.topk_weights;
  }
  py::object counts = py::none(), expected_m = py::none();
  if (out.format == OutputFormat::kHt) counts = py::cast(out.num_recv_tokens_per_expert);
  if (out.format == OutputFormat::kLl) expected_m = py::int_(out.expected_m);
  return py::make_tuple(format, to_torch(out.x, owner), to_torch(out.x_scale, owner), idx, weights,
                        counts, to_torch(out.masked_m, owner), expected_m,
                        view_to_torch(out.moe_output_view, owner));
}

void combine_a(PyDispatcher& d, py::object y, bool y_in_output_view,
               std::optional<uintptr_t> stream, py::handle overlap) {
  CombineInput in;
  in.y = to_view(y, "Dispatcher.combine_a: argument 'y'");
  in.y_in_output_view = y_in_output_view;
  in.stream = as_stream(stream);
  in.overlap = ll_overlap_arg(overlap, "Dispatcher.combine_a");
  {
    py::gil_scoped_release nogil;
    d.native->combine_a(in);
  }
  d.y = std::move(y);
}

py::object combine_b(PyDispatcher& d, std::optional<uintptr_t> stream) {
  Tensor out;
  {
    py::gil_scoped_release nogil;
    out = d.native->combine_b(as_stream(stream));
  }
  py::object result = to_torch(out, std::static_pointer_cast<void>(d.native));
  d.x = d.topk_idx = d.topk_weights = d.y = py::none();  // the call is over
  return result;
}

}  // namespace

void bind_dispatcher(py::module_& m) {
  py::class_<PyDispatcher, std::shared_ptr<PyDispatcher>>(m, "Dispatcher")
      .def(py::init([](const Group& group, int num_experts, int64_t hidden, int top_k,
                       int64_t max_tokens_per_rank, const std::string& backend,
                       const std::string& mode, const std::string& quant, int64_t num_worst_tokens,
                       bool return_recv_hook, bool ht_zero_copy) {
             auto d = std::make_shared<PyDispatcher>();
             DispatcherConfig& c = d->config;
             c.num_experts = num_experts;
             c.hidden = hidden;
             c.top_k = top_k;
             c.max_tokens_per_rank = max_tokens_per_rank;
             c.backend = parse_backend(backend);
             c.mode = parse_mode(mode);
             c.quant = parse_quant(quant);
             c.num_worst_tokens = num_worst_tokens;
             c.return_recv_hook = return_recv_hook;
             c.ht_zero_copy = ht_zero_copy;
             c.allocator = torch_allocator();
             d->num_ranks = group.size();
             {
               py::gil_scoped_release nogil;
               d->native = std::make_shared<Dispatcher>(group, c);
             }
             return d;
           }),
           py::arg("group"), py::arg("num_experts"), py::arg("hidden"), py::arg("top_k"),
           py::arg("max_tokens_per_rank"), py::arg("backend"), py::arg("mode"), py::arg("quant"),
           py::arg("num_worst_tokens"), py::arg("return_recv_hook"),
           py::arg("ht_zero_copy") = false)
      .def("dispatch_a", &dispatch_a, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("forward_mode"), py::arg("global_scale").none(true), py::arg("stream") = 0)
      .def("dispatch_b", &dispatch_b, py::arg("stream").none(true) = py::none())
      .def("combine_a", &combine_a, py::arg("y").none(true), py::arg("y_in_output_view"),
           py::arg("stream").none(true) = py::none(), py::arg("overlap") = py::none())
      .def("combine_b", &combine_b, py::arg("stream").none(true) = py::none())
      .def(
          "register_hook",
          [](PyDispatcher& d, py::object fn) {
            if (!PyCallable_Check(fn.ptr())) {
              throw_epx(ErrorCode::kInvalidArgument,
                        std::string("Dispatcher.register_hook: argument 'hook' is a ") +
                            Py_TYPE(fn.ptr())->tp_name + ", expected a callable");
            }
            d.native->register_hook(make_py_hook(std::move(fn)));
          },
          py::arg("hook"))
      .def("clear_hooks", [](PyDispatcher& d) { d.native->clear_hooks(); })
      .def(
          "expert_load",
          [](const PyDispatcher& d, std::optional<uintptr_t> stream) {
            return d.native->expert_load(as_stream(stream));
          },
          py::arg("stream").none(true) = py::none())
      .def(
          "reset",
          [](PyDispatcher& d, std::optional<uintptr_t> stream) {
            {
              py::gil_scoped_release release;
              d.native->reset(as_stream(stream));
            }
            d.x = d.topk_idx = d.topk_weights = d.y = py::none();
          },
          py::arg("stream").none(true) = py::none())
      .def(
          "reset_expert_load",
          [](PyDispatcher& d, std::optional<uintptr_t> stream) {
            d.native->reset_expert_load(as_stream(stream));
          },
          py::arg("stream").none(true) = py::none())
      .def_property_readonly(
          "stream",
          [](const PyDispatcher& d) { return reinterpret_cast<uintptr_t>(d.native->stream()); })
      .def_property_readonly(
          "last_format",
          [](const PyDispatcher& d) { return output_format_name(d.native->last_format()); })
      .def_property_readonly("stage", [](const PyDispatcher& d) { return d.native->stage_name(); })
      .def_property_readonly("num_experts",
                             [](const PyDispatcher& d) { return d.config.num_experts; })
      .def_property_readonly(
          "num_local_experts",
          [](const PyDispatcher& d) { return d.config.num_experts / d.num_ranks; })
      .def_property_readonly("hidden", [](const PyDispatcher& d) { return d.config.hidden; })
      .def_property_readonly("top_k", [](const PyDispatcher& d) { return d.config.top_k; })
      .def_property_readonly("max_tokens_per_rank",
                             [](const PyDispatcher& d) { return d.config.max_tokens_per_rank; })
      .def_property_readonly("backend",
                             [](const PyDispatcher& d) {
                               return d.config.backend == DispatcherBackend::kA2a ? "a2a"
                                                                                  : "deepep";
                             })
      .def_property_readonly(
          "mode", [](const PyDispatcher& d) { return dispatch_mode_name(d.config.mode); })
      .def_property_readonly(
          "quant", [](const PyDispatcher& d) { return dispatch_quant_name(d.config.quant); })
      .def_property_readonly("num_worst_tokens",
                             [](const PyDispatcher& d) { return d.config.num_worst_tokens; })
      .def_property_readonly("return_recv_hook",
                             [](const PyDispatcher& d) { return d.config.return_recv_hook; })
      .def_property_readonly("ht_zero_copy",
                             [](const PyDispatcher& d) { return d.config.ht_zero_copy; });
}

}  // namespace epx::python
