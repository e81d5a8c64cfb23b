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

- each repeated layer (the children of the model's ``nn.ModuleList`` stacks: ``transformer.h.0``,
  ...) is an FSDP unit of its own, as torchtitan shards a model: the module's subtree under the
  layer's name holds its parameters, and every program's graph is cut so that the layer's ops run
  in that subtree's forward (``runtime.module.outline``). FSDP2 then gathers one layer's parameters
  before its ops and frees them after (``reshard_after_forward``), prefetching the next, and
  reduce-scatters each layer's gradients as its backward ends. ``per_layer=False`` makes the
  whole module one unit instead (all parameters gathered at once before a forward).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ...errors import ConfigError
from ...distributed.mesh import device_mesh_of

__all__ = ["fully_shard", "whole_parameters"]


def fully_shard(pm: Any, per_layer: bool = True, replicate: int = 1, **kwargs: Any) -> Any:
    """Shard ``pm`` over its data-parallel ranks with FSDP2; returns ``pm`` (now also an
    ``FSDPModule``: ``unshard()``, ``reshard()``, ``set_requires_gradient_sync()``). ``kwargs`` go
    to ``torch.distributed.fsdp.fully_shard`` (``mp_policy=``, ``reshard_after_forward=``); the
    mesh is the module's dp dimension. ``per_layer``: each repeated layer its own FSDP unit (see
    the module docs), else one unit for the whole module.

    ``replicate`` > 1 is HSDP: the dp ranks form ``replicate`` groups of ``dp / replicate``
    neighbours; parameters and optimizer state are sharded within a group and replicated across
    groups (gradients reduce-scattered within, all-reduced across), FSDP2's 2-D dp mesh
    (``dp_replicate``, ``dp_shard``) beside tp, as torchtitan builds it. Put a group on one node
    and its shards move over the node's links. Build the optimizer after this call."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    if isinstance(pm, FSDPModule):
        raise ConfigError("this ParallelModule is already sharded with FSDP2")
    device_mesh = device_mesh_of(pm.mesh, pm.device)
    if device_mesh is None:
        raise ConfigError("fully_shard needs a ParallelModule on a (dp, tp) device mesh: build it with "
                          "autotp.parallelize in an initialized torch.distributed world")
    if "mesh" in kwargs:
        raise ConfigError("fully_shard shards over the module's own dp mesh dimension; do not pass mesh=")
    dp_mesh, tp_mesh = _meshes(pm, device_mesh, replicate)
    units = {path: pm.get_submodule(path) for path in pm._layers if _holds_parameters(pm, path)} \
        if per_layer else {}
    if units:   # every program's layers outlined first: a program that cannot be changes nothing
        from .outline import outline

        for program in pm._programs:
            outline(program.graph_module, program.param_order, list(units), units, check_only=True)
    for handle in pm._dp_hooks:       # FSDP2 reduces the gradients from now on
        handle.remove()
    pm._dp_hooks = []
    pm._leaves = None   # FSDP2 reads the unsharded parameters' gradients from autograd: no leaves
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
    for unit in units.values():
        torch_fully_shard(unit, mesh=dp_mesh, **kwargs)
    torch_fully_shard(pm, mesh=dp_mesh, **kwargs)
    # after FSDP2's pre-hook (which puts the gathered parameters on the module): feed them on
    pm.register_forward_pre_hook(lambda module, args: _refresh(module))
    pm._units = units
    if units:
        for program in pm._programs:
            pm._outline(program)
    return pm


def _meshes(pm: Any, device_mesh: Any, replicate: int) -> tuple[Any, Any]:
    """(the mesh FSDP2 shards over, the tp mesh the parameters live on): the module's own dp and
    tp dims, or for HSDP a (dp_replicate, dp_shard, tp) mesh over the same ranks in the same
    order (dp index = replica * shard size + shard), whose tp dim holds the same groups."""
    dp, tp = pm.mesh.dp, pm.mesh.tp
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1 or dp % replicate:
        choices = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        raise ConfigError(f"replicate={replicate!r} does not divide the {dp} data-parallel ranks into equal "
                          f"groups; choose replicate in {{{choices}}} (1: no replication, FSDP over all of them)")
    if replicate == 1:
        return device_mesh["dp"], device_mesh["tp"]
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device_mesh.device_type, torch.arange(dp * tp).view(replicate, dp // replicate, tp),
                      mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    return mesh["dp_replicate", "dp_shard"], mesh["tp"]


def _holds_parameters(pm: Any, path: str) -> bool:
    try:
        unit = pm.get_submodule(path)
    except AttributeError:   # a layer whose parameters the programs never use
        return False
    return any(True for _ in unit.parameters())


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
