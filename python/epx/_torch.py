"""The torch side of the bridge: dtype tables, streams, and registering both with epx._epx.

epx's C++ core never includes torch; at import this module hands the extension torch.empty (from
which the allocator every op uses for its outputs makes one 0-element template tensor per dtype
and device, whose new_empty makes the outputs), torch.utils.dlpack.from_dlpack (for workspace
views), the dtype tables and the exception classes. Where CMake built epx._epx_torch against
this torch (the ATen path, docs/design.md §12) it also registers that module's C table: inputs
are then read and outputs made through ATen, with the same results; aten_status() says whether
that happened and, if not, why (EPX_TORCH_BRIDGE=0 turns it off).
"""

import collections
import functools
import logging

import torch
import torch.utils.dlpack

from . import _epx, errors

# epx::DType order (include/epx/tensor.h): bf16, f16, f32, fp8_e4m3, i32, i64, u8, bool.
BF16, F16, F32, FP8, I32, I64, U8, BOOL = range(8)

#: True when this torch has float8_e4m3fn. Without it (torch 1.13) fp8 data travels as uint8
#: tensors holding e4m3 bit patterns, in both directions.
HAS_FP8 = hasattr(torch, "float8_e4m3fn")
FP8_DTYPE = torch.float8_e4m3fn if HAS_FP8 else torch.uint8

DTYPE_OF = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE, torch.int32, torch.int64,
            torch.uint8, torch.bool)
CODE_OF = {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32, torch.int32: I32,
           torch.int64: I64, torch.uint8: U8, torch.bool: BOOL}
if HAS_FP8:
    CODE_OF[torch.float8_e4m3fn] = FP8

assert list(_epx.dtype_names) == ["bf16", "f16", "f32", "fp8_e4m3", "i32", "i64", "u8", "bool"]
assert list(_epx.error_code_names) == [c.code for c in errors.BY_CODE]

_epx._init_torch(torch.empty, torch.utils.dlpack.from_dlpack, torch.device, CODE_OF,
                 list(DTYPE_OF), list(errors.BY_CODE))


def _load_aten():
    """Registers epx._epx_torch's table with the extension: '' when done, else why not."""
    if not _epx.torch_aten_built:
        return f"epx._epx_torch was not built ({_epx.torch_aten_note})"
    try:
        if _epx._torch_aten_env() == 0:
            return "EPX_TORCH_BRIDGE=0"
    except errors.InvalidArgument as e:  # creating a Group raises it as well
        return str(e)
    try:
        from . import _epx_torch
    except Exception as e:  # an ABI mismatch: undefined symbols, another libtorch
        return f"epx._epx_torch does not import ({e})"
    if _epx_torch.torch_version != torch.__version__:
        return (f"epx._epx_torch was built against torch {_epx_torch.torch_version}, not this "
                f"torch {torch.__version__} (rebuild epx)")
    try:
        _epx._init_torch_aten(_epx_torch.aten_api(list(DTYPE_OF), CODE_OF))
    except Exception as e:
        return f"epx._epx_torch does not register ({e})"
    return ""


_ATEN_REASON = _load_aten()
if _ATEN_REASON:  # said once, at import; the ops then take the attribute path, unchanged
    logging.getLogger("epx").info("epx: the torch bridge's ATen path is off: %s", _ATEN_REASON)

AtenStatus = collections.namedtuple("AtenStatus", "active reason")


def aten_status():
    """AtenStatus(active, reason): whether input tensors are read and outputs made through ATen
    (epx._epx_torch) rather than torch's Python methods, and if not, why (reason '' when
    active). Results are the same either way; the ATen path costs less host time."""
    if _epx._torch_aten_active():
        return AtenStatus(True, "")
    return AtenStatus(False, _ATEN_REASON or "turned off by _epx._set_torch_aten(False)")


def is_fp8(t):
    """An fp8 e4m3 tensor (or, on a torch without fp8, a uint8 tensor standing for one)."""
    return t.dtype is FP8_DTYPE


def fp8_without_scales(op, x, how):
    """The InvalidArgument for an fp8 `x` (or a uint8 one: fp8 e4m3 bits on a torch without
    float8_e4m3fn) given without its scales, or None when `x` is neither. `how` says where the
    scales go ("argument 'x_scales'", "x = (x, x_scales) with x_scales")."""
    if not isinstance(x, torch.Tensor) or (not is_fp8(x) and x.dtype is not torch.uint8):
        return None
    if x.dim() == 2:
        T, H = x.shape
        scales = (f"[{T}, {H // 128}] float32 (or [{T}, {(H + 511) // 512}] int32, UE8M0 packed)"
                  if H % 128 == 0 else f"[{T}, H/128] float32 with H a multiple of 128 (H is {H})")
    else:
        scales = "[T, H/128] float32 (or [T, ceil(H/512)] int32, UE8M0 packed)"
    if is_fp8(x):
        what = f"has dtype {x.dtype} (fp8 e4m3{'' if HAS_FP8 else ' on this torch'})"
    else:
        what = (f"has dtype {x.dtype}, which epx takes as fp8 e4m3 only with its scales (fp8 x "
                f"is {FP8_DTYPE} on this torch)")
    return errors.invalid(op, f"argument 'x' {what} but no scales were given: fp8 x needs its "
                              f"scales, {how} {scales}; expected bf16 x without scales, or fp8 x "
                              "with its scales")


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device):
    """The current stream of a cuda device (torch.device or index) as an integer cudaStream_t."""
    index = device if isinstance(device, int) else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def stream_of(t):
    """The current stream of t's device as an integer cudaStream_t (0 on CPU)."""
    if not getattr(t, "is_cuda", False):
        return 0
    return current_stream(t.get_device())


def device_key(t):
    """'cpu' or 'cuda:<index>' for the device tensors live on."""
    return "cpu" if not t.is_cuda else f"cuda:{t.get_device()}"


# The thread's __torch_function__ mode stack, as torch 2.x keeps it in C (torch 1.13 keeps a
# Python helper mode in front of it: left alone there, where set_default_device does not exist).
_TORCH2 = int(torch.__version__.split(".")[0]) >= 2
_tf_len = getattr(torch._C, "_len_torch_function_stack", None) if _TORCH2 else None
_tf_pop = getattr(torch._C, "_pop_torch_function_stack", None)
_tf_push = getattr(torch._C, "_push_on_torch_function_stack", None)


def plain_torch(fn):
    """Runs the op `fn` with this thread's __torch_function__ modes (torch.set_default_device's
    DeviceContext, as DeepEP's test utilities and some engines set it) taken off the stack and put
    back afterwards: otherwise every tensor method the op calls from Python or from the extension
    (data_ptr, stride, new_empty, ...) passes through the modes' Python handlers, about 1 us
    each, ~60 per ll dispatch + combine. epx passes every device explicitly, so the modes have
    nothing to change. Without a mode: one C call more."""
    if _tf_len is None or _tf_pop is None or _tf_push is None:
        return fn

    @functools.wraps(fn)
    def op(*args, **kwargs):
        n = _tf_len()
        if n == 0:
            return fn(*args, **kwargs)
        modes = [_tf_pop() for _ in range(n)]
        try:
            return fn(*args, **kwargs)
        finally:
            for mode in reversed(modes):
                _tf_push(mode)

    return op
