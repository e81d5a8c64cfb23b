"""What a rank's program runs for an op whose strategy holds routed rows: its rows alone.

The registry's one routed localizer (:func:`~.registry.register_routed_localizer`) dispatches by
what the strategy does: rows gathered or routed by the rank's own routing
(:mod:`.gathered_rows`, :mod:`.local_routing`), token rows made or split back
(:mod:`.token_rows`), a grouped product on the rank's experts (its rows cut at the layer's bounds,
or sent by the all-to-all dispatch and combined back), a reorder or a pick of rows, the top-k
sums, and any op on rows alone (other routed operands brought to the first one's row order,
replicated ones taken at the rank's rows). Row maps travel in the rewrite's context
(``ctx.rows_of``, ``ctx.made_rows``); the nodes a layer reads once are :mod:`.dispatch_sizes`'."""
from __future__ import annotations

import math
import operator
from typing import Any

import sympy
import torch

from ...placements import PARTIAL, REPLICATE, Routed
from .dispatch_sizes import (dispatches_tokens, expert_rows, expert_run, expert_runs, layer_dispatch_sizes,
                             own_dispatch_sizes, sorted_rows)
from .gathered_rows import gathered_rows_localizer, gathers_rows
from .local_routing import own_localizer, owns
from .contract import LocalContext, OpInfo, Strategy
from .registry import is_shard, op_name, register_routed_localizer
from .routing import counted_by, is_permutation, written
from .row_reads import GROUPED_MM
from .token_rows import ASCENDING, SIZED_VIEWS, token_localizer, token_sequence_localizer, token_split_localizer

aten = torch.ops.aten


@register_routed_localizer
def routed_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's program for an op whose strategy holds a Routed placement: its rows alone.
    ``ctx`` (a graph's context) gives the row map of each routed input (``ctx.rows_of``) and
    takes the row map of the output where the op makes a new one (``ctx.made_rows``)."""
    from ...distributed import experts as E

    out = strategy.output
    if gathers_rows(strategy):
        return gathered_rows_localizer(info, strategy, args, kwargs, ctx)
    if owns(strategy):
        return own_localizer(info, strategy, args, kwargs, ctx)
    if isinstance(out, Routed) and out.tokens and is_shard(strategy.inputs[0]):
        return token_localizer(info, strategy, args, kwargs, ctx)
    if is_shard(out) and isinstance(strategy.inputs[0], Routed) and strategy.inputs[0].tokens:
        if info.output.static(out.dim) is None:   # back to the rank's run of the sequence
            return token_sequence_localizer(info, strategy, args, kwargs, ctx)
        return token_split_localizer(info, strategy, args, kwargs, ctx)   # back to a dim split by head
    if op_name(info.target) in GROUPED_MM:
        return _grouped_localizer(info, strategy, args, kwargs, ctx)
    if info.target is aten.index.Tensor and isinstance(out, Routed):
        if isinstance(strategy.inputs[0], Routed):   # rows reordered
            x, index = ctx.inputs
            size = ctx.size(info.inputs[0].shape[0])
            if strategy.inputs[0].tokens:   # each row reordered is held where its token is
                ctx.made_owners = ctx.graph.call_function(E.take_rows, (ctx.owners[x], index, 0))
            if _permutes(info, ctx.node):   # every row kept once: the rank's rows stay, renumbered
                copy = len(ctx.node.args[0].users) > 1 or written(ctx.node)
                pair = ctx.graph.call_function(E.routed_permute, (x, index, ctx.rows_of(x), copy))
            else:
                # a rank's tokens' rows sorted by expert for a dispatching product (the rank's
                # program runs this reorder right before it, after its offs): how many are the
                # rank's is read with the layer's split sizes, one read; otherwise a nonzero
                reader = ctx.grouped_reader() if strategy.inputs[0].tokens else None
                count = None
                if reader is not None and dispatches_tokens(reader[1]):
                    sizes = layer_dispatch_sizes(*reader, ctx.made_owners, ctx)
                    count = ctx.graph.call_function(getattr, (sizes, "sent"))
                pair = ctx.graph.call_function(E.routed_reorder, (x, index, ctx.rows_of(x), size, count))
            ctx.made_rows = ctx.graph.call_function(operator.getitem, (pair, 1))
            return operator.getitem, (pair, 0), {}
        if strategy.inputs[0] == REPLICATE:   # rows gathered for a grouped product: its rank's rows
            product, product_strategy, offs = ctx.grouped_reader()
            if not isinstance(product_strategy.output, Routed):
                from ...errors import PlanError

                raise PlanError(f"{info.target} gathers its rows for a grouped product as routed rows, but the "
                                f"product does not run its experts' rows alone (it is {product_strategy}); the "
                                f"gather must be replicated here")
            bounds, ctx.made_rows = expert_rows(product, product_strategy, offs, ctx)
            h, index = ctx.inputs
            return E.gather_rows, (h, index, bounds), {}
        first, count = expert_run(info, strategy, 0, ctx)
        total = int(info.inputs[0].shape[0])
        weight, index = ctx.inputs
        offs = counted_by(ctx.node.args[1][0], total)
        if offs is not None and offs in ctx.env:
            # ids sorted, each counted in offs: its experts' ids are the rows its products take,
            # the same bounds read once (gpt-oss's biases)
            _, ctx.made_rows = sorted_rows(ctx.env[offs], first, count, ctx)
        else:
            ctx.made_rows = ctx.shared_rows(("picked", index, first, count),
                                            lambda: (E.picked_rows, (index, first, count, total)))
        return E.routed_pick, (weight, index, ctx.made_rows, first, total), {}
    if isinstance(out, Routed) and out.span > 1:   # [T*k, H] -> [T, k, H]: the rows as they are
        return aten.alias.default, (ctx.inputs[0],), {}
    if isinstance(out, Routed) and out.tokens and isinstance(strategy.inputs[0], Routed) \
            and strategy.inputs[0].span > 1:   # a token's rows summed on its own rank
        p = strategy.inputs[0]
        x = ctx.inputs[0]
        group = math.prod(int(info.inputs[0].shape[d]) for d in range(p.dim + 1, p.dim + p.span))
        rows = ctx.rows_of(x)
        sums = E.token_sums_in_order if rows.meta.get(ASCENDING) else E.token_sums
        pair = ctx.graph.call_function(sums, (x, rows, group, kwargs.get("dtype")))
        ctx.made_rows = ctx.graph.call_function(operator.getitem, (pair, 1))
        ctx.made_rows.meta[ASCENDING] = True
        if x in ctx.owners:   # rows a rank routed alone are all its own: no holders to carry
            ctx.made_owners = ctx.graph.call_function(E.token_sum_owners, (ctx.owners[x], group))
        return operator.getitem, (pair, 0), {}
    if out == PARTIAL and strategy.inputs and isinstance(strategy.inputs[0], Routed):   # a token's rows summed
        p = strategy.inputs[0]
        x = ctx.inputs[0]
        group = math.prod(int(info.inputs[0].shape[d]) for d in range(p.dim + 1, p.dim + p.span))
        shape = [ctx.size(s) for s in info.output.shape]
        return E.routed_combine, (x, ctx.rows_of(x), p.dim, group, shape, kwargs.get("dtype")), {}
    return _row_wise(info, strategy, args, kwargs, ctx)


def _permutes(info: OpInfo, node: Any) -> bool:
    """Whether ``x[index]`` (``node``) reorders all of x's rows by a permutation (the index as
    long as x's rows, made a permutation by the graph: :func:`is_permutation`)."""
    index = node.args[1][0]
    return is_permutation(index) and sympy.expand(info.inputs[1].shape[0] - info.inputs[0].shape[0]) == 0


def _row_wise(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """An op on rows alone, on the rank's rows: other routed operands brought to the first one's
    row order, replicated operands with the rows' dim taken at the rank's rows, a view's size
    of the rows' dim left to the local rows (-1)."""
    from ...distributed import experts as E

    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    metas = info.output if isinstance(info.output, tuple) else (info.output,)
    out_p, out_meta = next((p, m) for p, m in zip(outs, metas) if isinstance(p, Routed))
    routed = [i for i, p in enumerate(strategy.inputs) if isinstance(p, Routed)]
    rows = ctx.rows_of(ctx.inputs[routed[0]])
    size = info.inputs[routed[0]].shape[strategy.inputs[routed[0]].dim]
    swap = {}
    for i, (node, meta, p) in enumerate(zip(ctx.inputs, info.inputs, strategy.inputs)):
        if isinstance(p, Routed) and ctx.rows_of(node) is not rows:
            swap[node] = ctx.graph.call_function(E.match_rows, (node, ctx.rows_of(node), rows, p.dim,
                                                                ctx.size(size)))
        elif p == REPLICATE and meta.ndim:
            d = out_p.dim - (out_meta.ndim - meta.ndim)   # the dim broadcast against the rows
            if 0 <= d < meta.ndim and meta.shape[d] == size and size != 1:
                swap[node] = ctx.graph.call_function(E.take_rows, (node, rows, d))
    args = tuple(_swapped(a, swap) for a in args)
    kwargs = {k: _swapped(v, swap) for k, v in kwargs.items()}
    if info.target in SIZED_VIEWS or info.target is aten.expand.default:
        sizes = [ctx.size(s) for s in info.output.shape]
        sizes[out_p.dim] = -1
        args = (args[0], sizes) + tuple(args[2:])
    return info.target, args, kwargs


def _swapped(a, swap: dict):
    if isinstance(a, (list, tuple)):
        return type(a)(_swapped(x, swap) for x in a)
    return swap.get(a, a) if not isinstance(a, (int, float, bool, str)) and a is not None else a


def _grouped_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """A grouped product on this rank's experts: x's rows ``[start, end)`` of the sorted rows (or
    x routed already, the rows of the same experts: the previous product's) through the model's
    product, offs rebased to them."""
    from ...distributed import experts as E

    if not isinstance(strategy.output, Routed):
        return info.target, args, kwargs
    kwargs = dict(kwargs)
    offs = args[2] if len(args) > 2 else kwargs.pop("offs")
    x = ctx.inputs[0]
    first, count = expert_run(info, strategy, 1, ctx)
    x_routed = isinstance(strategy.inputs[0], Routed)
    dispatch = dispatches_tokens(strategy)
    own = ctx.own_layers.get(ctx.rows_of(x)) if dispatch else None
    if own is not None:   # rows the rank routed alone: the read and the plan from its exchanged counts
        sizes = own_dispatch_sizes(info, strategy, offs, own.routing, ctx)
    elif dispatch:   # the layer's one read (made first: the bounds below are read with it)
        sizes = layer_dispatch_sizes(info, strategy, offs, ctx.owners[x], ctx)
    bounds, ctx.made_rows = expert_rows(info, strategy, offs, ctx)
    from ...errors import PlanError

    if dispatch:
        # the all-to-all dispatch: every rank's rows of its tokens to the ranks of their experts,
        # planned once per layer on its one read, the plan kept for the combine back
        rows, owners = ctx.rows_of(x), ctx.owners.get(x)
        if own is not None:
            from ...distributed.expert_routing import local_dispatch_plan

            plan = ctx.shared_rows(("dispatch", offs, first, count),
                                   lambda: (local_dispatch_plan, (own.routing, expert_runs(info, strategy, ctx),
                                                                  ctx.rank, sizes)))
        else:
            plan = ctx.shared_rows(("dispatch", offs, first, count),
                                   lambda: (E.dispatch_plan, (rows, owners, offs, expert_runs(info, strategy, ctx),
                                                              sizes)))
        ctx.dispatches[(offs, first, count)] = ctx.sent[ctx.made_rows] = (plan, rows, owners)
        args = (ctx.comm(E.DispatchRows(ctx.group), x, plan),) + tuple(args[1:])
    elif x_routed and ctx.rows_of(x) is not ctx.made_rows:
        raise PlanError(f"the grouped product {info.target} reads routed rows that are not its own experts' "
                        f"rows sorted by expert (they were reordered or picked otherwise); its input must be "
                        f"replicated here")
    product = (E.routed_grouped_mm, (args[0], args[1], offs, bounds, first, count, op_name(info.target), x_routed),
               kwargs)
    if not strategy.output.tokens:
        return product
    # the combine by the reverse all-to-all: the rank's experts' output rows back to their
    # tokens' ranks, each into the row the dispatch took it from (its row map and holders)
    dispatched = ctx.dispatches.get((offs, first, count))
    if dispatched is None:
        raise PlanError(f"the grouped product {info.target} sends its rows back to their tokens' ranks, but no "
                        f"all-to-all dispatch of this layer sent them (the rows were gathered); its output must "
                        f"stay on its experts' ranks here")
    plan, ctx.made_rows, ctx.made_owners = dispatched
    return E.CombineRows(ctx.group), (ctx.graph.call_function(product[0], product[1], product[2]), plan), {}
