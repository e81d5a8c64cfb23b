"""Process groups and their failures: a group's size and ranks, and a failed collective named.

``group_size``, ``group_rank`` and ``group_ranks`` answer for a TP ``group`` (a torch.distributed
ProcessGroup; ``None`` is a group of one rank). ``_comm(op, group)`` is the context autotp's
collectives run in (the mappings', an expert layer's, agreement's, a checkpoint's, a pipeline
stage's): a failed torch.distributed call (timeout, lost peer, backend error) surfaces as
``autotp.errors.CommError`` naming the op and the group, or as ``LostRankError`` naming the rank
that is gone (the roll call of :mod:`autotp.distributed.faults`); the eager collectives note
their start and raise the same error inline (``_started``, ``_comm_failure``). ``_all_reduce``
is f's and g's sum over the group (:mod:`.collectives`): into a fresh tensor, or in its input's
own storage where the rewrite marked it ``in_place`` (:mod:`autotp.passes.in_place`).

No layout and no autograd here: inputs are process groups, tensors and the op's name.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as _c10d
from torch import Tensor

from autotp.errors import AutotpError, CommError, LostRankError

__all__ = ["group_size", "group_rank", "group_ranks", "backend_failure"]


def group_size(group, compiling: bool | None = None) -> int:
    """Ranks in ``group`` (1 for None). Eagerly the group's own answer (``ProcessGroup.size``, what
    ``dist.get_world_size`` returns for a group this rank is in, without its Python: asked several
    times per collective); under torch.compile the call dynamo folds. ``compiling``: whether a
    compile trace runs, where the caller asked already (None: asks)."""
    if group is None:
        return 1
    return dist.get_world_size(group) if (torch.compiler.is_compiling() if compiling is None else compiling) \
        else group.size()


def group_rank(group, compiling: bool | None = None) -> int:
    """This rank's place in ``group`` (0 for None); eagerly ``ProcessGroup.rank``, as above."""
    if group is None:
        return 0
    return dist.get_rank(group) if (torch.compiler.is_compiling() if compiling is None else compiling) \
        else group.rank()


def group_ranks(group) -> tuple[int, ...] | None:
    """Global ranks of ``group``, or None when they cannot be known (no process group)."""
    if group is None:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # only used to word messages; never let it mask the real error
        return None


#: Wall-clock start of the latest collective per group (keyed by the group's name).
_previous_start: dict[object, float] = {}


def _comm(op: str, group, only: Any = None) -> contextlib.AbstractContextManager:
    """Turn a torch.distributed failure (timeout, lost peer, backend error) into a CommError;
    a LostRankError naming the rank when the roll call (autotp.distributed.faults) finds one gone.
    ``only(exc)``, when given, picks the exceptions that are such failures (a block that also
    computes lets the others through as they are). Under torch.compile it is no context at
    all: clocks and try/except would break the graph, and a compiled program's collectives
    fail inside the compiled code, not here."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _CommGuard(op, group, only)


def backend_failure(exc: BaseException) -> bool:
    """Is ``exc`` a process group's failure (a lost peer, a timeout), not the computation's?"""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out"))


class _CommGuard:
    """The context :func:`_comm` enters around one collective: notes when it started (and when the
    group's previous one did, for the roll call), and on a failure raises the named error. A plain
    class, not a generator context manager: it is entered for every collective of every step, and
    ``contextlib``'s machinery cost that path three more Python calls and a generator each time."""

    __slots__ = ("op", "group", "only", "started", "since")

    def __init__(self, op: str, group, only: Any = None) -> None:
        self.op, self.group, self.only = op, group, only

    def __enter__(self) -> None:   # (_started's, inline: the guard is entered per collective too)
        self.started = time.monotonic()
        key = getattr(self.group, "group_name", None) or id(self.group)
        self.since = _previous_start.get(key)  # faults published before it are an earlier call's
        _previous_start[key] = time.time()

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, AutotpError) or not isinstance(exc, Exception):
            return False
        if self.only is not None and not self.only(exc):
            return False
        raise _comm_failure(self.op, self.group, exc, self.started, self.since) from exc


def _started(group) -> tuple[float, float | None]:
    """A collective on ``group`` starts now: when (``time.monotonic``), and when the group's previous
    one did (faults published before it are an earlier call's), for the roll call of a failure.
    The eager mappings' collectives note their start so and catch their failure inline, raising
    what :class:`_CommGuard`'s exit raises: the guard's ``__init__``, ``__enter__`` and
    ``__exit__`` were three Python calls per collective of every step."""
    started = time.monotonic()
    key = getattr(group, "group_name", None) or id(group)
    since = _previous_start.get(key)
    _previous_start[key] = time.time()
    return started, since


def _comm_failure(op: str, group, e: Exception, started: float, since: float | None) -> CommError:
    """The error a failed collective ``op`` on ``group`` raises (see :func:`_comm`)."""
    from .faults import note_comm_failure, roll_call
    from .timeouts import group_timeout

    note_comm_failure()

    ranks = group_ranks(group)
    where = f"the group of ranks {list(ranks)}" if ranks is not None else "its group"
    cause = f"{op} failed on {where}: {type(e).__name__}: {e}"
    timeout = group_timeout(group).total_seconds()
    found = roll_call(group, ranks, started, timeout, since) if ranks is not None else None
    advice = (
        "Check whether a rank died, raised, or took a different code path (ranks must call "
        "the same collectives in the same order). A rank that is merely slow hits the "
        f"collective timeout ({timeout:g} s here), fixed when the process group is created: "
        "autotp.distributed.mesh.DEFAULT_TIMEOUT, or the AUTOTP_TIMEOUT environment variable, "
        "unless the timeout= argument of autotp.distributed.mesh.init_from_env (or of launch / "
        "LocalCluster) says otherwise."
    )
    if found is not None and found.exited:
        advice = ("A rank of the group is gone, so this job cannot go on: find why it stopped "
                  "(its log, the OOM killer), then restart every rank.")
    if found is not None and found.lost:
        return LostRankError(f"{found.describe(timeout)}.\n{cause}\n{advice}")
    note = f" ({found.note})" if found is not None and found.note else ""
    return CommError(f"{cause}{note}\n{advice}")


def _all_reduce(x: Tensor, group, op: str, in_place: bool = False, compiling: bool | None = None) -> Tensor:
    """The sum over the group. ``in_place``: the caller knows that nothing else reads ``x``
    (the rewrite's decision, :mod:`autotp.passes.in_place`), so eager code reduces it in its own
    storage and returns it, as Megatron's ``_reduce`` does, where it is contiguous; otherwise a
    contiguous copy of it, reduced. A compiled program's is a functional collective (which
    copies its input first): torch.compile traces it as it is, and inductor reduces in place
    itself where the input is dead. A tensor reduced in place has its autograd version bumped
    (c10d does not), so a backward formula that saved it raises autograd's "modified by an
    inplace operation" instead of reading the sum. ``compiling``: as :func:`group_size`'s."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        x = x.detach()   # (not in place: dynamo loses a Function's detached alias)
        if group_size(group, True) == 1:
            return x.clone(memory_format=torch.contiguous_format)
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    if x.requires_grad:   # a Function's input in its forward (a gradient in backward needs none)
        x = x.detach()
    if group is None or group.size() == 1:
        return x if in_place else x.clone(memory_format=torch.contiguous_format)
    in_place = in_place and x.is_contiguous()
    if not in_place:
        x = x.clone(memory_format=torch.contiguous_format)
    started, since = _started(group)
    try:   # waited for inside: a failure surfaces here, named
        if type(x) is not Tensor or x.is_complex():
            _c10d_all_reduce(x, group)
        else:   # (_c10d_all_reduce's common case, inline: a Python call less per f and g)
            opts = _c10d.AllreduceOptions()
            opts.asyncOp = False
            work = group.allreduce([x], opts)
            if work is not None:   # a blocking collective may return no work (NCCL, torch 2.11)
                work.wait()
    except AutotpError:
        raise
    except Exception as exc:   # as _CommGuard's exit (the guard's three calls, inline)
        raise _comm_failure(op, group, exc, started, since) from exc
    if in_place:
        _increment_version((x,))
    return x


def _c10d_all_reduce(x: Tensor, group) -> None:
    """``dist.all_reduce(x, group=group)`` (a sum, waited for) without its Python: the group's own
    ``allreduce`` (which dispatches ``c10d.allreduce_``, as dist's does) with dist's options. The
    checks dist's makes that an eager step of a rank needs not: this rank is in the group (the
    group is its own TP group), no coalescing manager is open (autotp opens none); a complex
    tensor or a tensor subclass takes dist's own path (its real view, its ``__torch_function__``)."""
    if type(x) is not Tensor or x.is_complex():
        dist.all_reduce(x, group=group)
        return
    opts = _c10d.AllreduceOptions()   # reduceOp SUM
    opts.asyncOp = False
    work = group.allreduce([x], opts)
    if work is not None:   # a blocking collective may return no work (NCCL, torch 2.11)
        work.wait()


#: autograd's version bump of tensors written in place (``torch.autograd.graph.increment_version``
#: without its Python)
_increment_version = torch._C._increment_version


def broadcast_bytes(data: bytes, source: int, group: Any, what: str) -> bytes:
    """``data`` broadcast from global rank ``source`` over ``group`` (a gloo control group): its
    size, then its bytes (none where it is empty); every rank returns them. ``what`` names them
    in a CommError."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    with _comm(f"broadcast of the {what}'s size", group):
        dist.broadcast(size, src=source, group=group)
    n = int(size.item())
    if n == 0:
        return b""
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(n, dtype=torch.uint8)
    with _comm(f"broadcast of the {what}", group):
        dist.broadcast(buffer, src=source, group=group)
    return data or buffer.numpy().tobytes()


def sent_from_source(produce: Any, source: int, group: Any, what: str) -> tuple[Any, bytes]:
    """The sending rank's side of a one-to-all exchange (a capture, a plan's choices):
    ``produce()`` returns (result, the bytes to send); they are broadcast (none where it raised),
    then its error is raised. The others, sent nothing, do the work themselves and fail as they
    fail, so every rank passes through the broadcast once whatever happens."""
    failure, result, data = None, None, b""
    try:
        result, data = produce()
    except Exception as exc:  # noqa: BLE001 - raised below, after the others were told
        failure = exc
    broadcast_bytes(data, source, group, what)
    if failure is not None:
        raise failure
    return result, data
