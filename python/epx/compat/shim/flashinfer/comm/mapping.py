"""Minimal ``flashinfer.comm.mapping``: epx's Mapping."""

from epx.compat.flashinfer import Mapping

__all__ = ["Mapping"]
