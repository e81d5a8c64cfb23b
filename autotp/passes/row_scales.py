"""Per-row scales moved to a product's narrower side: a capture -> the same program with
``(x @ W) * s`` computed as ``(x * s) @ W`` where that is cheaper.

A mixture of experts weights each (token, expert) row by its routing weight after the down
product: ``y = grouped_mm(x, W, offs)`` (``[rows, hidden]``), then ``y * s`` with ``s``
``[rows, 1]``. The scale is one number per row, broadcast along the product's output columns,
and the product is linear in each row of x, so ``(x * s) @ W == (x @ W) * s`` up to rounding:
the same rows, the same gradients (the scale's gradient is the sum over the row of either
side's product with the incoming gradient). Under expert-TP a rank holds x split on its
features (``[rows, inter / tp]``) and y a partial sum on the whole width (``[rows, hidden]``),
so the scale and its backward run on ``inter / tp`` columns instead of ``hidden`` (Qwen3-30B-A3B
at tp 8: 96 against 2048); under expert parallelism or at tp 1 on ``inter`` against ``hidden``.

Found from the graph alone (:func:`row_scales`): an ``aten.mul.Tensor`` of a product's output,
the product's only use, by a tensor of the output's rows and one column; the product a grouped
one (``_grouped_mm``, transformers' ``grouped_mm_fallback``: ``[rows, in] x [experts, in, out]``)
or a ``bmm`` of picked matrices by x's rows as columns (``bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)``,
transformers' batched experts). Where a bias is added between the product and the scale
(gpt-oss's experts) nothing matches: the bias would have to be scaled too.

:func:`moved` returns a new capture (the given one is cached and shared: never edited) in which
each given scale multiplies x right before the product, under the name of the multiply it
replaces. The planner (:mod:`autotp.planner.planner`) offers it where a rank's x is narrower
than its y under the solved layout, solves or replays the moved capture too, and keeps the
cheaper predicted step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from ..capture import Capture
from ..capture.program import op_name

aten = torch.ops.aten

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:   # pragma: no cover - present in every torch autotp supports
    _LazyGraphModule = fx.GraphModule

#: grouped products of experts: x (argument 0, ``[rows, in]``) -> ``[rows, out]``, each row of
#: the output a product of x's same row alone
_GROUPED = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")


@dataclass(frozen=True)
class RowScale:
    """One per-row scale of a product's output: ``mul`` (the multiply's node name) scales
    ``product``'s output by ``scale``; ``x`` is the product's input rows (its node name),
    ``inner`` and ``outer`` x's and the output's widths (columns)."""

    mul: str
    product: str
    x: str
    scale: str
    inner: int
    outer: int


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same_size(a: Any, b: Any) -> bool:
    """Two sizes known equal without a guard: equal ints, or SymInts of one expression."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else a
    eb = b.node.expr if isinstance(b, torch.SymInt) else b
    return ea == eb


def _product_x(y: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(x, the node consuming x) where ``y`` is a row-wise product of x's rows, else None."""
    if y.op != "call_function":
        return None
    if op_name(y.target) in _GROUPED:
        x = y.args[0]
        return (x, y) if isinstance(x, fx.Node) else None
    # transformers' batched experts: bmm(W[ids] [rows, out, in], x.unsqueeze(-1) [rows, in, 1]).squeeze(-1)
    if y.target is aten.squeeze.dim and y.args[1] in (-1, 2):
        bmm = y.args[0]
        if not (isinstance(bmm, fx.Node) and bmm.target is aten.bmm.default and len(bmm.users) == 1):
            return None
        col = bmm.args[1]
        if not (isinstance(col, fx.Node) and col.target is aten.unsqueeze.default and col.args[1] in (-1, 2)
                and len(col.users) == 1 and isinstance(col.args[0], fx.Node)):
            return None
        return col.args[0], col
    return None


def row_scales(cap: Capture) -> list[RowScale]:
    """Every per-row scale of a row-wise product's output in ``cap`` that may move to its input."""
    found = []
    for node in cap.graph.nodes:
        if node.op != "call_function" or node.target is not aten.mul.Tensor or len(node.args) != 2:
            continue
        for y, s in (node.args, node.args[::-1]):
            if not (isinstance(y, fx.Node) and isinstance(s, fx.Node) and len(y.users) == 1):
                continue
            hit = _product_x(y)
            if hit is None:
                continue
            x = hit[0]
            xv, yv, sv, out = _val(x), _val(y), _val(s), _val(node)
            if xv is None or yv is None or sv is None or out is None or xv.dim() != 2 or yv.dim() != 2:
                continue
            # one number per row, broadcast along the output's columns, in a dtype that changes
            # neither x's (the product takes x's) nor the output's
            if not (sv.dim() == 2 and _same_size(sv.shape[1], 1) and _same_size(sv.shape[0], yv.shape[0])
                    and _same_size(xv.shape[0], yv.shape[0])):
                continue
            if not (xv.dtype == yv.dtype == out.dtype and torch.result_type(xv, sv) == xv.dtype):
                continue
            inner, outer = xv.shape[1], yv.shape[1]
            if not (isinstance(inner, int) and isinstance(outer, int)):
                continue
            late = _late(s, hit[1])
            if late is None or any(op_name(n.target).split(".")[-2].endswith("_") for n in late
                                   if n.op == "call_function" and "." in op_name(n.target)):
                continue   # computed from the product (not a scale of its rows), or written in place
            found.append(RowScale(node.name, y.name, x.name, s.name, inner, outer))
            break
    return found


def _late(s: fx.Node, consumer: fx.Node) -> list[fx.Node] | None:
    """``s`` and what it is computed from that the graph computes after ``consumer``, in graph
    order (to move before it); None where ``s`` depends on ``consumer`` itself."""
    order = {n: i for i, n in enumerate(s.graph.nodes)}
    late, stack = set(), [s]
    while stack:
        n = stack.pop()
        if n is consumer:
            return None
        if n in late or order[n] < order[consumer]:
            continue
        late.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(late, key=order.get)


def moved(cap: Capture, scales: list[RowScale]) -> Capture:
    """A copy of ``cap`` in which each of ``scales`` multiplies the product's x instead of its output."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(cap.graph, {}))   # the copy keeps the nodes' names and metadata
    for scale in scales:
        _move(graph, {n.name: n for n in graph.nodes}, scale)
    graph.lint()
    gm = _LazyGraphModule(cap.graph_module, graph)   # its code written when first run, as the capture's
    gm.meta.update(cap.graph_module.meta)
    return replace(cap, graph_module=gm)


def _move(graph: fx.Graph, nodes: dict[str, fx.Node], scale: RowScale) -> None:
    mul, x, s, y = nodes[scale.mul], nodes[scale.x], nodes[scale.scale], nodes[scale.product]
    consumer = _product_x(y)[1]
    # the scale and what it is computed from, where the graph computes them after the product,
    # move to just before it, in their order (none of them reads the product: row_scales)
    for n in _late(s, consumer):
        consumer.prepend(n)
    with graph.inserting_before(consumer):
        scaled = graph.call_function(aten.mul.Tensor, (x, s))
    # the multiply's module, with x's shape and dtype (s broadcasts along x's columns); none of
    # the output's shapes cached by the stages that read the capture before (autotp_*)
    scaled.meta = {k: v for k, v in mul.meta.items() if k not in ("val", "tensor_meta") and not k.startswith("autotp_")}
    scaled.meta.update({k: x.meta[k] for k in ("val", "tensor_meta") if k in x.meta})
    consumer.replace_input_with(x, scaled)
    mul.replace_all_uses_with(y)
    name = mul.name
    graph.erase_node(mul)
    scaled.name = name   # the multiply keeps its name: plans and notes name it as before
