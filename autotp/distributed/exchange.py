"""The all-to-all reshard, without autograd: this rank's part of a tensor split one way -> its
part of the tensor split another (another dim, or the same dealt another way), what
:func:`.collectives.reshard_tp` runs forward and, reversed, backward.

``_all_to_all(x, group, have, want, full_size, op)`` sends each rank only the elements it holds
under ``want``: along another dim 1/tp of the part, where an all-gather makes the whole tensor.
Splits that give every rank one run in rank order are laid out by at most one copy a side;
others go run by run (:class:`_Runs`, worked out once per layout), each block at its own size
(no padding). ``_exchange`` is the one ``all_to_all_single``: eagerly the group's own c10d
collective, waited for at once, a failure named (:func:`.comm._comm`); compiled, the functional
one, which dynamo traces. Layouts one all-to-all cannot move are refused before this
(:func:`~autotp.placements.resharded_by_all_to_all`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as _c10d
from torch import Tensor

from autotp.placements import Shard, local_ranges, local_size

from .comm import _CommGuard, group_rank, group_size
from .shards import _SPLITS_KEPT, _all_ones, _held, _Split, _split, _unpermute, dense_order, local_shard

__all__: list[str] = []


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
