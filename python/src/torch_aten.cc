// python/src/torch_aten.cc — epx._epx_torch: the ATen half of the torch bridge (optional).
//
// Data flow: epx/_torch.py imports this module (built only where CMake found torch's C++
// headers, against that torch) and calls aten_api(dtype_of, code_of) with the tables the
// attribute path uses; the capsule it returns goes to _epx._init_torch_aten, and from then on
// the torch-free _epx calls, through the C table of torch_aten_api.h,
//   allocate  epx dtype, shape, device -> at::empty(shape, dtype, device) wrapped as a Python
//             tensor: what new_empty on a 0-element template of the dtype and device returns
//             (PyTorch's allocator, on cuda the caching allocator and the current stream)
//   view      torch.Tensor -> sizes, strides, data_ptr(), dtype, device read from the at::Tensor
//             (the C++ calls torch.Tensor's own Python methods make), for plain tensors only;
//             every other object is declined and read by the attribute path, so its results and
//             messages stay that path's.
//   view_of   an output that lies in an allocation (the ll dispatch's outputs share two blocks)
//             -> a tensor of that dtype, shape, strides and offset on the allocation's storage,
//             made directly (one TensorImpl, no dispatcher call): the bytes and metadata the
//             attribute path's reshape / view / as_strided give, but not an autograd view (its
//             _base is None), as a tensor DeepEP allocates on its own would be.
// Only the C types of torch_aten_api.h leave this file. No CUDA-only call: the same source
// builds against a CPU torch (at::empty selects the device's allocator and device guard).
#include <ATen/ops/empty.h>
#include <c10/core/ScalarTypeToTypeMeta.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstdint>
#include <utility>

#include "torch_aten_api.h"

#ifndef EPX_TORCH_VERSION
#error "EPX_TORCH_VERSION (the torch.__version__ this module is built against) is not defined"
#endif

namespace {

constexpr int kNumDTypes = 8;         // epx::DType values
constexpr int kNumScalarTypes = 128;  // more than c10::ScalarType has

// epx::DType -> at::ScalarType and at::ScalarType -> epx::DType (-1: none), filled once by
// aten_api() from epx/_torch.py's DTYPE_OF and CODE_OF (on a torch without float8_e4m3fn both
// fp8 and u8 are allocated as uint8, and a uint8 tensor reads as u8, as in the attribute path).
std::array<c10::ScalarType, kNumDTypes> g_scalar_type_of{};
std::array<int8_t, kNumScalarTypes> g_dtype_of{};

PyObject* allocate(int32_t dtype, int32_t ndim, const int64_t* shape, int32_t device_type,
                   int32_t device_index, void** data) {
  try {
    const c10::Device device =
        device_type == 0 ? c10::Device(c10::kCPU)
                         : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index));
    at::Tensor t = at::empty(at::IntArrayRef(shape, static_cast<size_t>(ndim)),
                             at::TensorOptions().dtype(g_scalar_type_of[dtype]).device(device));
    *data = t.data_ptr();
    return THPVariable_Wrap(std::move(t));
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

int view(PyObject* obj, EpxAtenView* out) {
  // Subclasses may override the methods the attribute path calls (__torch_function__).
  if (!THPVariable_CheckExact(obj)) return 0;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_conj() || t.is_neg() ||
        t._is_zerotensor() || t.is_nested()) {
      return 0;
    }
    const int scalar_type = static_cast<int>(t.scalar_type());
    if (scalar_type < 0 || scalar_type >= kNumScalarTypes || g_dtype_of[scalar_type] < 0) return 0;
    const c10::Device device = t.device();
    if (!device.is_cpu() && !device.is_cuda()) return 0;
    const int64_t ndim = t.dim();
    if (ndim > EPX_ATEN_MAX_DIMS) return 0;
    EpxAtenView v{};
    const c10::IntArrayRef sizes = t.sizes();      // throws for symbolic sizes: declined
    const c10::IntArrayRef strides = t.strides();  // throws where strides are not defined
    for (int64_t i = 0; i < ndim; ++i) {
      v.shape[i] = sizes[i];
      v.strides[i] = strides[i];
    }
    v.data = t.data_ptr();  // what torch.Tensor.data_ptr() returns (throws without storage)
    v.dtype = g_dtype_of[scalar_type];
    v.device_type = device.is_cpu() ? 0 : 1;
    v.device_index = device.is_cpu() ? 0 : device.index();
    v.ndim = static_cast<int32_t>(ndim);
    *out = v;
    return 1;
  } catch (...) {
    return 0;
  }
}

PyObject* view_of(PyObject* base, int32_t dtype, int32_t ndim, const int64_t* shape,
                  const int64_t* strides, int64_t byte_offset) {
  try {
    if (!THPVariable_Check(base)) {
      PyErr_Format(PyExc_TypeError, "view_of: expected a torch.Tensor, got %s",
                   Py_TYPE(base)->tp_name);
      return nullptr;
    }
    const at::Tensor& b = THPVariable_Unpack(base);
    const c10::ScalarType st = g_scalar_type_of[dtype];
    const int64_t elem = static_cast<int64_t>(c10::elementSize(st));
    const int64_t first = b.storage_offset() * static_cast<int64_t>(b.element_size()) + byte_offset;
    // The tensor's bytes must lie in the allocation (as_strided's check; the shapes are epx's
    // own, so this only catches a bug).
    bool bad = first < 0 || first % elem != 0, empty = false;
    int64_t end = first + elem;  // one past the last byte it reaches
    for (int32_t i = 0; i < ndim; ++i) {
      if (shape[i] < 0 || strides[i] < 0)
        bad = true;
      else if (shape[i] == 0)
        empty = true;
      else
        end += (shape[i] - 1) * strides[i] * elem;
    }
    const int64_t bytes = static_cast<int64_t>(b.storage().nbytes());
    if (bad || (!empty && end > bytes)) {
      PyErr_Format(PyExc_RuntimeError,
                   "view_of: a view at byte %lld, element size %lld, ending at byte %lld does not "
                   "fit its allocation of %lld bytes (an epx bug)",
                   static_cast<long long>(first), static_cast<long long>(elem),
                   static_cast<long long>(end), static_cast<long long>(bytes));
      return nullptr;
    }
    // One TensorImpl on the block's storage with the block's dispatch keys (device, autograd,
    // inference): ≈ 0.8 µs less per output than view(dtype) + as_strided through the dispatcher
    // (docs/perf.md §4.5).
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(b.storage()), b.key_set(),
                                                     c10::scalarTypeToTypeMeta(st));
    impl->set_sizes_and_strides(at::IntArrayRef(shape, static_cast<size_t>(ndim)),
                                at::IntArrayRef(strides, static_cast<size_t>(ndim)));
    impl->set_storage_offset(first / elem);
    return THPVariable_Wrap(at::Tensor(std::move(impl)));
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

const EpxAtenApi kApi = {EPX_ATEN_API_VERSION, sizeof(EpxAtenApi), &allocate, &view, &view_of};

// The ScalarType of a torch.dtype object, or -1 (with a TypeError) for anything else.
int dtype_scalar_type(PyObject* dtype) {
  if (!THPDtype_Check(dtype)) {
    PyErr_Format(PyExc_TypeError, "aten_api: expected torch.dtype, got %s",
                 Py_TYPE(dtype)->tp_name);
    return -1;
  }
  return static_cast<int>(reinterpret_cast<THPDtype*>(dtype)->scalar_type);
}

// aten_api(dtype_of, code_of) -> capsule: dtype_of lists the torch.dtype of each epx::DType,
// code_of maps torch.dtype -> epx::DType (epx/_torch.py's DTYPE_OF and CODE_OF).
PyObject* aten_api(PyObject*, PyObject* args) {
  PyObject* dtype_of = nullptr;
  PyObject* code_of = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!:aten_api", &PyList_Type, &dtype_of, &PyDict_Type, &code_of))
    return nullptr;
  if (PyList_GET_SIZE(dtype_of) != kNumDTypes) {
    PyErr_Format(PyExc_ValueError, "aten_api: expected %d dtypes, got %zd", kNumDTypes,
                 PyList_GET_SIZE(dtype_of));
    return nullptr;
  }
  std::array<c10::ScalarType, kNumDTypes> scalar_type_of{};
  for (int i = 0; i < kNumDTypes; ++i) {
    const int s = dtype_scalar_type(PyList_GET_ITEM(dtype_of, i));
    if (s < 0) return nullptr;
    scalar_type_of[i] = static_cast<c10::ScalarType>(s);
  }
  std::array<int8_t, kNumScalarTypes> dtype_of_scalar;
  dtype_of_scalar.fill(-1);
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(code_of, &pos, &key, &value)) {
    const int s = dtype_scalar_type(key);
    if (s < 0) return nullptr;
    const long code = PyLong_AsLong(value);
    if (code < 0 || code >= kNumDTypes || s >= kNumScalarTypes) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "aten_api: bad dtype code");
      return nullptr;
    }
    dtype_of_scalar[s] = static_cast<int8_t>(code);
  }
  g_scalar_type_of = scalar_type_of;
  g_dtype_of = dtype_of_scalar;
  return PyCapsule_New(const_cast<EpxAtenApi*>(&kApi), EPX_ATEN_API_CAPSULE, nullptr);
}

PyMethodDef g_methods[] = {
    {"aten_api", &aten_api, METH_VARARGS,
     "aten_api(dtype_of, code_of) -> the capsule epx._epx._init_torch_aten takes"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef g_module = {
    PyModuleDef_HEAD_INIT,
    "_epx_torch",
    "epx's ATen half of the torch bridge (built against torch " EPX_TORCH_VERSION
    "); loaded by epx._torch, not for direct use",
    -1,
    g_methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__epx_torch() {
  PyObject* m = PyModule_Create(&g_module);
  if (m == nullptr) return nullptr;
  // The torch this module was compiled against; epx/_torch.py loads it only under that torch.
  if (PyModule_AddStringConstant(m, "torch_version", EPX_TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
