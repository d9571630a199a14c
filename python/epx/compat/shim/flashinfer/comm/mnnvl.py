"""Minimal ``flashinfer.comm.mnnvl``: epx's MnnvlConfig, is_mnnvl_fabric_supported (False: no
multi-node NVLink fabric path), CommBackend and TorchDistBackend."""

from epx.compat.flashinfer import (CommBackend, MnnvlConfig, TorchDistBackend,
                                   is_mnnvl_fabric_supported)

__all__ = ["CommBackend", "MnnvlConfig", "TorchDistBackend", "is_mnnvl_fabric_supported"]
