"""The rows ``h[perm // k]`` a column-parallel expert product reads, from the tokens a rank holds.

Under expert-TP with the tokens split along the sequence (``h``: ``P(tokens 0)``, a rank's ``b``
runs of ``s/tp`` tokens), the gather of the (token, expert) rows in the order of the sort by
expert was offered two ways: the tokens all-gathered first and every row gathered whole on every
rank (its backward a scatter-add of ``[T*k, h]`` on every rank), or each rank's tokens' rows
reordered on their rank (``P(tokens 0, reordered)``), scattered into zeros and all-reduced (a g of
``[T*k, h]``), with the f of the product's gradient on them (an all-reduce of ``[T*k, h]`` again).

Where the index is ``perm // k`` for a permutation ``perm`` of the ``T*k`` rows (:func:`row_copies`:
every token taken exactly ``k`` times), a rank's count of rows is ``k`` times its tokens', which
the shapes give, so the rows can be all-gathered (``(n-1)/n`` of the bytes) with no read:
``[P(tokens 0), R] -> R(grad P)`` with the all-gather inside (``all_gather_rows``; its backward a
reduce-scatter of the gradient's summands to the tokens' ranks, the f fused in), localized to
:class:`autotp.distributed.gathered_rows.GatherRowsTP`. The solver weighs it against both.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch

from ...placements import REPLICATE, REPLICATE_PARTIAL_GRAD, Routed
from .contract import LocalContext, OpInfo, Strategy
from .routing import index_length, is_permutation, written

aten = torch.ops.aten

#: the internal collective's kind (cost_model/symbolic.COLLECTIVES: an all-gather, backward a
#: reduce-scatter), its rows laid out in sorted order by one gather each way
KIND = "all_gather_rows"


def row_copies(node: Any) -> int:
    """``k`` where ``node`` is ``x[index]`` of float rows and the graph makes ``index`` ``p // k``
    (``floor_divide`` by an int) of a permutation ``p`` of ``k`` times x's rows
    (:func:`.routing.is_permutation`): every row of x taken exactly ``k`` times. 0 otherwise."""
    from torch import fx

    from ...capture import shape_of

    if not (isinstance(node, fx.Node) and node.target is aten.index.Tensor and len(node.args) == 2
            and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) == 1):
        return 0
    x, index = node.args[0], node.args[1][0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.ndim >= 1):
        return 0
    if getattr(index, "target", None) is not aten.floor_divide.default or written(index):
        return 0
    perm, k = index.args[:2]
    if not (isinstance(k, int) and k >= 1 and is_permutation(perm)):
        return 0
    n = index_length(perm)
    return k if n is not None and sympy.expand(n - k * shape_of(x)[0]) == 0 else 0


def gathered_rows_strategies(info: OpInfo, p: Routed) -> list[Strategy]:
    """``[P(tokens 0), R] -> R(grad P)`` with the rows all-gathered inside, for ``h[perm // k]``
    (:func:`row_copies`) of a rank's tokens in sequence order read by a grouped product (whole on
    every rank, its gradient a summand there); else nothing."""
    if not (info.row_copies and info.gathers_expert_rows and info.tp > 1 and p.tokens and not p.reordered
            and p.span == 1 and p.dim == 0 and p.unit == 1):
        return []
    return [Strategy((p, REPLICATE), REPLICATE_PARTIAL_GRAD, internal=((KIND, info.output),))]


def gathers_rows(strategy: Strategy) -> bool:
    """Whether ``strategy`` is :func:`gathered_rows_strategies`'."""
    return any(kind == KIND for kind, _ in strategy.internal)


def rank_rows_work(info: OpInfo, strategy: Strategy) -> tuple[OpInfo, Strategy]:
    """The op and strategy whose work a rank does under :func:`gathered_rows_strategies`: the
    gather of its own tokens' rows (``1/tp`` of them, the reorder that keeps them on their rank),
    with no read to the host (its count is the shapes') and no dispatch to plan (its rows are
    gathered, not sent; a dispatch is priced at the product that sends rows,
    ``cost_model/routing.dispatch_work``); the all-gather and the
    layout of the whole rows are the internal collective's (``propagate.internal_seconds``)."""
    p = strategy.inputs[0]
    # the internal all-gather kept: it says the rank runs GatherRowsTP's gather, not a reorder's
    # (cost_model/routing.reorders_rows), and is priced by the collective's own time, not here
    return replace(info, reads_rows=False, routing_experts=0), Strategy(strategy.inputs, replace(p, reordered=True),
                                                                        internal=strategy.internal)


def gathered_rows_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's program: :class:`~autotp.distributed.gathered_rows.GatherRowsTP` on its tokens'
    rows, their row map (a sequence split's, :func:`autotp.distributed.experts.token_rows`:
    ascending, its merged dims known) and every token's holder."""
    from ...distributed import experts as E
    from ...distributed.gathered_rows import GatherRowsTP
    from ...errors import PlanError

    x, index = ctx.inputs
    rows = ctx.rows_of(x)
    if rows.target is not E.token_rows or x not in ctx.owners:
        raise PlanError(f"{ctx.node.name} gathers the rows of tokens held as {strategy.inputs[0]} whose row map "
                        f"is not a sequence split's ({rows.name}): the all-gather of their rows needs each rank's "
                        "count from the shapes (an autotp bug: please report it); plan with sequence_parallel=False "
                        "to gather the tokens whole")
    _, _, outer, seq, _, _, _ = rows.args
    module = GatherRowsTP(ctx.group, info.row_copies)
    return module, (x, index, rows, ctx.owners[x], outer, seq), {}
