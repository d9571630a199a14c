"""epx's drop-in for DeepEP (V1 API) under DeepEP's own name: see epx.compat.deep_ep and
epx.compat.shim. DeepEP's module paths of that API resolve too: V1's ``deep_ep.buffer`` and
``deep_ep.utils``, DeepEP 2.x's ``deep_ep.buffers.legacy`` and ``deep_ep.utils.event``."""

from epx.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap, topk_idx_t

from . import buffer, buffers, utils  # noqa: F401  (DeepEP's submodules)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]

# DeepEP 2.x's own API (deep_ep/__init__.py of 2.x): not provided. An AttributeError, so that
# `hasattr(deep_ep, "ElasticBuffer")` is False and `from deep_ep import ElasticBuffer` raises
# ImportError, the checks engines use to fall back to the legacy Buffer.
_DEEPEP_V2_NAMES = ("ElasticBuffer", "EPHandle", "get_physical_domain_size",
                    "get_logical_domain_size")


def __getattr__(name):
    if name in _DEEPEP_V2_NAMES:
        raise AttributeError(
            f"deep_ep.{name} is DeepEP 2.x's ElasticBuffer API, which epx's drop-in does not "
            f"provide: it mirrors DeepEP's legacy Buffer API (deep_ep.Buffer, also "
            f"deep_ep.buffers.legacy.Buffer; docs/semantics.md §9)")
    raise AttributeError(f"module 'deep_ep' (epx's drop-in) has no attribute '{name}'")
