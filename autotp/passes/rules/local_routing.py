"""A rank routing its own tokens' (token, expert) rows (the all-to-all dispatcher's routing, issue 47).

Under sequence parallelism a rank holds its tokens' rows (``Routed(0, tokens=True)``, the router
and its top-k ran on them). transformers' grouped experts then flatten the top-k ids and weights
``[T, k] -> [T*k]``, sort the ids by expert, count them (``histc``, ``cumsum``: the grouped
product's ``offs``), gather the rows ``h[perm // k]`` and ``weights[perm]``, run the products, and
reorder the output back by the inverse of the sort (``inv = empty_like(perm); inv[perm] =
arange(T*k)``, ``out[inv]``). Whole, every rank all-gathers the ids and weights and runs all of
it on every token. Here each op runs on the rank's own rows alone, placed :data:`OWN`:

* the flatten: the rank's ``[T_r, k]`` as ``[T_r*k]``, row map ``t*k + j``;
* the sort: :func:`autotp.distributed.expert_routing.route_locally` (a stable sort of the rank's
  ids, its counts per expert exchanged: an all-gather of ``tp * experts`` numbers);
* ``floor_divide``, casts, ``empty_like``: as written, on the rank's rows;
* the inverse of the sort, in each form :func:`~.routing.makes_inverse` knows (the graph's one
  recognizer, ``OpInfo.inverts``): ``inv[perm] = arange(T*k)`` (``index_put``) or
  ``inv.scatter_(0, perm, arange(T*k))`` write the rank's sorted rows' positions (the whole arange
  left unread and erased); ``argsort(perm)`` / ``sort(perm)[1]`` sort the rank's own positions;
* ``histc`` (or ``bincount`` with ``minlength`` every expert) of the sorted ids: every rank's
  counts from the exchange, no pass over any row (the exchange is priced at the sort);
* ``x[index]`` by such an index: a local gather, no count read, no ``nonzero``; the grouped
  product's dispatch takes its split sizes and plan from the routing
  (:func:`~autotp.distributed.expert_routing.local_dispatch_sizes`,
  :func:`~autotp.distributed.expert_routing.local_dispatch_plan`).

``OWN`` tensors' index values are *local* positions (among the rank's flat rows, its tokens, or
its sorted rows): no collective converts them (``propagate._conversion``), so the solver takes
the chain whole or not at all, by cost against the whole sort. The rank's program checks, per
index, that its values point into the tensor it indexes (:func:`own_localizer`)."""
from __future__ import annotations

from typing import Any

import sympy
import torch

from ...placements import PARTIAL, REPLICATE, Routed, Shard
from .contract import LocalContext, OpInfo, Strategy, TensorMeta
from .experts import SENT_ALONE
from .routing import INVERTERS, SCATTERS, SORTS, inverted, router_experts

aten = torch.ops.aten

#: a rank's own rows routed by it alone (index values local positions)
OWN = Routed(0, tokens=True, reordered=True, own=True)
#: the rank's rows as any token-held rows in an order of its own: what a gather by an OWN index makes
ROWS = Routed(0, tokens=True, reordered=True)
#: ... where the gather takes the float rows a grouped product reads (``h[perm // k]``): if that
#: product dispatches them, its split sizes and plan come from the rank's own routing (priced so
#: there, ``cost_model/routing.dispatch_work``; a g makes them whole as any such rows)
ALONE = Routed(0, tokens=True, reordered=True, alone=True)
#: ... where the gather puts the rows the combine brought back in the rank's tokens' order (``out[inv]``,
#: the inverse of its sort): their ids ascend, each token's top-k rows together
IN_TOKEN_ORDER = Routed(0, tokens=True, reordered=True, ascending=True)
#: the sorts that return the indices alone
ARGSORTS = frozenset((aten.argsort.default, aten.argsort.stable))
#: ops on the rank's own rows that keep each entry in its place
_IN_PLACE_OF_ROWS = frozenset((aten.floor_divide.default, aten.floor_divide.Scalar, aten.to.dtype,
                               aten._to_copy.default, aten.clone.default, aten.empty_like.default,
                               aten.alias.default))


def is_own(p: Any) -> bool:
    return isinstance(p, Routed) and p.own


def owns(strategy: Strategy) -> bool:
    """Whether a strategy holds an :data:`OWN` placement."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    return any(is_own(p) for p in (*strategy.inputs, *outs))


def _in_order(p: Any) -> bool:
    """A rank's tokens' rows in sequence order (a flattened sequence split)."""
    return isinstance(p, Routed) and p.tokens and not p.reordered and not p.own and p.dim == 0 \
        and p.span == 1 and p.unit == 1


def own_merge(info: OpInfo, p: Any) -> Routed | None:
    """:data:`OWN` where a view flattens a rank's tokens' ``[T, k]`` (a static ``k``: the top-k ids
    or weights) to ``[T*k]``; None otherwise."""
    if not (_in_order(p) and info.tp > 1 and info.inputs[0].ndim == 2 and info.output is not None
            and info.output.ndim == 1 and info.inputs[0].static(1) is not None):
        return None
    before, after = info.inputs[0].shape, info.output.shape
    return OWN if sympy.expand(before[0] * before[1] - after[0]) == 0 else None


def own_strategies(info: OpInfo, placements: tuple) -> list[Strategy]:
    """The strategies of an op meeting an :data:`OWN` input: the routing's ops on the rank's own
    rows, and nothing else (an OWN tensor is never read whole)."""
    if info.tp < 2:
        return []
    target, n = info.target, len(info.inputs)
    if target in ARGSORTS | SORTS and n == 1 and info.inputs[0].ndim == 1 and not info.inputs[0].is_float:
        if info.inverts:
            # the inverse of the routing's sort, ``argsort(perm)`` or ``sort(perm)[1]``: the rank's
            # own sorted rows' positions, a sort of its own rows alone (no exchange)
            return [Strategy((OWN,), OWN if target in ARGSORTS else (OWN, OWN))]
        # an argsort: the sort's indices alone (a router that sorts by argsort, then gathers ids[perm])
        descending = info.args[2] if len(info.args) > 2 else info.kwargs.get("descending", False)
        if descending or not info.routing_experts:   # a sort of anything else runs on every row
            return []
        # route_locally: the rank's rows sorted (priced as a radix sort and the kernels around
        # it, routing.sort_work) and its counts per expert exchanged, an all-gather of
        # tp * experts int64 numbers
        counts = TensorMeta((sympy.Integer(info.tp * info.routing_experts),), torch.long)
        return [Strategy((OWN,), OWN if target in ARGSORTS else (OWN, OWN), internal=(("all_gather", counts),))]
    if target in _IN_PLACE_OF_ROWS and n == 1:
        return [Strategy((OWN,), OWN)]
    if target is aten.histc.default and n == 1:
        # every rank's rows per expert (one bin per expert id): of the sorted ids, the counts the
        # sort exchanged (``routed_counts``: no kernel, no collective; the sort's all-gather is
        # priced at the sort); of other ids, each rank's histogram all-gathered (tp * bins
        # numbers) and summed (``GatheredHistc``); or each rank's histogram of its rows, a
        # Partial (histc counts each row once, in any order: the ranks' counts sum to every row's)
        given = dict(zip(("bins", "min", "max"), info.args[1:]), **info.kwargs)
        bins = int(given.get("bins", 100))
        out = [Strategy((OWN,), PARTIAL)]
        if (given.get("min", 0), given.get("max", 0)) == (0, bins - 1):
            if info.routing_experts == bins:
                out.append(Strategy((OWN,), REPLICATE))
            else:
                counts = TensorMeta((sympy.Integer(info.tp * bins),), info.output.dtype)
                out.append(Strategy((OWN,), REPLICATE, internal=(("all_gather", counts),)))
        return out
    if target is aten.bincount.default and n == 1:
        # every rank's rows per expert, as histc's: of the sorted ids over every expert (a static
        # length, minlength), the counts the sort exchanged (no kernel of its own, no
        # collective); or each rank's count of its rows, a Partial, where minlength is the whole
        # count's length (each rank's count is then as long: it never counts past the largest id)
        length, minlength = info.output.static(0), _flag(info, 2, "minlength", 0)
        if length is None or minlength != length:
            return []
        out = [Strategy((OWN,), PARTIAL)]
        if info.routing_experts == length:
            out.append(Strategy((OWN,), REPLICATE))
        return out
    if target in INVERTERS and n == 3 and info.inverts and is_own(placements[0]) and is_own(placements[1]):
        # inv[perm] = arange(T*k), or inv.scatter_(0, perm, arange(T*k)) (routing.makes_inverse:
        # every entry written once): the values numbered whole, each rank writing its own sorted
        # rows' positions
        return [Strategy((OWN, OWN, REPLICATE), OWN)]
    if target is aten.index.Tensor and n == 2 and len(info.args[1]) == 1 and is_own(placements[1]):
        x = placements[0]
        if info.counted_pick and (x is None or x == Shard(0)) and info.inputs[0].static(0) is not None:
            # a stack of experts picked by the rank's sorted ids, counted into the products' offs
            # (gpt-oss's biases): the rows of its own experts the products take, from the offs
            # every rank holds (routed_counts) and the layer's bounds, not by the ids; the rows
            # the dispatch sent, too (their row map is the product's: a product adding them may
            # send its rows back, rules/experts.combine_back)
            return [Strategy((Shard(0), OWN), Routed(0))] + [Strategy((Shard(0), OWN), sent)
                                                             for sent in (Routed(0, sent=True), SENT_ALONE)]
        if is_own(x) or _in_order(x):
            if is_own(x) and not info.inputs[0].is_float:
                return [Strategy((x, OWN), OWN)]
            return [Strategy((x, OWN), _rows(info))]
        if isinstance(x, Routed) and x.tokens and x.reordered and x.span == 1:
            # the rows the combine brought back, as the rank sorted them, by the inverse of its
            # sort (own_localizer: its rows' map then the flat rows', in its tokens' order)
            return [Strategy((x, OWN), IN_TOKEN_ORDER)]
        if x in (REPLICATE, None) and info.inputs[0].is_float and (info.row_copies or info.permutes_rows):
            # whole rows: the rank's own taken by global id, where the index numbers rows (the
            # sort's positions, or their tokens ``perm // k``); never by the expert ids themselves
            # (batched_mm's ``gate_up_proj[ids]``: whole weights picked per row)
            return [Strategy((REPLICATE, OWN), _rows(info))]
    return []


def _rows(info: OpInfo) -> Routed:
    """The float rows a gather by an :data:`OWN` index makes: :data:`ALONE` where a grouped
    product reads them (what its dispatch is priced with), :data:`ROWS` otherwise."""
    return ALONE if info.gathers_expert_rows else ROWS


def _flag(info: OpInfo, position: int, name: str, default: Any) -> Any:
    return info.kwargs[name] if name in info.kwargs else info.args[position] if len(info.args) > position else default


def sorted_ids_experts(node: Any) -> int | None:
    """The number of experts where ``node`` (a captured node) is the sorted values of a sort of a
    router's top-k ids (through casts and copies): what the rank's program counts from the sort's
    exchange (:func:`own_localizer`'s ``routed_counts``); else None."""
    import operator

    while getattr(node, "target", None) in _IN_PLACE_OF_ROWS and node.target not in (
            aten.floor_divide.default, aten.floor_divide.Scalar, aten.empty_like.default):
        node = node.args[0]
    if getattr(node, "target", None) is not operator.getitem or node.args[1] != 0:
        return None
    sort = node.args[0]
    return router_experts(sort.args[0]) if getattr(sort, "target", None) in SORTS else None


class OwnLayer:
    """What a rank's program knows of one layer's local routing: the top-k ``k`` its rows were
    flattened by, their flat row map, and, once sorted, the routing and the sorted rows' map."""

    def __init__(self, k: int, flat: Any, routing: Any = None, sorted_rows: Any = None, experts: int = 0):
        self.k, self.flat, self.routing, self.sorted_rows = k, flat, routing, sorted_rows
        self.routing_experts = experts


def own_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's program for an op of the local routing. ``ctx.own`` keeps, for each OWN node
    of the rank's graph, what its values are and its layer (:class:`OwnLayer`): ``"values"``
    (flattened top-k ids or weights), ``"ids"`` (the sorted expert ids), or positions among the
    rank's ``"flat"`` rows, its ``"tokens"``, its ``"sorted"`` rows (``"unset"``: not yet
    written), so that each gather checks that its index points into the tensor it reads."""
    from ...distributed import expert_routing as R
    from ...distributed import experts as E

    target = info.target
    node = ctx.node
    if not any(is_own(p) for p in strategy.inputs):   # the flatten
        x = ctx.inputs[0]
        k = info.inputs[0].static(1)
        rows = ctx.rows_of(x)
        # of a sequence split's token rows, made once per shape like them (no kernel a step)
        make = (R.token_flat_rows, tuple(rows.args) + (k,)) if rows.target is E.token_rows else (R.flat_rows, (rows, k))
        ctx.made_rows = ctx.shared_rows(("own flat rows", rows, k), lambda: make)
        ctx.made_rows.meta["autotp_rows_ascending"] = bool(rows.meta.get("autotp_rows_ascending"))
        ctx.own_made = ("values", OwnLayer(k, ctx.made_rows))
        return target, (args[0], [-1]) + tuple(args[2:]), kwargs
    if (target in SORTS or target in ARGSORTS) and info.inverts:
        # argsort(perm) / sort(perm)[1], perm the routing's sort of the rank's flat rows: the
        # inverse of the rank's own sort, which is a permutation of its rows (its sorted rows'
        # position of each flat row), as the whole one is of every row
        layer = _inverted_layer(ctx, node)
        ctx.made_rows = layer.flat
        if target in ARGSORTS:
            ctx.own_made = ("sorted", layer)
        else:   # the sorted values are arange over the rank's rows: positions no op reads as any
            ctx.own_outputs = (("arange", layer), ("sorted", layer))
        return target, args, kwargs
    if target in SORTS or target in ARGSORTS:
        kind, layer = _values(ctx, ctx.inputs[0], node)
        experts = router_experts(node.args[0])
        if kind != "values" or experts is None:
            raise _refused(f"{node.name} sorts a rank's own rows routed alone, but its values are not a router's "
                           f"top-k expert ids (a topk over a static number of experts); it must sort every row")
        # one run (numbered rank-major within an expert): the rank needs not know the batch,
        # and exchanges ``experts`` counts (Megatron's dispatcher's order)
        routing = ctx.comm(R.RouteLocally(ctx.group, 1, experts, ctx.tp, ctx.rank), ctx.inputs[0])
        ctx.made_rows = ctx.graph.call_function(getattr, (routing, "rows"))
        layer = OwnLayer(layer.k, layer.flat, routing, ctx.made_rows, experts)
        ctx.own_layers[ctx.made_rows] = layer
        if target in ARGSORTS:
            ctx.own_made = ("flat", layer)
            return getattr, (routing, "perm"), {}
        ctx.own_outputs = (("ids", layer), ("flat", layer))
        return R.sorted_locally, (routing,), {}
    if target is aten.histc.default:
        kind, layer = _values(ctx, ctx.inputs[0], node)
        if kind not in ("values", "ids"):
            raise _refused(f"{node.name} counts a rank's own positions ({kind}), which mean nothing on another "
                           f"rank; it must count every row")
        from ...distributed.experts import histc

        if strategy.output == PARTIAL:   # the rank's rows' histogram: a summand
            return histc, args, kwargs
        given = dict(zip(("bins", "min", "max"), args[1:]), **kwargs)
        bins, low, high = given.get("bins", 100), given.get("min", 0), given.get("max", 0)
        if kind == "ids" and bins == layer.routing_experts:   # every expert's rows, exchanged already
            return R.routed_counts, (layer.routing, node.meta["val"].dtype), {}
        # another count of the rank's rows by id: each rank's histogram, gathered and summed
        return R.GatheredHistc(ctx.group, bins, low, high, ctx.tp), (args[0],), {}
    if target is aten.bincount.default:
        kind, layer = _values(ctx, ctx.inputs[0], node)
        if kind not in ("values", "ids"):
            raise _refused(f"{node.name} counts a rank's own positions ({kind}), which mean nothing on another "
                           f"rank; it must count every row")
        if strategy.output == PARTIAL:   # the rank's rows' count: a summand, as long as the whole's
            return target, args, kwargs
        if kind != "ids" or info.output.static(0) != layer.routing_experts:
            raise _refused(f"{node.name} counts a rank's own rows whole, but not the sorted expert ids of its "
                           f"routing over its {layer.routing_experts} experts; it must count every row "
                           f"(pass bincount's minlength as the number of experts)")
        return R.routed_counts, (layer.routing, node.meta["val"].dtype), {}
    if target in (aten.floor_divide.default, aten.floor_divide.Scalar):
        kind, layer = _values(ctx, ctx.inputs[0], node)
        if kind in ("values", "ids"):   # values divided in place: still values
            ctx.own_made = ("values", layer)
            return target, args, kwargs
        if kind != "flat" or args[1] != layer.k:
            raise _refused(f"{node.name} divides a rank's own row positions by {args[1]!r}, not by the top-k "
                           f"{layer.k} its rows were flattened by; it must run on every row")
        ctx.own_made = ("tokens", layer)
        return target, args, kwargs
    if target in (aten.index_put_.default, aten.index_put.default) or target in SCATTERS:
        # inv[perm] = arange(n) or inv.scatter_(0, perm, arange(n)) (routing.inverted: every
        # entry of inv written once, whatever it held)
        base, index, values = ctx.inputs
        layer = _inverted_layer(ctx, node)
        if _values(ctx, base, node)[1] is not layer:
            raise _refused(f"{node.name} writes the inverse of a rank's own sort into {_name(node.args[0])}, which "
                           f"holds other rows than the sort's; it must run on every row")
        ctx.made_rows = layer.flat
        ctx.own_made = ("sorted", layer)
        # the rank's sorted rows' positions, not the whole arange (which nothing else reads: erased)
        ctx.unused.append(values)
        at = 3 if target in SCATTERS else 2
        captured = node.args[at] if len(node.args) > at else node.kwargs["src" if target in SCATTERS else "values"]
        local = ctx.graph.call_function(R.own_arange, (layer.routing, captured.meta["val"].dtype))
        if target in SCATTERS:
            return target, tuple(args[:3]) + (local,) + tuple(args[4:]), kwargs
        return target, (args[0], args[1], local) + tuple(args[3:]), kwargs
    if target is aten.index.Tensor:
        x, index = ctx.inputs
        kind, layer = _values(ctx, index, node)
        have = strategy.inputs[0]
        if isinstance(have, Shard):   # a stack of experts picked by the sorted ids: its experts' rows
            return _counted_pick(info, strategy, kind, ctx)
        if have == REPLICATE:   # whole rows: the rank's own, by their global ids
            # the index's positions among the rank's flat rows, its tokens, or its sorted rows
            # (``out[inv]`` where the experts' output rows were made whole: placed by the global
            # ids its routing gave its sorted rows, ``LocalRouting.rows``)
            if kind == "tokens":
                ids = ctx.graph.call_function(R.flat_tokens, (layer.flat, layer.k))
            else:
                ids = {"flat": layer.flat, "sorted": layer.sorted_rows}.get(kind)
            if ids is None:
                raise _refused(f"{node.name} gathers whole rows by a rank's own positions ({kind}, "
                               f"{_name(node.args[1][0])}), which number no rows of the whole; it must gather every "
                               f"row")
            ctx.made_rows = ctx.rows_of(index)
            at = ctx.graph.call_function(aten.index_select.default, (ids, 0, index))
            return aten.index_select.default, (x, 0, at), {}
        if is_own(have):   # the flattened weights (or ids) by the sort's positions
            fits = kind == "flat" and ctx.rows_of(x) is layer.flat
        elif _in_order(have):   # the tokens' rows by the sorted rows' tokens: h[perm // k]
            fits = kind == "tokens"
        else:   # the experts' output rows the combine brought back, in the order the rank sorted them
            fits = kind == "sorted" and ctx.rows_of(x) is layer.sorted_rows
        if not fits:
            raise _refused(f"{node.name} gathers by a rank's own positions ({kind}, {_name(node.args[1][0])}) from "
                           f"rows they do not number ({_name(node.args[0])}, {have}); it must gather every row")
        ctx.made_rows = ctx.rows_of(index)
        if getattr(strategy.output, "ascending", False) and not ctx.made_rows.meta.get("autotp_rows_ascending"):
            raise _refused(f"{node.name} is planned to put the rows back in the rank's tokens' order, but its tokens' "
                           f"rows were not in sequence order ({_name(node.args[1][0])})")
        if is_own(strategy.output):
            ctx.own_made = _values(ctx, x, node)
        return target, args, kwargs
    # casts, copies, empty_like: each entry kept in its place
    kind, layer = _values(ctx, ctx.inputs[0], node)
    ctx.own_made = ("unset", layer) if target is aten.empty_like.default else (kind, layer)
    return target, args, kwargs


def _counted_pick(info: OpInfo, strategy: Strategy, kind: str, ctx: LocalContext):
    """``stack[ids]`` for the sorted ids of the rank's routing, counted into a grouped product's
    ``offs`` (:func:`~.routing.counted_pick`): the rows of the rank's experts among every row
    sorted by expert (the products' row map and bounds, one pair of nodes per layer), each its
    expert's row of the stack (:func:`~autotp.distributed.expert_routing.sorted_pick`)."""
    from ...distributed import expert_routing as R
    from ...placements import local_ranges
    from .dispatch_sizes import sorted_rows
    from .routing import counted_by

    node = ctx.node
    total = int(info.inputs[0].shape[0])
    offs = counted_by(node.args[1][0], total)
    if kind != "ids" or offs is None or offs not in ctx.env:
        raise _refused(f"{node.name} picks a stack of {total} experts by a rank's own {kind} (not the sorted "
                       f"expert ids counted into a grouped product's offs); it must pick by every row's ids")
    ((first, stop),) = local_ranges(total, strategy.inputs[0], ctx.tp, ctx.rank) or ((0, 0),)
    _, ctx.made_rows = sorted_rows(ctx.env[offs], first, stop - first, ctx)
    return R.sorted_pick, (ctx.inputs[0], ctx.env[offs], ctx.made_rows, first), {}


#: what a user can do where a rank's program refuses an op of the local routing (the rules
#: offered it a rank's own rows the op cannot read so: a bug of the rules)
FIX = ("plan with sequence_parallel=False to route every row on every rank (an autotp bug where the solver chose "
       "this routing: please report it)")


def _refused(message: str) -> Exception:
    """The PlanError of an op of the local routing its rank cannot run: the op, the cause, the fix."""
    from ...errors import PlanError

    return PlanError(f"{message}; {FIX}")


def _inverted_layer(ctx: LocalContext, node: Any) -> "OwnLayer":
    """The layer whose sort the captured ``node`` inverts (the graph's one recognizer,
    :func:`~.routing.inverted`: ``inv[p] = arange(n)``, a scatter of it, ``argsort(p)``,
    ``sort(p)[1]``), ``p`` the positions the rank's own sort gave its flat rows."""
    import operator

    made = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 1), None) \
        if node.target in SORTS else node
    p = inverted(made) if made is not None else None
    if p is None:
        raise _refused(f"{node.name} makes no inverse of a permutation the graph proves (inv[p] = arange(n), its "
                       f"scatter, argsort(p) or sort(p)[1] of a permutation p) from a rank's own rows routed alone; "
                       f"it must run on every row")
    found = ctx.own.get(ctx.env.get(p))
    if found is None or found[0] != "flat":
        raise _refused(f"{node.name} inverts {_name(p)}, not the positions the rank's own sort gave its rows; it must "
                       f"run on every row")
    return found[1]


def _name(node: Any) -> str:
    return getattr(node, "name", repr(node))


def _values(ctx: LocalContext, x: Any, node: Any) -> tuple[str, "OwnLayer"]:

    found = ctx.own.get(x)
    if found is None:
        raise _refused(f"{node.name} reads a rank's own rows routed alone ({_name(x)}) that no op of the local "
                       f"routing made")
    return found
