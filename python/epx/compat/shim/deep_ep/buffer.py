"""``deep_ep.buffer`` (where DeepEP V1 defines Buffer): epx's Buffer and the names it uses."""

from epx.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap, topk_idx_t

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]
