"""What eager PyTorch runs for one ATen op on one rank, forward and backward.

The cost model prices an op by the work its kernels do, not by a fused ideal: a GPU step spends a
third of its time in memory-bound ops (norms, residual adds, activations, dropout, casts, the
loss's float32 softmax), and those run one kernel per ATen op in eager mode, each reading and
writing whole tensors. :func:`op_work` lists, for an op under a strategy:

* **products**: every matrix product of the forward and of the backward (``dX = dY Wᵀ``,
  ``dW = Xᵀ dY``, each only where that input carries a gradient), with its shape, so that its
  efficiency can depend on it (small, skinny and unaligned products run well below peak);
* **attention**: fused attention's FLOPs (half the score matrix under a causal mask), head
  dim and whether it draws dropout;
* **moved**: the bytes each memory-bound kernel reads and writes, forward and backward, by op
  class (``elementwise``, ``cast``, ``reduction``, ``softmax``, ``norm``, ``random``,
  ``scatter``, ``sort``): each class attains its own share of the memory bandwidth;
* **launches**: how many kernels run (each pays the profile's launch cost);
* **passes**: how many radix-sort passes run (each pays the profile's ``sort_pass_s`` beyond its
  launch and bytes: a pass waits on every earlier tile's digit counts).

Every size is a sympy expression in the graph's batch and sequence symbols, on this rank's
local shapes (a Shard of a static dim: the largest rank's part; of the sequence: 1/tp of it).

Bytes per element: a float tensor in the dtype the model trains in (its parameters') is priced
at the profile's ``dtype_bytes``, so a float32 meta model is planned as it would train on a bf16
device; a float tensor in another dtype keeps its own size: RMSNorm's and the loss's float32
upcasts in a bf16 model move 4 bytes an element, and the casts themselves are kernels.

This module sorts an op into its family; each family's kernels are priced in its own module:
:mod:`.work` (the value types, an op's tensors on a rank), :mod:`.products` (products,
attention), :mod:`.memory_bound` (elementwise ops, casts, softmax, dropout, lookups,
reductions), :mod:`.norms`, :mod:`.loss` (the loss, whole or vocabulary-parallel) and
:mod:`.routing` (the expert routing: top-k, sorts, the rank's own routing and dispatch).
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from .loss import cross_entropy_work
from .memory_bound import cast_work, dropout_work, elementwise_work, embedding_work, reduction_work, softmax_work
from .norms import NORMS, norm_work
from .products import attention_work, grouped_work, product_work
from .routing import (counted_by_exchange, dispatch_work, dispatches, exchanged_counts_work, gathered_rows_work,
                      reorders_rows, routed_reorder_work, sort_work, sums_token_rows, token_sums_work, topk_work)
from .work import NO_WORK, OpWork, RankOp

aten = torch.ops.aten

#: Ops that move no data (views, metadata, reshapes that stay views, casts priced apart).
VIEWS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.t.default, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.slice.Tensor,
    aten.select.int, aten.alias.default, aten.detach.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.sym_size.int, aten.unbind.int, aten.chunk.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.narrow.default, aten.broadcast_to.default,
    aten.numpy_T.default, aten.view_as.default, aten.expand_as.default, aten.lift_fresh_copy.default,
})
#: views whose backward joins the pieces' gradients (one ``cat``)
_PIECES = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default})
COPIES = frozenset({aten.contiguous.default, aten.clone.default})
PRODUCTS = frozenset({aten.mm.default, aten.linear.default, aten.bmm.default, aten.matmul.default})
#: grouped products (mixtures of experts), by name: transformers registers its fallback only once imported
GROUPED_PRODUCTS = frozenset(("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"))
ATTENTION = aten.scaled_dot_product_attention.default

_REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
                         aten.amax.default, aten.amin.default, aten.var.correction, aten.max.dim,
                         aten.min.dim, aten.norm.ScalarOpt_dim, aten.argmax.default, aten.logsumexp.default,
                         aten.cumsum.default, aten.all.default, aten.any.default})
_SOFTMAX = frozenset({aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int})
_RANDOM = frozenset({aten.dropout.default, aten.native_dropout.default, aten.bernoulli.p, aten.rand_like.default})
_GATHERS = frozenset({aten.embedding.default, aten.index.Tensor, aten.index_select.default, aten.gather.default})
#: counts into bins, ``index_add`` (its rows added into a copy of every row; the dispatch's
#: ``index_add_``, cost_model/routing, is priced as a pass over every row likewise) and
#: ``index_put(_)``: priced as a pass over every operand and the output, two launches (the
#: in-place ``index_put_`` touches only the index, its values and the entries they land on: so
#: priced, the tiny MoE plans of tests/passes/test_experts_dispatch_plan.py tip, left to re-weigh)
_SCATTERS = frozenset({aten.histc.default, aten.bincount.default, aten.index_add.default,
                       aten.index_put_.default, aten.index_put.default})
#: ops writing values at positions of their first input, in place (``scatter_`` of a tensor or
#: of one value, ``scatter_add_``): one kernel, reading the index and the values and writing the
#: entries they land on (an add reading those entries too); out of place, by their overload (ATen's
#: kernel copies the input into the output first, then runs the in-place kernel on it)
_SCATTERS_IN_PLACE = {aten.scatter_.src: "src", aten.scatter_.value: "value", aten.scatter_add_.default: "add"}
_SCATTERS_OUT_OF_PLACE = {aten.scatter.src: "src", aten.scatter.value: "value", aten.scatter_add.default: "add"}
_FACTORIES = frozenset({aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format,
                        aten.arange.default, aten.arange.start, aten.arange.start_step, aten.new_ones.default,
                        aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
                        aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                        aten.empty_like.default, aten.fill_.Scalar})

_SORTS = frozenset({aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable})


def permuted_rows_work(op: Any, fwd: tuple) -> OpWork:
    """Rows reordered by a permutation of them (``distributed.functional.permute_rows``): forward
    a gather; backward one kernel over the gradient's rows, each read once and written to one
    row, with the index read: a gather by the inverse permutation where the rank's program holds
    it by then (transformers' ``perm`` and ``inv_perm``, the latter made before the weights'
    ``w[perm]``: ``passes/rewrite._inverses_first``), else a copy of each row to its row
    (``index_copy_``). The same bytes and launch either way; the inverse's own ops (an arange, a
    scatter or sort) are the graph's, priced where they are."""
    index_bytes = sum((b for b, m in zip(op.b_in, op.inputs) if not m.is_float), sympy.Integer(0))
    bwd = [("elementwise", op.main_out + b + index_bytes) for b, g in zip(op.b_in, op.grad) if g]
    return OpWork(moved=(fwd, *bwd), launches=1 + len(bwd))


def scattered_bytes(op: Any, kind: str) -> sympy.Expr:
    """The bytes the kernel of a scatter of ``kind`` touches on the rank: its index read, its
    values read (``src``: a tensor of them; ``value``: one number) and the entries they land on
    written (one an index entry), an add (``add``) reading those entries too."""
    index = op.b_in[1]
    if kind == "value":   # scatter_(dim, index, value): an entry of the input's dtype per index entry
        return index + op.n_in[1] * op.inputs[0].dtype.itemsize
    return index + op.b_in[2] * (3 if kind == "add" else 2)


def _joins_leading_dim(info: Any) -> bool:
    """Whether a ``cat`` joins its inputs along dim 0."""
    dim = info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0)
    ndim = info.output.ndim if hasattr(info.output, "ndim") else 0
    return isinstance(dim, int) and ndim > 0 and dim % ndim == 0


def op_work(info: Any, strategy: Any, tp: int, dtype_bytes: int, train_dtype: Any = None,
            rank: int | None = None) -> OpWork:
    """What one op runs on the largest rank (or on ``rank``) under ``strategy``, forward and backward."""
    t = info.target
    if t in _PIECES and info.inputs and info.inputs[0].is_float and (
            info.grad_inputs is None or (info.grad_inputs and info.grad_inputs[0])):
        # views forward; backward autograd joins the pieces' gradients into the input's
        # (``split_backward``: one ``cat``, a read and a write of the input's bytes), as for a
        # fused q|k|v or gate|up product's output (autotp/passes/products.py, GPT-2's c_attn)
        op = RankOp(info, strategy, tp, dtype_bytes, train_dtype, rank)
        return OpWork(moved=(("elementwise", 2 * op.b_in[0]),), launches=1)
    if t in VIEWS or t is torch.ops.aten.sym_size.int:
        return NO_WORK
    op = RankOp(info, strategy, tp, dtype_bytes, train_dtype, rank)
    if t is aten.cat.default and _joins_leading_dim(info):
        # a join along dim 0 (weights joined for one product, autotp/passes/products.py): one
        # kernel forward; backward each input's gradient is a contiguous block of the output's
        # (``narrow``): a view, no kernel
        return OpWork(moved=(("elementwise", sum(op.b_in, sympy.Integer(0)) + op.out_bytes),), launches=1)
    name = str(t)
    if getattr(strategy, "fused", False):
        # a bias the rank adds inside its product (autotp/passes/fused_bias.py): the product's
        # epilogue writes the sum, no kernel of its own forward; backward as an add's (the bias's
        # gradient summed over the tokens)
        work = elementwise_work(op)
        return OpWork(moved=work.moved[1:], launches=work.launches - 1)
    if t in PRODUCTS:
        return product_work(op, dtype_bytes, train_dtype)
    if name in GROUPED_PRODUCTS:
        work = grouped_work(op, dtype_bytes, train_dtype)
        if dispatches(op):   # the layer's dispatch's split sizes and plan, once a layer
            extra = dispatch_work(op)
            work = OpWork(products=work.products, moved=work.moved + extra.moved,
                          launches=work.launches + extra.launches, passes=work.passes + extra.passes)
        return work
    if t is ATTENTION:
        return attention_work(op)
    if t in CASTS:
        return cast_work(op)
    if t in COPIES:
        return OpWork(moved=(("elementwise", op.b_in[0] + op.main_out),), launches=1) if op.b_in else NO_WORK
    if t in NORMS:
        return norm_work(op)
    if t in _SOFTMAX:
        return softmax_work(op)
    if t is aten.cross_entropy_loss.default:
        return cross_entropy_work(op)
    if t in _RANDOM:
        return dropout_work(op)
    if t is aten.embedding.default:
        return embedding_work(op)
    if t is aten.sum.dim_IntList and sums_token_rows(op):
        return token_sums_work(op)
    if t in _REDUCTIONS:
        return reduction_work(op)
    if t in _SORTS:
        return sort_work(op, dtype_bytes, train_dtype)
    if t is aten.topk.default:
        return topk_work(op)
    if t in (aten.histc.default, aten.bincount.default) and counted_by_exchange(op):
        return exchanged_counts_work(op)
    if t in _SCATTERS_IN_PLACE:
        return OpWork(moved=(("scatter", scattered_bytes(op, _SCATTERS_IN_PLACE[t])),), launches=1)
    if t in _SCATTERS_OUT_OF_PLACE:   # the input copied into the output, then scattered into
        copy = ("elementwise", op.b_in[0] + op.out_bytes)
        return OpWork(moved=(copy, ("scatter", scattered_bytes(op, _SCATTERS_OUT_OF_PLACE[t]))), launches=2)
    if t in _SCATTERS:
        return OpWork(moved=(("scatter", sum(op.b_in, sympy.Integer(0)) + op.out_bytes),), launches=2)
    if t in _FACTORIES:
        return OpWork(moved=(("elementwise", op.out_bytes),), launches=1) if op.outputs else NO_WORK
    if not op.outputs:
        return NO_WORK
    if t is aten.index.Tensor and reorders_rows(op):   # routed rows reordered on the rank's rows
        return routed_reorder_work(op)
    if t is aten.index.Tensor:
        from ..passes.rules.gathered_rows import gathers_rows

        if gathers_rows(strategy):   # a rank's own tokens' rows, all-gathered after (GatherRowsTP)
            return gathered_rows_work(op)
    if t in _GATHERS:
        fwd = ("elementwise", op.out_bytes + sum((b for b, m in zip(op.b_in, op.inputs) if not m.is_float),
                                                 sympy.Integer(0)) + op.out_bytes)
        if op.info.permutes_rows:
            return permuted_rows_work(op, fwd)
        # a gradient scattered back into its rows (a sorted scatter-add)
        bwd = [("scatter", 2 * op.main_out + b) for b, g in zip(op.b_in, op.grad) if g]
        work = OpWork(moved=(fwd, *bwd), launches=1 + 2 * len(bwd))
        return work
    return elementwise_work(op)
