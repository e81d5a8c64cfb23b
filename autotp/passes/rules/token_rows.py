"""The tokens a rank holds under a sequence split, flattened to its rows, and split back.

A view merging dims ``0..d`` of a tensor split along ``d`` (``[b, s, h] -> [b*s, h]``: the
sequence-split tokens; ``[b, h, d, n] -> [b*h, d, n]``: Mamba2's split heads) leaves a rank ``b``
runs of its share of ``d``: no Shard says them where the batch is dynamic, so they are compact
rows, ``Routed(0, tokens=True)``, with a row map the shapes give (:func:`token_rows`; the view's
own rule extended by :func:`sized_view_rule`). A view splitting such rows back into the dims
merged is the shard again (:func:`token_split`, by head; :func:`token_sequence`, the rank's run
of the sequence after the combine's reverse all-to-all). The localizers here build the row maps
(one per merged shape and layout, shared: :func:`token_maps`) and check the rows split back are
that merge's, in its order."""
from __future__ import annotations

import math
from typing import Any

import sympy
import torch

from ...placements import Routed, Shard, divides, is_even, layout, same_placement
from .contract import LocalContext, OpInfo, Strategy
from .registry import _RULES, is_shard, register

aten = torch.ops.aten


#: views whose size arguments the rank's rows change (the routed dim's size: -1)
SIZED_VIEWS = frozenset((aten.view.default, aten.reshape.default, aten._unsafe_view.default))
#: the views' own rules (view.py's, registered before this file), which :func:`sized_view_rule` extends
_VIEW_RULES = {t: _RULES[t] for t in SIZED_VIEWS}


def token_rows(info: OpInfo, p) -> Routed | None:
    """``Routed(0, tokens=True)`` where a view merges dims ``0..d`` of a tensor split along ``d``
    into its rows (``[b, s, ...] -> [b*s, ...]``: the sequence-split tokens; ``[b, h, d, n] ->
    [b*h, d, n]``: Mamba2's split heads read for one ``bmm``), each row's elements kept; None
    otherwise. A rank's rows are then ``b`` runs of its share of ``d``, not a contiguous run: no
    Shard says them where a merged dim is dynamic (the batch), compact rows with a row map
    computed from the shapes do (:func:`token_localizer`). ``d`` split in contiguous runs: as a
    plain Shard deals them, or a static dim's runs of whole atoms, every rank holding some
    (Mamba2's heads dealt by group where tp divides neither: 8 heads of 4 groups at tp 3 hold 4,
    2 and 2 heads where a plain shard holds 3, 3 and 2)."""
    unit = _runs_unit(info.inputs[0], p, info.tp) if is_shard(p) and info.tp > 1 else None
    if unit is None:
        return None
    before, after = info.inputs[0].shape, info.output.shape
    d = p.dim
    if all(info.inputs[0].static(i) is not None for i in range(d + 1)):
        return None   # every merged dim static: a Shard of the merged dim says it (the view's own rule)
    if not after or sympy.expand(math.prod(before[:d + 1]) - after[0]) != 0 \
            or sympy.expand(math.prod(before[d + 1:]) - math.prod(after[1:])) != 0:
        return None
    heads = info.inputs[0].static(d)   # a static dim that is not the sequence: rows by head
    if heads is not None and (before[d] in info.sequence or _holds_sequence(before[d], info.sequence)):
        heads = None
    return Routed(0, tokens=True, unit=unit, heads=heads or 0)


def _runs_unit(meta, p, tp: int) -> int | None:
    """The atom ``u`` where shard ``p`` of ``meta`` deals its dim as ``Shard(p.dim, unit=u)``
    does, one contiguous run of whole atoms a rank, the first ``atoms % tp`` one atom longer
    (what the row maps compute from the shapes), every rank holding some: ``p.unit``, or 1 where
    ``p`` is laid out as a plain shard alone; a dynamic dim (the sequence) as a plain shard
    alone. None otherwise."""
    size = meta.static(p.dim)
    if size is None:
        return 1 if p == Shard(p.dim) else None
    for unit in dict.fromkeys((p.unit, 1)):
        runs = Shard(p.dim, unit=unit)
        if divides(size, runs) and size // unit >= tp and same_placement(p, runs, size, tp):
            return unit
    return None


def row_unit(size: Any, unit: int, tp: int) -> int:
    """The atom of the runs a merge's row map is computed from (:func:`token_maps`): 1 where
    ``Shard(d, unit=unit)`` of ``size`` is laid out as a plain shard, else the smallest atom laid
    out as it is, so that merges holding the same rows share one row map whatever their units say."""
    if unit == 1 or not (isinstance(size, int) or getattr(size, "is_Integer", False)):
        return 1   # a dynamic dim (the sequence) is split as a plain shard (:func:`_runs_unit`)
    size = int(size)
    want = layout(size, Shard(0, unit=unit), tp)
    return next(u for u in range(1, unit + 1) if size % u == 0 and layout(size, Shard(0, unit=u), tp) == want)


def token_split(info: OpInfo, p: Routed) -> Shard | None:
    """The shard merged where a view splits the rows of :func:`token_rows` back into dims
    ``0..d``, each row's elements kept (``[b*h, d, 1] -> [b, h, d]``: ``Shard(d, unit=p.unit)``)
    or, rows of a dim of ``p.heads`` heads split by head, folded into the last dim with the head
    they belong to (Gated DeltaNet's normed ``[b*s*h, d] -> [b, s, h*d]``: ``Shard(2, unit=p.unit *
    d)``, a rank's heads' elements contiguous); None otherwise. Sound where the rows are those a
    merge of the same dims made, in its order: the rank's program checks that the row map is that
    merge's (:func:`token_split_localizer`). Not where a dim before ``d`` holds the sequence and
    the rows are not by head: they are then held by their position along it, not along ``d`` (a
    token's top-k rows ``[b*s*k]`` viewed as ``[b*s, k]``: no merge split the top-k slots, and a
    rank holds all of a token's)."""
    if not (p.tokens and p.dim == 0 and p.span == 1 and info.tp > 1):
        return None
    form = _split_back(info, p)
    if form is None:
        return None
    d, _, fold = form
    size = info.output.static(d)
    if size is None:   # as a fresh shard of a sequence dim
        return Shard(d) if info.uneven and info.output.shape[d] in info.sequence else None
    back = Shard(d, unit=p.unit * fold)   # the shard merged (Mamba2's heads in a group's units)
    unit = _runs_unit(info.output, back, info.tp)
    if unit is None or not (info.uneven or is_even(size, back, info.tp)):
        return None
    return Shard(d, unit=unit)


def _split_back(info: OpInfo, p: Routed) -> tuple[int, Any, int] | None:
    """How a view splits rows ``p`` back (:func:`token_split`): ``(d, split, fold)``, the dim
    ``d`` of the output the merged dim split returns in, that dim's size as the merge saw it, and
    the elements of a row folded into ``d`` with it (1: none, the rows' elements kept in the dims
    after ``d``); None where the view is neither form."""
    before, after = info.inputs[0].shape, info.output.shape
    for d in range(1, len(after)):
        outer = math.prod(after[:d])
        if sympy.expand(outer * after[d] - before[0]) == 0:
            if sympy.expand(math.prod(after[d + 1:]) - math.prod(before[1:])) != 0:
                return None
            if p.heads and info.output.static(d) != p.heads:
                return None   # not the heads merged: the rows are not split back along them
            form = (d, after[d], 1)
        elif p.heads and d == len(after) - 1:
            fold = sympy.sympify(math.prod(before[1:]))
            if not fold.is_Integer or info.output.static(d) != p.heads * int(fold) \
                    or sympy.expand(outer * p.heads - before[0]) != 0:
                return None
            form = (d, p.heads, int(fold))
        else:
            continue
        if not p.heads and any(_holds_sequence(size, info.sequence) for size in after[:d]):
            return None
        return form
    return None


def _holds_sequence(size, sequence: frozenset) -> bool:
    """Whether the dim of ``size`` spans a sequence: its size a product with a sequence's symbol
    or (a program of a static length, ``OpInfo.sequence``) that length among its factors."""
    size = sympy.sympify(size)
    if any(sym in sequence for sym in size.free_symbols):
        return True
    return bool(size.is_Mul) and any(factor in sequence for factor in size.args)


def token_sequence(info: OpInfo, p) -> Shard | None:
    """``Shard(d)`` where a view unflattens a rank's token rows ``[b*s, ...]`` (``Routed(0,
    tokens=True)``) back to ``[b, s, ...]`` split along the sequence dim ``d`` (dims ``0..d``
    from dim 0, the rest kept, ``d``'s size a sequence symbol): the inverse of
    :func:`token_rows`, the rank's rows its ``b`` runs of ``s/tp`` positions again, no collective
    (the combine by the reverse all-to-all leaves the experts' output so)."""
    if not (isinstance(p, Routed) and p.tokens and p.dim == 0 and p.span == 1 and info.tp > 1):
        return None
    before, after = info.inputs[0].shape, info.output.shape
    d = len(after) - len(before)
    if d < 1 or after[d] not in info.sequence or tuple(after[d + 1:]) != tuple(before[1:]):
        return None
    if sympy.expand(math.prod(after[:d + 1]) - before[0]) != 0:
        return None
    return Shard(d)


def sized_view_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Besides :func:`.view.view_rule`: the sequence-split tokens flattened to the rank's rows
    (:func:`token_rows`), which the router, its softmax and top-k then run on alone."""
    out = _VIEW_RULES[info.target](info, placements)
    tokens = token_rows(info, placements[0]) if placements else None
    if tokens is not None:
        out.append(Strategy((placements[0],), tokens))
    return out


for _target in SIZED_VIEWS:
    register(_target)(sized_view_rule)


def token_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's ``[b, s_local, ...]`` flattened to ``[b*s_local, ...]``, its row map the
    global ids ``i*s + start + j`` of its runs (``start``: where its run of the sequence begins).
    Merges of the same dims share one row map (and one map of holders): their rows meet row by
    row as they are (Mamba2's state and C at their ``bmm``), and the split back finds it."""
    p = strategy.inputs[0]
    before = info.inputs[0].shape
    sizes = [-1] + [ctx.size(s) for s in info.output.shape[1:]]
    ctx.made_rows, ctx.made_owners = token_maps(ctx, ctx.inputs[0], p.dim, tuple(before[:p.dim]), before[p.dim],
                                                 p.unit)
    ctx.made_rows.meta[ASCENDING] = True   # the rank's rows in order: b runs of its s/tp (or h/tp)
    return info.target, (args[0], sizes) + tuple(args[2:]), kwargs


def token_maps(ctx: LocalContext, x: Any, dim: int, outer: tuple, seq: Any, unit: int) -> tuple[Any, Any]:
    """(row map, holders) of the rows a merge of dims ``outer + (seq,)`` split along the last in
    runs of ``unit``-element atoms makes, one pair per merged shape and layout of the runs
    (``x``: the rank's tensor of the first merge, for its local length along ``dim``)."""
    from ...distributed import experts as E

    unit = row_unit(seq, unit, ctx.tp)
    key = _rows_key(outer, seq, unit)
    outer_sizes = [ctx.size(s) for s in outer]
    rows = ctx.shared_rows(key, lambda: (E.token_rows, (x, dim, outer_sizes, ctx.size(seq), ctx.tp, ctx.rank, unit)))
    owners = ctx.shared_rows(("owners",) + key[1:],
                             lambda: (E.token_owners, (x, outer_sizes, ctx.size(seq), ctx.tp, unit)))
    return rows, owners


def _rows_key(outer: tuple, seq: Any, unit: int) -> tuple:
    """The key of a merge's row map (:func:`token_maps`): its dims and the atom of its runs."""
    return ("tokens", outer, seq) + ((unit,) if unit != 1 else ())


def token_split_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's rows of a merge split back into its dims (:func:`token_split`): a view, where
    they are that merge's rows in its order (the one row map of :func:`token_maps`); otherwise
    first brought to that order (:func:`autotp.distributed.experts.match_rows`, which raises
    where the rank holds other rows); where no merge of those dims made a row map, a PlanError."""
    from ...distributed import experts as E

    p, after, x = strategy.inputs[0], info.output.shape, ctx.inputs[0]
    d, split, _ = _split_back(info, p)
    want = ctx.found_rows(_rows_key(tuple(after[:d]), split, row_unit(split, p.unit, ctx.tp)))
    if want is None:
        from ...errors import PlanError

        raise PlanError(f"{info.target} splits rows back into {tuple(after[:d + 1])} that no merge of those dims "
                        f"made on this rank (they are {strategy.inputs[0]}): its input must be converted here "
                        "(an autotp bug: please report it)")
    if ctx.rows_of(x) is not want:
        x = ctx.graph.call_function(E.match_rows, (x, ctx.rows_of(x), want, 0, ctx.size(info.inputs[0].shape[0])))
    sizes = [ctx.size(s) for s in after]
    sizes[d] = -1
    return info.target, (x, sizes) + tuple(args[2:]), kwargs


#: a row map's node meta key: its rows ascending (a rank's tokens in sequence order, b runs of s/tp)
ASCENDING = "autotp_rows_ascending"


def token_sequence_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """A rank's token rows ``[rows, ...]`` viewed back as its run of the sequence ``[b, s/tp,
    ...]``: its rows in ascending order are exactly that (:func:`token_rows`); rows in another
    order (a reorder's) are put in it first."""
    from ...distributed import experts as E

    x = ctx.inputs[0]
    rows = ctx.rows_of(x)
    if not rows.meta.get(ASCENDING):
        x = ctx.graph.call_function(E.in_row_order, (x, rows))
    sizes = [ctx.size(s) for s in info.output.shape]
    sizes[strategy.output.dim] = -1
    return info.target, (x, sizes) + tuple(args[2:]), kwargs
