// python/src/timing.cc — C++ baselines for the Python call overhead (docs/perf.md §4.5).
//
// Data flow: each function converts its torch inputs once, then calls the epx ops N times in a C++
// loop with the GIL released and returns host nanoseconds per iteration (one dispatch + one
// combine). With a `sync` callable (CUDA tensors: torch.cuda.synchronize) the loop runs in chunks
// of `every` iterations and calls it after each chunk, outside the timed spans, so the launch
// queue never fills and the time is the host's own, not the device's.
// Outputs come from a caching host allocator (freed blocks of the same size are reused, as
// PyTorch's allocators do), so the baseline measures the ops, not malloc/mmap of fresh pages.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <vector>

#include "bindings.h"
#include "epx/a2a.h"
#include "epx/buffer.h"
#include "torch_bridge.h"

namespace epx::python {

namespace {

// Reuses a block once nothing but the cache references it. Host memory only.
class CachingAllocator {
 public:
  Tensor allocate(DType dtype, const std::vector<int64_t>& shape, Device device) {
    Tensor t;
    static_cast<TensorView&>(t) = TensorView::contiguous(nullptr, dtype, shape, device);
    const size_t bytes = std::max<size_t>(64, (t.nbytes() + 63) / 64 * 64);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& block : blocks_[bytes]) {
      if (block.use_count() == 1) {
        t.storage = block;
        t.data = block.get();
        return t;
      }
    }
    Tensor fresh = default_allocator()(DType::kU8, {static_cast<int64_t>(bytes)}, device);
    blocks_[bytes].push_back(fresh.storage);
    t.storage = fresh.storage;
    t.data = fresh.storage.get();
    return t;
  }
  Allocator allocator() {
    return
        [this](DType d, const std::vector<int64_t>& s, Device dev) { return allocate(d, s, dev); };
  }

 private:
  std::mutex mutex_;
  std::map<size_t, std::vector<std::shared_ptr<void>>> blocks_;
};

template <typename Body>
double ns_per_iteration(int iters, const py::object& sync, int every, Body body) {
  if (sync.is_none() || every <= 0) every = iters;
  std::chrono::duration<double, std::nano> ns{0};
  for (int done = 0; done < iters;) {
    const int n = std::min(every, iters - done);
    {
      py::gil_scoped_release nogil;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) body();
      ns += std::chrono::steady_clock::now() - start;
    }
    done += n;
    if (!sync.is_none()) sync();
  }
  return ns.count() / (iters > 0 ? iters : 1);
}

double time_ll(const std::shared_ptr<Buffer>& b, py::handle x, py::handle topk_idx,
               py::handle weights, bool use_fp8, int iters, const py::object& sync, int every,
               bool hook) {
  CachingAllocator cache;
  const Allocator alloc = cache.allocator();
  LlDispatchArgs d;
  d.x = to_view(x, "x");
  d.topk_idx = to_view(topk_idx, "topk_idx");
  d.use_fp8 = use_fp8;
  d.return_recv_hook = hook;
  LlCombineArgs c;
  c.topk_idx = d.topk_idx;
  c.topk_weights = to_view(weights, "topk_weights");
  c.return_recv_hook = hook;
  return ns_per_iteration(iters, sync, every, [&] {
    LlDispatchResult r = b->ll_dispatch(d, alloc);
    if (hook) r.hook();
    Tensor y = alloc(DType::kBF16, {r.recv_x.shape[0], r.recv_x.shape[1], r.recv_x.shape[2]},
                     r.recv_x.device);
    c.y = y;
    c.handle = &r.handle;
    LlCombineResult o = b->ll_combine(c, alloc);
    if (hook) o.hook();
  });
}

double time_ht(const std::shared_ptr<Buffer>& b, py::handle x, py::handle topk_idx, int iters,
               const py::object& sync, int every) {
  CachingAllocator cache;
  const Allocator alloc = cache.allocator();
  HtDispatchArgs d;
  d.x = to_view(x, "x");
  d.topk_idx = to_view(topk_idx, "topk_idx");
  return ns_per_iteration(iters, sync, every, [&] {
    HtDispatchResult r = b->ht_dispatch(d, alloc);
    HtCombineArgs c;
    c.y = r.recv_x;
    c.handle = &r.handle;
    HtCombineResult o = b->ht_combine(c, alloc);
  });
}

double time_a2a(const std::shared_ptr<A2a>& a, py::handle topk_idx, const py::list& payloads,
                py::handle y, int64_t runtime_max, int iters, const py::object& sync, int every) {
  CachingAllocator cache;
  const Allocator alloc = cache.allocator();
  A2aDispatchArgs args;
  args.topk_idx = to_view(topk_idx, "topk_idx");
  for (size_t i = 0; i < payloads.size(); ++i) args.payloads.push_back(to_view(payloads[i], "p"));
  args.runtime_max_tokens_per_rank = runtime_max;
  const TensorView yv = to_view(y, "y");
  return ns_per_iteration(iters, sync, every, [&] {
    A2aDispatchResult r = a->dispatch(args);
    Tensor out = a->combine(yv, runtime_max, false, nullptr, alloc);
  });
}

}  // namespace

void bind_timing(py::module_& m) {
  m.def(
      "_alloc_stats",
      [](bool reset) {
        const AllocStats s = torch_alloc_stats(reset);
        return py::make_tuple(s.calls, s.ns);
      },
      py::arg("reset") = false,
      "(calls, host ns) of the torch allocator since the last reset (reset=True zeroes); the "
      "first call starts the host timing (no clock read per allocation before).");
  m.def("_set_alloc_new_empty", &set_torch_alloc_new_empty, py::arg("on"),
        "Outputs by a cached template's new_empty (True, default) or by torch.empty (False).");
  m.def("_time_ll_cpp", &time_ll, py::arg("buffer"), py::arg("x"), py::arg("topk_idx"),
        py::arg("topk_weights"), py::arg("use_fp8"), py::arg("iters"), py::arg("sync") = py::none(),
        py::arg("every") = 0, py::arg("hook") = false);
  m.def("_time_ht_cpp", &time_ht, py::arg("buffer"), py::arg("x"), py::arg("topk_idx"),
        py::arg("iters"), py::arg("sync") = py::none(), py::arg("every") = 0);
  m.def("_time_a2a_cpp", &time_a2a, py::arg("a2a"), py::arg("topk_idx"), py::arg("payloads"),
        py::arg("y"), py::arg("runtime_max_tokens_per_rank"), py::arg("iters"),
        py::arg("sync") = py::none(), py::arg("every") = 0);
}

}  // namespace epx::python
