// python/src/buffer_bindings.cc — epx::Buffer (ht and ll modes) for Python.
//
// Data flow of every op: torch tensors -> to_view() (GIL held) -> the C++ op with the GIL released
// (outputs allocated as torch tensors through torch_allocator(), which re-takes the GIL) ->
// to_torch() on each result (GIL held). Handles stay C++ objects (HtHandle / LlHandle) whose
// tensor fields read back as the torch tensors that were allocated for them. Hooks (ll
// return_recv_hook) are callable objects that keep their Buffer alive and run exactly once.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "epx/buffer.h"
#include "torch_bridge.h"

namespace epx::python {

namespace {

using BufferPtr = std::shared_ptr<Buffer>;

// A recv hook: calls the C++ hook once, without the GIL. `keep` holds the Python objects the
// hook's kernel writes or that must outlive it (the caller's stats / out tensors, the handle)
// until it was launched; the receive reads none of the caller's inputs (they were copied by the
// call), so the caller may drop them as soon as the call returned.
struct Hook {
  LlHook fn;
  BufferPtr owner;
  const char* op = "hook";
  py::object keep;
  bool called = false;
  void call() {
    if (called) {
      throw_epx(ErrorCode::kInvalidArgument,
                std::string(op) + " hook: called a second time, expected exactly one call");
    }
    called = true;
    {
      py::gil_scoped_release nogil;
      fn();
    }
    keep = py::none();  // launched: later users of that memory are ordered after the kernel
  }
};

// `keep0`, `keep1`: what the hook's kernel writes (Hook::keep); the tuple is built only when
// there is a hook.
py::object make_hook(LlHook fn, const BufferPtr& owner, const char* op, py::handle keep0,
                     py::handle keep1) {
  if (!fn) return py::none();
  py::tuple keep = py::make_tuple(py::reinterpret_borrow<py::object>(keep0),
                                  py::reinterpret_borrow<py::object>(keep1));
  return py::cast(std::make_shared<Hook>(Hook{std::move(fn), owner, op, std::move(keep)}));
}

std::shared_ptr<void> owner_of(const BufferPtr& b) {
  return std::static_pointer_cast<void>(b);
}

MoeShape make_shape(int64_t hidden, int top_k, int num_experts, int64_t max_tokens) {
  MoeShape s;
  s.hidden = hidden;
  s.top_k = top_k;
  s.num_experts = num_experts;
  s.max_tokens_per_rank = max_tokens;
  return s;
}

Mode parse_mode(const std::string& mode) {
  if (mode == "ht") return Mode::kHt;
  if (mode == "ll") return Mode::kLl;
  throw_epx(ErrorCode::kInvalidArgument,
            "Buffer.bytes_needed: argument 'mode' is '" + mode + "', expected 'ht' or 'll'");
}

Backend parse_backend(const std::string& backend) {
  if (backend == "cpu") return Backend::kCpu;
  if (backend == "cuda") return Backend::kCuda;
  throw_epx(ErrorCode::kInvalidArgument,
            "argument 'backend' is '" + backend + "', expected 'cpu' or 'cuda'");
}

Stream as_stream(uintptr_t stream) {
  return reinterpret_cast<Stream>(stream);
}

py::tuple ht_layout(const BufferPtr& b, py::handle topk_idx, uintptr_t stream) {
  TensorView idx = to_view(topk_idx, "ht_layout: argument 'topk_idx'");
  HtLayout r;
  {
    py::gil_scoped_release nogil;
    r = b->ht_layout(idx, as_stream(stream), torch_allocator());
  }
  return py::make_tuple(to_torch(r.num_tokens_per_rank), to_torch(r.num_tokens_per_expert),
                        to_torch(r.is_token_in_rank));
}

// The C++ object behind a handle argument, or null where it is no T (one type look-up; the
// message of the error is built only when there is one).
template <typename T>
std::shared_ptr<T> handle_or_null(py::handle h) {
  if (h.is_none()) return nullptr;
  py::detail::make_caster<std::shared_ptr<T>> caster;
  if (!caster.load(h, false)) return nullptr;
  return py::detail::cast_op<std::shared_ptr<T>>(caster);
}

// The handle arguments: an HtHandle / LlHandle, else InvalidArgument naming the argument.
std::shared_ptr<HtHandle> ht_handle_arg(py::handle h, const char* op, bool allow_none = false) {
  if (auto p = handle_or_null<HtHandle>(h)) return p;
  return bound_arg<HtHandle>(h, std::string(op) + ": argument 'handle'",
                             std::string("an epx HtHandle (the handle ht_dispatch returned)") +
                                 (allow_none ? " or None" : ""),
                             allow_none);
}
std::shared_ptr<LlHandle> ll_handle_arg(py::handle h, const char* op) {
  if (auto p = handle_or_null<LlHandle>(h)) return p;
  return bound_arg<LlHandle>(h, std::string(op) + ": argument 'handle'",
                             "an epx LlHandle (the handle ll_dispatch returned)");
}

py::tuple ht_dispatch(const BufferPtr& b, py::handle x, py::handle x_scales, bool x_is_fp8,
                      py::handle topk_idx, py::handle topk_weights, int expert_alignment,
                      int64_t num_worst_tokens, py::handle handle_obj, uintptr_t stream,
                      bool zero_copy) {
  const std::shared_ptr<HtHandle> handle_ptr = ht_handle_arg(handle_obj, "ht_dispatch", true);
  const HtHandle* handle = handle_ptr.get();
  HtDispatchArgs args;
  args.x = to_view(x, "ht_dispatch: argument 'x'");
  if (x_is_fp8 && args.x.dtype == DType::kU8) args.x.dtype = DType::kF8E4M3;
  args.x_scales = to_view(x_scales, "ht_dispatch: argument 'x_scales'");
  args.topk_idx = to_view(topk_idx, "ht_dispatch: argument 'topk_idx'");
  args.topk_weights = to_view(topk_weights, "ht_dispatch: argument 'topk_weights'");
  args.expert_alignment = expert_alignment;
  args.num_worst_tokens = num_worst_tokens;
  args.handle = handle;
  args.zero_copy = zero_copy;
  args.stream = as_stream(stream);
  HtDispatchResult r;
  {
    py::gil_scoped_release nogil;
    r = b->ht_dispatch(args, torch_allocator());
  }
  const auto owner = owner_of(b);
  py::object h = handle ? py::none() : py::cast(std::make_shared<HtHandle>(std::move(r.handle)));
  return py::make_tuple(to_torch(r.recv_x, owner), to_torch(r.recv_x_scales, owner),
                        to_torch(r.recv_topk_idx, owner), to_torch(r.recv_topk_weights, owner),
                        to_torch(r.recv_src_idx, owner), py::cast(r.num_recv_tokens_per_expert), h);
}

py::tuple ht_combine(const BufferPtr& b, py::handle y, py::handle handle_obj,
                     py::handle topk_weights, py::handle bias0, py::handle bias1, uintptr_t stream,
                     bool zero_copy) {
  const std::shared_ptr<HtHandle> handle = ht_handle_arg(handle_obj, "ht_combine");
  HtCombineArgs args;
  args.y = to_view(y, "ht_combine: argument 'y'");
  args.handle = handle.get();
  args.topk_weights = to_view(topk_weights, "ht_combine: argument 'topk_weights'");
  args.bias0 = to_view(bias0, "ht_combine: argument 'bias[0]'");
  args.bias1 = to_view(bias1, "ht_combine: argument 'bias[1]'");
  args.zero_copy = zero_copy;
  args.stream = as_stream(stream);
  HtCombineResult r;
  {
    py::gil_scoped_release nogil;
    r = b->ht_combine(args, torch_allocator());
  }
  const auto owner = owner_of(b);
  return py::make_tuple(to_torch(r.out, owner), to_torch(r.combined_topk_weights, owner));
}

py::tuple ll_dispatch(const BufferPtr& b, py::handle x, py::handle topk_idx, bool use_fp8,
                      bool round_scale, bool use_ue8m0, bool return_recv_hook, py::handle stats,
                      uintptr_t stream, py::handle wait_stats, bool use_nvfp4,
                      py::handle x_global_scale, std::optional<float> global_scale) {
  LlDispatchArgs args;
  args.use_nvfp4 = use_nvfp4;
  args.x_global_scale = to_view(x_global_scale, "ll_dispatch: argument 'x_global_scale'");
  args.global_scale = global_scale;
  args.x = to_view(x, "ll_dispatch: argument 'x'");
  args.topk_idx = to_view(topk_idx, "ll_dispatch: argument 'topk_idx'");
  args.use_fp8 = use_fp8;
  args.round_scale = round_scale;
  args.use_ue8m0 = use_ue8m0;
  args.return_recv_hook = return_recv_hook;
  args.cumulative_local_expert_recv_stats =
      to_view(stats, "ll_dispatch: argument 'cumulative_local_expert_recv_stats'");
  args.dispatch_wait_recv_cost_stats =
      to_view(wait_stats, "ll_dispatch: argument 'dispatch_wait_recv_cost_stats'");
  args.stream = as_stream(stream);
  LlDispatchResult r;
  {
    py::gil_scoped_release nogil;
    r = b->ll_dispatch(args, torch_allocator());
  }
  const auto owner = owner_of(b);
  py::object hook = make_hook(std::move(r.hook), b, "ll_dispatch", stats, wait_stats);
  return py::make_tuple(to_torch(r.recv_x, owner), to_torch(r.recv_scales, owner),
                        to_torch(r.recv_count, owner),
                        py::cast(std::make_shared<LlHandle>(std::move(r.handle))), hook);
}

py::tuple ll_combine(const BufferPtr& b, py::handle y, py::handle topk_idx, py::handle topk_weights,
                     py::handle handle_obj, bool zero_copy, bool return_recv_hook, py::handle out,
                     uintptr_t stream, py::handle wait_stats, bool use_logfmt, py::handle overlap) {
  const std::shared_ptr<LlHandle> handle_ptr = ll_handle_arg(handle_obj, "ll_combine");
  const LlHandle& handle = *handle_ptr;
  LlCombineArgs args;
  args.y = to_view(y, "ll_combine: argument 'y'");
  args.topk_idx = to_view(topk_idx, "ll_combine: argument 'topk_idx'");
  args.topk_weights = to_view(topk_weights, "ll_combine: argument 'topk_weights'");
  args.handle = &handle;
  args.zero_copy = zero_copy;
  args.use_logfmt = use_logfmt;
  args.return_recv_hook = return_recv_hook;
  args.out = to_view(out, "ll_combine: argument 'out'");
  args.combine_wait_recv_cost_stats =
      to_view(wait_stats, "ll_combine: argument 'combine_wait_recv_cost_stats'");
  args.overlap = ll_overlap_arg(overlap, "ll_combine");
  args.stream = as_stream(stream);
  LlCombineResult r;
  {
    py::gil_scoped_release nogil;
    r = b->ll_combine(args, torch_allocator());
  }
  py::object result =
      out.is_none() ? to_torch(r.out, owner_of(b)) : py::reinterpret_borrow<py::object>(out);
  return py::make_tuple(result, make_hook(std::move(r.hook), b, "ll_combine", result, wait_stats));
}

}  // namespace

std::optional<LlCombineOverlap> ll_overlap_arg(py::handle overlap, const char* op) {
  if (overlap.is_none()) return std::nullopt;
  const std::string what = std::string(op) + ": argument 'overlap'";
  if (!py::isinstance<py::tuple>(overlap) || py::len(overlap) != 5)
    throw_epx(ErrorCode::kInvalidArgument,
              what + " is a " + type_name(overlap) +
                  ", expected epx.LlCombineOverlap(signals, block_rows, expected, num_sms, "
                  "recv_count)");
  const auto t = py::reinterpret_borrow<py::tuple>(overlap);
  LlCombineOverlap o;
  o.signals = to_view(t[0], (what + ".signals").c_str());
  o.block_rows = t[1].cast<int64_t>();
  o.expected = t[2].cast<int64_t>();
  o.num_sms = t[3].cast<int>();
  o.recv_count = to_view(t[4], (what + ".recv_count").c_str());
  return o;
}

void bind_buffer(py::module_& m) {
  py::class_<HtHandle, std::shared_ptr<HtHandle>>(m, "HtHandle",
                                                  "What ht combine and cached dispatch need.")
      .def_property_readonly("rank_prefix_matrix",
                             [](const HtHandle& h) { return to_torch(h.rank_prefix_matrix); })
      .def_property_readonly("recv_src_idx",
                             [](const HtHandle& h) { return to_torch(h.recv_src_idx); })
      .def_property_readonly("is_token_in_rank",
                             [](const HtHandle& h) { return to_torch(h.is_token_in_rank); })
      .def_property_readonly("send_pos", [](const HtHandle& h) { return to_torch(h.send_pos); })
      .def_readonly("num_tokens", &HtHandle::num_tokens)
      .def_readonly("num_recv_tokens", &HtHandle::num_recv_tokens)
      .def_readonly("num_worst_tokens", &HtHandle::num_worst_tokens)
      .def_readonly("top_k", &HtHandle::top_k)
      .def_readonly("buffer_id", &HtHandle::buffer_id);

  py::class_<LlHandle, std::shared_ptr<LlHandle>>(m, "LlHandle",
                                                  "What ll combine needs (from ll_dispatch).")
      .def_property_readonly("src_info", [](const LlHandle& h) { return to_torch(h.src_info); })
      .def_property_readonly("layout_range",
                             [](const LlHandle& h) { return to_torch(h.layout_range); })
      .def_readonly("max_tokens", &LlHandle::max_tokens)
      .def_readonly("hidden", &LlHandle::hidden)
      .def_readonly("num_experts", &LlHandle::num_experts)
      .def_readonly("num_tokens", &LlHandle::num_tokens)
      .def_readonly("buffer_id", &LlHandle::buffer_id);

  py::class_<Hook, std::shared_ptr<Hook>>(m, "Hook",
                                          "Finishes the receive half of an ll op; call once.")
      .def("__call__", &Hook::call)
      .def_readonly("called", &Hook::called);

  py::class_<Buffer, BufferPtr>(m, "Buffer")
      .def(py::init([](const Group& group, int64_t hidden, int top_k, int num_experts,
                       int64_t max_tokens_per_rank, bool enable_ht, bool enable_ll,
                       bool enable_shrink) {
             BufferConfig config;
             config.enable_ht = enable_ht;
             config.enable_ll = enable_ll;
             config.enable_shrink = enable_shrink;
             MoeShape shape = make_shape(hidden, top_k, num_experts, max_tokens_per_rank);
             py::gil_scoped_release nogil;
             return std::make_shared<Buffer>(group, shape, config);
           }),
           py::arg("group"), py::arg("hidden"), py::arg("top_k"), py::arg("num_experts"),
           py::arg("max_tokens_per_rank"), py::arg("enable_ht") = true,
           py::arg("enable_ll") = false, py::arg("enable_shrink") = false)
      .def_static(
          "bytes_needed",
          [](const std::string& mode, int64_t hidden, int top_k, int num_experts,
             int64_t max_tokens, int num_ranks, const std::string& backend, int ranks_per_node) {
            return Buffer::bytes_needed(parse_mode(mode),
                                        make_shape(hidden, top_k, num_experts, max_tokens),
                                        num_ranks, parse_backend(backend), ranks_per_node);
          },
          py::arg("mode"), py::arg("hidden"), py::arg("top_k"), py::arg("num_experts"),
          py::arg("max_tokens_per_rank"), py::arg("num_ranks"), py::arg("backend"),
          py::arg("ranks_per_node") = 0)
      .def_property_readonly("bytes_allocated", &Buffer::bytes_allocated)
      .def_property_readonly("id", &Buffer::id)
      .def_property_readonly("hidden", [](const Buffer& b) { return b.shape().hidden; })
      .def_property_readonly("top_k", [](const Buffer& b) { return b.shape().top_k; })
      .def_property_readonly("num_experts", [](const Buffer& b) { return b.shape().num_experts; })
      .def_property_readonly("max_tokens_per_rank",
                             [](const Buffer& b) { return b.shape().max_tokens_per_rank; })
      .def_property_readonly("device", [](const Buffer& b) { return b.device().str(); })
      .def("check", &Buffer::check, py::call_guard<py::gil_scoped_release>())
      .def("ht_layout", &ht_layout, py::arg("topk_idx"), py::arg("stream") = 0)
      .def("ht_dispatch", &ht_dispatch, py::arg("x"), py::arg("x_scales"), py::arg("x_is_fp8"),
           py::arg("topk_idx"), py::arg("topk_weights"), py::arg("expert_alignment"),
           py::arg("num_worst_tokens"), py::arg("handle").none(true), py::arg("stream") = 0,
           py::arg("zero_copy") = false)
      .def("ht_combine", &ht_combine, py::arg("y"), py::arg("handle"), py::arg("topk_weights"),
           py::arg("bias0"), py::arg("bias1"), py::arg("stream") = 0, py::arg("zero_copy") = false)
      .def(
          "ht_combine_buffer",
          [](const BufferPtr& b, py::handle handle) {
            const auto h = ht_handle_arg(handle, "ht_combine_buffer");
            return view_to_torch(b->ht_combine_buffer(*h), owner_of(b));
          },
          py::arg("handle"))
      .def("ll_dispatch", &ll_dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("use_fp8"),
           py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("return_recv_hook"),
           py::arg("cumulative_local_expert_recv_stats"), py::arg("stream") = 0,
           py::arg("dispatch_wait_recv_cost_stats") = py::none(), py::arg("use_nvfp4") = false,
           py::arg("x_global_scale") = py::none(), py::arg("global_scale") = py::none())
      .def("ll_combine", &ll_combine, py::arg("y"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("handle"), py::arg("zero_copy"), py::arg("return_recv_hook"), py::arg("out"),
           py::arg("stream") = 0, py::arg("combine_wait_recv_cost_stats") = py::none(),
           py::arg("use_logfmt") = false, py::arg("overlap") = py::none())
      .def(
          "ll_next_combine_buffer",
          [](const BufferPtr& b, py::handle handle) {
            const auto h = ll_handle_arg(handle, "ll_next_combine_buffer");
            return view_to_torch(b->ll_next_combine_buffer(*h), owner_of(b));
          },
          py::arg("handle"))
      .def("ll_clean", &Buffer::ll_clean, py::call_guard<py::gil_scoped_release>())
      .def(
          "ll_update_mask",
          [](Buffer& b, int rank, bool mask, uintptr_t stream) {
            b.ll_update_mask(rank, mask, as_stream(stream));
          },
          py::arg("rank"), py::arg("mask"), py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "ll_query_mask",
          [](const Buffer& b, py::handle mask_status, uintptr_t stream) {
            const TensorView v = to_view(mask_status, "ll_query_mask: argument 'mask_status'");
            py::gil_scoped_release nogil;
            b.ll_query_mask(v, as_stream(stream));
          },
          py::arg("mask_status"), py::arg("stream") = 0)
      .def(
          "ll_clean_mask", [](Buffer& b, uintptr_t stream) { b.ll_clean_mask(as_stream(stream)); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("reset", &Buffer::reset, py::call_guard<py::gil_scoped_release>());
}

}  // namespace epx::python
