"""What autograd keeps for backward, per ATen op: the activation memory of a training step.

Input: an op (:class:`~autotp.passes.rules.OpInfo`) and which of its tensor inputs carry a
gradient. Output (:func:`kept`): the tensors its backward keeps, each an input, an output or a
tensor the op makes for its backward alone (a norm's statistics, attention's log-sum-exp, a
dropout mask). Which ones is ATen's own autograd formula (``tools/autograd/derivatives.yaml``):
PyTorch saves a tensor only where a formula that needs it is for an input that carries a gradient,
so ``x * w`` keeps ``w`` for ``x``'s gradient and ``x`` for ``w``'s, and ``x * cos`` with a
constant ``cos`` keeps ``cos`` alone.

This module says *what* is kept; :meth:`~autotp.passes.propagate.GraphIndex.activation_bytes` says
*once*: a tensor read by several ops that keep it (the normed hidden state read by q, k and v; a
view of the fused q/k/v product read by attention and ...) is one storage, counted once per step
by its storage root (the op that made it, through views: :func:`aliases`) and its placement on
the rank. A view keeps its whole storage alive: attention keeping ``v``, a third of the fused
q/k/v product's output, keeps all of it.

Sizes are as the rest of the cost model prices them (:mod:`.symbolic`): floats at the profile's
training dtype, integers (token ids, targets) at their own; statistics (a norm's mean and reciprocal
root, attention's log-sum-exp) in float32, as ATen accumulates them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from ..passes.rules import OpInfo
from ..passes.rules.registry import aliases_first
from . import kernels

aten = torch.ops.aten


@dataclass(frozen=True)
class Kept:
    """One tensor an op keeps for backward: ``input`` (its ``index``-th tensor input), ``output``
    (its ``index``-th output, 0 for a single one) or ``new`` (made for backward alone: ``numel``
    elements of ``nbytes`` each, 0: the profile's float size, split as the op's first input is)."""

    source: str
    index: int = 0
    numel: Any = 0
    nbytes: int = 0


#: products: operands (tensor input positions) whose gradients read each other
_OPERANDS = {aten.addmm.default: (1, 2), aten.baddbmm.default: (1, 2)}
#: ops that keep their output (``result`` in the formulas)
KEEP_OUTPUT = frozenset({
    aten.tanh.default, aten.sigmoid.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default,
    aten.relu.default, aten.reciprocal.default, aten._softmax.default, aten._log_softmax.default,
    aten.softmax.int, aten.log_softmax.int, aten.exp2.default, aten.expm1.default})
#: ops that keep their first input (``self``)
KEEP_INPUT = frozenset({
    aten.gelu.default, aten.silu.default, aten.pow.Tensor_Scalar, aten.log.default, aten.sin.default,
    aten.cos.default, aten.abs.default, aten.erf.default, aten.log1p.default, aten.square.default,
    aten.mish.default, aten.softplus.default, aten.elu.default, aten.leaky_relu.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.clamp.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.log2.default, aten.atan.default, aten.sinh.default, aten.cosh.default,
    aten.asin.default, aten.acos.default})
#: ops whose backward reads no tensor (sizes, dims and scalars only) or that carry no gradient
KEEP_NOTHING = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
    aten.neg.default, aten.cat.default, aten.stack.default, aten.sum.dim_IntList, aten.sum.default,
    aten.mean.dim, aten.mean.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.to.other, aten.contiguous.default, aten.copy.default,
    aten.pad.default, aten.constant_pad_nd.default, aten.repeat.default, aten.repeat_interleave.self_int,
    aten.mul.Scalar, aten.div.Scalar, aten.fill.Scalar, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.new_zeros.default, aten.new_ones.default, aten.expand.default,
    aten.roll.default, aten.flip.default, aten.tril.default, aten.triu.default, aten.cumsum.default,
    aten.diff.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default})
#: layer norm: the input, and a mean and a reciprocal root per row
_LAYER_NORMS = frozenset({aten.layer_norm.default, aten.native_layer_norm.default})
_RMS_NORMS = frozenset({aten.rms_norm.default})
_LOSS = frozenset({aten.cross_entropy_loss.default})
_DROPOUT = frozenset({aten.dropout.default, aten.native_dropout.default})
#: ops that keep an integer or boolean operand (the indices, the mask) for their gradient
_KEEP_INDEX = {aten.embedding.default: (1,), aten.where.self: (0,), aten.masked_fill.Scalar: (1,),
               aten.masked_fill.Tensor: (1,), aten.index_select.default: (1,), aten.gather.default: (1,),
               aten.index.Tensor: None}   # None: every integer tensor input

STAT_BYTES = 4   # statistics accumulate in float32


def _numel(shape: tuple) -> Any:
    out = sympy.Integer(1)
    for s in shape:
        out = out * s
    return out


def _rows(meta: Any, normalized: int) -> Any:
    """Rows of a norm over the last ``normalized`` dims."""
    return _numel(meta.shape[:meta.ndim - normalized])


def dropout_active(args: tuple) -> bool:
    """Whether a ``dropout(x, p, train)`` draws a mask: ATen returns ``x`` itself where ``p`` is 0 or
    ``train`` False (``aten/src/ATen/native/Dropout.cpp``)."""
    p = args[1] if len(args) > 1 else 0.5
    train = args[2] if len(args) > 2 else True
    return not (isinstance(p, (int, float)) and p == 0) and train is not False


def kept(info: OpInfo, grads: tuple, mask_bytes: int) -> tuple[Kept, ...]:
    """What ``info``'s backward keeps; ``grads[i]``: does tensor input ``i`` carry a gradient.
    ``mask_bytes``: bytes per element of a dropout mask (1 on CUDA, ``native_dropout``'s bool mask;
    0, a float of the input's size, on CPU, whose ``dropout`` multiplies by a scaled noise tensor)."""
    t, inputs = info.target, info.inputs
    if not any(grads):
        return ()   # no input carries a gradient: autograd records nothing
    if t in KEEP_NOTHING or t in _SPLITS or aliases_first(t):
        return ()
    first = inputs[0] if inputs else None
    if t in kernels.PRODUCTS or t in _OPERANDS or str(t) in kernels.GROUPED_PRODUCTS:
        a, b = _OPERANDS.get(t, (0, 1))
        if len(inputs) <= b:
            return ()
        return tuple(Kept("input", i) for i, other in ((a, b), (b, a)) if grads[other] and inputs[i].is_float)
    if t is kernels.ATTENTION:
        q = first
        dropout = info.kwargs.get("dropout_p", info.args[4] if len(info.args) > 4 else 0.0)
        if mask_bytes == 0 and not (isinstance(dropout, (int, float)) and dropout == 0):
            # CPU with dropout: no fused kernel takes it, ATen runs the math fallback (q and k
            # scaled, their product, softmax, dropout by a float noise tensor, the product by
            # v), which keeps the scaled q and k, v, and three (b, h, s, s) tensors: the
            # softmax, the noise and the dropped probabilities
            scores = _numel(q.shape[:-1]) * inputs[1].shape[-2]
            return (Kept("input", 2), Kept("new", numel=_numel(q.shape) + _numel(inputs[1].shape)),
                    Kept("new", numel=3 * scores))
        # flash (CPU and CUDA) and memory-efficient kernels: q, k, v, the output, a log-sum-exp
        # per (batch, head, query) and the mask where one is given
        lse = _numel(q.shape[:-1])
        return tuple(Kept("input", i) for i in range(min(len(inputs), 4))) + (
            Kept("output"), Kept("new", numel=lse, nbytes=STAT_BYTES))
    if t in _LAYER_NORMS:
        normalized = len(info.args[1]) if len(info.args) > 1 else 1
        return (Kept("input", 0), Kept("new", numel=2 * _rows(first, normalized), nbytes=STAT_BYTES))
    if t in _RMS_NORMS:
        normalized = len(info.args[1]) if len(info.args) > 1 else 1
        return (Kept("input", 0), Kept("new", numel=_rows(first, normalized), nbytes=STAT_BYTES))
    if t in _LOSS:
        # log-softmax of the logits (its result, the logits' size) and the targets
        out = [Kept("new", numel=_numel(first.shape), nbytes=0)]
        return tuple(out) + tuple(Kept("input", i) for i in range(1, len(inputs)) if not inputs[i].is_float)
    if t in _DROPOUT:
        if t is aten.dropout.default and not dropout_active(info.args):
            return ()
        return (Kept("new", numel=_numel(first.shape), nbytes=mask_bytes),)
    if t in KEEP_OUTPUT:
        return (Kept("output"),)
    if t in KEEP_INPUT:
        return (Kept("input", 0),)
    if t in (aten.mul.Tensor, aten.div.Tensor):
        if len(inputs) < 2:
            return ()   # by a Python number: nothing kept
        if t is aten.mul.Tensor:
            return tuple(Kept("input", i) for i, other in ((0, 1), (1, 0)) if grads[other])
        # a / b: b for a's gradient and b's; a for b's
        return tuple(k for k, keep in ((Kept("input", 1), grads[0] or grads[1]), (Kept("input", 0), grads[1]))
                     if keep)
    if t in _KEEP_INDEX:
        positions = _KEEP_INDEX[t]
        positions = range(len(inputs)) if positions is None else positions
        return tuple(Kept("input", i) for i in positions if i < len(inputs) and not inputs[i].is_float)
    # an op this table does not know: its float inputs that carry a gradient (the common case of
    # a formula reading its operands), a bound rather than a guess of nothing
    return tuple(Kept("input", i) for i, m in enumerate(inputs) if m.is_float and grads[i])


#: ops returning views of their first argument as a list (their schemas annotate the list's
#: elements, which :func:`~autotp.passes.rules.registry.aliases_first` does not read)
_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
                     aten.tensor_split.sections, aten.tensor_split.indices, aten.split.sizes})
_MAYBE_COPY = frozenset({aten.reshape.default, aten.contiguous.default, aten.flatten.using_ints,
                         aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other})


def aliases(node: fx.Node) -> fx.Node | None:
    """The tensor whose storage ``node``'s output shares (a view of it), or None where the op
    makes a tensor of its own. ``reshape`` and ``contiguous`` copy where the strides ask it and
    ``to`` where the dtype changes: read from the traced values."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        src = node.args[0]
        return aliases(src) if isinstance(src, fx.Node) else None
    t = node.target
    if t is aten.dropout.default and not dropout_active(node.args):
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if not aliases_first(t) and t not in _MAYBE_COPY and t not in _SPLITS:
        return None
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if src is None or t not in _MAYBE_COPY:
        return src
    out, val = node.meta.get("val"), src.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor):
        return src
    if out.dtype != val.dtype:
        return None
    if t in (aten.reshape.default, aten.contiguous.default, aten.flatten.using_ints):
        try:
            return src if out.untyped_storage()._cdata == val.untyped_storage()._cdata else None
        except (RuntimeError, NotImplementedError, AttributeError):
            return src
    return src


def kept_root(node: fx.Node) -> fx.Node:
    """The node that made the storage ``node``'s value lives in at run time (itself where it is
    no view): unlike :func:`~autotp.passes.propagate.storage_root` (the tensor an in-place write
    reaches), through splits, and through ``reshape``/``contiguous``/``to`` only where they return
    a view, and dropout where it returns its input."""
    seen = 0
    while True:
        src = aliases(node)
        if src is None or seen > 10_000:
            return node
        node, seen = src, seen + 1
