"""``deep_ep.utils`` (where DeepEP V1 defines EventOverlap and imports EventHandle; a package in
DeepEP 2.x, whose ``deep_ep.utils.event`` holds them): epx's."""

from epx.compat.deep_ep import EventHandle, EventOverlap

from . import event  # noqa: F401  (DeepEP 2.x's submodule)

__all__ = ["EventHandle", "EventOverlap"]
