"""``autotp.runtime.dcp.save`` / ``async_save`` / ``load``, the path the README shows; the code is
:mod:`autotp.runtime.checkpoint.dcp`."""
from .checkpoint.dcp import async_save, load, save

__all__ = ["save", "async_save", "load"]
