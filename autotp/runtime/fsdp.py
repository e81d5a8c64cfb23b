"""``autotp.runtime.fsdp.fully_shard(pm)``, the path the README shows; the code is
:mod:`autotp.runtime.module.fsdp`."""
from .module.fsdp import fully_shard, whole_parameters

__all__ = ["fully_shard", "whole_parameters"]
