// python/src/torch_aten_api.h — the C table through which the torch-free epx._epx reaches ATen.
//
// epx._epx_torch (torch_aten.cc, compiled against the installed torch's C++ API) fills one
// EpxAtenApi and hands it out in a PyCapsule named EPX_ATEN_API_CAPSULE; epx/_torch.py gives
// the capsule to _epx._init_torch_aten at import. From then on torch_bridge.cc makes outputs
// with `allocate` (at::empty: what new_empty on a template of the dtype and device gives) and
// reads input tensors with `view` (the tensor's sizes, strides, data_ptr, dtype and device,
// without a Python call), falling back to the attribute path for every tensor `view` declines.
// Only C types cross: the two modules may differ in C++ runtime (_epx links libstdc++
// statically, torch does not) and in _GLIBCXX_USE_CXX11_ABI.
#pragma once

#include <Python.h>
#include <stdint.h>

#define EPX_ATEN_API_CAPSULE "epx._epx_torch.aten_api"
#define EPX_ATEN_API_VERSION 2
#define EPX_ATEN_MAX_DIMS 6  // epx::kMaxDims

// A tensor as epx::TensorView holds it; codes as epx::DType and epx::DeviceType.
typedef struct EpxAtenView {
  void* data;
  int32_t dtype;         // epx::DType
  int32_t device_type;   // epx::DeviceType: 0 cpu, 1 cuda
  int32_t device_index;  // cuda ordinal; 0 for cpu
  int32_t ndim;
  int64_t shape[EPX_ATEN_MAX_DIMS];
  int64_t strides[EPX_ATEN_MAX_DIMS];  // in elements
} EpxAtenView;

typedef struct EpxAtenApi {
  uint32_t version;  // EPX_ATEN_API_VERSION
  uint32_t size;     // sizeof(EpxAtenApi)
  // Called with the GIL held. A new contiguous tensor of `dtype` (epx::DType) and `shape` on
  // the device (at::empty; on cuda from the caching allocator, current stream) as a new
  // reference, its data pointer in *data; NULL with the Python exception set (the one torch
  // raises for new_empty, e.g. torch.OutOfMemoryError) when it fails.
  PyObject* (*allocate)(int32_t dtype, int32_t ndim, const int64_t* shape, int32_t device_type,
                        int32_t device_index, void** data);
  // Called with the GIL held. 1: `obj` is a torch.Tensor (or nn.Parameter) that the attribute
  // path would read as *out, and *out holds it; 0: declined (anything else: subclasses, layouts
  // other than strided, conj / neg / zero-tensor bits, dtypes epx lacks, devices other than cpu
  // and cuda, more than EPX_ATEN_MAX_DIMS dims), *out untouched. Never raises.
  int (*view)(PyObject* obj, EpxAtenView* out);
  // Called with the GIL held. A view of the tensor `base` (one `allocate` made) as `dtype`
  // (epx::DType) with `ndim` sizes and strides (in elements of `dtype`) starting `byte_offset`
  // bytes after base's data: what the attribute path's base.reshape(-1).view(torch.uint8)
  // .view(dtype) (for another dtype) then .as_strided(sizes, strides, offset) returns, as a new
  // reference; NULL with the Python exception set when torch refuses it.
  PyObject* (*view_of)(PyObject* base, int32_t dtype, int32_t ndim, const int64_t* shape,
                       const int64_t* strides, int64_t byte_offset);
} EpxAtenApi;
