"""The loss as a rank runs it: ``cross_entropy_loss`` whole, or split by vocabulary as the
kernels of the rank's vocab-parallel cross-entropy."""
from __future__ import annotations

from typing import Any

import sympy

from ..placements import Shard, local_ranges
from .work import OpWork, RankOp, flag, local_shape


def cross_entropy_work(op: RankOp) -> OpWork:
    """log_softmax over the logits and a gather of the targets' entries; backward a zero-filled
    gradient, the targets' entries set, and log_softmax's backward. Logits split by vocabulary:
    the kernels the rank's vocab-parallel loss runs (:func:`vocab_parallel_loss_work`)."""
    p = op.in_place[0]
    if isinstance(p, Shard) and p.dim == 1 and op.tp > 1:
        logits, target = op.inputs[0], op.inputs[1]
        rows, cols = local_shape(logits, p, op.tp, op.rank, op.share)
        vocab = int(logits.shape[1])
        runs = len(local_ranges(vocab, p, op.tp, 0 if op.rank is None else op.rank))
        reduction = flag(op.info.args, op.info.kwargs, 3, "reduction", 1)
        return vocab_parallel_loss_work(rows, cols, int(op.b_in[0] / op.n_in[0]), target.dtype.itemsize, runs,
                                        reduction, many=True, grad=op.grad[0])
    x = op.b_in[0]
    moved = [("softmax", 2 * x)]
    launches = 3
    if op.grad[0]:
        moved += [("elementwise", x), ("softmax", 3 * x)]
        launches += 3
    return OpWork(moved=tuple(moved), launches=launches)


def vocab_parallel_loss_work(rows: Any, cols: Any, elem_bytes: int, target_bytes: int, runs: int,
                             reduction: int, *, many: bool = True, grad: bool = True) -> OpWork:
    """The kernels ``distributed.functional._VocabParallelCrossEntropy`` runs on a rank holding
    ``cols`` of the vocabulary (in ``runs`` ranges) for ``rows`` tokens, forward and backward,
    each with the bytes it reads and writes: the float32 upcast of half-precision logits (and the
    gradient's cast back), the local row max, the local softmax (one fused kernel), the targets'
    local columns found range by range, their logits gathered, the per-token arithmetic that
    combines the ranks' sums of exps and makes the loss; backward the softmax rescaled (one pass
    over the logits) and the targets' entries lowered by a scatter. The collectives are the
    strategy's ``internal`` ones, priced as collectives.

    Bytes are what each kernel touches: a gather reads the entries it picks, an in-place
    scatter-add reads and writes the entries it adds to, a fill reads nothing."""
    e = int(elem_bytes)
    f = max(e, 4)                                  # the loss computes in float32 at least
    i, n, nv = int(target_bytes), rows, rows * cols
    whole = f if reduction else f * n              # the loss (a number, or one per token)
    fwd: list = []
    if e < f:
        fwd.append(("cast", (e + f) * nv))
    fwd += [("reduction", f * nv + (f + 8) * n),   # local max (values and int64 positions)
            ("softmax", 2 * f * nv),               # local softmax
            ("elementwise", 8 * n + 2 * f * n)]    # its entry at the max: 1 / the local sum of exps
    if many:
        fwd.append(("elementwise", 2 * f * n))     # the local max kept apart from the all-reduced one
    for run in range(runs):                        # the targets' local columns: sub, ge, lt, and, then
        fwd += [("elementwise", 2 * i * n)] + [("elementwise", i * n + n)] * 2 + [("elementwise", 3 * n)]
        fwd += [("elementwise", 2 * i * n + n)] if run == 0 else \
            [("elementwise", n + 3 * i * n), ("elementwise", 3 * n)]   # * hit; or where, or_
    fwd += [("elementwise", i * n + 2 * f * n),   # gather of the targets' logits
            ("elementwise", 3 * f * n),             # - max
            ("elementwise", 2 * f * n + n),         # * in range
            ("elementwise", 3 * f * n),             # local max - max
            ("elementwise", 2 * f * n),             # exp_
            ("elementwise", 3 * f * n)]             # / (1 / local sum): this rank's share of the sum
    if many:
        fwd.append(("elementwise", 4 * f * n))     # stack (sums of exps, targets' logits) for one all-reduce
    fwd += [("elementwise", 2 * f * n), ("elementwise", 3 * f * n),   # log, - target's logit
            ("elementwise", 3 * f * n),             # share / sum: the local softmax's part
            ("elementwise", i * n + n), ("elementwise", 2 * f * n + n),   # != ignore_index, * valid
            ("reduction", n + 8)]                   # count of valid targets
    if reduction:
        fwd.append(("reduction", f * n + f))       # sum of the losses
    if reduction == 1:
        fwd.append(("elementwise", 2 * f + 8))     # / count
    bwd: list = []
    if grad:
        if reduction == 1:
            bwd.append(("elementwise", 2 * f + 8))   # grad / count
        bwd += [("elementwise", f),                   # the 0 of where(valid, scale, 0)
                ("elementwise", n + whole + f + f * n),   # where
                ("elementwise", 3 * f * n),           # scale * share
                ("broadcast", 2 * f * nv + f * n),    # softmax * (scale * share)
                ("elementwise", 2 * f * n + n),       # scale * in range
                ("elementwise", 2 * f * n),           # neg
                ("scatter", i * n + 3 * f * n)]       # scatter_add_ into the targets' entries
        if e < f:
            bwd.append(("cast", (f + e) * nv))
    moved = tuple((cls, sympy.sympify(b)) for cls, b in fwd + bwd)
    return OpWork(moved=moved, launches=len(moved))
