"""A product's bias added inside the product, as the serial model adds it.

Capture splits ``addmm(b, x, W)`` and ``linear(x, W, b)`` into the product and an ``add`` of the
bias (:mod:`autotp.capture.normalize`), so that the rules can place the bias apart: a row-parallel
bias is added once, after the g. Where nothing stands between the product and its bias on a rank
(column-parallel: the bias split like the product's columns; a replicated or batch-split product),
the rank's program adds it inside the product again, in the call the serial model makes
(:func:`fused_product`: ``addmm`` on the flattened tokens, or ``linear`` with its bias): one kernel
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


def _parameter(node: Any, param_names: Any) -> bool:
    """A parameter's placeholder, or parameters joined along dim 0 (``cat``: sibling products'
    weights and biases fused, :mod:`autotp.passes.products`)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target is aten.cat.default and len(node.args) == 1 and not node.kwargs:
        return all(_parameter(p, param_names) and p.op == "placeholder" for p in node.args[0])
    return node.op == "placeholder" and node.name in param_names


def bias_add(node: fx.Node, param_names: Any) -> bool:
    """``add(x @ W, b)``: a product of an activation and a 2-D weight (both parameters' reads,
    placeholders named in ``param_names``, or such placeholders joined by a ``cat``), read by this add alone, plus a 1-D parameter as long
    as the product's last dim and of its dtype: what ``addmm``/``linear`` with a bias computes."""
    if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return False
    product, bias = node.args
    if not isinstance(product, fx.Node) or product.op != "call_function" or product.target not in PRODUCTS \
            or len(product.args) != 2 or product.kwargs or len(product.users) != 1:
        return False
    weight = product.args[1]
    if not all(_parameter(p, param_names) for p in (weight, bias)):
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


def fused_product(graph: fx.Graph, product: fx.Node, bias: fx.Node, ndim: int) -> fx.Node | None:
    """The product node of a rank's program with ``bias`` added inside it, inserted where it is
    called (after ``bias``, which may be a conversion made after the product); ``product`` is left
    without readers for the caller to erase. ``ndim``: the dims of the product's output (and of
    its activation). None where ``product`` is not a plain product of the rank's program (a padded
    one is a slice of a wider product: its bias stays an add).

    What serial runs: ``linear(x, W, b)`` where W is stored ``[out, in]`` (nn.Linear), ``addmm``
    where x is 2-D, and where W is stored ``[in, out]`` on a 3-D or wider x (HF's Conv1D)
    ``addmm(b, x.reshape(-1, in), W)`` viewed back to x's leading dims, read from x at run time
    (dynamic batch and sequence). ``linear(x, W.T, b)`` would compute the same with a transpose of
    W each way and linear's own transpose back, forward and backward: four views a product more
    than serial makes, host work on every step."""
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
    if product.target is aten.mm.default or ndim == 2:
        return made(aten.addmm.default, (bias, x, w))
    # x [..., K] @ W [K, N]: HF's Conv1D's own call on the flattened tokens, a view each side
    # (reshape: a view where x is laid out densely, as serial's x is; a copy, never an error,
    # where a rank's x is not)
    sizes = [made(aten.sym_size.int, (x, d)) for d in range(ndim)]
    flat = made(aten.reshape.default, (x, [-1, sizes[-1]]))
    out = made(aten.addmm.default, (bias, flat, w))
    out.meta["autotp_ndim"] = 2   # the bias, 1-D, broadcast over its rows (in_place.BIASED)
    # the width named, not -1: a rank whose run of the sequence is empty has no rows to infer it from
    return made(aten.view.default, (out, [*sizes[:-1], made(aten.sym_size.int, (w, 1))]))
