"""Where a shard lands when a reshape regroups the dims it lies in.

A reshape groups input and output dims into blocks of equal element count (:func:`view_groups`);
a shard on one input dim is a (chunks, unit) pattern over its block's flat index, which lands
on the one output dim of the block that can express it (:func:`map_view_shard`: GPT-2's
``view(b, s, 32) -> (b, s, 4, 8)`` moves a head-unit shard onto the heads dim; a per-block
shard's blocks move whole, never cut). :func:`plain_if_same` names a per-block shard that
deals what a plain one does by the plain one.

Pure functions of shapes and placements, asked by the view rules (:mod:`.view`) and the column
hints (:mod:`autotp.passes.hints`); nothing here is registered.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any

import sympy

from ...placements import Shard, layout
from .registry import is_shard


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
    if found is None:
        found = _in_common_head(src, dst, shard)
    return found if found is not None else _in_common_tail(src, dst, shard)


def _in_common_head(src: tuple, dst: tuple, shard: Shard) -> Shard | None:
    """A shard of a dim among the leading dims that ``src`` and ``dst`` share size for size: the
    reshape regroups only the dims after them (Gated DeltaNet's chunked rule views the padded
    ``[b, heads, s + pad, d]`` as ``[b, heads, (s + pad) // 64, 64, d]``, a padded length export
    writes with ``Mod`` terms that :func:`view_groups` cannot divide), so every element keeps its
    index along the shard's dim and the dims before it, and the shard keeps its place."""
    d = shard.dim
    if d >= min(len(src), len(dst)) or src[d] == 1 or (shard.per_block and shard.outer > d):
        return None
    if any(src[k] != dst[k] for k in range(d + 1)):
        return None
    return shard


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
