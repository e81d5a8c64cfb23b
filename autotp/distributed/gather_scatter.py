"""The backends' all-gather and reduce-scatter of a sharded tensor, without autograd: what the
mappings of :mod:`.collectives` run forward and backward.

``_all_gather(x, group, shard, full_size, op)``: every rank's part -> the whole tensor;
``_reduce_scatter``: a summand on every rank -> this rank's part of the sum. Collectives need
equal sizes on every rank, so uneven shards are padded to ``max_local_size`` and cut back (a
reduce-scatter of uneven or interleaved shards is still one reduce-scatter, over padded blocks).
An even split after a few leading rows (:data:`ROWS_COALESCED`) goes row by row, one collective a
row in one coalesced call where the backend has one (:func:`_backend_coalesces`), straight
between the tensor and the result. Eager code calls the group's own c10d collective, waited for
at once, a failure named as :func:`.comm._comm` names it; a compiled program the functional one,
which dynamo traces. A result is never a view of the staging buffers kept between calls
(:func:`_scratch`), which the next call may overwrite.
"""
from __future__ import annotations

import math
import threading
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as _c10d
from torch import Tensor

from autotp.errors import AutotpError
from autotp.placements import Shard

from .comm import _all_reduce, _comm_failure, _started, group_rank, group_size
from .shards import _all_ones, _held, _split, _splits, _unpermute, dense_order, local_shard

#: the functional all-gather into one tensor: ``all_gather_single`` from torch 2.13 on, where
#: ``all_gather_tensor`` (the name before) warns that it is deprecated
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

__all__ = ["ROWS_COALESCED", "SCRATCH_BYTES", "all_gather_single"]


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
