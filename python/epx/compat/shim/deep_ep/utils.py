"""``deep_ep.utils`` (where DeepEP V1 defines EventOverlap): epx's EventOverlap."""

from epx.compat.deep_ep import EventOverlap

__all__ = ["EventOverlap"]
