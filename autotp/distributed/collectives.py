"""Megatron's tensor-parallel mappings as autograd Functions, forward and backward side by side.

Every mapping takes the TP ``group`` (a torch.distributed ProcessGroup). ``group=None`` means a
group of one rank: every mapping is then the identity (or plain slicing), with no communication.

    mapping          forward                              backward
    f  copy_to_tp    identity                             all-reduce(sum)
    g  reduce_from   all-reduce(sum)                      identity
    gather_from_tp   all-gather shards -> full            keep this rank's slice
    scatter_to_tp    keep this rank's slice               all-gather -> full
    reduce_scatter   sum over ranks, keep this rank's     all-gather -> full
                     slice (Partial -> Shard)
    reshard_tp       all-to-all: one split -> another     the reverse all-to-all
                     (Shard(a) -> Shard(b), or the same
                     dim dealt another way)

Sharded layouts follow ``autotp.placements.Shard`` (chunks, unit, uneven runs). Collectives need
equal sizes on every rank, so uneven shards are padded to ``max_local_size`` and cut back (a
reduce-scatter of uneven or interleaved shards is still one reduce-scatter, over padded blocks).
Collectives write into fresh tensors, never into their inputs, except an f's or a g's
all-reduce that the rewrite marked ``in_place`` (:mod:`autotp.passes.in_place`), and a failed
torch.distributed call surfaces as ``autotp.errors.CommError`` naming the op and the group, or
as ``LostRankError`` naming the rank that is gone (the roll call of :mod:`autotp.distributed.faults`).

``CopyToTP``, ``ReduceFromTP``, ... wrap the mappings as ``nn.Module``s so that rewritten torch.fx
graphs call them as ``call_module`` nodes and ``print(gm.code)`` shows them by name.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import operator
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as _c10d
from torch import Tensor, nn

from autotp.errors import AutotpError, CommError, LostRankError, PlanError
from autotp.placements import (Shard, local_ranges, local_size, owned_ranges,
                               resharded_by_all_to_all)

#: the functional all-gather into one tensor: ``all_gather_single`` from torch 2.13 on, where
#: ``all_gather_tensor`` (the name before) warns that it is deprecated
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

__all__ = [
    "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "reduce_scatter_to_tp", "reshard_tp",
    "local_shard", "assemble", "traced_as_now", "group_size", "group_rank", "group_ranks",
    "CopyToTP", "ReduceFromTP", "GatherFromTP", "ScatterToTP", "ReduceScatterToTP", "ReshardTP",
]


# ---------------------------------------------------------------- groups and errors

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


# ---------------------------------------------------------------- layouts (no communication)

class _Split:
    """Where the ranks' parts of a dim of ``full_size`` lie under ``shard`` on ``tp`` ranks: each
    rank's ranges (``local_ranges``) and size, the widest part, and whether the split is even
    and contiguous. Worked out once per (shard, size, tp) in eager code (:func:`_split`), not at
    every collective of every step."""

    __slots__ = ("ranges", "sizes", "width", "even", "ordered", "blocks")

    def __init__(self, full_size: int, shard: Shard, tp: int) -> None:
        self.ranges = tuple(local_ranges(full_size, shard, tp, r) for r in range(tp))
        self.sizes = tuple(sum(b - a for a, b in ranges) for ranges in self.ranges)
        self.width = max(self.sizes)
        # an even contiguous split: every rank one run of the same width, in rank order
        self.even = shard.chunks == 1 and not shard.rotate and not shard.tail and len(set(self.sizes)) == 1
        # every rank at most one run, the runs in rank order tiling the dim (widths may differ:
        # a vocabulary of 50257 on 8 ranks, 6283 rows then 6282): the ranks' parts concatenated
        # in rank order are the whole
        runs = [run for ranges in self.ranges for run in ranges]
        self.ordered = all(len(ranges) <= 1 for ranges in self.ranges) \
            and [a for a, _ in runs] == [0] + [b for _, b in runs[:-1]] and (not runs or runs[-1][1] == full_size)
        # an ordered split's ranks of one width side by side, (first index, ranks, width) each, the
        # empty parts left out: one block an even split, two an uneven one (a hidden of 20 on 3
        # ranks: 7, 7, then 6), each cut along the dim by one strided copy (_all_to_all)
        self.blocks: tuple[tuple[int, int, int], ...] = ()
        if self.ordered:
            for ranges, n in zip(self.ranges, self.sizes):
                if n and self.blocks and self.blocks[-1][2] == n:
                    first, ranks, _ = self.blocks[-1]
                    self.blocks = self.blocks[:-1] + ((first, ranks + 1, n),)
                elif n:
                    self.blocks += ((ranges[0][0], 1, n),)


#: (id(shard), full size, tp) -> (shard, its _Split), for eager code; cleared when it grows past
#: _SPLITS_KEPT (a dim whose size changes per call, the sequence under sequence parallelism, adds
#: one a length). Keyed by the shard object's identity, which a comm module keeps from step to
#: step: a Shard's hash and equality are Python (two calls a lookup); the entry keeps its shard
#: alive, so an id in the table is never another object's
_splits: dict[tuple[int, int, int], tuple[Shard, _Split]] = {}
_SPLITS_KEPT = 4096


def _split(full_size: int, shard: Shard, tp: int, compiling: bool | None = None) -> _Split:
    """:class:`_Split` of ``shard`` over a dim of ``full_size`` on ``tp`` ranks; afresh inside a
    torch.compile trace (which must not write a module's dict, and runs it once per graph).
    ``compiling``: whether one is running, where the caller asked already (None: asks)."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        return _Split(full_size, shard, tp)
    key = (id(shard), full_size, tp)
    found = _splits.get(key)
    if found is None:
        if len(_splits) >= _SPLITS_KEPT:
            _splits.clear()
        found = _splits[key] = (shard, _Split(full_size, shard, tp))
    return found[1]


def local_shard(full: Tensor, shard: Shard, tp: int, rank: int) -> Tensor:
    """The part of ``full`` that ``rank`` holds under ``shard`` (contiguous, possibly empty)."""
    d = shard.dim
    ranges = local_ranges(full.shape[d], shard, tp, rank)
    if not ranges:
        return full.narrow(d, 0, 0).contiguous()
    return torch.cat([full.narrow(d, a, b - a) for a, b in ranges], dim=d).contiguous()


def rank_slice(x: Tensor, shard: Shard, tp: int, rank: int, strided: bool = False,
               compiling: bool | None = None) -> Tensor:
    """``local_shard`` of an activation or a gradient inside a step, copied only where it must
    be: one run whose slice is contiguous already (a split of dim 0, or of a dim with only dims
    of size one before it: the sequence of a batch of one) is that slice, a view, as serial
    code slicing it would hold. A strided slice (a split of a dim after one of size above one)
    of an activation is laid out by one copy, for the program's ``view`` nodes, which cannot
    view it; ``strided``: a gradient's, handed to the backward formula of the op that made the
    tensor, stays a view, which ATen's formulas read strided as they are (attention's, the
    pointwise ops') or copy themselves where their kernel needs it contiguous (no more bytes
    than this copy); several runs are joined by one copy. A compiled
    program gets ``local_shard``'s fresh tensor: inductor plans its own buffers, and dynamo has
    lost gradients of outputs that alias an autograd Function's input (``_output``).
    ``compiling``: as :func:`group_size`'s."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        return local_shard(x, shard, tp, rank)
    found = _splits.get((id(shard), x.shape[shard.dim], tp))   # (_split's lookup, inline)
    ranges = (found[1] if found is not None else _split(x.shape[shard.dim], shard, tp, False)).ranges[rank]
    if len(ranges) != 1:
        return local_shard(x, shard, tp, rank)
    (a, b), = ranges
    cut = x.narrow(shard.dim, a, b - a)
    return cut if strided else cut.contiguous()   # a view where the slice is contiguous


def assemble(pieces: Sequence[Tensor], shard: Shard, full_size: int) -> Tensor:
    """Inverse of ``local_shard``: ``pieces[r]`` is rank r's shard; returns the full tensor."""
    d, tp = shard.dim, len(pieces)
    segments: list[tuple[int, Tensor]] = []
    for rank, piece in enumerate(pieces):
        offset, owned = 0, set(owned_ranges(full_size, shard, tp, rank))
        for a, b in local_ranges(full_size, shard, tp, rank):
            if (a, b) in owned:   # a tail every rank holds is taken from rank 0
                segments.append((a, piece.narrow(d, offset, b - a)))
            offset += b - a
    segments.sort(key=lambda s: s[0])  # the owned ranges of all ranks tile [0, full_size)
    if not segments:
        return pieces[0].narrow(d, 0, 0)
    return torch.cat([t for _, t in segments], dim=d)


def dense_order(x: Tensor) -> list[int] | None:
    """The dims of ``x`` in the order its memory holds them, where ``x`` is a permutation of a
    contiguous tensor that is not contiguous itself (attention's output ``[b, heads, s, d]`` laid
    out as ``[b, s, heads, d]``): ``x.permute(order)`` is then contiguous. None where ``x`` is
    contiguous, or strided past a permutation (a slice)."""
    if x.is_contiguous():
        return None
    # the dims by falling stride, ties in dim order (a stable sort): keyed by C functions alone, no
    # Python call per dim (a strided gradient reaches it in a step's gathers and reduce-scatters)
    order = sorted(range(x.dim()), key=tuple(map(operator.neg, x.stride())).__getitem__)
    return order if x.permute(order).is_contiguous() else None


def _held(shard: Shard, order: list[int]) -> Shard:
    """``shard`` of a tensor as it is held in memory, ``x.permute(order)`` (:func:`dense_order`)."""
    return dataclasses.replace(shard, dim=order.index(shard.dim),
                               outer=order.index(shard.outer) if shard.outer >= 0 else shard.outer)


def _unpermute(t: Tensor, order: list[int]) -> Tensor:
    """The inverse of ``permute(order)``: ``t`` held in memory order, back to the caller's dims."""
    return t.permute(sorted(range(t.dim()), key=order.__getitem__))


def _all_gather(x: Tensor, group, shard: Shard, full_size: int, op: str, compiling: bool | None = None) -> Tensor:
    """All ranks' shards of ``x`` assembled into the full tensor (no autograd). An even split's
    part held as a permutation of a contiguous tensor is gathered in its memory's order and
    returned as that permutation, as the serial program's tensor is (attention's output
    ``[b, heads, s, d]`` held as ``[b, s, heads, d]``, whose heads the program folds into the
    hidden by a view; made contiguous first, its send was one copy and that fold another).
    ``compiling``: as :func:`group_size`'s, asked once for the helpers below."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if x.requires_grad or compiling:   # (a gradient in an eager backward needs no detach: an ATen call)
        x = x.detach()
    # eagerly the group's size and the split's layout without a Python call (group_size's,
    # _split's: asked in every gather of every step)
    tp = group.size() if group is not None and not compiling else group_size(group, compiling)
    if tp == 1:
        return x.contiguous()
    found = None if compiling else _splits.get((id(shard), full_size, tp))
    split = found[1] if found is not None else _split(full_size, shard, tp, compiling)
    # The blocks travel in each rank's memory order, so every rank must hold its part alike: an
    # even split's parts are one shape, made by the same program, laid out the same. An uneven
    # one's differ (an empty or one-long part is contiguous, its strides ties), so they are made
    # contiguous. A compiled program's layouts are inductor's.
    order = dense_order(x) if split.even and x.numel() and not compiling and not x.is_contiguous() else None
    if order is not None:
        return _unpermute(_all_gather(x.permute(order), group, _held(shard, order), full_size, op, False), order)
    d, width = shard.dim, split.width
    if split.even:
        # An even contiguous split: one all_gather_into_tensor into a [tp, *local] buffer; the
        # full tensor is that buffer with the rank axis folded into dim d (none where d == 0,
        # else one copy out of a kept buffer), or, after a few leading rows, one gather a row
        # straight into the full tensor (_rows_collective).
        if math.prod(x.shape[:d]) == 1 if not compiling else _all_ones(x.shape[:d], True):
            # every dim before d of size one (dim 0 itself, or a batch of one under sequence
            # parallelism): the ranks' blocks in rank order are the full tensor already
            shape = list(x.shape)
            shape[d] = tp * width
            return _gather_into(x.contiguous(), group, op, tp=tp, compiling=compiling, shape=shape)
        shape = list(x.shape)
        shape[d] = full_size
        rows = math.prod(shape[:d]) if not compiling else 0
        if _row_by_row(x, rows, compiling):
            # each leading index's [width, *post] block is contiguous in x, and its [tp*width,
            # *post] row of the result holds the ranks' blocks in rank order: gathered row by row
            # straight into the result, no staging, no copy
            full = x.new_empty(shape)
            _rows_collective("all_gather", full.view(rows, -1), x.view(rows, -1), group, op)
            return full
        out = _gather_into(x.contiguous(), group, op, scratch=True, tp=tp, compiling=compiling)
        full = x.new_empty(shape)   # a fresh tensor: the buffer may be reused
        full.view(shape[:d] + [tp, width] + shape[d + 1:]).copy_(out.movedim(0, d))
        return full
    # Uneven or interleaved: each rank's part padded at the end of dim d to the widest (dims
    # kept in place, so the copies move whole rows), gathered into one buffer, and every run
    # copied once to where it belongs in the full tensor.
    send = x.contiguous()
    if x.shape[d] < width and compiling:
        # a pure pad, not a staging buffer: AOTAutograd merges two gathers of one tensor into one
        # (CSE) where their inputs are the same nodes, as they are on a rank whose part needs no
        # padding, but never two buffers made by empty(). A rank that padded through a buffer
        # gathered twice where the others gathered once: under inductor each rank's graph then
        # ran other collectives than its peers' (a hang, the all-to-all dispatch at tp 2, seq 7)
        send = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - d) + [0, width - x.shape[d]])
    elif x.shape[d] < width:
        padded = list(x.shape)
        padded[d] = width
        send = _scratch(padded, x, "send", compiling)
        send.narrow(d, 0, x.shape[d]).copy_(x)
        send.narrow(d, x.shape[d], width - x.shape[d]).zero_()
    out = _gather_into(send, group, op, scratch=True, tp=tp, compiling=compiling)
    shape = list(x.shape)
    shape[d] = full_size
    full = x.new_empty(shape)
    for r in range(tp):
        offset = 0
        for a, b in split.ranges[r]:
            full.narrow(d, a, b - a).copy_(out[r].narrow(d, offset, b - a))
            offset += b - a
    return full


def _all_ones(sizes: Sequence[int], compiling: bool) -> bool:
    """Whether every size is 1 (none: true). Eagerly their product (C; a generator's every step is
    a Python call, in every gather of every step); under torch.compile size by size, as dynamo
    guards them."""
    return all(size == 1 for size in sizes) if compiling else math.prod(sizes) == 1


def _gather_into(send: Tensor, group, op: str, scratch: bool = False, tp: int | None = None,
                 compiling: bool | None = None, shape: Sequence[int] | None = None) -> Tensor:
    """Every rank's contiguous ``send`` in one buffer, viewed ``[tp, *send.shape]`` (backends take
    the output as the inputs concatenated along dim 0). ``scratch``: the caller copies what it
    needs out of the buffer before the next collective, so a reused one may serve (``_scratch``).
    Eager code calls c10d's collective into that buffer; a compiled program the functional one,
    which dynamo traces into its graph. (Eagerly the functional collective costs its Python
    dispatch, the wrapper tensor it returns and the autograd registration it goes through, about
    80 Python calls each time; and torch 2.11's kills the process where gloo gathers GPU tensors.)
    ``tp`` and ``compiling``: the group's size and whether a compile trace runs, where the caller
    knows them (None: asked here). ``shape``: the view of the buffer returned instead (the caller's
    own, one view where two were made)."""
    tp = group_size(group) if tp is None else tp
    view = (tp,) + tuple(send.shape) if shape is None else shape
    if torch.compiler.is_compiling() if compiling is None else compiling:
        return funcol.wait_tensor(all_gather_single(send, 0, group)).view(view)
    flat = (tp * send.shape[0],) + tuple(send.shape[1:])
    out = _scratch(flat, send, "gather", False) if scratch else send.new_empty(flat)
    started, since = _started(group)
    try:   # a collective, waited for inside
        if type(send) is Tensor and not send.is_complex() and hasattr(group, "all_gather_single"):
            # the group's own collective, as dist.all_gather_single calls it (see _c10d_all_reduce)
            opts = _c10d.AllgatherOptions()
            opts.asyncOp = False
            work = group.all_gather_single(out, send, opts)
            if work is not None:   # a blocking collective may return no work (NCCL, torch 2.11)
                work.wait()
        else:
            _c10d_all_gather_single(out, send, group=group)
    except AutotpError:
        raise
    except Exception as exc:   # as _CommGuard's exit (see _all_reduce)
        raise _comm_failure(op, group, exc, started, since) from exc
    return out.view(view)


#: c10d's all-gather into one tensor (``all_gather_single`` from torch 2.13 on; the older name
#: warns there)
_c10d_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: the largest buffer ``_scratch`` keeps between calls, in bytes
SCRATCH_BYTES = 256 << 20
_scratches = threading.local()


def _reusable(t: Tensor, compiling: bool | None = None) -> bool:
    """Whether a gather of ``t`` may go through a kept buffer: eager code on the CPU. CPU
    allocators hand a large block back to the system when it is freed, so every fresh buffer
    the size of a gathered logits tensor costs the kernel's page faults and zeroing again (about
    as much as the copy that lays the gathered shards out); accelerator allocators keep their
    blocks, and a compiled program plans its own. ``compiling``: as :func:`_split`'s."""
    return t.device.type == "cpu" and not (torch.compiler.is_compiling() if compiling is None else compiling)


def _scratch(shape, like: Tensor, slot: str, compiling: bool | None = None) -> Tensor:
    """A buffer of ``shape`` and ``like``'s dtype and device for one collective's staging, kept
    for the next call on this thread (one per slot, dtype and device; grown, never shrunk) when
    it is at most ``SCRATCH_BYTES``. Its contents are garbage; callers copy out what they keep
    before the next call may reuse it, so nothing returned to a caller is ever a view of it."""
    numel = math.prod(shape)
    if not _reusable(like, compiling) or numel * like.element_size() > SCRATCH_BYTES:
        return like.new_empty(shape)
    kept = getattr(_scratches, "buffers", None)
    if kept is None:
        kept = _scratches.buffers = {}
    key = (slot, like.dtype, like.device)
    buf = kept.get(key)
    if buf is None or buf.numel() < numel:
        buf = kept[key] = like.new_empty(numel)
    return buf[:numel].view(shape)


def _gloo_on_device(t: Tensor, group) -> bool:
    """A gloo group gathering accelerator tensors (ranks sharing one GPU) in eager code: torch
    2.11's functional all-gather kills the process there (SIGSEGV, measured on an H200 with
    two ranks on GPU 0; ``benchmarks/gloo_cuda_probe.py``), while c10d's
    ``all_gather_into_tensor``, the functional all-reduce and ``reduce_scatter_tensor`` work."""
    return t.device.type != "cpu" and not torch.compiler.is_compiling() and dist.get_backend(group) == "gloo"


def _reduce_scatter(x: Tensor, group, shard: Shard, full_size: int, op: str,
                    compiling: bool | None = None) -> Tensor:
    """Sum ``x`` over the ranks and keep this rank's shard (no autograd). An even split's
    summand held as a permutation of a contiguous tensor (a gradient that a transpose's backward
    hands on, attention's ``[b, heads, s, d]`` held as ``[b, s, heads, d]``) is reduce-scattered
    in its memory's order and the shard returned held so, as :func:`_all_gather` does: made
    contiguous first, it was one copy serial does not make, and staging it for the collective
    another, where in memory's order the split dim comes first (after dims of size one) and
    needs no staging. ``compiling``: as :func:`_all_gather`'s."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if x.requires_grad or compiling:   # (see _all_gather)
        x = x.detach()
    if group is not None and not compiling:   # without group_size's and group_rank's calls (see _all_gather)
        tp, rank = group.size(), group.rank()
    else:
        tp, rank = group_size(group, compiling), group_rank(group, compiling)
    if tp == 1:
        return local_shard(x, shard, 1, 0)
    if x.device.type != "cpu" and dist.get_backend(group) == "gloo":
        # gloo reduce-scatters CPU tensors only; it all-reduces GPU tensors (ranks sharing a GPU).
        return local_shard(_all_reduce(x, group, op, compiling=compiling), shard, tp, rank)
    found = None if compiling else _splits.get((id(shard), full_size, tp))
    split = found[1] if found is not None else _split(full_size, shard, tp, compiling)
    # the blocks are summed element by element, so every rank must hold its summand alike: an
    # even split's are one shape made by one program (as _all_gather's parts)
    order = dense_order(x) if split.even and x.numel() and not compiling and not x.is_contiguous() else None
    if order is not None:
        return _unpermute(_reduce_scatter(x.permute(order), group, _held(shard, order), full_size, op, False),
                          order)
    d, width = shard.dim, split.width
    shape = list(x.shape)
    pre, post = shape[:d], shape[d + 1:]
    # One block per rank, in rank order, each this rank's shard padded at the end of dim d to
    # the widest: a reduce-scatter of equal blocks, even when the shard is uneven or
    # interleaved (the zero padding sums to zero and is cut). An even split of dim 0 is that
    # layout already; an even split of another dim is one copy, or after a few leading rows one
    # reduce-scatter a row (_rows_collective); else each run copied once.
    rows = math.prod(pre) if not compiling else 0
    if split.even and rows > 1 and _row_by_row(x, rows, compiling):
        # each leading index's [tp*width, *post] row of the summand holds the ranks' blocks in
        # rank order and its [width, *post] row of the result is this rank's: reduce-scattered
        # row by row straight from the summand into the result, no staging, no copy
        out = x.new_empty(pre + [width] + post)
        _rows_collective("reduce_scatter", out.view(rows, -1), x.view(rows, -1), group, op)
        return out
    if split.even and (rows == 1 if not compiling else _all_ones(pre, True)):
        # dim 0, or only dims of size one before d: in rank order already, [tp, *local] with its
        # first two dims flattened as backends take the ranks' blocks (one view, not two)
        blocks = [tp] + pre + [width] + post
        send = x.contiguous().view([tp * blocks[1]] + blocks[2:])
    else:
        send = _scratch([tp] + pre + [width] + post, x, "reduce_scatter", compiling)
        if split.even:
            send.copy_(x.view(pre + [tp, width] + post).movedim(d, 0))
        else:
            for r in range(tp):
                offset = 0
                for a, b in split.ranges[r]:
                    send[r].narrow(d, offset, b - a).copy_(x.narrow(d, a, b - a))
                    offset += b - a
                if offset < width:
                    send[r].narrow(d, offset, width - offset).zero_()
        send = send.flatten(0, 1)   # [tp, *local] -> the ranks' blocks along dim 0, as backends take them
    if compiling:   # the functional collective, traced (see _gather_into)
        out = funcol.wait_tensor(funcol.reduce_scatter_tensor(send, "sum", 0, group))
    else:
        out = x.new_empty(pre + [width] + post)
        started, since = _started(group)
        try:   # a collective, waited for inside
            if type(send) is Tensor and not send.is_complex() and hasattr(group, "reduce_scatter_single"):
                # a sum, as dist.reduce_scatter_single calls it (see _c10d_all_reduce)
                opts = _c10d.ReduceScatterOptions()
                opts.asyncOp = False
                work = group.reduce_scatter_single(out, send, opts)
                if work is not None:   # a blocking collective may return no work (NCCL, torch 2.11)
                    work.wait()
            else:
                _c10d_reduce_scatter_tensor(out, send, group=group)
        except AutotpError:
            raise
        except Exception as exc:   # as _CommGuard's exit (see _all_reduce)
            raise _comm_failure(op, group, exc, started, since) from exc
    n = split.sizes[rank]
    return out if n == width else out.narrow(d, 0, n).contiguous()


#: The most leading rows (the product of the dims before the split one: the batch of ``[b, s, h]``
#: split along s) an even split's gather or reduce-scatter moves row by row, one collective per
#: row issued as one coalesced call, straight between the tensor and the result. More rows are
#: staged by one copy of the whole tensor (the split of a hidden after ``b*s`` rows). NCCL runs a
#: coalesced call's collectives as one kernel (grouped operations aggregated), so the rows add no
#: launch on the device; they add one enqueue each on the host (a few microseconds), which a
#: bound keeps from growing with the tokens. 8 covers the micro-batches tensor parallelism runs
#: (GPT-2 xl's 8 x 1024 on the H200, Llama-3-8B's 2 x 4096). The cost model prices the same
#: choice (:func:`autotp.passes.propagate.layout_copy_seconds`).
ROWS_COALESCED = 8

#: backends whose coalesced collectives (``allgather_into_tensor_coalesced``,
#: ``reduce_scatter_tensor_coalesced``) take the rows as one call, per tensor device type: NCCL's
#: one group of kernels; gloo's CPU ones (torch 2.3 on); torch's ``fake`` (the rank benchmarks).
#: Others, gloo on an accelerator among them, take the rows one collective after another.
_COALESCING = {("nccl", "cuda"), ("gloo", "cpu"), ("fake", "cpu"), ("fake", "cuda")}
#: (id(group), device type) -> (the group, whether its backend coalesces), asked once per group
#: and device; the group kept so that its id is never another's (a world destroyed and made
#: again on another backend has the same name), the table cleared past a few dozen groups
_coalesces: dict[tuple[int, str], tuple[object, bool]] = {}


def _row_by_row(x: Tensor, rows: int, compiling: bool) -> bool:
    """Whether an even split's collective over ``x`` (``rows`` leading rows) goes row by row
    (:data:`ROWS_COALESCED`): eager code, a plain contiguous tensor of a few rows. A compiled
    program keeps its one functional collective (inductor lays the buffer out itself)."""
    return (not compiling and 1 < rows <= ROWS_COALESCED and x.is_contiguous() and type(x) is Tensor
            and not x.is_complex() and x.numel() > 0)


def _backend_coalesces(group, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` has coalesced collectives (:data:`_COALESCING`)."""
    key = (id(group), device.type)
    found = _coalesces.get(key)
    if found is None or found[0] is not group:
        name = str(dist.get_backend(group))
        if ":" in name:   # several backends, one per device ("cpu:gloo,cuda:nccl")
            name = dict(pair.split(":") for pair in name.split(",")).get(device.type, "")
        if len(_coalesces) >= 64:
            _coalesces.clear()
        found = _coalesces[key] = (group, (name, device.type) in _COALESCING)
    return found[1]


def _rows_collective(kind: str, out: Tensor, send: Tensor, group, op: str) -> None:
    """One ``kind`` collective (``all_gather`` or ``reduce_scatter``, a sum) per row of ``send``
    into the same row of ``out`` (2-D, contiguous rows), waited for: one coalesced call where the
    backend has one (:func:`_backend_coalesces`; ``all_gather_single_coalesced`` and
    ``reduce_scatter_single_coalesced`` from torch 2.13 on, the older names before), else one
    collective after another. A failure is named as every collective's (see :func:`_all_reduce`)."""
    outs, sends = list(out.unbind(0)), list(send.unbind(0))
    gather = kind == "all_gather"
    started, since = _started(group)
    try:
        opts = _c10d.AllgatherOptions() if gather else _c10d.ReduceScatterOptions()   # (a sum)
        opts.asyncOp = False
        if _backend_coalesces(group, send.device):
            call = (getattr(group, "all_gather_single_coalesced", None) or group.allgather_into_tensor_coalesced) \
                if gather else \
                (getattr(group, "reduce_scatter_single_coalesced", None) or group.reduce_scatter_tensor_coalesced)
            works = [call(outs, sends, opts)]
        elif gather:
            works = [group.all_gather_single(o, i, opts) if hasattr(group, "all_gather_single")
                     else _c10d_all_gather_single(o, i, group=group) for o, i in zip(outs, sends)]
        else:
            works = [group.reduce_scatter_single(o, i, opts) if hasattr(group, "reduce_scatter_single")
                     else _c10d_reduce_scatter_tensor(o, i, group=group) for o, i in zip(outs, sends)]
        for work in works:
            if work is not None:   # a blocking collective may return no work (NCCL, torch 2.11)
                work.wait()
    except AutotpError:
        raise
    except Exception as exc:   # as _CommGuard's exit (see _all_reduce)
        raise _comm_failure(op, group, exc, started, since) from exc


#: c10d's reduce-scatter of one tensor (``reduce_scatter_single`` from torch 2.13 on, where the
#: older name warns)
_c10d_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_to_all(x: Tensor, group, have: Shard, want: Shard, full_size: int, op: str) -> Tensor:
    """This rank's part of a tensor split as ``have`` (``full_size``: the whole size of
    ``have.dim``) -> its part of the tensor split as ``want``, by one all-to-all (no autograd).
    Rank r sends rank q the elements of its part that q holds under ``want``: along another dim,
    1/tp of its part, where an all-gather makes the whole tensor; along the same dim dealt
    another way, the runs that change rank alone (and its own, kept).

    Between splits of two dims that each give every rank one run, in rank order (even or not,
    :attr:`_Split.ordered`), each side reads and writes its part at most once. Send: rank q's
    block is the q-th run of ``x`` along ``want``'s dim; where only dims of size one come before
    it those runs lie one after another in ``x``, sent as it is (a row-split table's gradient
    ``[V, h/tp]`` back to the rows' ranks), else they are laid out rank-major by one strided copy
    per width (:func:`_packed`; one where the split is even: the table's rows packed into ``tp``
    column blocks, two where tp does not divide the hidden). Receive: rank r's block is r's run
    along ``have``'s dim; where only dims of size one come before it the blocks in rank order are
    the part (the table's columns ``[V, h/tp]``, even where the vocabulary does not divide by
    ``tp``), else they are joined along it by one copy (:func:`_folded`; the gradient's blocks
    into the rank's rows). Other splits are cut run by run, each run copied once into the send
    buffer (:func:`_cut_runs`, the runs worked out once: :class:`_Runs`), sent at their own size
    (no padding) and copied once into place. Between even splits, a part held as a permutation
    of a contiguous tensor is sent in its memory's order and the part received held so
    (:func:`_reduce_scatter`): no copy where, in memory's order, the dim it is cut along (or the
    one it is laid out along) comes first after dims of size one."""
    compiling = torch.compiler.is_compiling()
    tp, rank, x = group_size(group, compiling), group_rank(group, compiling), x.detach()
    a, b = have.dim, want.dim
    if a != b:
        cut, held = _split(x.shape[b], want, tp, compiling), _split(full_size, have, tp, compiling)
        even = cut.even and held.even
        if even:
            order = dense_order(x) if x.numel() and not compiling else None
            if order is not None:
                got = _all_to_all(x.permute(order), group, _held(have, order), _held(want, order), full_size, op)
                return _unpermute(got, order)
        shape = list(x.shape)
        lead_b, lead_a = _all_ones(shape[:b], compiling), _all_ones(shape[:a], compiling)
        if cut.ordered and held.ordered:
            rest = math.prod(shape[:b] + shape[b + 1:])   # elements per index of b
            if lead_b:
                send, send_sizes = x.reshape(-1), [n * rest for n in cut.sizes]   # a view where x is contiguous
            elif cut.even:
                send = x.unflatten(b, (tp, cut.width)).movedim(b, 0).contiguous().view(-1)   # one copy
                send_sizes = [cut.width * rest] * tp
            else:
                send, send_sizes = _packed(x, b, cut), [n * rest for n in cut.sizes]   # one copy a width
            out = list(shape)
            out[b] = cut.sizes[rank]
            each = math.prod(out[:a] + out[a + 1:])   # elements received per index of a
            recv_sizes = [n * each for n in held.sizes]
            got = _exchange(send, None if even else recv_sizes, None if even else send_sizes, group, op)
            if lead_a:
                out[a] = full_size
                return got.view(out)   # the ranks' runs along a in rank order: the whole dim
            if held.even:
                out[a] = held.width
                got = got.view([tp] + out)   # got[r]: r's run of a
                return got.movedim(0, a).flatten(a, a + 1).contiguous()   # one copy
            return _folded(got, out, a, held.sizes, recv_sizes)   # one copy
    other = x.shape[b] if a != b else full_size   # the whole size of want's dim
    if compiling:
        sends = [_runs_for(x, have, want, full_size, other, tp, rank, q) for q in range(tp)]
        shapes = [_block_shape(x, have, want, full_size, other, tp, r, rank) for r in range(tp)]
        send, send_sizes = torch.cat([t.reshape(-1) for t in sends]), [t.numel() for t in sends]
        arrivals = [_overlaps(have, want, full_size, other, tp, r, rank) for r in range(tp)]
    else:
        runs = _runs(have, want, full_size, other, tp, rank)
        send, send_sizes = _cut_runs(x, b if a != b else a, runs.sends)
        shapes = []
        for n in runs.widths:
            shapes.append(list(x.shape))
            shapes[-1][a], shapes[-1][b] = n, (runs.width if a != b else n)
        arrivals = runs.arrivals
    recv_sizes = [math.prod(sh) for sh in shapes]
    got = _exchange(send, recv_sizes, send_sizes, group, op)
    shape = list(x.shape)
    shape[a] = full_size if a != b else shape[a]
    shape[b] = local_size(other, want, tp, rank)
    out = x.new_empty(shape)
    for block, r in zip(got.split(recv_sizes), range(tp)):
        block = block.view(shapes[r])
        for src, dst, n in arrivals[r]:
            out.narrow(a, dst, n).copy_(block.narrow(a, src, n))
    return out


class _Runs:
    """Where one rank's part moves in an all-to-all that goes run by run (:func:`_all_to_all`):
    ``sends[q]``, the runs ``(start, length)`` of its part, along the dim it is cut, that rank q
    gets, in q's order; ``arrivals[r]``, the runs ``(offset in r's block, offset in the part,
    length)`` along ``have``'s dim that come from rank r; ``widths[r]``, the length of r's block
    along that dim; ``width``, the part's size along ``want``'s dim. Worked out once per
    (shards, sizes, tp, rank) in eager code (:func:`_runs`), not at every step."""

    __slots__ = ("sends", "arrivals", "widths", "width")

    def __init__(self, have: Shard, want: Shard, full_size: int, other: int, tp: int, rank: int) -> None:
        if have.dim != want.dim:   # q's runs of want's dim, which the part holds whole
            self.sends = tuple(tuple((s, e - s) for s, e in local_ranges(other, want, tp, q)) for q in range(tp))
        else:   # the runs of the part q holds, in q's order
            self.sends = tuple(tuple((src, n) for src, _, n in sorted(
                _shared_runs(have, want, full_size, other, tp, rank, q), key=lambda run: run[1])) for q in range(tp))
        self.arrivals = tuple(tuple(_overlaps(have, want, full_size, other, tp, r, rank)) for r in range(tp))
        self.widths = tuple(sum(n for _, _, n in runs) for runs in self.arrivals)
        self.width = local_size(other, want, tp, rank)


#: (id(have), id(want), sizes, tp, rank) -> (have, want, their _Runs), as _splits keeps _Split
_runs_kept: dict[tuple, tuple[Shard, Shard, _Runs]] = {}


def _runs(have: Shard, want: Shard, full_size: int, other: int, tp: int, rank: int) -> _Runs:
    """:class:`_Runs` of a rank's part, kept from call to call (eager code only)."""
    key = (id(have), id(want), full_size, other, tp, rank)
    found = _runs_kept.get(key)
    if found is None:
        if len(_runs_kept) >= _SPLITS_KEPT:
            _runs_kept.clear()
        found = _runs_kept[key] = (have, want, _Runs(have, want, full_size, other, tp, rank))
    return found[2]


def _cut_runs(x: Tensor, d: int, sends: Sequence[Sequence[tuple[int, int]]]) -> tuple[Tensor, list[int]]:
    """The send buffer of a run-by-run all-to-all: ``x``'s runs along ``d`` that each rank gets
    (``sends[q]``), each rank's block laid out whole, one after another, by one copy of each run
    into its place (every element read and written once), and the blocks' sizes."""
    shape = list(x.shape)
    rest = x.numel() // shape[d] if shape[d] else math.prod(shape[:d] + shape[d + 1:])
    sizes = [sum(n for _, n in runs) * rest for runs in sends]
    send, offset = x.new_empty(sum(sizes)), 0
    for runs, size in zip(sends, sizes):
        shape[d] = sum(n for _, n in runs)
        block, at = send[offset:offset + size].view(shape), 0
        for start, n in runs:
            block.narrow(d, at, n).copy_(x.narrow(d, start, n))
            at += n
        offset += size
    return send, sizes


def _packed(x: Tensor, b: int, cut: _Split) -> Tensor:
    """``x``'s runs along dim ``b`` under an ordered uneven split (``cut``), each laid out whole
    and contiguous, one after another in rank order: the blocks an all-to-all sends. One strided
    copy per width (:attr:`_Split.blocks`: two, where an even split's is one) into one buffer,
    each element read and written once."""
    shape = list(x.shape)
    rest = x.numel() // shape[b] if shape[b] else 0   # elements per index of b
    send, offset = x.new_empty(x.numel()), 0
    for first, ranks, width in cut.blocks:
        shape[b] = width
        n = ranks * width * rest
        send[offset:offset + n].view([ranks] + shape).copy_(
            x.narrow(b, first, ranks * width).unflatten(b, (ranks, width)).movedim(b, 0))
        offset += n
    return send


def _folded(got: Tensor, shape: list, a: int, sizes: Sequence[int], recv_sizes: Sequence[int]) -> Tensor:
    """The blocks received from the ranks in rank order (``got``, flat), rank r's run of dim ``a``
    of ``sizes[r]`` and the rest of ``shape``, joined along ``a`` into the part by one ``cat``
    (one kernel, each element read and written once)."""
    blocks = got.split(list(recv_sizes))
    parts = []
    for block, n in zip(blocks, sizes):
        shape[a] = n
        parts.append(block.view(shape))
    return torch.cat(parts, a)


def _exchange(send: Tensor, recv_sizes, send_sizes, group, op: str) -> Tensor:
    """One all-to-all of ``send`` along dim 0 (equal blocks where the sizes are None), into a
    fresh tensor. Eager code calls the group's own c10d collective, waited for at once (see
    :func:`_c10d_all_to_all`); a compiled program the functional one, which dynamo traces."""
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_to_all_single(send, recv_sizes, send_sizes, group))
    if send_sizes is not None and not send.numel() and sum(recv_sizes) and dist.get_backend(group) == "fake":
        return _exchange_from_nothing(send, recv_sizes, send_sizes, group, op)
    return _c10d_all_to_all(send, recv_sizes, send_sizes, group, op)


def _c10d_all_to_all(send: Tensor, recv_sizes, send_sizes, group, op: str) -> Tensor:
    """``dist.all_to_all_single`` into a fresh tensor, waited for, without its Python or the
    functional collective's (its pytree, dispatch, wrapper tensor and autograd registration:
    about 110 Python calls an exchange): the group's own ``all_to_all_single`` with dist's
    options (see :func:`_c10d_all_reduce`). ``send`` is contiguous (every caller lays it out so);
    the exchange runs inside an autograd Function's forward or backward, which records no graph.
    Equal blocks are passed by their sizes, as the functional collective passes them: torch's
    fake backend fills a rank's receipt block by block from its own send only so (given none,
    it copies the whole send), and a compiled program's exchange must fill it alike."""
    shape = list(send.shape)
    if recv_sizes is None:
        tp = group.size()
        recv_sizes = send_sizes = [shape[0] // tp] * tp
    else:
        shape[0] = sum(recv_sizes)
    got = send.new_empty(shape)
    with _CommGuard(op, group):   # waited for inside: a failure surfaces here, named
        if type(send) is Tensor and not send.is_complex() and hasattr(group, "all_to_all_single"):
            opts = _c10d.AllToAllOptions()
            opts.asyncOp = False
            work = group.all_to_all_single(got, send, list(recv_sizes), list(send_sizes), opts)
            if work is not None:   # a blocking collective may return no work (NCCL, torch 2.11)
                work.wait()
        else:
            dist.all_to_all_single(got, send, list(recv_sizes), list(send_sizes), group=group)
    return got


def _exchange_from_nothing(send: Tensor, recv_sizes, send_sizes, group, op: str) -> Tensor:
    """:func:`_exchange` on torch's fake backend for a rank that sends nothing and receives
    something (it holds no row of an uneven split: a sequence of 7 at tp 8 leaves rank 7 none).
    That backend stands in for the other ranks by filling what a rank receives from what it
    sends, and refuses an empty send; gloo and NCCL take it. The rank sends one element to itself
    there, cut from what it receives: the same one collective, the others' blocks as they were."""
    rank = group_rank(group)
    send_sizes, recv_sizes = list(send_sizes), list(recv_sizes)
    send_sizes[rank] += 1
    recv_sizes[rank] += 1
    at = sum(recv_sizes[:rank]) + recv_sizes[rank] - 1   # the element's place in what comes back
    got = _c10d_all_to_all(send.new_zeros(1), recv_sizes, send_sizes, group, op)
    return torch.cat([got[:at], got[at + 1:]])


def _shared_runs(have: Shard, want: Shard, full_size: int, other: int, tp: int, r: int, q: int) -> list:
    """Along one dim dealt two ways: ``(offset in r's part under have, offset in q's part under
    want, length)`` of each run both hold, in q's ranges' order, then r's."""
    found, dst = [], 0
    for ws, we in local_ranges(other, want, tp, q):
        src = 0
        for hs, he in local_ranges(full_size, have, tp, r):
            lo, hi = max(ws, hs), min(we, he)
            if lo < hi:
                found.append((src + lo - hs, dst + lo - ws, hi - lo))
            src += he - hs
        dst += we - ws
    return found


def _overlaps(have: Shard, want: Shard, full_size: int, other: int, tp: int, r: int, q: int) -> list:
    """``(offset in the block r sends q, offset in q's part, length)`` along ``have.dim`` of each run
    q receives from r: along another dim, r's runs under ``have`` (the block holds them in r's
    order, q's part holds them where they lie in the whole); along the same dim, the runs of r's
    part under ``have`` that q holds under ``want``, in q's order (the block holds them so)."""
    if have.dim != want.dim:
        out, offset = [], 0
        for start, stop in local_ranges(full_size, have, tp, r):
            out.append((offset, start, stop - start))
            offset += stop - start
        return out
    out, offset = [], 0
    for src, dst, n in sorted(_shared_runs(have, want, full_size, other, tp, r, q), key=lambda run: run[1]):
        out.append((offset, dst, n))
        offset += n
    return out


def _runs_for(x: Tensor, have: Shard, want: Shard, full_size: int, other: int, tp: int, rank: int, q: int) -> Tensor:
    """The block this rank sends rank q (see :func:`_overlaps`), contiguous."""
    if have.dim != want.dim:
        return local_shard(x, want, tp, q)   # x is whole along want's dim
    runs = _shared_runs(have, want, full_size, other, tp, rank, q)
    found = [(dst, x.narrow(have.dim, src, n)) for src, dst, n in runs]
    if not found:
        return x.narrow(have.dim, 0, 0).contiguous()
    return torch.cat([t for _, t in sorted(found, key=lambda run: run[0])], dim=have.dim)


def _block_shape(x: Tensor, have: Shard, want: Shard, full_size: int, other: int, tp: int, r: int,
                 q: int) -> list:
    """The shape of the block rank r sends rank q."""
    shape = list(x.shape)
    shape[have.dim] = sum(n for _, _, n in _overlaps(have, want, full_size, other, tp, r, q))
    if have.dim != want.dim:
        shape[want.dim] = local_size(other, want, tp, q)
    return shape


# ---------------------------------------------------------------- the mappings

def _output(t: Tensor, compiling: bool) -> Tensor:
    """An autograd Function's forward output: under torch.compile a view of what it computed.
    torch 2.11's dynamo loses the gradient of some outputs returned as they are: a functional
    collective's result (g's input gradient came out zero in a compiled program at tp 2) and a
    rank's slice made by ``torch.cat`` of one narrowed run (scatter's); a view of either is traced
    right. Eager code returns it as it is: the view was one more ATen call and one more view's
    autograd bookkeeping per collective, for nothing there."""
    return t.view_as(t) if compiling else t


def traced_as_now(x: Tensor) -> Tensor:
    """``x`` as an autograd Function's input: under ``torch.compile``, a view of it, so that
    dynamo reads whether it requires grad from the tensor as it is now. Dynamo (torch 2.13) keeps
    the flag a tensor had when it was made: a buffer made without grad (``new_empty``) and then
    written through a slice with a tensor that requires grad (DeepSeek-V3's key, its ``k_nope``
    and ``k_rot`` copied into two slices) still reads as needing none, so the Function's forward
    is traced inline and its own backward dropped (scatter_to_tp's all-gather: only this rank's
    heads' gradient reached ``k_rot``). A fresh view's flag is read from the traced value, which
    is right. Eager code takes ``x`` as it is."""
    return x.view_as(x) if torch.compiler.is_compiling() else x


class _Mapping(torch.autograd.Function):
    """A mapping's autograd Function. Each takes, after its tensor, whether a compile trace runs
    (``compiling``, asked once by the caller, :func:`_apply`), and hands its backward none for it.
    ``_c_apply``: autograd's own C++ ``apply`` of the class, which :func:`_apply` calls in eager
    code."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._c_apply = super(torch.autograd.Function, cls).apply


def _apply(fn: type, compiling: bool, x: Tensor, *args: Any) -> Tensor:
    """``fn.apply(x, *args, compiling)``. Under torch.compile, or a functorch transform, through
    ``Function.apply`` (which dynamo traces; x a fresh view, :func:`traced_as_now`). Eagerly through
    autograd's C++ ``apply`` itself, the one ``Function.apply`` ends in: its Python before that
    (whether ``setup_context`` is defined, functorch's dead wrappers unwrapped argument by
    argument) was seven Python calls per collective in every step, to the same result: this
    Function defines no ``setup_context``, and ``x``, if a dead functorch wrapper, is unwrapped
    here as there."""
    if compiling:
        return fn.apply(x.view_as(x), *args, True)
    if _functorch_active():
        return fn.apply(x, *args, False)
    return fn._c_apply(_unwrap_if_dead(x), *args, False)


_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


class _CopyToTP(_Mapping):
    """f: identity forward, all-reduce of the gradient backward (``in_place``: in the gradient's
    own storage, where no other backward formula holds it)."""

    @staticmethod
    def forward(ctx, x, group, in_place, compiling):
        ctx.group, ctx.in_place = group, in_place
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "all_reduce in f (backward)", ctx.in_place), None, None, None


class _ReduceFromTP(_Mapping):
    """g: all-reduce forward (``in_place``: in the partial's own storage, where nothing else
    reads it), identity backward."""

    @staticmethod
    def forward(ctx, x, group, in_place, compiling):
        out = _all_reduce(x, group, "all_reduce in g (forward)", in_place, compiling)
        return out.view_as(out) if compiling else out   # (_output, inline: a call less per eager g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherFromTP(_Mapping):
    """Shard -> Replicate: all-gather forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard = group, shard
        out = _all_gather(x, group, shard, full_size, "all_gather in gather_from_tp (forward)", compiling)
        return out.view_as(out) if compiling else out   # (_output, inline)

    @staticmethod
    def backward(ctx, grad):
        # the rank's slice of the gradient as a view, strided where the split is not of the
        # outermost dims (the heads of attention's output): the formula it goes to reads it so
        g, s, compiling = ctx.group, ctx.shard, torch.compiler.is_compiling()
        if g is not None and not compiling:   # (group_size's and group_rank's answers, inline)
            return rank_slice(grad, s, g.size(), g.rank(), strided=True, compiling=False), None, None, None, None
        cut = rank_slice(grad, s, group_size(g, compiling), group_rank(g, compiling), strided=True, compiling=compiling)
        return cut, None, None, None, None


class _GatherIntoTP(_Mapping):
    """Shard -> Replicate into tensor-parallel compute (Megatron-SP's f̄: f fused with the
    all-gather): all-gather forward; the gradient there is a summand, so backward
    reduce-scatters it, each rank keeping its slice of the sum."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard, ctx.full_size = group, shard, full_size
        out = _all_gather(x, group, shard, full_size, "all_gather in gather_into_tp (forward)", compiling)
        return out.view_as(out) if compiling else out   # (_output, inline)

    @staticmethod
    def backward(ctx, grad):
        op = "reduce_scatter in gather_into_tp (backward)"
        return _reduce_scatter(grad, ctx.group, ctx.shard, ctx.full_size, op), None, None, None, None


class _ScatterToTP(_Mapping):
    """Replicate -> Shard: keep this rank's slice forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard, ctx.full_size = group, shard, full_size
        if group is not None and not compiling:   # (group_size's and group_rank's answers, inline)
            return rank_slice(x, shard, group.size(), group.rank(), compiling=False)
        cut = rank_slice(x, shard, group_size(group, compiling), group_rank(group, compiling), compiling=compiling)
        return _output(cut, compiling)

    @staticmethod
    def backward(ctx, grad):
        op = "all_gather in scatter_to_tp (backward)"
        return _all_gather(grad, ctx.group, ctx.shard, ctx.full_size, op), None, None, None, None


class _ReduceScatterToTP(_Mapping):
    """Partial -> Shard: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard, ctx.full_size = group, shard, full_size
        out = _reduce_scatter(x, group, shard, full_size, "reduce_scatter in reduce_scatter_to_tp (forward)", compiling)
        return out.view_as(out) if compiling else out   # (_output, inline)

    @staticmethod
    def backward(ctx, grad):
        op = "all_gather in reduce_scatter_to_tp (backward)"
        return _all_gather(grad, ctx.group, ctx.shard, ctx.full_size, op), None, None, None, None


class _ReshardTP(_Mapping):
    """Shard -> Shard (another dim, or the same dealt another way): all-to-all forward; the
    reverse all-to-all backward (the gradient of a part is that part's gradient, sent back to
    the rank it came from)."""

    @staticmethod
    def forward(ctx, x, group, have, want, full_size, compiling):
        # the whole size of want's dim, the backward's full_size: x holds it whole, or it is have's
        other = x.shape[want.dim] if want.dim != have.dim else full_size
        ctx.group, ctx.have, ctx.want, ctx.other = group, have, want, other
        return _output(_all_to_all(x, group, have, want, full_size, "all_to_all in reshard_tp (forward)"), compiling)

    @staticmethod
    def backward(ctx, grad):
        op = "all_to_all in reshard_tp (backward)"
        return _all_to_all(grad, ctx.group, ctx.want, ctx.have, ctx.other, op), None, None, None, None, None


def copy_to_tp(x: Tensor, group, in_place: bool = False) -> Tensor:
    """f: a Replicate activation enters sharded compute. ``in_place``: its gradient is a tensor
    no other backward formula holds (:mod:`autotp.passes.in_place`), summed in its storage."""
    return _apply(_CopyToTP, torch.compiler.is_compiling(), x, group, in_place)


def reduce_from_tp(x: Tensor, group, in_place: bool = False) -> Tensor:
    """g: a Partial activation becomes Replicate. ``in_place``: nothing else reads ``x`` and no
    backward formula saved it (:mod:`autotp.passes.in_place`); the sum is written over it."""
    return _apply(_ReduceFromTP, torch.compiler.is_compiling(), x, group, in_place)


# In a group of one, a shard is the whole tensor: the three layout changes below are plain
# tensor ops there, outside their autograd Functions. (torch 2.11's dynamo drops the gradient
# of an autograd Function whose forward or backward returns a detached alias of its input, as
# ``x.detach().contiguous()`` is: every gradient of a compiled tp=1 program came out zero.)

def gather_from_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Shard becomes Replicate; ``full_size`` is the gathered size of ``shard.dim``."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.contiguous()
    return _apply(_GatherFromTP, compiling, x, group, shard, full_size)


def gather_into_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Shard becomes Replicate where it feeds sharded compute: all-gather forward,
    reduce-scatter of the gradient backward (an all-gather and an f, in the bytes of one)."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.contiguous()
    return _apply(_GatherIntoTP, compiling, x, group, shard, full_size)


def scatter_to_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Replicate tensor becomes this rank's Shard (``full_size`` = ``x.shape[shard.dim]``)."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return _apply(_ScatterToTP, compiling, x, group, shard, full_size)


def reduce_scatter_to_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Partial tensor becomes this rank's Shard of the sum."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return _apply(_ReduceScatterToTP, compiling, x, group, shard, full_size)


def reshard_tp(x: Tensor, group, have: Shard, want: Shard, full_size: int) -> Tensor:
    """This rank's part of a tensor split as ``have`` becomes its part of the tensor split as
    ``want`` (another dim, or the same dealt another way) by one all-to-all; ``full_size`` is the
    whole size of ``have.dim``. Layouts one all-to-all does not move
    (:func:`~autotp.placements.resharded_by_all_to_all`: a tail or blocks every rank holds whole,
    per-block dealing) are a PlanError: the plan gathers and cuts those."""
    if not resharded_by_all_to_all(have, want):
        raise PlanError(f"reshard_tp cannot move {have!r} -> {want!r} by one all-to-all (it moves splits "
                        "whose every element one rank holds: no tail, whole block or per-block dealing); "
                        "plan it as an all-gather and a cut (autotp.passes.propagate.gather_parts lists "
                        "such a reshard so)")
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return _apply(_ReshardTP, compiling, x, group, have, want, full_size)


# ---------------------------------------------------------------- modules for fx graphs

class _CommModule(nn.Module):
    kind = ""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group  # a ProcessGroup is neither a parameter nor a buffer: plain attribute

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; a copied graph talks over the same group.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key == "group" else copy.deepcopy(value, memo)
        return new

    def eager_forward(self, *args: Any) -> Any:
        """``forward``, for eager code that runs outside any trace (a program's eager code,
        :mod:`autotp.runtime.module.eager_code`, calls it in place of the module call). The
        mappings' own (below) apply their autograd Function through autograd's C++ ``apply`` at
        once: no module call (``__getattr__``, ``_wrapped_call_impl``, ``_call_impl``), no
        compile check, no mapping function between (five to seven Python calls a collective).
        Module hooks do not run on this path; autotp registers none on these modules."""
        return self.forward(*args)

    def _group_repr(self) -> str:
        ranks = group_ranks(self.group)
        return "group=None" if self.group is None else f"ranks={list(ranks) if ranks else '?'}"

    def extra_repr(self) -> str:
        return self._group_repr()


class _ShardedCommModule(_CommModule):
    """``full_size=None``: the sharded dim is dynamic (the sequence, under sequence parallelism);
    the graph passes its size at call time, or the input, when whole, shows it."""

    #: the mapping's autograd Function (None: ``forward`` itself runs eagerly too)
    _function: type | None = None
    #: whether the input is whole along the sharded dim (it shows the size where none is given)
    _whole_input = False

    def __init__(self, group, shard: Shard, full_size: int | None) -> None:
        super().__init__(group)
        self.shard = shard
        self.full_size = None if full_size is None else int(full_size)

    def eager_forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        """``forward`` outside any trace (:meth:`_CommModule.eager_forward`)."""
        group, fn = self.group, self._function
        if fn is None or group is None or group.size() == 1:   # (a group of one: plain tensor ops, as forward's)
            return self.forward(x, full_size)
        size = int(full_size) if full_size is not None else self.full_size
        if size is None:   # (size's answer where the input is whole, inline; else its error)
            size = x.shape[self.shard.dim] if self._whole_input else self.size(x, None, False)
        if _functorch_active():
            return fn.apply(x, group, self.shard, size, False)
        return fn._c_apply(_unwrap_if_dead(x), group, self.shard, size, False)

    def size(self, x: Tensor, full_size: int | None, whole_input: bool) -> int:
        if full_size is not None:
            return int(full_size)
        if self.full_size is not None:
            return self.full_size
        if whole_input:
            return x.shape[self.shard.dim]
        raise CommError(
            f"{self.kind} of {self.shard!r}: the gathered size of a dynamic dim is unknown; the "
            "rewrite must pass it (a sym_size node) as the module's second argument"
        )

    def extra_repr(self) -> str:
        size = "dynamic" if self.full_size is None else self.full_size
        return f"{self._group_repr()}, shard={self.shard!r}, full_size={size}"


class _ReduceModule(_CommModule):
    """An f or a g; ``in_place`` (set by :mod:`autotp.passes.in_place`): its all-reduce writes the
    sum over the tensor it reduces, which nothing else reads."""

    _function: type

    def __init__(self, group, in_place: bool = False) -> None:
        super().__init__(group)
        self.in_place = in_place

    def eager_forward(self, x: Tensor) -> Tensor:
        """``forward`` outside any trace (:meth:`_CommModule.eager_forward`)."""
        if _functorch_active():
            return self._function.apply(x, self.group, self.in_place, False)
        return self._function._c_apply(_unwrap_if_dead(x), self.group, self.in_place, False)

    def extra_repr(self) -> str:
        return f"{self._group_repr()}, in_place" if self.in_place else self._group_repr()


class CopyToTP(_ReduceModule):
    """f: identity forward, all-reduce of the gradient backward."""

    kind = "f"
    _function = _CopyToTP

    def forward(self, x: Tensor) -> Tensor:
        return copy_to_tp(x, self.group, self.in_place)


class ReduceFromTP(_ReduceModule):
    """g: all-reduce forward, identity backward."""

    kind = "g"
    _function = _ReduceFromTP

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_tp(x, self.group, self.in_place)


class GatherFromTP(_ShardedCommModule):
    kind = "all_gather"
    _function = _GatherFromTP

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return gather_from_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=False))


class GatherIntoTP(_ShardedCommModule):
    """f̄: all-gather forward, reduce-scatter backward (a sequence shard entering a
    column-parallel product)."""

    kind = "all_gather_f"
    _function = _GatherIntoTP

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return gather_into_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=False))


class ScatterToTP(_ShardedCommModule):
    kind = "scatter"
    _function, _whole_input = _ScatterToTP, True

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return scatter_to_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=True))


class ReduceScatterToTP(_ShardedCommModule):
    kind = "reduce_scatter"
    _function, _whole_input = _ReduceScatterToTP, True

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return reduce_scatter_to_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=True))


class ReshardTP(_ShardedCommModule):
    """A split along one dim resharded along another by one all-to-all (``shard``: the split the
    input holds, ``want``: the one it leaves with; ``full_size``: the whole size of the input's
    split dim, None where it is dynamic and the graph passes it)."""

    kind = "all_to_all"

    def __init__(self, group, shard: Shard, want: Shard, full_size: int | None) -> None:
        super().__init__(group, shard, full_size)
        self.want = want

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return reshard_tp(x, self.group, self.shard, self.want, self.size(x, full_size, whole_input=False))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, want={self.want!r}"
