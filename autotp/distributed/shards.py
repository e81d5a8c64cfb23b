"""Sharded layouts without communication: where each rank's part of a dim lies, and the cuts
and joins that need no collective.

Sharded layouts follow ``autotp.placements.Shard`` (chunks, unit, uneven runs). ``local_shard`` is
the part a rank holds (a fresh contiguous tensor), ``assemble`` its inverse (the ranks' parts ->
the whole), ``rank_slice`` a rank's part inside a step (a view where that part is contiguous
already). ``_split`` works out where the ranks' parts lie (:class:`_Split`) once per (shard, size,
tp) in eager code, which the collectives (:mod:`.gather_scatter`, :mod:`.exchange`) read at every
call; ``dense_order``, ``_held`` and ``_unpermute`` hold a tensor laid out as a permutation of a
contiguous one in its memory's order, and its shard with it.

Functions of tensors, placements and sizes: no process group, no autograd.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Sequence

import torch
from torch import Tensor

from autotp.placements import Shard, local_ranges, owned_ranges

__all__ = ["local_shard", "rank_slice", "assemble", "dense_order"]


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


def _all_ones(sizes: Sequence[int], compiling: bool) -> bool:
    """Whether every size is 1 (none: true). Eagerly their product (C; a generator's every step is
    a Python call, in every gather of every step); under torch.compile size by size, as dynamo
    guards them."""
    return all(size == 1 for size in sizes) if compiling else math.prod(sizes) == 1
