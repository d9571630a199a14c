"""Marks this flashinfer directory as epx's shim (flashinfer/__init__.py skips such directories
when it looks for a real FlashInfer)."""
