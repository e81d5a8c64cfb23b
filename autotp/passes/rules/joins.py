"""Joins and repeats: ``cat``, ``stack``, ``repeat``, ``repeat_interleave``.

Rotary embeddings (``rotate_half``'s ``cat``, GPT-J's interleaved ``stack``), GPT-J's sin/cos
tables, grouped kv heads repeated for their query heads and Mamba2's groups repeated for their
heads. A shard of a dim the op leaves alone passes; a join of inputs each split along the join
dim by head is one shard in blocks (:func:`_cat_blocks`); a repeated dim keeps its shard with
atoms ``repeats`` times wider.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import sympy
import torch

from ...placements import PARTIAL, REPLICATE, Shard, divides, layout, local_ranges
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
        # weights joined for a product, free or their dim alone pinned: split as the product's
        # output is read (a plain Shard is a pin of the dim, its blocks read off the graph)
        fresh = _fresh_blocks(info, placements, dim)
        if fresh is not None:
            return out + [fresh]
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


def _fresh_blocks(info: OpInfo, placements: tuple, dim: int) -> Strategy | None:
    """Weights joined for one product (sibling products fused, :mod:`autotp.passes.products`:
    ``cat([Wq, Wk, Wv])``), each free or its dim alone decided (a plain ``Shard(dim)``): the
    joined weight split as its product's output is read (the hint: q | k | v by head, in groups
    of a kv head with its query heads), each weight that layout's blocks of it, its own run of
    heads (:func:`~.pieces.fewer_blocks`), so that each rank joins only its local shards
    (Megatron's layout of a fused grouped projection). None where the hint's blocks are not the
    inputs (or a rank's runs would not be the inputs' own, :func:`_cat_blocks`)."""
    from .pieces import _whole_block_pieces, fewer_blocks

    if dim not in info.hints or not all(p is None or (is_shard(p) and p.dim == dim and (p.chunks, p.unit) == (1, 1)
                                                      and not p.holds_whole) for p in placements):
        return None
    joined = info.fresh_shard(dim)
    size = info.output.static(dim)
    sizes = [m.static(dim) for m in info.inputs]
    if not is_shard(joined) or joined.dim != dim or size is None or None in sizes:
        return None
    spans = _whole_block_pieces(joined, sympy.Integer(size), [sympy.Integer(n) for n in sizes])
    if spans is None:
        return None
    parts = tuple(fewer_blocks(joined, *span) for span in spans)
    if not all(is_shard(q) for q in parts) or _cat_blocks(info, parts, dim) != joined:
        return None
    return Strategy(parts, joined)


@register(aten.stack.default)
def stack_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    dim = _join_dim(info, info.output.ndim)
    return _joined_shards(info, placements, lambda d: d + 1 if d >= dim else d)


@register(aten.repeat.default)
def repeat_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Tiling copies whole dims: a shard survives on a dim repeated once."""
    reps = list(info.args[1])
    lead = len(reps) - info.inputs[0].ndim
    return follow(info, placements, lambda s: s.with_dim(s.dim + lead) if reps[s.dim + lead] == 1 else None)


@register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """GPT-J's sin/cos widened element by element along the head dim: a shard of any other dim
    survives; without a dim the input is flattened, so only whole tensors. The repeated dim
    itself (grouped kv heads repeated for their query heads, ``k.repeat_interleave(n_rep, 1)``)
    keeps its shard with atoms ``repeats`` times wider: element i becomes elements
    [i * repeats, (i + 1) * repeats), so each rank's kv heads become the copies its query heads use."""
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim")
    if dim is None:
        return follow(info, placements, lambda s: None)
    dim = norm_dim(dim, info.inputs[0].ndim)
    repeats = info.args[1] if len(info.args) > 1 else info.kwargs.get("repeats")
    if not isinstance(repeats, int) or repeats < 1:
        return follow(info, placements, lambda s: None if s.dim == dim else s)
    out = follow(info, placements, lambda s: replace(s, unit=s.unit * repeats) if s.dim == dim else s)
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
