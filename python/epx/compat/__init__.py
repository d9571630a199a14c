"""Drop-in compatibility layers: ``epx.compat.deep_ep`` and ``epx.compat.flashinfer``."""
