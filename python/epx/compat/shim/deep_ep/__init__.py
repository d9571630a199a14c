"""epx's drop-in for DeepEP (V1 API) under DeepEP's own name: see epx.compat.deep_ep and
epx.compat.shim."""

from epx.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap, topk_idx_t

from . import buffer, utils  # noqa: F401  (DeepEP's submodules)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]
