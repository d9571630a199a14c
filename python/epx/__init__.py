"""epx -- expert-parallel exchange for PyTorch.

    import epx
    group = epx.Group.from_process_group(pg)            # gloo -> cpu backend, NCCL -> cuda
    buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=T_max,
                     enable_ll=True)
    r = buf.ll_dispatch(x, topk_idx)                     # docs/semantics.md §2
    d = epx.Dispatcher(group, num_experts=E, hidden=H, top_k=K, max_tokens_per_rank=T_max,
                       mode="auto", quant="fp8")          # the MoE layer's (semantics.md §7)
    out = d.dispatch(x, topk_idx, topk_weights, forward_mode="decode")

Drop-in compatibility layers: ``epx.compat.deep_ep`` (DeepEP's Buffer) and
``epx.compat.flashinfer`` (FlashInfer's MoeAlltoAll).
"""

try:
    from . import _epx
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "epx: the C++ extension epx._epx is not built for this interpreter "
        f"({e}). Build it with `bash scripts/test.sh` (or cmake -DEPX_BUILD_PYTHON=ON "
        "-DPython3_EXECUTABLE=<python> and the target _epx) and use PYTHONPATH=python, or install "
        "with `pip install --no-build-isolation ./python`.") from e
from . import _torch  # noqa: E402  (registers torch with the C++ extension)
from .buffer import (A2a, A2aDispatchResult, Buffer, HtCombineResult, HtDispatchResult,
                     HtHandle, HtLayout, LlCombineOverlap, LlCombineResult, LlDispatchResult,
                     LlHandle)
from .dispatcher import DispatchOutput, Dispatcher
from .errors import (CudaError, EpxError, InternalError, InvalidArgument, NcclError, OutOfStep,
                     OutOfCapacity, Timeout, Unsupported)
from .group import Group
from .nvfp4 import nvfp4_block_scale_interleave

__version__ = "0.1.0"

#: True when the extension was built with the cuda backend (EPX_WITH_CUDA=ON).
built_with_cuda = bool(_epx.built_with_cuda)
#: True when torch has float8_e4m3fn; otherwise fp8 travels as uint8 bit patterns.
has_fp8_dtype = _torch.HAS_FP8
#: The torch dtype epx uses for fp8 e4m3 data in this torch.
fp8_dtype = _torch.FP8_DTYPE

__all__ = [
    "A2a", "A2aDispatchResult", "Buffer", "CudaError", "DispatchOutput", "Dispatcher", "EpxError",
    "Group", "HtCombineResult", "HtDispatchResult", "HtHandle", "HtLayout", "InternalError",
    "InvalidArgument", "LlCombineOverlap", "LlCombineResult", "LlDispatchResult", "LlHandle",
    "NcclError",
    "OutOfCapacity", "OutOfStep", "Timeout", "Unsupported", "built_with_cuda", "fp8_dtype",
    "has_fp8_dtype", "nvfp4_block_scale_interleave",
]
