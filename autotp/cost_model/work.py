"""What one op's kernels are made of, and its tensors on a rank.

The value types :func:`.kernels.op_work` answers with (:class:`Product`, :class:`Attention`,
:class:`OpWork`), and the sizes every price is built from: an operand's local shape and elements
on a rank (a Shard of a static dim: the largest rank's part; of the sequence: 1/tp of it), its
bytes per element as priced, whether a product's widths are aligned, and :class:`RankOp`, one
op's inputs and outputs on a rank, in bytes and elements.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch

from ..placements import Routed, Shard, local_size, max_local_size
from . import alignment

#: the classes of memory-bound kernels a profile gives a bandwidth each
CLASSES = ("elementwise", "strided", "broadcast", "cast", "reduction", "softmax", "norm", "random", "scatter", "sort")


@dataclass(frozen=True)
class Product:
    """One matrix product, ``batch`` of (m x k) @ (k x n); ``aligned``: its leading dims hold
    16-byte multiples, which the fast tensor-core kernels need."""

    m: Any
    n: Any
    k: Any
    batch: Any = 1
    aligned: bool = True
    #: where the rewrite may run an unaligned product padded (:mod:`.alignment`): this product at
    #: the padded width, the bytes the pad copies, and the op's rows that decide whether it pays
    padded: "Product | None" = None
    pad_bytes: Any = 0
    rows: Any = 0
    #: a grouped product's: the elements of each expert's weights the pass reads (or, for their
    #: gradient, writes), streamed once per expert (0: an ordinary product)
    streamed: Any = 0

    @property
    def flops(self) -> Any:
        return 2 * self.batch * self.m * self.n * self.k


@dataclass(frozen=True)
class Attention:
    flops: Any          # forward and backward FLOPs run
    head_dim: int
    dropout: bool
    moved: Any = 0      # bytes its kernels read and write (q, k, v, the output, their gradients)


@dataclass(frozen=True)
class OpWork:
    products: tuple = ()                 # Product, forward and backward
    attention: tuple = ()                # Attention
    moved: tuple = ()                    # (class, bytes) forward and backward
    launches: int = 0
    passes: int = 0                      # radix-sort passes (DeviceProfile.sort_pass_s each)

    def bytes_by_class(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for cls, b in self.moved:
            out[cls] = out.get(cls, 0) + b
        return out


NO_WORK = OpWork()


def local_numel(meta: Any, placement: Any, tp: int, rank: int | None = None, share: float | None = None) -> sympy.Expr:
    """Elements of ``meta`` on the largest rank (or on ``rank``) under ``placement`` (a sequence
    shard: 1/tp; ``share``: as :func:`local_shape`)."""
    value = sympy.Integer(1)
    for size in local_shape(meta, placement, tp, rank, share):
        value = value * size
    return value


def local_shape(meta: Any, placement: Any, tp: int, rank: int | None = None, share: float | None = None) -> tuple:
    """``meta``'s shape on the largest rank: a Shard's dim at its largest part (a sequence shard:
    1/tp); a Routed tensor's rows (a rank's experts' rows, held compactly) at 1/tp of them, as
    uniform routing deals them, or at ``share`` of them (the rank's share under a router's load,
    :mod:`autotp.planner.expert_load`; rows held by their tokens' ranks stay 1/tp). With ``rank``,
    a static Shard's dim at that rank's part (an uneven split's parts differ, and rotate from
    layer to layer)."""
    out = []
    for d, size in enumerate(meta.shape):
        if isinstance(placement, Shard) and placement.dim == d and tp > 1:
            static = int(size) if size.is_Integer else None
            if not static:
                size = size / tp
            elif rank is None:
                size = sympy.Integer(max_local_size(static, placement, tp))
            else:
                size = sympy.Integer(local_size(static, placement, tp, rank))
        elif isinstance(placement, Routed) and placement.dim == d and tp > 1:
            size = size / tp if share is None or placement.tokens else size * sympy.Float(share, 12)
        out.append(size)
    return tuple(out)


def element_bytes(dtype: torch.dtype, dtype_bytes: int | None, train_dtype: torch.dtype | None = None) -> int:
    """Bytes per element as priced: a float in the training dtype at the profile's
    ``dtype_bytes``; another float (an explicit upcast) and integers at their own size."""
    if dtype_bytes is not None and dtype.is_floating_point and (train_dtype is None or dtype == train_dtype):
        return dtype_bytes
    return dtype.itemsize


def aligned(size: Any, elem_bytes: int) -> bool:
    """Does a row of ``size`` elements start every row on a 16-byte boundary
    (:func:`.alignment.aligned`)? cuBLAS's fast kernels need it of every leading dimension; a
    dynamic size counts as aligned (the planning workload's batch and sequence are)."""
    if not (isinstance(size, (sympy.Integer, int))):
        return True
    return alignment.aligned(int(size), elem_bytes)


def aligned_width(size: int, elem_bytes: int) -> int:
    return alignment.aligned_width(size, elem_bytes)



def prod(shape: Sequence) -> sympy.Expr:
    value = sympy.Integer(1)
    for s in shape:
        value = value * s
    return value


def metas(out: Any) -> list:
    if out is None:
        return []
    if isinstance(out, tuple):
        return [o for o in out if o is not None and hasattr(o, "shape")]
    return [out] if hasattr(out, "shape") else []


def flag(args: tuple, kwargs: dict, position: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


class RankOp:
    """One op's tensors on a rank: bytes of each input and output, as priced."""

    def __init__(self, info: Any, strategy: Any, tp: int, dtype_bytes: int, train_dtype: Any,
                 rank: int | None = None):
        self.info, self.strategy, self.tp, self.rank = info, strategy, tp, rank
        # the rank's share of its MoE block's rows under a router's load (the busiest rank's
        # without ``rank``); None: a balanced router (OpInfo.expert_share)
        shares = getattr(info, "expert_share", None)
        self.share = None if shares is None else max(shares) if rank is None else shares[rank]
        share = self.share
        outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
        self.inputs = list(info.inputs)
        self.in_place = list(strategy.inputs)
        self.outputs = metas(info.output)
        self.out_place = list(outs) + [None] * (len(self.outputs) - len(outs))

        def nbytes(meta: Any, p: Any) -> sympy.Expr:
            return local_numel(meta, p, tp, rank, share) * element_bytes(meta.dtype, dtype_bytes, train_dtype)

        self.b_in = [nbytes(m, p) for m, p in zip(self.inputs, self.in_place)]
        self.b_out = [nbytes(m, p) for m, p in zip(self.outputs, self.out_place)]
        self.n_in = [local_numel(m, p, tp, rank, share) for m, p in zip(self.inputs, self.in_place)]
        self.n_out = [local_numel(m, p, tp, rank, share) for m, p in zip(self.outputs, self.out_place)]
        grads = getattr(info, "grad_inputs", None)
        self.grad = [bool(grads[i]) if grads is not None and i < len(grads) else m.is_float
                     for i, m in enumerate(self.inputs)]
        self.grad = [g and m.is_float for g, m in zip(self.grad, self.inputs)]

    @property
    def out_bytes(self) -> sympy.Expr:
        return sum(self.b_out, sympy.Integer(0))

    @property
    def main_out(self) -> sympy.Expr:
        return self.b_out[0] if self.b_out else sympy.Integer(0)


#: the sizes ``differ`` substitutes for a symbol (positive integers, as every size symbol is):
#: two points, distinct primes per symbol, so that no product of sizes cancels by coincidence
_POINTS = ((101, 103, 107, 109, 113, 127, 131, 137), (211, 223, 227, 229, 233, 239, 241, 251))


@functools.lru_cache(maxsize=4096)
def differ(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Whether two element counts differ as functions of the graph's size symbols: what
    ``sympy.simplify(a - b) != 0`` says, without simplify's cost where the answer is plain
    (0.05-0.7 s a call; a Mamba2 mixer's chunk sizes, floor divisions of a padded sequence,
    took a third of its plan). Structurally equal, or an expanded polynomial difference (zero
    exactly when it is identically zero): decided. Otherwise the difference is evaluated at
    positive integer sizes: a number other than zero there is a difference no simplification
    can remove; zero at every point is left to ``simplify``, as before."""
    if a == b:
        return False
    diff = sympy.expand(a - b)
    if diff == 0:
        return False
    symbols = sorted(diff.free_symbols, key=str)
    if not symbols or diff.is_polynomial(*symbols):
        return True
    for point in _POINTS:
        values = {sym: point[i % len(point)] * (1 + i // len(point)) for i, sym in enumerate(symbols)}
        try:
            value = diff.xreplace(values)
        except (TypeError, ValueError, ZeroDivisionError):
            break
        if value.is_number and value.is_finite and value != 0:
            return True
    return sympy.simplify(diff) != 0
