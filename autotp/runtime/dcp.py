"""Save and load a ParallelModule (and its optimizer) with torch.distributed.checkpoint.

``save(pm, path, optimizer=None)``, ``async_save`` and ``load(pm, path, optimizer=None)``: every
rank of the world calls them. A save is staged in ``<path>.partial`` and moved to ``path`` only
when complete, so an interrupted save never loads as a mix of two checkpoints. The checkpoint is in the model's names and full shapes, so a module planned at
another tp (or dp) loads it: DCP reads, for each rank, the parts of the saved chunks its own
layout holds.

DCP writes one chunk per rank at one offset. A parameter in torch's ``Shard(dim)`` or
``Replicate()`` is written as it is; a ``RunShard`` parameter (several runs per rank: fused
q|k|v, uneven heads) is handed to DCP as a DTensor over a ``LocalShardsWrapper`` of views of its
runs, one chunk per contiguous range of the full tensor. The views share the parameter's
storage, so loading writes straight into the tensors the programs use. Optimizer state
(AdamW's ``exp_avg`` ...) has its parameter's placements and goes the same way, under
``optim.state.<fqn>.<key>`` as torch's ``get_optimizer_state_dict`` names it.
"""
from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import CheckpointError
from .dtensor import RunShard


def _chunks(t: torch.Tensor) -> Any:
    """``t`` as DCP should see it: a RunShard DTensor as a DTensor over its runs' views."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    from torch.distributed.tensor.placement_types import Shard as TorchShard

    if not isinstance(t, DTensor):
        return t
    runs = [(i, p) for i, p in enumerate(t.placements) if isinstance(p, RunShard)]
    if not runs:
        return t
    if len(runs) > 1:
        raise CheckpointError(f"a tensor with run layouts on {len(runs)} mesh dims cannot be saved")
    mesh_dim, run = runs[0]
    local, dim, n = t._local_tensor, run.dim, t.shape[run.dim]
    tp, rank = t.device_mesh.size(mesh_dim), t.device_mesh.get_local_rank(mesh_dim)
    views, offsets, at = [], [], 0
    for a, b in run.ranges(n, tp, rank):
        views.append(local.narrow(dim, at, b - a))
        offsets.append(tuple(a if d == dim else 0 for d in range(t.dim())))
        at += b - a
    if not views:
        raise CheckpointError(f"this rank holds none of a tensor of shape {list(t.shape)} ({run!r} at tp={tp}): "
                              "DCP cannot save or load an empty shard; choose a tp that gives every rank a head")
    placements = [TorchShard(dim) if i == mesh_dim else p for i, p in enumerate(t.placements)]
    return DTensor.from_local(LocalShardsWrapper(views, offsets), t.device_mesh, placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def _tree(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tree(v) for v in obj]
    return _chunks(obj) if isinstance(obj, torch.Tensor) else obj


def _state(pm: Any, optimizer: Any) -> tuple[dict, dict | None]:
    model = {k: v.detach() for k, v in pm.state_dict().items()}
    if optimizer is None:
        return {"model": model}, None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optim = get_optimizer_state_dict(pm, optimizer)
    return {"model": model, "optim": optim}, optim


def save(pm: Any, path: str, optimizer: Any = None) -> None:
    """Write ``pm``'s parameters and buffers (and ``optimizer``'s state) to the DCP folder ``path``.

    The files go to ``<path>.partial`` first; only when every rank has written its part (DCP's
    metadata is written last, by rank 0) does rank 0 move the folder to ``path``, replacing an
    earlier checkpoint there. A save cut short (a rank killed mid-write) leaves ``path`` as it was:
    never a mix of two checkpoints."""
    import torch.distributed.checkpoint as dcp

    staging = _stage(path)
    state, _ = _state(pm, optimizer)
    dcp.save(_tree(state), checkpoint_id=staging)
    _publish(staging, path)
    _barrier()


def async_save(pm: Any, path: str, optimizer: Any = None) -> Future:
    """:func:`save` in the background (``torch.distributed.checkpoint.async_save``): returns once
    the state is copied aside, so training may go on and change the parameters. The returned
    future completes on rank 0 once the checkpoint is in ``path`` (on the other ranks once their
    part is written); wait for it on every rank, and on rank 0 before a load reads ``path``."""
    import torch.distributed.checkpoint as dcp

    staging = _stage(path)
    state, _ = _state(pm, optimizer)
    writing = dcp.async_save(_tree(state), checkpoint_id=staging)
    done: Future = Future()

    def finish(f: Any) -> None:
        try:
            f.result()
            _publish(staging, path)
            done.set_result(path)
        except BaseException as exc:   # the caller sees the write's own error
            done.set_exception(exc)

    writing.add_done_callback(finish)
    return done


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        from .collectives import _comm

        with _comm("the checkpoint's barrier", dist.group.WORLD):   # a rank lost here is named
            dist.barrier()


def _stage(path: str) -> str:
    """``<path>.partial``, emptied of an earlier interrupted save's files, on every rank alike."""
    staging = f"{os.fspath(path).rstrip(os.sep)}.partial"
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier()
    return staging


def _publish(staging: str, path: str) -> None:
    """On rank 0: the complete ``staging`` folder becomes ``path`` (an earlier one moved aside
    first, then removed; a crash between the two renames leaves ``<path>.old``, complete)."""
    if _rank() != 0:
        return
    path = os.fspath(path).rstrip(os.sep)
    old = f"{path}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def load(pm: Any, path: str, optimizer: Any = None) -> None:
    """Read :func:`save`'s folder into ``pm`` (and ``optimizer``), whatever tp and dp saved it."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, ".metadata")):
        partial = os.path.exists(f"{os.fspath(path).rstrip(os.sep)}.partial")
        raise CheckpointError(
            f"{path} is not a complete DCP checkpoint (no .metadata)"
            + (f"; {path}.partial is a save that did not finish and is never loaded" if partial else "")
            + ": load a folder autotp.runtime.dcp.save (or async_save, once its future is done) wrote")
    if optimizer is not None and not optimizer.state:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)   # the state tensors DCP loads into
    state, optim = _state(pm, optimizer)
    view = _tree(state)
    with torch.no_grad():
        dcp.load(view, checkpoint_id=path)
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        # the state tensors were loaded in place; this brings back the param groups (lr, betas)
        set_optimizer_state_dict(pm, optimizer, _untree(view["optim"], optim))
    if hasattr(pm, "check_replicas"):   # every TP rank loaded the same replicated values, or all raise
        pm.check_replicas()


def _untree(loaded: Any, original: Any) -> Any:
    """The loaded state with every tensor the original one (loaded in place through its views)."""
    if isinstance(original, dict):
        return {k: _untree(loaded[k], v) for k, v in original.items()}
    if isinstance(original, list):
        return [_untree(a, b) for a, b in zip(loaded, original)]
    return original if isinstance(original, torch.Tensor) else loaded
