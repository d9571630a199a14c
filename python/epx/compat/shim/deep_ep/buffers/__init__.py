"""``deep_ep.buffers`` (DeepEP 2.x's package of buffer classes): only ``legacy``, the V1 Buffer
that epx's drop-in mirrors. DeepEP 2.x's ``elastic`` (``ElasticBuffer``) is not provided."""

from . import legacy  # noqa: F401
