"""Memory-bound ops as eager PyTorch runs them, one kernel per ATen op forward and its backward's
kernels, each with the bytes it reads and writes: elementwise ops (by their operands' layout),
casts, softmax, dropout, embedding lookups and reductions. Norms are :mod:`.norms`'s, the loss
:mod:`.loss`'s, the expert routing's kernels :mod:`.routing`'s."""
from __future__ import annotations

import sympy
import torch

from .work import NO_WORK, OpWork, RankOp, differ, flag

aten = torch.ops.aten

#: elementwise ops whose backward passes the gradient on untouched (a kernel only to reduce a broadcast)
_PASS_GRAD = frozenset({aten.add.Tensor, aten.add_.Tensor, aten.add.Scalar, aten.sub.Scalar})
#: elementwise ops whose backward needs no saved tensor (one kernel: the gradient scaled or negated)
_SCALE_GRAD = frozenset({aten.neg.default, aten.mul.Scalar, aten.div.Scalar})
#: unary ops whose backward takes two kernels (pow: x^(e-1), then the product with the gradient)
_TWO_KERNEL_GRAD = frozenset({aten.pow.Tensor_Scalar, aten.div.Tensor, aten.pow.Tensor_Tensor})


def elementwise_work(op: RankOp) -> OpWork:
    """Forward: one kernel reads every input and writes the output. Backward, per input that
    carries a gradient: a kernel that writes it (reading the incoming gradient and what the
    formula saved), and a reduction where the input was broadcast."""
    t = op.info.target
    cls = layout_class(op)
    moved = [(cls, sum(op.b_in, sympy.Integer(0)) + op.out_bytes)]
    launches = 1
    out_float = bool(op.outputs) and op.outputs[0].is_float
    if out_float:
        g = op.main_out
        others = sum(op.b_in, sympy.Integer(0))
        for i, needs in enumerate(op.grad):
            if not needs:
                continue
            broadcast = op.n_out and differ(op.n_in[i], op.n_out[0])
            if t in _PASS_GRAD or (t is aten.sub.Tensor and i == 0):
                pass
            elif t in _SCALE_GRAD or t is aten.sub.Tensor:
                moved.append((cls, 2 * g))
                launches += 1
            else:
                saved = others - op.b_in[i] if len(op.inputs) > 1 else op.b_in[i]
                kernels = 2 if t in _TWO_KERNEL_GRAD else 1
                moved.append((cls, kernels * (2 * g) + saved))
                launches += kernels
            if broadcast:
                moved.append(("reduction", g + op.b_in[i]))
                launches += 1
    return OpWork(moved=tuple(moved), launches=launches)


def layout_class(op: RankOp) -> str:
    """The class of an elementwise kernel by its operands' layout: ``strided`` where an input is
    strided (a transpose's, an expand's), ``broadcast`` where one is broadcast against the
    output (a norm's weight, a per-token scale), other than a single number; ``elementwise``
    otherwise. A GPU runs both of the first two on PyTorch's non-vectorized path alike; a CPU
    runs a broadcast one near a contiguous one's rate and a transposed one far below it."""
    strided = getattr(op.info, "strided_inputs", ()) or ()
    if any(strided):
        return "strided"
    if op.n_out and any(differ(n, op.n_out[0]) and n != 1 for n in op.n_in):
        return "broadcast"
    return "elementwise"


def cast_work(op: RankOp) -> OpWork:
    if not op.inputs or not op.outputs or op.inputs[0].dtype == op.outputs[0].dtype:
        return NO_WORK   # a cast to the dtype it has (or a device move on one device): the tensor itself
    moved = [("cast", op.b_in[0] + op.main_out)]
    if op.grad[0] and op.outputs[0].is_float:
        moved.append(("cast", op.b_in[0] + op.main_out))
    return OpWork(moved=tuple(moved), launches=len(moved))


def softmax_work(op: RankOp) -> OpWork:
    moved = [("softmax", op.b_in[0] + op.main_out)]
    if op.grad[0]:
        moved.append(("softmax", 2 * op.main_out + op.b_in[0]))
    return OpWork(moved=tuple(moved), launches=len(moved))


def dropout_work(op: RankOp) -> OpWork:
    info = op.info
    p = flag(info.args, info.kwargs, 1, "p", 0.5)
    train = flag(info.args, info.kwargs, 2, "train", True)
    if not train or not p:
        return NO_WORK
    mask = op.n_in[0]   # one byte an element
    moved = [("random", op.b_in[0] + op.main_out + mask)]
    if op.grad[0]:
        moved.append(("elementwise", 2 * op.main_out + mask))
    return OpWork(moved=tuple(moved), launches=len(moved))


def embedding_work(op: RankOp) -> OpWork:
    """A lookup reads the rows it writes; the weight's gradient is a zero-filled table into
    which the rows' gradients are scattered (sorted by index: a slow kernel)."""
    w, idx = op.b_in[0], op.b_in[1]
    moved = [("elementwise", 2 * op.main_out + idx)]
    launches = 1
    if op.grad[0]:
        moved += [("elementwise", w), ("scatter", 2 * op.main_out + idx)]
        launches += 3
    return OpWork(moved=tuple(moved), launches=launches)


def reduction_work(op: RankOp) -> OpWork:
    moved = [("reduction", op.b_in[0] + op.out_bytes)]
    launches = 1
    if op.grad and op.grad[0] and op.outputs and op.outputs[0].is_float \
            and op.info.target not in (aten.sum.dim_IntList, aten.sum.default):
        moved.append(("elementwise", op.b_in[0] + op.main_out))   # the gradient spread back (sum's is a view)
        launches += 1
    return OpWork(moved=tuple(moved), launches=launches)
