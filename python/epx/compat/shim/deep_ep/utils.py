"""``deep_ep.utils`` (where DeepEP V1 defines EventOverlap and imports EventHandle): epx's."""

from epx.compat.deep_ep import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
