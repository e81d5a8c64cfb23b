"""Products and attention as a rank runs them: every matrix product of the forward and of the
backward, with its shape (its efficiency depends on it), and fused attention's FLOPs and bytes."""
from __future__ import annotations

from typing import Any

import sympy
import torch

from .work import OpWork, Product, RankOp, Attention, aligned, aligned_width, element_bytes, flag, local_shape, prod

aten = torch.ops.aten


def product_work(op: RankOp, dtype_bytes: int, train_dtype: Any) -> OpWork:
    """``mm``, ``linear``, ``bmm``, ``matmul`` on the local shapes: the forward product, and in
    backward ``dX = dY·Wᵀ`` where x carries a gradient and ``dW = Xᵀ·dY`` where W does."""
    t = op.info.target
    x, w = (local_shape(m, p, op.tp, op.rank, op.share) for m, p in zip(op.inputs[:2], op.in_place[:2]))
    if t is aten.linear.default:
        k, n, batch, m = x[-1], w[0], sympy.Integer(1), prod(x[:-1])
    elif len(x) >= 3 and len(w) >= 3:                       # batched
        k, n, m, batch = x[-1], w[-1], x[-2], prod(x[:-2])
    else:
        k, n, batch, m = x[-1], w[-1], sympy.Integer(1), prod(x[:-1])
    eb = element_bytes(op.inputs[0].dtype, dtype_bytes, train_dtype)
    ok = aligned(k, eb) and aligned(n, eb)
    shapes = [(m, n, k)]
    if op.grad[0]:
        shapes.append((m, k, n))
    if len(op.grad) > 1 and op.grad[1]:
        shapes.append((k, n, m))
    wide = None
    if not ok and len(op.inputs[1].shape) == 2 and not getattr(op.strategy, "f_runs_only", False) \
            and getattr(n, "is_Integer", False) and aligned(k, eb):
        wide = sympy.Integer(aligned_width(int(n), eb))   # the rewrite may pad N (and the backward's K)
    products = []
    for first, (a, b, c) in enumerate(shapes):
        padded = pad = None
        if wide is not None:
            grow = {id(n): wide}
            padded = Product(*(grow.get(id(d), d) for d in (a, b, c)), batch, True)
            # forward: the weight's shard copied at the padded width; backward: the output's
            # gradient written into a zero-padded buffer
            pad = k * wide * eb * 2 if first == 0 else (m * wide * eb * 2 if (a, b, c) == (m, k, n) else 0)
        products.append(Product(a, b, c, batch, ok, padded, sympy.sympify(pad or 0), m * batch))
    return OpWork(products=tuple(products), launches=len(products))


def grouped_work(op: RankOp, dtype_bytes: int, train_dtype: Any) -> OpWork:
    """A grouped product (each row by its expert's matrix): priced as one product per expert this
    rank holds, of the rows an expert gets on average."""
    x = local_shape(op.inputs[0], op.in_place[0], op.tp, op.rank, op.share)
    w = local_shape(op.inputs[1], op.in_place[1], op.tp, op.rank, op.share)
    out = local_shape(op.outputs[0], op.out_place[0], op.tp, op.rank, op.share)
    k, n = x[-1], out[-1]
    groups = w[0] if len(w) >= 3 else sympy.Integer(1)               # this rank's experts
    experts = op.inputs[1].shape[0] if len(w) >= 3 else sympy.Integer(1)
    eb = element_bytes(op.inputs[0].dtype, dtype_bytes, train_dtype)
    ok = aligned(k, eb) and aligned(n, eb)
    m = prod(op.outputs[0].shape[:-1]) / experts    # the rows an expert gets on average
    batch, streamed = groups, k * n
    if op.share is not None and len(w) >= 3 and _whole_experts(op.in_place[1]):
        # under a router's load (autotp/planner/expert_load.py) the rank's experts get its share
        # of the rows, not their count's share: priced as ``share * experts`` products of the
        # average expert's rows (its FLOPs those of the rank's rows; each product's shape, and so
        # its rate, a balanced router's: the product model's rate, whose weight-gradient product
        # contracts over the rows, would make a tiny one cheaper with more rows), the weights
        # streamed those of the rank's own experts
        batch = sympy.Float(op.share, 12) * experts
        streamed = k * n * groups / batch
    products = [Product(m, n, k, batch, ok, streamed=streamed)]
    if op.grad[0]:
        products.append(Product(m, k, n, batch, ok, streamed=streamed))
    if len(op.grad) > 1 and op.grad[1]:
        products.append(Product(k, n, m, batch, ok, streamed=streamed))
    return OpWork(products=tuple(products), launches=len(products))


def _whole_experts(p: Any) -> bool:
    """A stack of experts split by expert (expert parallelism's Shard(0)): whole experts per rank."""
    from ..placements import Shard

    return isinstance(p, Shard) and p.dim == 0


def attention_work(op: RankOp) -> OpWork:
    info = op.info
    q_shape = local_shape(op.inputs[0], op.in_place[0], op.tp, op.rank, op.share)
    k_shape = local_shape(op.inputs[1], op.in_place[1], op.tp, op.rank, op.share)
    mask = flag(info.args, info.kwargs, 3, "attn_mask", None)
    dropout = flag(info.args, info.kwargs, 4, "dropout_p", 0.0)
    causal = flag(info.args, info.kwargs, 5, "is_causal", False)
    head_dim = q_shape[-1]
    fwd = 4 * prod(q_shape) * k_shape[-2]
    if causal and mask is None:
        fwd = fwd / 2   # the kernels skip the blocks above the diagonal
    total = fwd * (sympy.Rational(7, 2) if any(op.grad[:3]) else 1)   # backward: 5 products to forward's 2
    moved = sum(op.b_in, sympy.Integer(0)) + op.main_out
    if any(op.grad[:3]):
        moved += 2 * sum(op.b_in[:3], sympy.Integer(0)) + 2 * op.main_out
    d = int(head_dim) if getattr(head_dim, "is_Integer", False) else 128
    return OpWork(attention=(Attention(total, d, bool(dropout), moved),), launches=1 + 2 * any(op.grad[:3]))
