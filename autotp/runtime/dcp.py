"""Save and load a ParallelModule (and its optimizer) with torch.distributed.checkpoint: autotp's
one path for training checkpoints (``autotp.runtime.checkpoint`` reads HuggingFace folders and
gathers one; its old per-rank ``save_sharded``/``load_sharded`` now come here).

``save(pm, path, optimizer=None)``, ``async_save`` and ``load(pm, path, optimizer=None)``: every
rank of the world calls them. A save is staged in ``<path>.partial``, summed into a manifest and
moved to ``path`` only when every rank has written its part, so an interrupted save never loads
as a mix of two checkpoints, and a load refuses damaged or mixed files on every rank
(``autotp.runtime.dcp_safety`` says how). The checkpoint is in the model's names and full
shapes, so a module planned at another tp (or dp) loads it: DCP reads, for each rank, the parts
of the saved chunks its own layout holds.

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
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import CheckpointError
from . import dcp_safety as safety
from .dtensor import RunShard


def _chunks(t: torch.Tensor) -> Any:
    """``t`` as DCP should see it: a RunShard DTensor as a DTensor over its runs' views."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
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
    placements = tuple(TorchShard(dim) if i == mesh_dim else p for i, p in enumerate(t.placements))
    spec = DTensorSpec(t.device_mesh, placements, tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))
    # built directly, not by DTensor.from_local: that views the local tensor as itself, which torch's
    # LocalShardsWrapper refuses for more than 2 dims (a 3-D experts stack split inside each expert)
    return DTensor(LocalShardsWrapper(views, offsets), spec, requires_grad=False)


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

    Every rank calls it (autotp.runtime.dcp_safety checks that they do, and names a rank that
    does not). The files go to ``<path>.partial`` first; when every rank has written its part,
    each sums its files into the manifest, and only when every rank has succeeded does rank 0
    move the folder to ``path``, replacing an earlier checkpoint there; every rank returns or
    raises together. A save cut short (a rank killed mid-write) leaves ``path`` as it was: never
    a mix of two checkpoints. ``path`` must be a folder this module wrote, or not exist."""
    import torch.distributed.checkpoint as dcp

    safety.serialize()
    path = _fspath(path)
    save_id = safety.agree_to_start("save", path, safety.save_path_problem(path))
    staging = safety.stage(path)
    state, _ = _state(pm, optimizer)
    safety.run_dcp("save", path, lambda: dcp.save(_tree(state), checkpoint_id=staging))
    _finish(pm, staging, path, save_id)


def async_save(pm: Any, path: str, optimizer: Any = None) -> Future:
    """:func:`save` in the background (``torch.distributed.checkpoint.async_save``): returns once
    the state is copied aside, so training may go on and change the parameters. The returned
    future completes on every rank once the checkpoint is in ``path`` (or raises on every rank);
    wait for it. A later save, async_save or load in this process first waits for it: their
    collectives would otherwise interleave with the background ones (both would hang)."""
    import torch.distributed.checkpoint as dcp

    safety.serialize()
    path = _fspath(path)
    save_id = safety.agree_to_start("async_save", path, safety.save_path_problem(path))
    staging = safety.stage(path)
    state, _ = _state(pm, optimizer)
    writing = safety.run_dcp("async_save", path, lambda: dcp.async_save(_tree(state), checkpoint_id=staging))
    done: Future = Future()

    def finish(f: Any) -> None:
        try:
            # the background write's error, under the fault handling (a lost rank named)
            safety.run_dcp("async_save", path, f.result)
            _finish(pm, staging, path, save_id)
            done.set_result(path)
        except BaseException as exc:   # the caller sees the write's own error
            done.set_exception(exc)

    writing.add_done_callback(finish)
    safety.in_flight(done)
    return done


def _fspath(path: Any) -> str:
    return os.fspath(path).rstrip(os.sep) or os.sep


def _finish(pm: Any, staging: str, path: str, save_id: str) -> None:
    """After DCP wrote ``staging``: the manifest, then (rank 0) the publish; every rank learns
    whether it worked before any returns."""
    plan = getattr(pm, "plan", None)
    safety.write_manifest(staging, save_id, {"tp": getattr(plan, "tp", None)})
    problem = safety.attempt(lambda: safety.publish(staging, path))[1] if safety.rank() == 0 else None
    safety.agree_on(f"the publish of {path}", problem and f"rank 0 could not move {staging} to {path}: {problem}")


def load(pm: Any, path: str, optimizer: Any = None, *, strict: bool = True, verify: bool = True) -> None:
    """Read :func:`save`'s folder into ``pm`` (and ``optimizer``), whatever tp and dp saved it.

    Every rank calls it. The files are first checked against the save's manifest (each rank
    reads a share; ``verify=False`` skips it), then the checkpoint's keys and shapes against the
    module's: a tensor of another shape is an error; with ``strict`` (the default) so is a key
    only one of them holds (a checkpoint of a deeper model, one saved without optimizer state);
    ``strict=False`` loads the keys both hold and leaves the rest as they are."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    safety.serialize()
    path = _fspath(path)
    safety.agree_to_start("load", path, safety.load_path_problem(path))
    if verify:
        safety.verify_files(path)
    if optimizer is not None and not optimizer.state:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)   # the state tensors DCP loads into
    state, optim = _state(pm, optimizer)
    view = _tree(state)
    whole = getattr(getattr(pm, "mesh", None), "pp", 1) == 1   # a pipeline stage holds some layers only
    safety.agree_on(f"the keys of {path}", safety.attempt(lambda: _check_keys(path, state, strict, whole))[1])
    with torch.no_grad():
        safety.run_dcp("load", path, lambda: dcp.load(view, checkpoint_id=path,
                                                      planner=DefaultLoadPlanner(allow_partial_load=not strict)))
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        # the state tensors were loaded in place; this brings back the param groups (lr, betas)
        set_optimizer_state_dict(pm, optimizer, _untree(view["optim"], optim))
    if hasattr(pm, "check_replicas"):   # every TP rank loaded the same replicated values, or all raise
        pm.check_replicas()


def _check_keys(path: str, state: dict, strict: bool, whole: bool = True) -> None:
    """The checkpoint's tensors against the module's, by name and full shape (DCP's metadata).
    Keys the checkpoint holds and the module lacks count only for a ``whole`` model (not a
    pipeline stage, which holds its own layers)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(state)

    def shown(keys: list[str]) -> str:
        return ", ".join(k.removeprefix("model.") for k in keys[:4]) + (f" (and {len(keys) - 4} more)" if len(keys) > 4 else "")

    wrong = [f"{k.removeprefix('model.')}: saved {list(saved[k].size)}, the module holds {list(v.shape)}"
             for k, v in flat.items() if isinstance(v, torch.Tensor) and isinstance(saved.get(k), TensorStorageMetadata)
             and tuple(saved[k].size) != tuple(v.shape)]
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensor(s) of {path} have another shape than the module's: "
                              f"{'; '.join(wrong[:3])}: the checkpoint is of another model or config")
    if not strict:
        return
    if any(k.startswith("optim.") for k in flat) and not any(k.startswith("optim.") for k in saved):
        raise CheckpointError(f"{path} holds no optimizer state (it was saved without optimizer=): load it "
                              "without optimizer=, or pass strict=False to keep the optimizer's own state")
    missing = sorted(k for k in flat if k not in saved)
    extra = sorted(k for k in saved if whole and k.startswith("model.") and k not in flat)
    if missing or extra:
        said = ([f"the module holds {len(missing)} key(s) the checkpoint lacks: {shown(missing)}"] if missing else []) + (
            [f"the checkpoint holds {len(extra)} key(s) the module lacks: {shown(extra)}"] if extra else [])
        raise CheckpointError(f"{path} does not match the module: {'; '.join(said)}. It was saved from another "
                              "model (more or fewer layers?); pass strict=False to load the keys both hold")


def _untree(loaded: Any, original: Any) -> Any:
    """The loaded state with every tensor the original one (loaded in place through its views)."""
    if isinstance(original, dict):
        return {k: _untree(loaded[k], v) for k, v in original.items()}
    if isinstance(original, list):
        return [_untree(a, b) for a, b in zip(loaded, original)]
    return original if isinstance(original, torch.Tensor) else loaded
