// python/src/torch_bridge.cc — PyTorch <-> epx tensors (see torch_bridge.h for the data flow).
//
// Ownership: a tensor made by torch_allocator() carries, in its shared storage, a PyRef deleter
// that owns one reference to the torch tensor; std::get_deleter finds it again in to_torch(), so a
// result maps back to the very tensor PyTorch allocated. Workspace views leave through DLPack
// capsules ("dltensor", laid out per the DLPack ABI) whose context owns a shared_ptr to the
// Buffer/A2a, so the symmetric memory outlives every torch view of it.
#include "torch_bridge.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "torch_aten_api.h"

namespace epx::python {

static_assert(EPX_ATEN_MAX_DIMS == kMaxDims);

namespace {

// Never destroyed: its Python references must not be released after the interpreter is gone.
TorchApi* g_api = new TorchApi();

std::atomic<uint64_t> g_alloc_calls{0}, g_alloc_ns{0};
// Host time of the allocations is measured from the first torch_alloc_stats() call on (two clock
// reads per output, ≈ 0.05 µs: none until a benchmark asks); calls are always counted.
std::atomic<bool> g_alloc_timed{false};

// Owns one reference to a torch tensor; the deleter of an allocated Tensor's storage. Its dtype
// and shape (a fixed array: no heap allocation per output) let to_torch() recognise the tensor.
struct PyRef {
  PyObject* obj = nullptr;
  DType dtype = DType::kU8;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  void operator()(void*) const {
    if (obj == nullptr || !Py_IsInitialized()) return;
    PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(obj);
    PyGILState_Release(state);
  }
};

[[noreturn]] void bad(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

// ---- DLPack (the ABI torch.utils.dlpack.from_dlpack reads) ---------------------------------
namespace dl {
struct Device {
  int32_t device_type;  // 1 = CPU, 2 = CUDA
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};
}  // namespace dl

struct ExportContext {
  dl::ManagedTensor managed{};
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  std::shared_ptr<void> owner;
};

void delete_export(dl::ManagedTensor* m) {
  delete static_cast<ExportContext*>(m->manager_ctx);
}

void capsule_destructor(PyObject* capsule) {
  // Not consumed by a framework: free it here. A consumer renames it "used_dltensor".
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (m) m->deleter(m);
  } else {
    PyErr_Clear();
  }
}

// The DLPack type we export `dtype` as; fp8 and bool travel as uint8 and are re-viewed.
dl::DataType dl_type(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return {4, 16, 1};
    case DType::kF16:
      return {2, 16, 1};
    case DType::kF32:
      return {2, 32, 1};
    case DType::kI32:
      return {0, 32, 1};
    case DType::kI64:
      return {0, 64, 1};
    case DType::kF8E4M3:
    case DType::kU8:
    case DType::kBool:
      return {1, 8, 1};
  }
  return {1, 8, 1};
}

py::object device_object(Device device) {
  TorchApi& api = torch_api();
  if (device.type == DeviceType::kCpu) return api.cpu_device;
  return api.device_ctor("cuda", device.index);
}

// Interned attribute names (built once; attribute lookups by PyObject* skip re-encoding).
struct Names {
  PyObject* data_ptr = PyUnicode_InternFromString("data_ptr");
  PyObject* new_empty = PyUnicode_InternFromString("new_empty");
  PyObject* dtype = PyUnicode_InternFromString("dtype");
  PyObject* shape = PyUnicode_InternFromString("shape");
  PyObject* stride = PyUnicode_InternFromString("stride");
  PyObject* is_cuda = PyUnicode_InternFromString("is_cuda");
  PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
  PyObject* get_device = PyUnicode_InternFromString("get_device");
  PyObject* mT = PyUnicode_InternFromString("mT");
  PyObject* as_strided = PyUnicode_InternFromString("as_strided");
};

const Names& names() {
  static const Names* n = new Names();  // never freed (lives as long as the interpreter)
  return *n;
}

// {"dtype": ..., "device": ...} for torch.empty, one dict per (dtype, device), built once.
const py::dict& empty_kwargs(DType dtype, Device device) {
  static auto* cache = new std::map<int, py::dict>();
  const int key =
      static_cast<int>(dtype) * 4096 + (device.type == DeviceType::kCpu ? 0 : 1 + device.index);
  auto it = cache->find(key);
  if (it == cache->end()) {
    py::dict kwargs;
    kwargs["dtype"] = torch_api().dtype_of[static_cast<int>(dtype)];
    kwargs["device"] = device_object(device);
    it = cache->emplace(key, std::move(kwargs)).first;
  }
  return it->second;
}

// The bound method new_empty of a 0-element tensor of (dtype, device), one per pair, built once
// (never freed, as the dicts above): outputs are made by new_empty(sizes), which skips
// torch.empty's keyword parsing — ≈ 1 µs less per output on CUDA (docs/perf.md §4.5, 8acf6bc);
// bound once, so no method look-up per output.
PyObject* empty_template_new_empty(DType dtype, Device device) {
  static auto* cache = new std::map<int, py::object>();
  const int key =
      static_cast<int>(dtype) * 4096 + (device.type == DeviceType::kCpu ? 0 : 1 + device.index);
  auto it = cache->find(key);
  if (it == cache->end()) {
    py::object t = py::reinterpret_steal<py::object>(PyObject_Call(
        torch_api().empty.ptr(), py::make_tuple(0).ptr(), empty_kwargs(dtype, device).ptr()));
    if (!t) throw py::error_already_set();
    py::object method =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(t.ptr(), names().new_empty));
    if (!method) throw py::error_already_set();
    it = cache->emplace(key, std::move(method)).first;
  }
  return it->second.ptr();
}

std::atomic<bool> g_alloc_new_empty{true};

// The ATen path (torch_aten_api.h): set once at import, under the GIL; used when g_aten_on.
const EpxAtenApi* g_aten = nullptr;
std::atomic<bool> g_aten_on{false};

const EpxAtenApi* aten() {
  return g_aten_on.load(std::memory_order_relaxed) ? g_aten : nullptr;
}

TensorView from_aten(const EpxAtenView& a) {
  TensorView v;
  v.data = a.data;
  v.dtype = static_cast<DType>(a.dtype);
  v.device = a.device_type == 0 ? Device::cpu() : Device::cuda(a.device_index);
  v.ndim = a.ndim;
  for (int i = 0; i < a.ndim; ++i) {
    v.shape[i] = a.shape[i];
    v.strides[i] = a.strides[i];
  }
  return v;
}

// A new torch tensor of `shape` (GIL held), its data pointer in *data: through the ATen path
// when it is on, else the template's new_empty (or torch.empty: bench_overhead.py's A/B) and
// data_ptr().
py::object new_torch_tensor(DType dtype, const std::vector<int64_t>& shape, Device device,
                            void** data) {
  if (const EpxAtenApi* a = aten()) {
    PyObject* t = a->allocate(static_cast<int32_t>(dtype), static_cast<int32_t>(shape.size()),
                              shape.data(), device.type == DeviceType::kCpu ? 0 : 1,
                              device.type == DeviceType::kCpu ? 0 : device.index, data);
    if (t == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(t);
  }
  py::tuple sizes(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    PyTuple_SET_ITEM(sizes.ptr(), i, PyLong_FromLongLong(shape[i]));
  }
  py::object t;
  if (g_alloc_new_empty.load(std::memory_order_relaxed)) {
    t = py::reinterpret_steal<py::object>(
        PyObject_CallOneArg(empty_template_new_empty(dtype, device), sizes.ptr()));
  } else {
    py::tuple args = py::make_tuple(sizes);
    t = py::reinterpret_steal<py::object>(
        PyObject_Call(torch_api().empty.ptr(), args.ptr(), empty_kwargs(dtype, device).ptr()));
  }
  if (!t) throw py::error_already_set();
  py::object ptr =
      py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t.ptr(), names().data_ptr));
  if (!ptr) throw py::error_already_set();
  *data = PyLong_AsVoidPtr(ptr.ptr());
  return t;
}

}  // namespace

void register_aten_api(py::handle capsule) {
  const char* expected = EPX_ATEN_API_CAPSULE;
  auto* table = PyCapsule_CheckExact(capsule.ptr())
                    ? static_cast<const EpxAtenApi*>(PyCapsule_GetPointer(capsule.ptr(), expected))
                    : nullptr;
  if (table == nullptr) {
    PyErr_Clear();
    throw_epx(ErrorCode::kInternal,
              std::string("_init_torch_aten: expected the capsule ") + expected);
  }
  if (table->version != EPX_ATEN_API_VERSION || table->size != sizeof(EpxAtenApi)) {
    throw_epx(ErrorCode::kInternal, "_init_torch_aten: epx._epx_torch has table version " +
                                        std::to_string(table->version) +
                                        ", this epx._epx expects " +
                                        std::to_string(EPX_ATEN_API_VERSION) + " (rebuild both)");
  }
  g_aten = table;
  g_aten_on.store(true);
}

bool aten_enabled() {
  return aten() != nullptr;
}

bool aten_view(py::handle tensor, TensorView& out) {
  const EpxAtenApi* a = aten();
  EpxAtenView read;
  if (a == nullptr || !a->view(tensor.ptr(), &read)) return false;
  out = from_aten(read);
  return true;
}

bool set_aten_enabled(bool on) {
  const bool was = aten_enabled();
  g_aten_on.store(on && g_aten != nullptr);
  return was;
}

void set_torch_alloc_new_empty(bool on) {
  g_alloc_new_empty.store(on);
}

TorchApi& torch_api() {
  return *g_api;
}

py::object torch_dtype(DType dtype) {
  return torch_api().dtype_of[static_cast<int>(dtype)];
}

void throw_epx(ErrorCode code, const std::string& message) {
  throw Error(code, message);
}

std::string type_name(py::handle obj) {
  PyTypeObject* type = Py_TYPE(obj.ptr());
  py::handle t(reinterpret_cast<PyObject*>(type));
  try {
    const std::string qualname = py::str(t.attr("__qualname__"));
    const std::string module = py::str(t.attr("__module__"));
    return module == "builtins" ? qualname : module + "." + qualname;
  } catch (const py::error_already_set&) {
    return type->tp_name;
  }
}

TensorView to_view(py::handle t, const char* what) {
  TensorView v;
  if (t.is_none()) return v;
  TorchApi& api = torch_api();
  if (!api.ready) throw_epx(ErrorCode::kInternal, "epx._epx used before epx was imported");
  if (aten_view(t, v)) return v;
  const Names& n = names();
  PyObject* o = t.ptr();
  auto not_a_tensor = [&]() {
    PyErr_Clear();
    bad(std::string(what) + " is a " + Py_TYPE(o)->tp_name + ", expected a torch.Tensor");
  };
  py::object dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(o, n.dtype));
  if (!dtype) not_a_tensor();
  PyObject* code = PyDict_GetItem(api.dtype_code.ptr(), dtype.ptr());  // borrowed
  if (code == nullptr) {
    if (!PyObject_HasAttr(o, n.data_ptr)) not_a_tensor();
    bad(std::string(what) + " has dtype " + std::string(py::str(dtype)) +
        ", which epx does not support (bfloat16, float16, float32, float8_e4m3fn, int32, int64, "
        "uint8, bool)");
  }
  v.dtype = static_cast<DType>(PyLong_AsLong(code));
  py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(o, n.shape));
  py::object strides = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(o, n.stride));
  py::object data = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(o, n.data_ptr));
  if (!shape || !strides || !data || !PyTuple_Check(shape.ptr()) || !PyTuple_Check(strides.ptr()))
    not_a_tensor();
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.ptr());
  if (ndim > kMaxDims) {
    bad(std::string(what) + " has " + std::to_string(ndim) + " dims, epx accepts at most " +
        std::to_string(kMaxDims));
  }
  v.ndim = static_cast<int>(ndim);
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
    v.strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides.ptr(), i));
  }
  v.data = PyLong_AsVoidPtr(data.ptr());
  py::object is_cuda = py::reinterpret_steal<py::object>(PyObject_GetAttr(o, n.is_cuda));
  if (!is_cuda) not_a_tensor();
  if (is_cuda.ptr() == Py_True) {
    py::object index =
        py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(o, n.get_device));
    if (!index) not_a_tensor();
    v.device = Device::cuda(static_cast<int>(PyLong_AsLong(index.ptr())));
  } else {
    py::object is_cpu = py::reinterpret_steal<py::object>(PyObject_GetAttr(o, n.is_cpu));
    if (!is_cpu) PyErr_Clear();
    if (is_cpu && is_cpu.ptr() != Py_True) {
      bad(std::string(what) + " is on " + std::string(py::str(t.attr("device"))) +
          ", epx accepts cpu and cuda tensors");
    }
  }
  if (PyErr_Occurred()) not_a_tensor();
  return v;
}

const Allocator& torch_allocator() {
  static const Allocator alloc = [](DType dtype, const std::vector<int64_t>& shape,
                                    Device device) -> Tensor {
    const bool timed = g_alloc_timed.load(std::memory_order_relaxed);
    const auto start =
        timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    py::gil_scoped_acquire gil;
    void* data = nullptr;
    py::object t = new_torch_tensor(dtype, shape, device, &data);
    Tensor out;
    static_cast<TensorView&>(out) = TensorView::contiguous(data, dtype, shape, device);
    PyRef ref;
    ref.dtype = dtype;
    ref.ndim = out.ndim;
    for (int i = 0; i < out.ndim; ++i) ref.shape[i] = out.shape[i];
    ref.obj = t.release().ptr();
    out.storage = std::shared_ptr<void>(data, ref);
    g_alloc_calls.fetch_add(1, std::memory_order_relaxed);
    if (timed) {
      const std::chrono::duration<double, std::nano> ns = std::chrono::steady_clock::now() - start;
      g_alloc_ns.fetch_add(static_cast<uint64_t>(ns.count()), std::memory_order_relaxed);
    }
    return out;
  };
  return alloc;
}

AllocStats torch_alloc_stats(bool reset) {
  g_alloc_timed.store(true, std::memory_order_relaxed);
  AllocStats s;
  s.calls = reset ? g_alloc_calls.exchange(0) : g_alloc_calls.load();
  s.ns = reset ? g_alloc_ns.exchange(0) : g_alloc_ns.load();
  return s;
}

py::object view_to_torch(const TensorView& v, std::shared_ptr<void> owner) {
  if (!v.defined()) return py::none();
  auto* ctx = new ExportContext();
  ctx->owner = std::move(owner);
  for (int i = 0; i < v.ndim; ++i) {
    ctx->shape[i] = v.shape[i];
    ctx->strides[i] = v.strides[i];
  }
  dl::Tensor& t = ctx->managed.dl_tensor;
  t.data = v.data;
  t.device = {v.device.type == DeviceType::kCpu ? 1 : 2,
              v.device.type == DeviceType::kCpu ? 0 : v.device.index};
  t.ndim = v.ndim;
  t.dtype = dl_type(v.dtype);
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = delete_export;
  PyObject* capsule = PyCapsule_New(&ctx->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    delete ctx;
    throw py::error_already_set();
  }
  py::object out = torch_api().from_dlpack(py::reinterpret_steal<py::object>(capsule));
  if (v.dtype == DType::kF8E4M3 || v.dtype == DType::kBool) {
    py::object want = torch_dtype(v.dtype);
    if (!want.is(out.attr("dtype"))) out = out.attr("view")(want);
  }
  return out;
}

py::object to_torch(const Tensor& t, const std::shared_ptr<void>& fallback_owner) {
  if (!t.defined()) return py::none();
  const PyRef* ref = std::get_deleter<PyRef>(t.storage);
  if (ref == nullptr || ref->obj == nullptr) {
    return view_to_torch(t, t.storage ? t.storage : fallback_owner);
  }
  py::handle base(ref->obj);
  char* base_ptr = static_cast<char*>(t.storage.get());
  bool same_shape = t.ndim == ref->ndim;
  for (int i = 0; same_shape && i < t.ndim; ++i) same_shape = t.shape[i] == ref->shape[i];
  if (t.data == base_ptr && t.dtype == ref->dtype && same_shape && t.is_contiguous()) {
    return py::reinterpret_borrow<py::object>(base);
  }
  // The allocation with its last two dims swapped (ll's column-major fp8 scales): base.mT, an
  // attribute (≈ 1 µs less than as_strided's argument parsing; torch >= 1.11, else as_strided).
  if (t.data == base_ptr && t.dtype == ref->dtype && t.ndim >= 2 && t.ndim == ref->ndim) {
    const int n = t.ndim;
    std::array<int64_t, kMaxDims> base_strides{};  // the allocation's: contiguous
    int64_t acc = 1;
    for (int k = n - 1; k >= 0; --k) {
      base_strides[k] = acc;
      acc *= ref->shape[k];
    }
    bool swapped = true;
    for (int i = 0; swapped && i < n; ++i) {
      const int j = i == n - 1 ? n - 2 : i == n - 2 ? n - 1 : i;
      swapped = t.shape[i] == ref->shape[j] && t.strides[i] == base_strides[j];
    }
    if (swapped) {
      PyObject* mt = PyObject_GetAttr(base.ptr(), names().mT);
      if (mt != nullptr) return py::reinterpret_steal<py::object>(mt);
      PyErr_Clear();
    }
  }
  // A view of the allocation with other shape, strides, offset or dtype.
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  const int64_t offset_bytes = static_cast<char*>(t.data) - base_ptr;
  if (offset_bytes % elem != 0) {
    throw_epx(ErrorCode::kInternal, "to_torch: result view at byte offset " +
                                        std::to_string(offset_bytes) +
                                        " is not aligned to its element size");
  }
  if (const EpxAtenApi* a = aten()) {  // the same ops in C++ (≈ 4 µs less for a dtype change)
    PyObject* v = a->view_of(base.ptr(), static_cast<int32_t>(t.dtype), t.ndim, t.shape.data(),
                             t.strides.data(), offset_bytes);
    if (v == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(v);
  }
  py::object storage = py::reinterpret_borrow<py::object>(base);
  if (t.dtype != ref->dtype) {
    storage = storage.attr("reshape")(-1)
                  .attr("view")(torch_dtype(DType::kU8))
                  .attr("view")(torch_dtype(t.dtype));
  }
  py::tuple sizes(t.ndim), strides(t.ndim);
  for (int i = 0; i < t.ndim; ++i) {
    sizes[i] = py::int_(t.shape[i]);
    strides[i] = py::int_(t.strides[i]);
  }
  return storage.attr(py::handle(names().as_strided))(sizes, strides, offset_bytes / elem);
}

}  // namespace epx::python
