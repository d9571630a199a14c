// python/src/a2a_bindings.cc — epx::A2a (fixed-geometry multi-payload all-to-all) for Python.
//
// Data flow: dispatch(topk_idx[T, K], payloads p_i[T, ...]) -> per payload a torch view
// [R, M, ...] of the receive workspace plus recv_counts[R] (also a workspace view); the views are
// DLPack exports that keep the A2a alive. combine(y[R, M, H]) -> out[T, H] allocated as a torch
// tensor; with payload_in_workspace, y is the view combine_payload_view() returned. The
// dispatch -> combine -> dispatch order is enforced by epx::A2a itself (InvalidArgument).
#include <pybind11/stl.h>

#include <optional>

#include "bindings.h"
#include "epx/a2a.h"
#include "torch_bridge.h"

namespace epx::python {

namespace {

using A2aPtr = std::shared_ptr<A2a>;

Backend backend_of(const std::string& backend) {
  if (backend == "cpu") return Backend::kCpu;
  if (backend == "cuda") return Backend::kCuda;
  throw_epx(ErrorCode::kInvalidArgument,
            "A2a.workspace_bytes: argument 'backend' is '" + backend + "', expected cpu or cuda");
}

A2aShape make_shape(int64_t max_tokens, int top_k, int num_experts,
                    const std::vector<size_t>& payload_bytes, size_t combine_bytes) {
  A2aShape s;
  s.max_tokens_per_rank = max_tokens;
  s.top_k = top_k;
  s.num_experts = num_experts;
  s.payload_bytes_per_token = payload_bytes;
  s.combine_bytes_per_token = combine_bytes;
  return s;
}

py::tuple dispatch(const A2aPtr& a, py::handle topk_idx, const py::list& payloads,
                   int64_t runtime_max, std::optional<int32_t> invalid_expert_id,
                   int expert_id_payload_index, uintptr_t stream) {
  A2aDispatchArgs args;
  args.topk_idx = to_view(topk_idx, "a2a dispatch: argument 'token_selected_experts'");
  args.payloads.reserve(payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    const std::string what = "a2a dispatch: argument 'input_payloads[" + std::to_string(i) + "]'";
    args.payloads.push_back(to_view(payloads[i], what.c_str()));
  }
  args.runtime_max_tokens_per_rank = runtime_max;
  args.invalid_expert_id = invalid_expert_id;
  args.expert_id_payload_index = expert_id_payload_index;
  args.stream = reinterpret_cast<Stream>(stream);
  A2aDispatchResult r;
  {
    py::gil_scoped_release nogil;
    r = a->dispatch(args);
  }
  const auto owner = std::static_pointer_cast<void>(a);
  py::list recv;
  for (const TensorView& v : r.recv) recv.append(view_to_torch(v, owner));
  return py::make_tuple(recv, view_to_torch(r.recv_counts, owner));
}

}  // namespace

void bind_a2a(py::module_& m) {
  m.attr("kMaxA2aPayloads") = kMaxA2aPayloads;
  py::class_<A2a, A2aPtr>(m, "A2a")
      .def(py::init([](const Group& group, int64_t max_tokens_per_rank, int top_k, int num_experts,
                       const std::vector<size_t>& payload_bytes_per_token,
                       size_t combine_bytes_per_token) {
             A2aShape shape = make_shape(max_tokens_per_rank, top_k, num_experts,
                                         payload_bytes_per_token, combine_bytes_per_token);
             py::gil_scoped_release nogil;
             return std::make_shared<A2a>(group, shape);
           }),
           py::arg("group"), py::arg("max_tokens_per_rank"), py::arg("top_k"),
           py::arg("num_experts"), py::arg("payload_bytes_per_token"),
           py::arg("combine_bytes_per_token"))
      .def_static(
          "workspace_bytes",
          [](int64_t max_tokens, int top_k, int num_experts,
             const std::vector<size_t>& payload_bytes, size_t combine_bytes, int num_ranks,
             const std::string& backend) {
            return A2a::workspace_bytes(
                make_shape(max_tokens, top_k, num_experts, payload_bytes, combine_bytes), num_ranks,
                backend_of(backend));
          },
          py::arg("max_tokens_per_rank"), py::arg("top_k"), py::arg("num_experts"),
          py::arg("payload_bytes_per_token"), py::arg("combine_bytes_per_token"),
          py::arg("num_ranks"), py::arg("backend"))
      .def_property_readonly("bytes_allocated", &A2a::bytes_allocated)
      .def_property_readonly("max_tokens_per_rank",
                             [](const A2a& a) { return a.shape().max_tokens_per_rank; })
      .def_property_readonly("top_k", [](const A2a& a) { return a.shape().top_k; })
      .def_property_readonly("num_experts", [](const A2a& a) { return a.shape().num_experts; })
      .def_property_readonly("payload_bytes_per_token",
                             [](const A2a& a) { return a.shape().payload_bytes_per_token; })
      .def_property_readonly("combine_bytes_per_token",
                             [](const A2a& a) { return a.shape().combine_bytes_per_token; })
      .def_property_readonly("device", [](const A2a& a) { return a.device().str(); })
      .def("check", &A2a::check, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_active_ranks",
          [](A2a& a, const std::vector<bool>& active, uintptr_t stream) {
            a.set_active_ranks(active, reinterpret_cast<Stream>(stream));
          },
          py::arg("active"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("active_ranks", &A2a::active_ranks)
      .def(
          "dropped_counts",
          [](const A2a& a) {
            const A2aDropCounts c = a.dropped_counts();
            return py::make_tuple(c.tokens, c.selections);
          })
      .def(
          "reset_dropped_counts",
          [](A2a& a, uintptr_t stream) { a.reset_dropped_counts(reinterpret_cast<Stream>(stream)); },
          py::arg("stream") = 0)
      .def("dispatch", &dispatch, py::arg("topk_idx"), py::arg("payloads"),
           py::arg("runtime_max_tokens_per_rank"), py::arg("invalid_expert_id").none(true),
           py::arg("expert_id_payload_index"), py::arg("stream") = 0)
      .def(
          "combine_payload_view",
          [](const A2aPtr& a, int64_t runtime_max, int64_t hidden, int dtype) {
            if (dtype < 0 || dtype >= kNumDTypes) {
              throw_epx(ErrorCode::kInvalidArgument,
                        "a2a combine_payload_view: argument 'dtype' code " + std::to_string(dtype) +
                            " is not an epx dtype");
            }
            TensorView v = a->combine_payload_view(runtime_max, hidden, static_cast<DType>(dtype));
            return view_to_torch(v, std::static_pointer_cast<void>(a));
          },
          py::arg("runtime_max_tokens_per_rank"), py::arg("hidden"), py::arg("dtype"))
      .def(
          "combine",
          [](const A2aPtr& a, py::handle y, int64_t runtime_max, bool payload_in_workspace,
             uintptr_t stream) {
            TensorView yv = to_view(y, "a2a combine: argument 'payload'");
            Tensor out;
            {
              py::gil_scoped_release nogil;
              out = a->combine(yv, runtime_max, payload_in_workspace,
                               reinterpret_cast<Stream>(stream), torch_allocator());
            }
            return to_torch(out, std::static_pointer_cast<void>(a));
          },
          py::arg("y"), py::arg("runtime_max_tokens_per_rank"), py::arg("payload_in_workspace"),
          py::arg("stream") = 0);
}

}  // namespace epx::python
