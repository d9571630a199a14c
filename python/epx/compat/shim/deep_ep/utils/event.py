"""``deep_ep.utils.event`` (DeepEP 2.x's home of EventOverlap, which imports EventHandle there):
epx's."""

from epx.compat.deep_ep import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
