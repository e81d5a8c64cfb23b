"""Ops that take pieces of a dim: ``slice``, ``select``, ``split``, ``chunk``, ``unbind``.

A shard of another dim passes to every piece. A shard of the cut dim itself passes only where
the pieces are whole blocks of it (a fused q|k|v cut back into q, k and v: each piece this
rank's run of its blocks, :func:`whole_blocks`, :func:`fewer_blocks`), or, of a tailed shard,
where a piece is exactly the dealt atoms or lies in the tail (:func:`tail_part`: GPT-BigCode's
one kv head). The localizers turn the pieces' global bounds and sizes into this rank's
(:func:`block_span`, :func:`tail_position`); :mod:`.misc`'s index rule reads tails with the same
helpers.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import sympy
import torch

from ...placements import PARTIAL, REPLICATE, Replicate, Shard, block_bounds, block_local_sizes, divides
from .contract import LocalContext, OpInfo, Strategy
from .registry import (
    is_partial,
    is_replicate,
    is_shard,
    norm_dim,
    register,
    register_localizer,
)
from .view import follow

aten = torch.ops.aten


@register(aten.slice.Tensor)
def slice_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    nd = info.inputs[0].ndim
    dim = norm_dim(info.args[1] if len(info.args) > 1 else 0, nd)
    src, dst = info.inputs[0].shape, info.output.shape
    # Slicing a sharded dim would need global indices; slicing others keeps the shard.
    out = follow(info, placements, lambda s: s if s.dim != dim or src[dim] == dst[dim] else None)
    p = placements[0]
    if is_shard(p) and p.dim == dim and p.tail:
        bounds = _slice_bounds(info)
        part = tail_part(p, src[dim], bounds and range(bounds[0], bounds[1]))
        if part is not None:
            out.append(Strategy((p,), part))
    blocks = whole_blocks(p, src[dim], _slice_bounds(info)) if is_shard(p) and p.dim == dim else None
    if blocks is not None and blocks != (0, p.chunks):   # the whole dim: follow keeps the shard
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
    return follow(info, placements,
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
