"""Save and load a ParallelModule (and its optimizer) with torch.distributed.checkpoint: autotp's
one path for training checkpoints (``autotp.runtime.checkpoint`` reads HuggingFace folders and
gathers one; its old per-rank ``save_sharded``/``load_sharded`` now come here).

``save(pm, path, optimizer=None, overwrite=False)``, ``async_save`` and ``load(pm, path,
optimizer=None)``: every rank of the world calls them. A save first checks, on every rank and
before it writes anything, that it replaces no other model's or training run's checkpoint, that
the optimizer is over the module's parameters and that the TP ranks' replicas are equal; it is
staged in ``<path>.partial``, summed into a manifest and moved to ``path`` only when every rank
has written its part, so an interrupted save never loads as a mix of two checkpoints, and a load
refuses damaged or mixed files on every rank (``autotp.runtime.checkpoint.dcp_safety`` says how). The
checkpoint is in the model's names and full shapes, so a module planned at another tp (or dp)
loads it: DCP reads, for each rank, the parts of the saved chunks its own layout holds.

DCP writes one chunk per rank at one offset. A parameter in torch's ``Shard(dim)`` or
``Replicate()`` is written as it is; a ``RunShard`` parameter (several runs per rank: fused
q|k|v, uneven heads, an experts stack's gate|up split inside each expert) is handed to DCP as a
DTensor over a ``LocalShardsWrapper`` of views of its runs, one chunk per contiguous range of the
full tensor. The views share the parameter's storage, so loading writes straight into the
tensors the programs use. Optimizer state (AdamW's ``exp_avg`` ...) has its parameter's
placements and goes the same way, under ``optim.state.<fqn>.<key>`` as torch's
``get_optimizer_state_dict`` names it.
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch

from ...errors import CheckpointError
from . import dcp_safety as safety
from ..module.dtensor import RunShard


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


def save(pm: Any, path: str, optimizer: Any = None, *, overwrite: bool = False) -> None:
    """Write ``pm``'s parameters and buffers (and ``optimizer``'s state) to the DCP folder ``path``.

    Every rank calls it (autotp.runtime.checkpoint.dcp_safety checks that they do, and names a rank that
    does not). First, on every rank before anything is written: ``path`` must not exist, or hold
    a checkpoint of this module's training run (one it saved or loaded; ``overwrite=True``
    replaces any checkpoint), ``optimizer`` must be over this module's parameters, and the TP
    ranks' replicated parameters and buffers must be equal (``pm.check_replicas()``). The files
    go to ``<path>.partial``; when every rank has written its part, each sums its files into the
    manifest, and only when every rank has succeeded does rank 0 move the folder to ``path``,
    replacing the earlier checkpoint there; every rank returns or raises together. A save cut
    short (a rank killed mid-write) leaves ``path`` as it was: never a mix of two checkpoints.
    One checkpoint operation runs at a time in a process: another thread's waits for it."""
    import torch.distributed.checkpoint as dcp

    with safety.one_at_a_time():
        path = _fspath(path)
        save_id, run = _start_save("save", pm, path, optimizer, overwrite)
        staging = safety.stage(path)
        state, _ = _state(pm, optimizer)
        safety.run_dcp("save", path, lambda: dcp.save(_tree(state), checkpoint_id=staging))
        _finish(pm, staging, path, save_id, run)


def async_save(pm: Any, path: str, optimizer: Any = None, *, overwrite: bool = False) -> Future:
    """:func:`save` in the background (``torch.distributed.checkpoint.async_save``): returns once
    the checks are done and the state is copied aside, so training may go on and change the
    parameters. The returned future completes on every rank once the checkpoint is in ``path``
    (or raises on every rank); wait for it. A later save, async_save or load in this process
    first waits for it: their collectives would otherwise interleave with the background ones
    (both would hang)."""
    import torch.distributed.checkpoint as dcp

    with safety.one_at_a_time():
        path = _fspath(path)
        save_id, run = _start_save("async_save", pm, path, optimizer, overwrite)
        staging = safety.stage(path)
        state, _ = _state(pm, optimizer)
        writing = safety.run_dcp("async_save", path, lambda: dcp.async_save(_tree(state), checkpoint_id=staging))
        done: Future = Future()

        def finish(f: Any) -> None:
            try:
                # the background write's error, under the fault handling (a lost rank named)
                safety.run_dcp("async_save", path, f.result)
                _finish(pm, staging, path, save_id, run)
                done.set_result(path)
            except BaseException as exc:   # the caller sees the write's own error
                done.set_exception(exc)

        writing.add_done_callback(finish)
        safety.in_flight(done)
        return done


#: the training run of the checkpoints a module saved or loaded (the run's first save id), kept on
#: the module: a save may replace a checkpoint of its own run only (dcp_safety.replace_problem)
_RUN = "_autotp_checkpoint_run"


def _start_save(op: str, pm: Any, path: str, optimizer: Any, overwrite: bool) -> tuple[str, str]:
    """The checks before a save writes anything, agreed by every rank: the path, the optimizer,
    the checkpoint the save would replace, then the replicas. Returns the save id and run."""
    run = getattr(pm, _RUN, None)
    problem = (safety.save_path_problem(path) or _optimizer_problem(pm, optimizer)
               or (None if overwrite else safety.replace_problem(path, run, _shapes(pm), _whole(pm))))
    save_id, run = safety.agree_to_start(op, path, problem, run)
    _check_replicas(pm, path)
    return save_id, run


def _shapes(pm: Any) -> dict[str, tuple[int, ...]]:
    return {f"model.{k}": tuple(v.shape) for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)}


def _whole(pm: Any) -> bool:
    return getattr(getattr(pm, "mesh", None), "pp", 1) == 1   # a pipeline stage holds some layers only


def _optimizer_problem(pm: Any, optimizer: Any) -> str | None:
    """Why ``optimizer``'s state cannot be saved or loaded with ``pm``: it holds parameters that
    are not the module's (torch's state_dict helpers fail on them with a raw ``KeyError: 0``)."""
    if optimizer is None:
        return None
    own = {id(p) for p in pm.parameters()}
    held = [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]
    foreign = [p for p in held if id(p) not in own]
    if not foreign:
        return None
    shapes = ", ".join(str(list(p.shape)) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    return (f"the optimizer holds {len(foreign)} parameter(s) (of {len(held)}) that are not this module's, of "
            f"shapes {shapes}: it was built over another module's parameters (the serial model's, or another "
            "ParallelModule's), so its state cannot be named by this module's parameters; pass the optimizer built "
            "over this module's: torch.optim.AdamW(pm.parameters(), ...)")


def _check_replicas(pm: Any, path: str) -> None:
    """Before a save: every TP group's replicated parameters and buffers equal on its ranks
    (``pm.check_replicas()``), or every rank of the world raises the DisagreementError, nothing
    written. A checkpoint keeps one rank's copy of a replicated tensor: a drifted rank's values
    would be dropped, or saved in place of the others', without a word."""
    from ...errors import DisagreementError

    if not hasattr(pm, "check_replicas"):
        return
    problem = None
    try:
        pm.check_replicas(when=f"before the save of {path}", advice=(
            "Replicas drift when something changes them on some ranks only: an optimizer step, gradient "
            "clipping or an in-place update run on some ranks and not the others (or on other gradients), or a "
            "load on some ranks only. Nothing was written: make every rank of the TP group take the same steps, "
            "or load the last good checkpoint on every rank and go on from it."))
    except DisagreementError as exc:
        problem = str(exc)
    safety.agree_on(f"the replicas' check before the save of {path}", problem, error=DisagreementError)


def _fspath(path: Any) -> str:
    return os.fspath(path).rstrip(os.sep) or os.sep


def _finish(pm: Any, staging: str, path: str, save_id: str, run: str) -> None:
    """After DCP wrote ``staging``: the manifest, then (rank 0) the publish; every rank learns
    whether it worked before any returns. The module is then in the save's training run."""
    plan = getattr(pm, "plan", None)
    safety.write_manifest(staging, save_id, {"tp": getattr(plan, "tp", None), "run": run})
    problem = safety.attempt(lambda: safety.publish(staging, path))[1] if safety.rank() == 0 else None
    safety.agree_on(f"the publish of {path}", problem and f"rank 0 could not move {staging} to {path}: {problem}")
    setattr(pm, _RUN, run)


def load(pm: Any, path: str, optimizer: Any = None, *, strict: bool = True, verify: bool = True) -> None:
    """Read :func:`save`'s folder into ``pm`` (and ``optimizer``), whatever tp and dp saved it.

    Every rank calls it. The files are first checked against the save's manifest (each rank
    reads a share; ``verify=False`` skips it), then the checkpoint's keys and shapes against the
    module's: a tensor of another shape is an error; with ``strict`` (the default) so is a key
    only one of them holds (a checkpoint of a deeper model, one saved without optimizer state);
    ``strict=False`` loads the keys both hold and leaves the rest as they are. The module is then
    in the checkpoint's training run: its later saves may replace checkpoints of that run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    with safety.one_at_a_time():
        path = _fspath(path)
        safety.agree_to_start("load", path, safety.load_path_problem(path) or _optimizer_problem(pm, optimizer))
        manifest = safety.verify_files(path) if verify else safety.read_manifest(path)
        if optimizer is not None and not optimizer.state:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(optimizer)   # the state tensors DCP loads into
        state, optim = _state(pm, optimizer)
        view = _tree(state)
        safety.agree_on(f"the keys of {path}",
                        safety.attempt(lambda: _check_keys(path, state, strict, _whole(pm)))[1])
        with torch.no_grad():
            safety.run_dcp("load", path, lambda: dcp.load(view, checkpoint_id=path,
                                                          planner=DefaultLoadPlanner(allow_partial_load=not strict)))
        if optimizer is not None:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            # the state tensors were loaded in place; this brings back the param groups (lr, betas)
            set_optimizer_state_dict(pm, optimizer, _untree(view["optim"], optim))
        if hasattr(pm, "check_replicas"):   # every TP rank loaded the same replicated values, or all raise
            pm.check_replicas()
        if manifest is not None:
            setattr(pm, _RUN, manifest.get("run") or manifest.get("save_id"))


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
