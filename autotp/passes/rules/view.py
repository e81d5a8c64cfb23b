"""View-like ops: a shard follows its data through reshapes, transposes, splits and slices.

The central piece is :func:`map_view_shard`: a reshape groups input and output dims into
blocks of equal element count; a shard on one input dim is a (chunks, unit) pattern over
its block's flat index, which lands on the one output dim of the block that can express it
(GPT-2's ``view(b, s, 32) -> (b, s, 4, 8)`` moves a head-unit shard onto the heads dim).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

from functools import lru_cache
from typing import Any

import sympy
import torch

from ...placements import (PARTIAL, REPLICATE, Replicate, Shard, block_bounds, block_local_sizes, divides, layout,
                           local_ranges)
from .registry import (
    LocalContext,
    OpInfo,
    Strategy,
    is_partial,
    is_replicate,
    is_shard,
    norm_dim,
    register,
    register_localizer,
)

aten = torch.ops.aten


def _divides(a: sympy.Expr, b: sympy.Expr) -> bool:
    q = sympy.cancel(b / a)
    _, den = sympy.fraction(q)
    return den == 1


@lru_cache(maxsize=8192)
def view_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Blocks of (input dims, output dims) with equal products; size-1 dims belong to none."""
    ins = [i for i, s in enumerate(src) if s != 1]
    outs = [j for j, s in enumerate(dst) if s != 1]
    groups, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        gi, go = [ins[i]], [outs[j]]
        pi, po = src[ins[i]], dst[outs[j]]
        i, j = i + 1, j + 1
        while sympy.expand(pi - po) != 0:
            if _divides(pi, po) and i < len(ins):
                pi = pi * src[ins[i]]
                gi.append(ins[i])
                i += 1
            elif _divides(po, pi) and j < len(outs):
                po = po * dst[outs[j]]
                go.append(outs[j])
                j += 1
            else:
                return None
        groups.append((gi, go))
    if i != len(ins) or j != len(outs):
        return None
    return groups


def _prod(sizes) -> sympy.Expr:
    out = sympy.Integer(1)
    for s in sizes:
        out = out * s
    return out


@lru_cache(maxsize=8192)
def map_view_shard(src: tuple, dst: tuple, shard: Shard) -> Shard | None:
    """Where a shard of ``src`` lands in ``dst`` after a reshape, or None if it cannot."""
    found = _map_view_shard(src, dst, shard)
    return found if found is not None else _in_common_tail(src, dst, shard)


def _in_common_tail(src: tuple, dst: tuple, shard: Shard) -> Shard | None:
    """A shard of a dim among the trailing dims that ``src`` and ``dst`` share size for size: the
    reshape regroups only the dims before them (Mamba2's chunked scan views the padded sequence
    ``[b, s, heads, d]`` as ``[b, s // chunk, chunk, heads, d]``, sizes export writes in a form the
    grouping of :func:`view_groups` cannot pair), so the shard keeps its place counted from the end."""
    from_end = len(src) - shard.dim
    if shard.per_block or from_end > min(len(src), len(dst)) or src[shard.dim] == 1:
        # a split dim of size 1 may be the one the view drops (squeeze): its place is not kept
        return None
    if any(src[-k] != dst[-k] for k in range(1, from_end + 1)):
        return None
    return shard.with_dim(len(dst) - from_end)


def _map_view_shard(src: tuple, dst: tuple, shard: Shard) -> Shard | None:
    groups = view_groups(src, dst)
    if groups is None:
        return None
    if shard.per_block:
        return _map_per_block(src, dst, shard, groups)
    for gi, go in groups:
        if shard.dim not in gi:
            continue
        k = gi.index(shard.dim)
        before, after = _prod(src[d] for d in gi[:k]), _prod(src[d] for d in gi[k + 1:])
        if not (before.is_Integer and after.is_Integer):
            return None
        flat_chunks, flat_unit = shard.chunks * int(before), shard.unit * int(after)
        if shard.sizes and int(before) != 1:
            return None   # blocks of unequal size repeated along a merged dim: no shard says that
        for n, j in enumerate(go):
            qb, qa = _prod(dst[d] for d in go[:n]), _prod(dst[d] for d in go[n + 1:])
            if not (qb.is_Integer and qa.is_Integer):
                continue
            qb, qa = int(qb), int(qa)
            if shard.sizes and qb != 1:
                continue  # ... nor cut across two dims
            if flat_chunks % qb == 0 and flat_unit % qa == 0:
                c, u = flat_chunks // qb, flat_unit // qa
                # A plain shard of a dynamic dim (the sequence) survives a view that keeps the dim.
                if (c, u) == (1, 1) and not dst[j].is_Integer and len(go) == 1 and len(gi) == 1:
                    return shard.with_blocks(j, c, u)
                parts = shard.parts if shard.sizes else c   # unequal blocks: c is their count
                if dst[j].is_Integer and int(dst[j]) % (parts * u) == 0:
                    return shard.with_blocks(j, c, u)
        return None
    return None


def _map_per_block(src: tuple, dst: tuple, shard: Shard, groups: list) -> Shard | None:
    """:func:`map_view_shard` for a per-block shard. Its blocks are whole groups of atoms held
    by sets of ranks, so a view may move them between the shard's own dim (blocks side by side)
    and a dim of their own (``outer``: Falcon's ``[..., groups * (heads + 2) * d]`` viewed as
    ``[..., groups, heads + 2, d]`` and the query heads flattened back), but never cut a block."""
    def find(d: int):
        return next(((gi, go) for gi, go in groups if d in gi), None)

    found = find(shard.dim)
    if found is None:
        return None
    gi, go = found
    k = gi.index(shard.dim)
    lead = gi[:k]
    if shard.outer >= 0 and shard.outer in gi:
        # the blocks' dim merges with the shard's: it must come right before, nothing ahead of it
        if lead != [shard.outer] or src[shard.outer] != shard.chunks:
            return None
        merged, new_outer = True, None
    else:
        if lead:
            return None
        merged, new_outer = shard.outer < 0, None
        if shard.outer >= 0:
            outer_group = find(shard.outer)
            if outer_group is None or len(outer_group[0]) != 1 or len(outer_group[1]) != 1:
                return None
            new_outer = outer_group[1][0]
    after = _prod(src[d] for d in gi[k + 1:])
    if not after.is_Integer:
        return None
    flat_unit = shard.unit * int(after)
    for n, j in enumerate(go):
        qb, qa = _prod(dst[d] for d in go[:n]), _prod(dst[d] for d in go[n + 1:])
        if not (qb.is_Integer and qa.is_Integer and dst[j].is_Integer) or flat_unit % int(qa):
            continue
        u = flat_unit // int(qa)
        if int(qb) == 1:
            if merged and int(dst[j]) % (shard.chunks * u) == 0:
                return replace(shard, dim=j, unit=u, outer=-1)        # blocks side by side on j
            if new_outer is not None and int(dst[j]) % u == 0:
                return replace(shard, dim=j, unit=u, outer=new_outer)
        elif merged and n == 1 and dst[go[0]] == shard.chunks and int(dst[j]) % u == 0:
            return replace(shard, dim=j, unit=u, outer=go[0])         # the blocks on a dim of their own
    return None


def plain_if_same(p: Any, size: Any, tp: int) -> Any:
    """A per-block shard without a tail whose ranks hold what a plain shard of the same atoms
    gives them (Falcon's query heads flattened back: 2 groups of 4 at tp=8 are heads 0..7 in
    order) as that plain shard, which every rule knows."""
    if not (is_shard(p) and p.per_block and p.outer < 0 and not p.tail and getattr(size, "is_Integer", False)):
        return p
    plain = Shard(p.dim, 1, p.unit)
    n = int(size)
    if n % p.unit == 0 and layout(n, plain, tp) == layout(n, p, tp):
        return plain
    return p


def _follow(info: OpInfo, placements: tuple, mapped) -> list[Strategy]:
    """R -> R, P -> P, and S -> mapped(S) where the shard survives the op."""
    p = placements[0]
    out = [Strategy((REPLICATE,), REPLICATE)]
    if is_partial(p):
        out.append(Strategy((PARTIAL,), PARTIAL))
    elif is_shard(p):
        target = mapped(p)
        if target is not None:
            out.append(Strategy((p,), target))
    return out


def _mapped_view(info: OpInfo):
    src, dst = info.inputs[0].shape, info.output.shape

    def mapped(s: Shard) -> Shard | None:
        out = map_view_shard(src, dst, s)
        return out if out is None else plain_if_same(out, dst[out.dim], info.tp)

    return mapped


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def view_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return _follow(info, placements, _mapped_view(info))


def _size_list_localizer(list_pos: int):
    def localize(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
        out = strategy.output
        if not is_shard(out):
            return info.target, args, kwargs
        sizes = list(args[list_pos])
        sizes[out.dim] = ctx.local(sizes[out.dim], info.output.shape[out.dim], out)
        if out.outer >= 0 and not (isinstance(sizes[out.outer], int) and sizes[out.outer] == -1):
            sizes[out.outer] = 1   # a per-block shard's blocks on a dim of their own: one per rank
        if isinstance(sizes[out.dim], int) and sizes[out.dim] == 0:
            # A rank holding none of the dim: a -1 elsewhere would be ambiguous; spell it out.
            sizes = [int(g) if isinstance(a, int) and a == -1 and g.is_Integer else a
                     for a, g in zip(sizes, info.output.shape)]
        elif not isinstance(sizes[out.dim], int):
            # A dynamic local size (a sequence shard) may be 0 on some ranks at some lengths.
            sizes = [ctx.size(g) if isinstance(a, int) and a == -1 else a
                     for a, g in zip(sizes, info.output.shape)]
        args = args[:list_pos] + (sizes,) + args[list_pos + 1:]
        return info.target, args, kwargs

    return localize


register_localizer(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)(
    _size_list_localizer(1)
)


@register(aten.alias.default, aten.contiguous.default, aten.clone.default, aten.detach.default,
          aten.lift_fresh_copy.default, aten.detach_.default)
def identity_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return _follow(info, placements, lambda s: s)


@register(aten.transpose.int)
def transpose_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    nd = info.inputs[0].ndim
    a, b = norm_dim(info.args[1], nd), norm_dim(info.args[2], nd)
    swap = {a: b, b: a}
    out = _follow(info, placements, lambda s: s.with_dim(swap.get(s.dim, s.dim)))
    if placements[0] is None and nd == 3 and 0 not in swap and info.inputs[0].static(0) not in (None, 1):
        # a free stack of matrices transposed per matrix (a mixture's experts read as
        # ``w.transpose(-2, -1)``) may be split by whole matrices: expert parallelism
        out.append(Strategy((Shard(0),), Shard(0)))
    if nd == 3 and set(swap) == {1, 2} and info.inputs[0].static(0) is not None and (
            placements[0] is None or (is_shard(placements[0]) and placements[0].dim in swap
                                      and (placements[0].chunks, placements[0].unit) == (1, 1))):
        # ... or inside every matrix (expert tensor parallelism): a fresh shard of either matrix
        # dim, in the blocks the product's output shows (gate|up: two), see rules/experts.py
        for d in (1, 2):
            fresh = info.fresh_shard(d)
            if fresh is not None and not fresh.holds_whole and not fresh.per_block and \
                    (placements[0] is None or placements[0].dim == swap[d]):
                strategy = Strategy((fresh.with_dim(swap[d]),), fresh)
                if strategy not in out:
                    out.append(strategy)
    return out


@register(aten.permute.default)
def permute_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    nd = info.inputs[0].ndim
    perm = [norm_dim(d, nd) for d in info.args[1]]
    return _follow(info, placements, lambda s: s.with_dim(perm.index(s.dim)))


@register(aten.unsqueeze.default)
def unsqueeze_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    d = norm_dim(info.args[1], info.output.ndim)
    return _follow(info, placements, lambda s: s.with_dim(s.dim + 1 if s.dim >= d else s.dim))


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    src, dst = info.inputs[0].shape, info.output.shape
    return _follow(info, placements, lambda s: map_view_shard(src, dst, s))


@register_localizer(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    # Squeeze the dims of global size 1 only: a rank holding one element of a split dim keeps it.
    if not is_shard(strategy.inputs[0]):
        return info.target, args, kwargs
    shape = info.inputs[0].shape
    asked = args[1] if len(args) > 1 else range(len(shape))
    asked = {norm_dim(d, len(shape)) for d in ([asked] if isinstance(asked, int) else asked)}
    return aten.squeeze.dims, (args[0], [d for d in sorted(asked) if shape[d] == 1]), {}


@register(aten.expand.default)
def expand_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    src, dst = info.inputs[0].shape, info.output.shape
    lead = len(dst) - len(src)

    def mapped(s: Shard):
        return s.with_dim(s.dim + lead) if src[s.dim] == dst[s.dim + lead] else None

    out = _follow(info, placements, mapped)
    if placements[0] is None or placements[0] == REPLICATE:
        # A whole tensor broadcast along a new or size-1 dim (one key/value head for every query
        # head: multi-query attention's repeat) may give each rank only its own copies: no data
        # moves forward, and the f's backward all-reduce sums the copies' gradients, a tensor of
        # the unexpanded size (a scatter of the copies would all-gather every copy's instead).
        # Offered where every dim between the first and the broadcast one has size 1: the copies
        # a rank keeps are then one contiguous run of heads once the dims merge, as a
        # column-parallel q's heads are. With several kv groups a rank's query heads need copies
        # of one group, a run no shard of the broadcast dim describes: a scatter covers that.
        for d in range(len(dst)):
            if (d < lead or src[d - lead] == 1) and dst[d] != 1 and all(x == 1 for x in dst[1:d]):
                fresh = info.fresh_shard(d)
                if fresh is not None:
                    out.append(Strategy((REPLICATE,), fresh))
    return out


@register(aten.slice.Tensor)
def slice_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    nd = info.inputs[0].ndim
    dim = norm_dim(info.args[1] if len(info.args) > 1 else 0, nd)
    src, dst = info.inputs[0].shape, info.output.shape
    # Slicing a sharded dim would need global indices; slicing others keeps the shard.
    out = _follow(info, placements, lambda s: s if s.dim != dim or src[dim] == dst[dim] else None)
    p = placements[0]
    if is_shard(p) and p.dim == dim and p.tail:
        bounds = _slice_bounds(info)
        part = tail_part(p, src[dim], bounds and range(bounds[0], bounds[1]))
        if part is not None:
            out.append(Strategy((p,), part))
    blocks = whole_blocks(p, src[dim], _slice_bounds(info)) if is_shard(p) and p.dim == dim else None
    if blocks is not None and blocks != (0, p.chunks):   # the whole dim: _follow keeps the shard
        out.append(Strategy((p,), fewer_blocks(p, *blocks)))
    return out


def whole_blocks(p: Shard, size: Any, bounds: tuple[int, int] | None) -> tuple[int, int] | None:
    """The blocks [first, last) a slice takes whole from a dim split in blocks (a fused q|k|v
    read back with slices, Phi-3's ``qkv[..., :q_size]``, dealt block by block: every rank holds
    the same heads of each block, or, of blocks of unequal size, its run of each), or None. The
    slice then holds the same runs of fewer blocks."""
    if p.chunks < 2 or p.tail or p.per_block or bounds is None or not size.is_Integer \
            or not divides(int(size), p):
        return None
    edges = [a for a, _ in block_bounds(int(size), p)] + [int(size)]
    a, b = bounds
    if a not in edges or b not in edges or b <= a:
        return None
    return edges.index(a), edges.index(b)


def fewer_blocks(p: Shard, first: int, last: int) -> Shard | Replicate:
    """``p`` of the blocks [first, last) alone, as a slice or split that takes them whole holds them.
    Blocks of unequal size are dealt in groups (``sizes[i]`` atoms of block ``i``): the blocks
    kept deal the same groups, so where their sizes share a factor (the query block alone: 4
    heads per group) that factor joins the atom (``S(2/512)``, 10 groups of 4 heads of 128).
    Blocks every rank holds whole stay so (Mamba2's ``x | B | C``); of whole blocks alone every
    rank holds all: Replicate (its B, its C)."""
    whole = tuple(i - first for i in p.whole if first <= i < last)
    if len(whole) == last - first:
        return REPLICATE
    sizes = p.sizes[first:last]
    g = math.gcd(*sizes) if sizes else 1
    return replace(p, chunks=last - first, unit=p.unit * g, sizes=tuple(x // g for x in sizes), whole=whole)


def block_span(p: Shard, size: int, first: int, last: int, ctx: LocalContext) -> tuple[int, int]:
    """[start, stop) of blocks [first, last) of a dim of ``size`` in this rank's local tensor,
    which holds its run of every block, one after another."""
    runs = block_local_sizes(size, p, ctx.tp, ctx.rank)
    return sum(runs[:first]), sum(runs[:last])


def slice_range(size: Any, args: tuple) -> tuple[int, int] | None:
    """[start, stop) of ``slice(x, dim, start, stop, step)`` (``args`` from ``dim`` on) over a dim
    of ``size``, normalized; None unless the size is static and the step 1."""
    args = tuple(args) + (None,) * (4 - len(args))
    start, stop, step = args[1], args[2], args[3]
    if step not in (None, 1) or not size.is_Integer or not isinstance(start or 0, int) \
            or not isinstance(stop, (int, type(None))):
        return None
    n = int(size)
    start = 0 if start is None else (start + n if start < 0 else start)
    stop = n if stop is None else (stop + n if stop < 0 else stop)
    return max(0, min(start, n)), max(0, min(stop, n))


def _slice_bounds(info: OpInfo) -> tuple[int, int] | None:
    return slice_range(info.inputs[0].shape[norm_dim(info.args[1] if len(info.args) > 1 else 0, info.inputs[0].ndim)],
                       info.args[1:])


def tail_part(p: Shard, size: Any, positions: Any) -> Any:
    """What a slice or pick of ``positions`` (elements of a one-block tailed dim) holds: the
    dealt atoms exactly -> the shard without its tail; elements of the tail only -> Replicate
    (every rank has them); anything else -> None (not offered)."""
    if positions is None or not positions or p.blocks_in_dim != 1 or not size.is_Integer:
        return None
    n = int(size)
    if n % p.unit or n // p.unit <= p.tail:
        return None
    dealt = (n // p.unit - p.tail) * p.unit
    lo, hi = min(positions), max(positions)
    once = isinstance(positions, range) or len(set(positions)) == len(positions)   # a slice's range: no list
    if lo == 0 and hi == dealt - 1 and len(positions) == dealt and once:
        return p.without_tail()   # every dealt element, each once
    if lo >= dealt:
        return tail_whole(p)
    return None


def tail_whole(p: Shard) -> Any:
    """What a rank holds of a piece inside the tail: all of it (Replicate), or, where the blocks
    sit on a dim of their own (``outer``), its set's block whole (a per-block shard of that dim,
    one-element blocks that are all tail)."""
    if p.outer < 0:
        return REPLICATE
    return Shard(p.outer, p.chunks, 1, p.rotate, tail=1, per_block=True)


def tail_position(p: Shard, size: int, position: int, ctx: LocalContext) -> int:
    """Where boundary ``position`` of a one-block tailed dim (0, the end of the dealt atoms, or
    inside the tail) sits in this rank's local tensor: the rank's run comes first, then the tail."""
    if position == 0:
        return 0
    dealt = (size // p.unit - p.tail) * p.unit
    run = ctx.local(dealt, sympy.Integer(dealt), p.without_tail())
    return run + position - dealt


@register_localizer(aten.slice.Tensor)
def slice_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    p = strategy.inputs[0]
    dim = norm_dim(info.args[1] if len(info.args) > 1 else 0, info.inputs[0].ndim)
    blocks = whole_blocks(p, info.inputs[0].shape[dim], _slice_bounds(info)) if is_shard(p) and p.dim == dim else None
    if blocks is not None and (is_shard(strategy.output) and strategy.output.dim == dim
                               or is_replicate(strategy.output) and p.whole):
        # whole blocks: this rank's run of each (or the whole of blocks held whole), one after another
        start, stop = block_span(p, int(info.inputs[0].shape[dim]), *blocks, ctx)
        return info.target, (args[0], dim, start, stop), {}
    if not (is_shard(p) and p.dim == dim and p.tail):
        return info.target, args, kwargs
    # The dealt part (the query heads) or a piece of the tail, at this rank's local offsets.
    size = int(info.inputs[0].shape[dim])
    start, stop = _slice_bounds(info)
    a, b = tail_position(p, size, start, ctx), tail_position(p, size, stop, ctx)
    return info.target, (args[0], dim, a, b), {}


@register(aten.select.int)
def select_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    nd = info.inputs[0].ndim
    dim = norm_dim(info.args[1], nd)
    return _follow(info, placements,
                   lambda s: None if s.dim == dim else s.with_dim(s.dim - 1 if s.dim > dim else s.dim))


def _split_pieces(info: OpInfo) -> tuple[int, list]:
    nd = info.inputs[0].ndim
    dim = norm_dim(info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", 0), nd)
    return dim, [o.shape[dim] for o in info.output]


@register(aten.split.Tensor, aten.split_with_sizes.default)
def split_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    p = placements[0]
    dim, pieces = _split_pieces(info)
    n = len(pieces)
    out = [Strategy((REPLICATE,), tuple(REPLICATE for _ in range(n)))]
    if is_partial(p):
        out.append(Strategy((PARTIAL,), tuple(PARTIAL for _ in range(n))))
    elif is_shard(p):
        if p.dim != dim:
            out.append(Strategy((p,), tuple(p for _ in range(n))))
        elif p.tail:
            # GPT-BigCode's [q | k | v] with one kv head: the dealt q heads, then k and v whole.
            starts = [sum(pieces[:i], sympy.Integer(0)) for i in range(n + 1)]
            parts = [tail_part(p, info.inputs[0].shape[dim], range(int(a), int(b))) if a.is_Integer and b.is_Integer
                     else None for a, b in zip(starts, starts[1:])]
            if all(q is not None for q in parts):
                out.append(Strategy((p,), tuple(parts)))
        elif len(set(pieces)) == 1 and p.chunks % n == 0 and not p.per_block and not p.sizes:
            # Equal pieces aligned with the shard's blocks: piece i is blocks [i*c/n, (i+1)*c/n).
            piece = p.with_blocks(dim, p.chunks // n, p.unit)
            out.append(Strategy((p,), tuple(piece for _ in range(n))))
        else:
            # Pieces of whole blocks, of unequal size (q | k | v of fewer kv heads) or of
            # different block counts (equal q | k | v split into q|k and v): each piece holds
            # this rank's run of its blocks
            spans = _whole_block_pieces(p, info.inputs[0].shape[dim], pieces)
            if spans is not None:
                out.append(Strategy((p,), tuple(fewer_blocks(p, *sp) for sp in spans)))
    return out


def _whole_block_pieces(p: Shard, size: Any, pieces: list) -> list[tuple[int, int]] | None:
    """The blocks [first, last) of each piece of a split where every piece is whole blocks of
    ``p`` (see :func:`whole_blocks`), or None."""
    starts = [sum(pieces[:i], sympy.Integer(0)) for i in range(len(pieces) + 1)]
    if not all(x.is_Integer for x in starts):
        return None
    spans = [whole_blocks(p, size, (int(a), int(b))) for a, b in zip(starts, starts[1:])]
    return spans if all(sp is not None for sp in spans) else None


@register_localizer(aten.split.Tensor, aten.split_with_sizes.default)
def split_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    # the first piece split on the dim (a piece of whole blocks alone is Replicate: Mamba2's B)
    piece = next((q for q in strategy.output if is_shard(q)), strategy.output[0])
    dim, pieces = _split_pieces(info)
    p = strategy.inputs[0]
    if is_shard(p) and p.dim == dim and p.tail:
        # The pieces that take the dealt atoms shrink to this rank's run; tail pieces stay whole.
        sizes = [ctx.local(int(s), s, q) if is_shard(q) else int(s) for s, q in zip(pieces, strategy.output)]
        return aten.split_with_sizes.default, (args[0], sizes) + tuple(args[2:]), kwargs
    if not is_shard(piece) or piece.dim != dim:
        return info.target, args, kwargs
    spans = _whole_block_pieces(p, info.inputs[0].shape[dim], pieces) if is_shard(p) and p.dim == dim else None
    if spans is not None and any(q != piece for q in strategy.output):
        # pieces of whole blocks that differ (unequal blocks, or different block counts): each
        # this rank's runs of its blocks
        size = int(info.inputs[0].shape[dim])
        sizes = [b - a for a, b in (block_span(p, size, first, last, ctx) for first, last in spans)]
        return aten.split_with_sizes.default, (args[0], sizes) + tuple(args[2:]), kwargs
    if info.target is aten.split.Tensor:
        size = ctx.local(args[1], pieces[0], piece)
        if size == 0:   # a rank holding none of the dim: split(x, 0) would give one piece, not n
            return aten.split_with_sizes.default, (args[0], [0] * len(pieces)) + tuple(args[2:]), kwargs
        return info.target, (args[0], size) + tuple(args[2:]), kwargs
    sizes = [ctx.local(a, s, piece) for a, s in zip(args[1], pieces)]
    return info.target, (args[0], sizes) + tuple(args[2:]), kwargs


# ---- joins and copies: rotary embeddings (rotate_half), GPT-J's interleaved rotation, repeat_kv

def _joined_shards(info: OpInfo, placements: tuple, dim_of) -> list[Strategy]:
    """cat/stack: every input takes the same shard of a dim other than the join dim, and the
    output holds it on ``dim_of(input dim)``; a Partial passes when every input is Partial (the
    join is linear). A shard of the join dim itself would need global offsets: not offered."""
    n = len(info.inputs)
    out = [Strategy(tuple(REPLICATE for _ in range(n)), REPLICATE)]
    if n and all(is_partial(p) for p in placements):
        out.append(Strategy(tuple(PARTIAL for _ in range(n)), PARTIAL))
    seen = set()
    for meta, p in zip(info.inputs, placements):
        if not is_shard(p) or p in seen or meta.ndim != info.inputs[0].ndim:
            continue
        seen.add(p)
        od = dim_of(p.dim)
        if od is None or info.output.shape[od] != meta.shape[p.dim]:
            continue
        out.append(Strategy(tuple(p for _ in range(n)), p.with_dim(od)))
    return out


def _join_dim(info: OpInfo, ndim: int) -> int:
    dim = info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0)
    return norm_dim(dim, ndim)


@register(aten.cat.default)
def cat_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """rotate_half's ``cat([-x2, x1], -1)`` on the head dim keeps a heads shard local."""
    metas = info.inputs
    # torch.cat skips legacy empty 1-D inputs (a KV cache's first update joins its empty start
    # with the keys): they stay whole, the others decide the output's placement
    empty = [m.ndim == 1 and m.shape[0] == 0 for m in metas]
    real = [m for m, e in zip(metas, empty) if not e]
    if not real or len({m.ndim for m in real}) != 1:
        return [Strategy(tuple(REPLICATE for _ in metas), REPLICATE)]
    dim = _join_dim(info, real[0].ndim)
    if not any(empty):
        out = _joined_shards(info, placements, lambda d: None if d == dim else d)
        blocks = _cat_blocks(info, placements, dim)
        return out + ([Strategy(tuple(placements), blocks)] if blocks is not None else [])
    sub = dataclasses.replace(info, inputs=tuple(real))
    joined = _joined_shards(sub, tuple(p for p, e in zip(placements, empty) if not e),
                            lambda d: None if d == dim else d)
    out = []
    for strat in joined:
        it = iter(strat.inputs)
        out.append(Strategy(tuple(REPLICATE if e else next(it) for e in empty), strat.output))
    return out


def _cat_blocks(info: OpInfo, placements: tuple, dim: int) -> Shard | None:
    """The join of tensors each split along the join dim by head (Gated DeltaNet's q | k | v,
    joined for its depthwise conv): each input one block of the output, dealt as it was, the
    blocks of unequal size where the inputs differ (``S(dim x 1:1:2 / unit)``: a rank's run of
    q, of k and of v, side by side). Offered where the inputs deal the same number of groups
    (each input's shard laid out as runs of ``size / groups`` elements), else None."""
    if len(placements) < 2 or not all(is_shard(p) and p.dim == dim and p.chunks == 1 and not p.holds_whole
                                      and not p.per_block and not p.rotate for p in placements):
        return None
    sizes = [m.static(dim) for m in info.inputs]
    if None in sizes or not all(divides(n, p) for n, p in zip(sizes, placements)):
        return None
    groups = math.gcd(*(n // p.unit for n, p in zip(sizes, placements)))
    widths = [n // groups for n in sizes]   # one group's elements of each input
    if not all(layout(n, p, info.tp) == layout(n, Shard(dim, unit=w), info.tp)
               for n, p, w in zip(sizes, placements, widths)):
        return None
    unit = math.gcd(*widths)
    out = Shard(dim, len(sizes), unit, sizes=tuple(w // unit for w in widths))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    for rank in range(info.tp):   # each rank holds its runs of the inputs, in order
        want = [(a + s0, b + s0) for n, p, s0 in zip(sizes, placements, starts)
                for a, b in local_ranges(n, p, info.tp, rank)]
        if list(local_ranges(total, out, info.tp, rank)) != want:
            return None
    return out


@register(aten.stack.default)
def stack_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    dim = _join_dim(info, info.output.ndim)
    return _joined_shards(info, placements, lambda d: d + 1 if d >= dim else d)


@register(aten.flatten.using_ints)
def flatten_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """A reshape whose arguments name dims, not sizes: no localizer needed (dims untouched by
    the shard keep their sizes; a merged shard is the view's ``(chunks, unit)`` mapping)."""
    return _follow(info, placements, _mapped_view(info))


@register(aten.numpy_T.default, aten.t.default)
def weight_transpose_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``x @ weight.T`` (Falcon's linear): the shard follows the transpose. A free weight (or
    one split on the matching dim) may also be cut afresh on either dim, in the form the
    product hints for its output features (fused q/k/v, whole heads): column- and
    row-parallel products then find their weight already laid out."""
    nd = info.inputs[0].ndim
    out = _follow(info, placements, lambda s: s.with_dim(nd - 1 - s.dim) if nd == 2 or
                  info.target is aten.numpy_T.default else s)
    p = placements[0]
    if nd != 2 or is_partial(p):
        return out
    for od in range(nd):
        fresh = info.fresh_shard(od)
        if fresh is not None and (p is None or (is_shard(p) and p.dim == nd - 1 - od)) and \
                not any(s.output == fresh for s in out):
            out.append(Strategy((fresh.with_dim(nd - 1 - od),), fresh))
    return out


@register(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Rotary embeddings as complex products (Llama-4): ``[..., n, 2]`` real pairs read as ``[..., n]``
    complex numbers and back. Every dim but the pairs keeps its index, so a shard of one (the heads)
    passes as it is; the pairs' dim is whole on every rank."""
    pairs = info.inputs[0].ndim - 1 if info.target is aten.view_as_complex.default else info.inputs[0].ndim
    return _follow(info, placements, lambda s: s if s.dim < pairs else None)


@register(aten.repeat.default)
def repeat_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Tiling copies whole dims: a shard survives on a dim repeated once."""
    reps = list(info.args[1])
    lead = len(reps) - info.inputs[0].ndim
    return _follow(info, placements, lambda s: s.with_dim(s.dim + lead) if reps[s.dim + lead] == 1 else None)


@register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """GPT-J's sin/cos widened element by element along the head dim: a shard of any other dim
    survives; without a dim the input is flattened, so only whole tensors. The repeated dim
    itself (grouped kv heads repeated for their query heads, ``k.repeat_interleave(n_rep, 1)``)
    keeps its shard with atoms ``repeats`` times wider: element i becomes elements
    [i * repeats, (i + 1) * repeats), so each rank's kv heads become the copies its query heads use."""
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim")
    if dim is None:
        return _follow(info, placements, lambda s: None)
    dim = norm_dim(dim, info.inputs[0].ndim)
    repeats = info.args[1] if len(info.args) > 1 else info.kwargs.get("repeats")
    if not isinstance(repeats, int) or repeats < 1:
        return _follow(info, placements, lambda s: None if s.dim == dim else s)
    out = _follow(info, placements, lambda s: replace(s, unit=s.unit * repeats) if s.dim == dim else s)
    size = info.output.static(dim)
    if info.inputs[0].static(dim) is not None and size is not None and size >= info.tp and (
            size % info.tp == 0 or info.uneven) and not is_shard(placements[0]) and not is_partial(placements[0]):
        # whole groups read by their heads (Mamba2's B and C of fewer groups than ranks, repeated
        # to the heads): each rank repeats the groups of its own heads alone; the input's
        # gradient, a sum over the rank's heads, is summed over the ranks by the f in front
        out.append(Strategy((REPLICATE,), Shard(dim)))
    return out


@register_localizer(aten.repeat_interleave.self_int)
def repeat_interleave_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """``output_size`` (export writes the repeated dim's size: Mamba2's B and C groups repeated for
    their heads) is this rank's size of that dim where it is split."""
    out = strategy.output
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim")
    if dim is None or not is_shard(out) or out.dim != norm_dim(dim, info.inputs[0].ndim):
        return info.target, args, kwargs
    if is_replicate(strategy.inputs[0]) and info.inputs[0].static(out.dim) != 1:
        # whole groups: each repeated for this rank's heads alone
        from ...distributed.functional import repeat_rows
        from ...placements import local_ranges

        ranges = local_ranges(int(info.output.shape[out.dim]), out, ctx.tp, ctx.rank)
        return repeat_rows, (args[0], args[1], out.dim, ranges), {}
    if is_replicate(strategy.inputs[0]):   # one group repeated for this rank's heads alone
        args = (args[0], ctx.local(args[1], info.output.shape[out.dim], out)) + tuple(args[2:])
    if "output_size" in kwargs and kwargs["output_size"] is not None:
        kwargs = dict(kwargs, output_size=ctx.local(kwargs["output_size"], info.output.shape[out.dim], out))
    elif len(args) > 3 and args[3] is not None:
        args = args[:3] + (ctx.local(args[3], info.output.shape[out.dim], out),) + args[4:]
    return info.target, args, kwargs


@register(aten.broadcast_to.default)
def broadcast_to_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return expand_rule(info, placements)


register_localizer(aten.broadcast_to.default)(_size_list_localizer(1))


def _chunk_pieces(info: OpInfo) -> tuple[int, int]:
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", 0)
    return norm_dim(dim, info.inputs[0].ndim), len(info.output)


@register(aten.chunk.default)
def chunk_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """GPT-NeoX's fused q|k|v per head, ``[b, heads, s, 3*d].chunk(3, -1)``: a heads shard
    passes to every piece. A shard of the chunked dim only where its blocks are the pieces (a
    fused gate|up in two blocks, ``chunk(2, -1)``): every rank holds the same run of each block,
    so its local ``chunk`` cuts them apart exactly; any other shard of that dim is not offered
    (the pieces' local sizes would not follow ``chunk``'s rounding)."""
    p = placements[0]
    dim, n = _chunk_pieces(info)
    out = [Strategy((REPLICATE,), tuple(REPLICATE for _ in range(n)))]
    if is_partial(p):
        out.append(Strategy((PARTIAL,), tuple(PARTIAL for _ in range(n))))
    elif is_shard(p) and p.dim != dim:
        out.append(Strategy((p,), tuple(p for _ in range(n))))
    elif is_shard(p) and p.chunks % n == 0 and not p.tail and not p.per_block and not p.sizes and \
            info.inputs[0].static(dim) is not None and info.inputs[0].static(dim) % n == 0 and \
            info.inputs[0].static(dim) // (p.chunks * p.unit) >= info.tp:   # every rank holds atoms
        piece = p.with_blocks(dim, p.chunks // n, p.unit)
        out.append(Strategy((p,), tuple(piece for _ in range(n))))
    return out


@register(aten.unbind.int)
def unbind_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """ModernBERT's fused q|k|v viewed as ``[b, s, 3, heads, d]`` and unbound along the 3: a shard
    of another dim (the heads) passes to every piece, one dim lower past the unbound one; a
    Partial passes (the pieces are linear in the input). A shard of the unbound dim would leave a
    piece on some ranks only: not offered."""
    p = placements[0]
    nd = info.inputs[0].ndim
    dim = norm_dim(info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0), nd)
    n = len(info.output)
    out = [Strategy((REPLICATE,), tuple(REPLICATE for _ in range(n)))]
    if is_partial(p):
        out.append(Strategy((PARTIAL,), tuple(PARTIAL for _ in range(n))))
    elif is_shard(p) and p.dim != dim and p.outer < 0:
        piece = p.with_dim(p.dim - 1 if p.dim > dim else p.dim)
        out.append(Strategy((p,), tuple(piece for _ in range(n))))
    return out
