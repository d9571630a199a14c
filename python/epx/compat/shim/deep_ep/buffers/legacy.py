"""``deep_ep.buffers.legacy`` (where DeepEP 2.x keeps the V1 Buffer, also ``deep_ep.Buffer``):
epx's Buffer and the names that module imports."""

from epx.compat.deep_ep import Buffer, Config, EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
