"""Process groups for tensor parallelism inside a DP x TP mesh.

``init_from_env`` initializes torch.distributed from torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). ``get_mesh(tp)`` splits the initialized world into TP groups of
neighbouring ranks ([0..tp-1], [tp..2tp-1], ...; one node's fast links stay inside a TP group)
and DP groups across them (ranks i, i+tp, i+2tp, ...), as in Figure 8 of the Megatron-LM paper.

Collectives that do not complete within ``DEFAULT_TIMEOUT`` (300 s) raise instead of hanging
forever: long enough for a slow first step (compilation, a checkpoint load on one rank), short
enough that a dead or diverged rank is reported within minutes. Set the ``AUTOTP_TIMEOUT``
environment variable (seconds) or pass ``timeout=`` to ``init_from_env`` to change it (a world
you initialize yourself keeps the timeout you gave ``init_process_group``); groups made by
``get_mesh`` inherit the world's timeout. A rank whose process dies is named sooner: see
:mod:`autotp.distributed.faults`.

Each mesh also has a ``control_group``: the TP ranks over gloo, for the few small CPU messages
autotp exchanges to check that ranks agree (:mod:`autotp.distributed.agreement`) without touching
the accelerator's stream. Under a gloo world it is the TP group itself.
"""
from __future__ import annotations

import atexit
import datetime
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autotp.errors import ConfigError
from autotp.distributed.faults import register_process
from autotp.distributed.timeouts import DEFAULT_TIMEOUT, collective_timeout, group_timeout

__all__ = ["DEFAULT_TIMEOUT", "TPMesh", "init_from_env", "get_mesh", "collective_timeout", "group_timeout"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# get_mesh's groups, per (tp, backend), for the world they were made in. new_group is a
# collective and each call creates new communicators: tests that ask for the same mesh hundreds
# of times must get the same groups back.
_MESHES: dict[tuple[int, str | None], "TPMesh"] = {}
_MESHES_WORLD = None  # the default group _MESHES belongs to


def _choose_backend() -> str:
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): it needs a GPU per local rank.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.is_available() and local_world <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def init_from_env(backend: str | None = None, timeout: datetime.timedelta | None = None) -> str | None:
    """Initialize torch.distributed from torchrun's environment if that has not been done.

    Returns the default group's backend name, or None when torch.distributed is not initialized
    and the torchrun variables are absent (nothing to initialize from). ``timeout`` defaults to
    :func:`collective_timeout`.
    """
    if dist.is_initialized():
        return dist.get_backend()
    if not all(v in os.environ for v in _TORCHRUN_VARS):
        return None
    backend = backend or _choose_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout or collective_timeout())
    atexit.register(_leave)
    return backend


def _leave() -> None:
    """At exit, destroy the process group this module made: a process that exits with gloo's
    threads still running can abort in their destructors ("terminate called without an active
    exception", exit code -6, seen under torchrun after the job had passed)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:   # exiting anyway; never turn a finished job into a failure
            pass


@dataclass(frozen=True)
class TPMesh:
    """This rank's place in the DP x TP mesh. A group of one rank is None."""

    tp: int
    dp: int
    tp_group: object = field(compare=False, hash=False, repr=False)
    dp_group: object = field(compare=False, hash=False, repr=False)
    tp_rank: int
    dp_rank: int
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    backend: str
    control_group: object = field(default=None, compare=False, hash=False, repr=False)
    #: the same layout as a torch DeviceMesh, dims ("dp", "tp"), over the same groups (for DTensor
    #: and other torch.distributed code that takes a mesh); under a pipeline, this stage's ranks
    device_mesh: object = field(default=None, compare=False, hash=False, repr=False)
    #: pipeline stages (PTD-P): this rank's stage, and the ranks that hold the other stages at the
    #: same (dp, tp) position, in stage order (the point-to-point group the pipeline talks over)
    pp: int = 1
    pp_rank: int = 0
    pp_ranks: tuple[int, ...] = ()
    pp_group: object = field(default=None, compare=False, hash=False, repr=False)
    #: every stage's TP ranks at this rank's dp position (one pipeline replica), over gloo; None
    #: without a pipeline. A step checks over it that they were handed batches of one shape
    replica_control_group: object = field(default=None, compare=False, hash=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def device_mesh_for(self, device: Any) -> Any:
        """:attr:`device_mesh` for tensors on ``device``: the same groups under that device type.
        DTensor moves a local tensor to its mesh's device type, and gloo carries the CUDA
        tensors of ranks that share one GPU (NCCL refuses them), so a gloo mesh of CUDA
        parameters is a "cuda" mesh over the gloo groups. None where there is no mesh."""
        mesh = self.device_mesh
        kind = torch.device(device).type
        if mesh is None or kind == mesh.device_type:
            return mesh
        key = (id(mesh), kind)
        if key not in _DEVICE_MESHES:
            _DEVICE_MESHES[key] = (mesh, DeviceMesh.from_group(
                [mesh.get_group(name) for name in mesh.mesh_dim_names], kind, mesh=mesh.mesh,
                mesh_dim_names=mesh.mesh_dim_names))
        return _DEVICE_MESHES[key][1]


def device_mesh_of(mesh: Any, device: Any) -> Any:
    """``mesh``'s DeviceMesh for tensors on ``device`` (None for no mesh, or one without)."""
    if hasattr(mesh, "device_mesh_for"):
        return mesh.device_mesh_for(device)
    return getattr(mesh, "device_mesh", None)


#: (id of a mesh's DeviceMesh, device type) -> (that DeviceMesh, kept alive; its twin)
_DEVICE_MESHES: dict[tuple[int, str], tuple[Any, Any]] = {}


def _check_tp(tp) -> int:
    if isinstance(tp, bool) or not isinstance(tp, numbers.Integral) or tp < 1:
        raise ConfigError(
            f"tp={tp!r} is not valid: tp must be a positive integer, the number of ranks that "
            "share each layer (tp=1 runs unsharded)"
        )
    return int(tp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def get_mesh(tp: int, backend: str | None = None, pp: int = 1) -> TPMesh:
    """This rank's TP and DP groups for ``tp``-way tensor parallelism (cached per tp, pp, backend).

    Every rank must call it with the same arguments: creating a group is a collective.
    ``backend=None`` uses the default group's backend. With ``pp`` pipeline stages the world is
    ``pp`` blocks of ``dp * tp`` neighbouring ranks, one per stage (the pipeline is the outermost
    dim, as in Megatron-LM: a stage's TP and DP groups stay inside its block, its point-to-point
    neighbours are ``dp * tp`` ranks away), and ``dp = world / (tp * pp)``.
    """
    tp = _check_tp(tp)
    if isinstance(pp, bool) or not isinstance(pp, numbers.Integral) or pp < 1:
        raise ConfigError(f"pp={pp!r} is not valid: pp must be a positive integer, the number of pipeline stages "
                          "(pp=1: no pipeline)")
    pp = int(pp)
    init_from_env()
    if not dist.is_initialized():
        raise ConfigError(
            "autotp.parallelize needs an initialized torch.distributed process group: launch with "
            "torchrun, or use autotp.testing.launch / LocalCluster for local ranks"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        choices = ", ".join(str(d) for d in _divisors(world))
        raise ConfigError(f"world size {world} is not divisible by tp={tp}; choose tp in {{{choices}}}")
    if world % (tp * pp):
        choices = ", ".join(str(d) for d in _divisors(world // tp))
        raise ConfigError(f"world size {world} is not dp * pp * tp for tp={tp}, pp={pp}: {world} ranks are not a "
                          f"multiple of {tp * pp}; with tp={tp} choose pp in {{{choices}}}, or launch a multiple of "
                          f"{tp * pp} ranks")

    global _MESHES_WORLD
    default_group = dist.distributed_c10d._get_default_group()
    if _MESHES_WORLD is not default_group:  # a new world: the old groups are gone
        _MESHES.clear()
        _MESHES_WORLD = default_group
    key = (tp, pp, backend)
    if key not in _MESHES:
        _MESHES[key] = _make_mesh(tp, world, rank, backend, pp)
    return _MESHES[key]


def _make_mesh(tp: int, world: int, rank: int, backend: str | None, pp: int = 1) -> TPMesh:
    block = world // pp          # the ranks of one pipeline stage
    dp = block // tp
    stage, base = rank // block, (rank // block) * block
    timeout = group_timeout()

    def groups(all_ranks: list[tuple[int, ...]], backend: str | None):
        mine = None
        for ranks in all_ranks:  # every rank creates every group, in the same order
            group = dist.new_group(list(ranks), timeout=timeout, backend=backend) if len(ranks) > 1 else None
            if rank in ranks:
                mine = (group, ranks)
        return mine

    all_tp = [tuple(range(s * block + b * tp, s * block + (b + 1) * tp)) for s in range(pp) for b in range(dp)]
    tp_group, tp_ranks = groups(all_tp, backend)
    dp_group, dp_ranks = groups([tuple(range(s * block + i, (s + 1) * block, tp)) for s in range(pp) for i in range(tp)],
                                backend)
    pp_group, pp_ranks = groups([tuple(range(j, world, block)) for j in range(block)], backend)
    backend = backend or dist.get_backend()
    # the CPU backends carry the control messages themselves ("fake": torch's one-process
    # backend, whose collectives do nothing; a planning and rewriting tier runs one rank on it)
    control = tp_group if backend in ("gloo", "fake") else groups(all_tp, "gloo")[0]
    # a pipeline's replica (every stage's TP ranks at this rank's dp position), over gloo: the
    # per-step check that its ranks were handed batches of one shape
    replica = None
    if pp > 1:
        all_replicas = [tuple(s * block + b * tp + i for s in range(pp) for i in range(tp)) for b in range(dp)]
        replica = groups(all_replicas, "gloo" if backend != "fake" else backend)[0]
    # A DeviceMesh needs a group for every dim, a dim of one rank too: singletons, made only then.
    single = None
    if dp == 1 or tp == 1:
        for r in range(world):
            group = dist.new_group([r], timeout=timeout, backend=backend)
            single = group if r == rank else single
    device_mesh = DeviceMesh.from_group(
        [dp_group or single, tp_group or single], "cuda" if backend == "nccl" else "cpu",
        mesh=torch.arange(base, base + block).view(dp, tp), mesh_dim_names=("dp", "tp"))
    register_process()  # so that a roll call after a failed collective can tell this rank died
    return TPMesh(
        tp=tp, dp=dp, tp_group=tp_group, dp_group=dp_group,
        tp_rank=tp_ranks.index(rank), dp_rank=dp_ranks.index(rank),
        tp_ranks=tp_ranks, dp_ranks=dp_ranks, backend=backend, control_group=control,
        device_mesh=device_mesh, pp=pp, pp_rank=stage, pp_ranks=pp_ranks, pp_group=pp_group,
        replica_control_group=replica,
    )
