"""A product's bias added inside the product, as the serial model adds it.

Capture splits ``addmm(b, x, W)`` and ``linear(x, W, b)`` into the product and an ``add`` of the
bias (:mod:`autotp.capture.normalize`), so that the rules can place the bias apart: a row-parallel
bias is added once, after the g. Where nothing stands between the product and its bias on a rank
(column-parallel: the bias split like the product's columns; a replicated or batch-split product),
the rank's program adds it inside the product again (``addmm``, or ``linear`` with its bias, which
eager PyTorch runs as ``addmm`` over the flattened tokens), as the serial model does: one kernel
and one pass over the product's output fewer a product (forward; backward is the same: the bias's
gradient is the sum of the output's gradient over the tokens either way).

Input: a captured ``add`` node (:func:`bias_add` says whether it adds a parameter bias to a
parameter product it alone reads) and, at plan time, whether its chosen strategy takes the product
as the product makes it (no conversion, no f between: :func:`takes_as_made`;
:class:`~autotp.passes.rules.contract.Strategy` ``fused``). The cost model prices a fused add's
forward kernel as nothing (:func:`autotp.cost_model.kernels.op_work`); the rewrite emits the fused
product (:func:`fused_product`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

#: products a bias can be folded back into: (x, W) -> their form with a bias
PRODUCTS = (aten.mm.default, aten.matmul.default, aten.linear.default)


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def bias_add(node: fx.Node, param_names: Any) -> bool:
    """``add(x @ W, b)``: a product of an activation and a 2-D weight (both parameters' reads
    placeholders named in ``param_names``), read by this add alone, plus a 1-D parameter as long
    as the product's last dim and of its dtype: what ``addmm``/``linear`` with a bias computes."""
    if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return False
    product, bias = node.args
    if not isinstance(product, fx.Node) or product.op != "call_function" or product.target not in PRODUCTS \
            or len(product.args) != 2 or product.kwargs or len(product.users) != 1:
        return False
    weight = product.args[1]
    if not all(isinstance(p, fx.Node) and p.op == "placeholder" and p.name in param_names for p in (weight, bias)):
        return False
    out, b, w, x = _val(product), _val(bias), _val(weight), _val(product.args[0])
    if out is None or b is None or w is None or x is None:
        return False
    if product.target is aten.mm.default and x.dim() != 2:
        return False
    return (w.dim() == 2 and b.dim() == 1 and out.dim() >= 2 and b.shape[0] == out.shape[-1]
            and b.dtype == out.dtype == x.dtype == w.dtype)


def takes_as_made(strategy: Any, actual: tuple, f: bool | str) -> bool:
    """Whether a strategy of a bias add takes the product as it arrives (``actual``, the
    product's placement), with no f: then no collective or copy stands between the two."""
    return bool(actual) and strategy.inputs[0] == actual[0] and not f


def fused_product(graph: fx.Graph, product: fx.Node, bias: fx.Node) -> fx.Node | None:
    """The product node of a rank's program with ``bias`` added inside it, inserted where it is
    called (after ``bias``, which may be a conversion made after the product); ``product`` is left
    without readers for the caller to erase. None where ``product`` is not a plain product of the
    rank's program (a padded one is a slice of a wider product: its bias stays an add)."""
    if product.op != "call_function" or product.target not in PRODUCTS or len(product.args) != 2 \
            or product.kwargs or product.users:
        return None
    x, w = product.args

    def made(target: Any, args: tuple) -> fx.Node:   # in the product's layer (activation checkpointing)
        node = graph.call_function(target, args)
        node.meta.update({k: product.meta[k] for k in ("stack_trace", "nn_module_stack") if k in product.meta})
        return node

    if product.target is aten.linear.default:
        return made(aten.linear.default, (x, w, bias))
    if product.target is aten.mm.default:
        return made(aten.addmm.default, (bias, x, w))
    # x [..., K] @ W [K, N]: linear(x, W.T, b) (GPT-2's Conv1D; eager runs it as addmm on x's
    # flattened tokens, HF's Conv1D's own call)
    return made(aten.linear.default, (x, made(aten.t.default, (w,)), bias))
