"""A rank's run of experts and the nodes its program makes once per expert layer: the bounds of its
experts' rows among the rows sorted by expert, their row map, and, where the tokens' rows go to
their experts' ranks by an all-to-all, the dispatch's split sizes (read to the host with the
bounds, the layer's one read). Shared through the rewrite's context (``ctx.shared_rows``) by the
layer's gather, its two grouped products, the reorder of its tokens' rows and the combine back,
so none reads a count of its own. Used by :mod:`.routed_localizer`."""
from __future__ import annotations

from typing import Any

from ...placements import Routed, local_ranges
from .contract import LocalContext, OpInfo, Strategy


def expert_run(info: OpInfo, strategy: Strategy, i: int, ctx: LocalContext) -> tuple[int, int]:
    """(first expert, experts) this rank holds of input ``i``'s stack."""
    size = int(info.inputs[i].shape[0])
    ((start, stop),) = local_ranges(size, strategy.inputs[i], ctx.tp, ctx.rank) or ((0, 0),)
    return start, stop - start


def dispatches_tokens(strategy: Strategy) -> bool:
    """Whether a grouped product's strategy sends its rows of tokens to their experts' ranks (the
    all-to-all dispatch)."""
    x = strategy.inputs[0] if strategy.inputs else None
    return isinstance(x, Routed) and x.tokens and isinstance(strategy.output, Routed)


def expert_runs(info: OpInfo, strategy: Strategy, ctx: LocalContext) -> tuple[tuple[int, int], ...]:
    """Every rank's (first expert, experts) of a grouped product's stack of experts, in rank order."""
    total = int(info.inputs[1].shape[0])
    runs = tuple(local_ranges(total, strategy.inputs[1], ctx.tp, r) or ((0, 0),) for r in range(ctx.tp))
    return tuple((a, b - a) for ((a, b),) in runs)


def layer_dispatch_sizes(info: OpInfo, strategy: Strategy, offs: Any, owners: Any, ctx: LocalContext) -> Any:
    """The node of a dispatching layer's one read (:func:`autotp.distributed.experts.dispatch_sizes`:
    its bounds, split sizes and so its tokens' rows' count), made once per layer by the first of
    the reorder of its tokens' rows and its dispatching product (``info``, ``strategy``: the
    product's; ``owners``: the holder of each row sorted by expert). The layer's bounds are
    taken from it, so the products read nothing of their own."""
    from ...distributed import experts as E

    first, count = expert_run(info, strategy, 1, ctx)
    key = ("dispatch sizes", offs, first, count)
    if ctx.found_rows(key) is None:
        sizes = ctx.shared_rows(key, lambda: (E.dispatch_sizes, (owners, offs, expert_runs(info, strategy, ctx),
                                                                  ctx.rank)))
        ctx.shared_rows(("bounds", offs, first, count), lambda: (getattr, (sizes, "bounds")))
    return ctx.found_rows(key)


def own_dispatch_sizes(info: OpInfo, strategy: Strategy, offs: Any, routing: Any, ctx: LocalContext) -> Any:
    """:func:`layer_dispatch_sizes` where the rank routed its own rows (``routing``: its
    :class:`~autotp.distributed.expert_routing.LocalRouting`): the same read, from the counts
    its sort exchanged (:func:`~autotp.distributed.expert_routing.local_dispatch_sizes`)."""
    from ...distributed.expert_routing import local_dispatch_sizes

    first, count = expert_run(info, strategy, 1, ctx)
    key = ("dispatch sizes", offs, first, count)
    if ctx.found_rows(key) is None:
        sizes = ctx.shared_rows(key, lambda: (local_dispatch_sizes, (routing, expert_runs(info, strategy, ctx),
                                                                       ctx.rank)))
        ctx.shared_rows(("bounds", offs, first, count), lambda: (getattr, (sizes, "bounds")))
    return ctx.found_rows(key)


def expert_rows(info: OpInfo, strategy: Strategy, offs: Any, ctx: LocalContext) -> tuple[Any, Any]:
    """(bounds, row map) of the rows of this rank's experts among a grouped product's rows sorted
    by expert: one pair of nodes per layer (``offs`` and the run of experts), shared by its two
    products and the gather in front of them, and read to the host once."""
    first, count = expert_run(info, strategy, 1, ctx)
    return sorted_rows(offs, first, count, ctx)


def sorted_rows(offs: Any, first: int, count: int, ctx: LocalContext) -> tuple[Any, Any]:
    """(bounds, row map) of experts ``first .. first + count - 1`` among rows sorted by expert
    (``offs``: the cumulative rows per expert, in the rank's graph), made once per layer."""
    from ...distributed import experts as E

    bounds = ctx.shared_rows(("bounds", offs, first, count), lambda: (E.expert_bounds, (offs, first, count)))
    rows = ctx.shared_rows(("sorted", offs, first, count), lambda: (E.expert_rows, (offs, bounds)))
    # erased where no op reads it: a dispatching layer's products take the rows as they arrive
    # (an arange a layer a call, made and dropped, before)
    ctx.unused.append(rows)
    return bounds, rows
