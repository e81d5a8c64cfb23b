"""Data parallelism through FSDP2: ``fully_shard(pm)`` hands a ParallelModule's data-parallel
dimension to ``torch.distributed.fsdp.fully_shard``.

Without it, the ranks of a DP group each hold the whole of their TP shard and average every
gradient with one all-reduce per parameter (``ParallelModule._average_over_dp``). After it:

- each parameter is a DTensor on the (dp, tp) mesh that FSDP2 shards over dp (``Shard(0)`` or,
  where TP already splits dim 0, torch's ``_StridedShard``) on top of autotp's tp placement, the
  torchtitan composition of FSDP2 and TP; optimizer state built afterwards is sharded alike;
- before each forward FSDP2 all-gathers the parameters over dp (its forward pre-hook; this
  module's hook, registered after it, then feeds the gathered tensors to the programs), and after
  backward reduce-scatters the gradients (``mp_policy=MixedPrecisionPolicy(reduce_dtype=...)``
  reduces in another dtype, e.g. float32 under bfloat16 parameters);
- gradient accumulation is FSDP2's: ``pm.set_requires_gradient_sync(False)`` for the
  micro-batches before the last;
- the per-parameter all-reduce hooks are removed.

The whole module is one FSDP unit: the programs are one graph each, not a module per layer, so
all parameters are gathered at once before a forward (ZeRO-3 over the whole model, without
FSDP's per-layer prefetch and overlap).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["fully_shard", "whole_parameters"]


def fully_shard(pm: Any, **kwargs: Any) -> Any:
    """Shard ``pm`` over its data-parallel ranks with FSDP2; returns ``pm`` (now also an
    ``FSDPModule``: ``unshard()``, ``reshard()``, ``set_requires_gradient_sync()``). ``kwargs`` go
    to ``torch.distributed.fsdp.fully_shard`` (``mp_policy=``, ``reshard_after_forward=``); the
    mesh is the module's dp dimension. Build the optimizer after this call."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    if isinstance(pm, FSDPModule):
        raise ConfigError("this ParallelModule is already sharded with FSDP2")
    device_mesh = getattr(pm.mesh, "device_mesh", None)
    if device_mesh is None:
        raise ConfigError("fully_shard needs a ParallelModule on a (dp, tp) device mesh: build it with "
                          "autotp.parallelize in an initialized torch.distributed world")
    if "mesh" in kwargs:
        raise ConfigError("fully_shard shards over the module's own dp mesh dimension; do not pass mesh=")
    for handle in pm._dp_hooks:       # FSDP2 reduces the gradients from now on
        handle.remove()
    pm._dp_hooks = []
    tp_mesh = device_mesh["tp"]
    moved: dict[int, nn.Parameter] = {}
    for name, param in list(pm.named_parameters(remove_duplicate=False)):
        if id(param) not in moved:    # on the tp mesh alone: FSDP2 adds the dp dimension
            local = DTensor.from_local(param._local_tensor, tp_mesh, [param.placements[-1]], run_check=False,
                                       shape=param.shape, stride=param.stride())
            moved[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
        *path, leaf = name.split(".")
        setattr(pm.get_submodule(".".join(path)), leaf, moved[id(param)])
    pm._held = {fqn: moved[id(param)] for fqn, param in pm._held.items()}
    names = {id(param): name for name, param in pm.named_parameters()}
    pm._held_names = {fqn: names[id(param)] for fqn, param in pm._held.items()}
    torch_fully_shard(pm, mesh=device_mesh["dp"], **kwargs)
    # after FSDP2's pre-hook (which puts the gathered parameters on the module): feed them on
    pm.register_forward_pre_hook(lambda module, args: _refresh(module))
    return pm


def _refresh(pm: Any) -> None:
    pm._held = {fqn: pm.get_parameter(name) for fqn, name in pm._held_names.items()}


@contextmanager
def whole_parameters(pm: Any) -> Iterator[None]:
    """Around a use of ``pm``'s programs outside its ``__call__`` (generation): under FSDP2, the
    parameters gathered over dp for its duration; otherwise nothing."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(pm, FSDPModule):
        yield
        return
    pm.unshard()
    _refresh(pm)
    try:
        yield
    finally:
        pm.reshard()
        _refresh(pm)
