"""Norms (layer norm, RMS norm, group norm) as eager PyTorch runs them: one fused kernel
forward, one for the input's gradient and one for the weight's and bias's, each reading and
writing whole tensors. A norm's pricing entry goes here."""
from __future__ import annotations

import torch

from .work import OpWork, RankOp

aten = torch.ops.aten

NORMS = frozenset({aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
                    aten.group_norm.default})


def norm_work(op: RankOp) -> OpWork:
    """Forward reads x (and the small weight) and writes y; backward reads the gradient and x,
    writes x's gradient, and reads both again for the weight's and bias's."""
    x, y = op.b_in[0], op.main_out
    moved = [("norm", x + y)]
    launches = 1
    if op.grad[0]:
        moved.append(("norm", 2 * x + y))
        launches += 1
    if any(op.grad[1:]):
        moved.append(("norm", 2 * x))
        launches += 1
    return OpWork(moved=tuple(moved), launches=launches)
