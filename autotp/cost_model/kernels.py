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
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch

from ..placements import Partial, Routed, Shard, local_ranges, local_size, max_local_size
from . import alignment

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
CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default})
COPIES = frozenset({aten.contiguous.default, aten.clone.default})
PRODUCTS = frozenset({aten.mm.default, aten.linear.default, aten.bmm.default, aten.matmul.default})
#: grouped products (mixtures of experts), by name: transformers registers its fallback only once imported
GROUPED_PRODUCTS = frozenset(("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"))
ATTENTION = aten.scaled_dot_product_attention.default

#: elementwise ops whose backward passes the gradient on untouched (a kernel only to reduce a broadcast)
_PASS_GRAD = frozenset({aten.add.Tensor, aten.add_.Tensor, aten.add.Scalar, aten.sub.Scalar})
#: elementwise ops whose backward needs no saved tensor (one kernel: the gradient scaled or negated)
_SCALE_GRAD = frozenset({aten.neg.default, aten.mul.Scalar, aten.div.Scalar})
#: unary ops whose backward takes two kernels (pow: x^(e-1), then the product with the gradient)
_TWO_KERNEL_GRAD = frozenset({aten.pow.Tensor_Scalar, aten.div.Tensor, aten.pow.Tensor_Tensor})
_REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
                         aten.amax.default, aten.amin.default, aten.var.correction, aten.max.dim,
                         aten.min.dim, aten.norm.ScalarOpt_dim, aten.argmax.default, aten.logsumexp.default,
                         aten.cumsum.default, aten.all.default, aten.any.default})
_SOFTMAX = frozenset({aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int})
_NORMS = frozenset({aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
                    aten.group_norm.default})
_RANDOM = frozenset({aten.dropout.default, aten.native_dropout.default, aten.bernoulli.p, aten.rand_like.default})
_GATHERS = frozenset({aten.embedding.default, aten.index.Tensor, aten.index_select.default, aten.gather.default})
_SCATTERS = frozenset({aten.index_put_.default, aten.index_put.default, aten.scatter_add.default,
                       aten.index_add.default, aten.scatter.src, aten.histc.default, aten.bincount.default})
_FACTORIES = frozenset({aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format,
                        aten.arange.default, aten.arange.start, aten.arange.start_step, aten.new_ones.default,
                        aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
                        aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                        aten.empty_like.default, aten.fill_.Scalar})

_SORTS = frozenset({aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable})

#: the classes of memory-bound kernels a profile gives a bandwidth each
CLASSES = ("elementwise", "strided", "broadcast", "cast", "reduction", "softmax", "norm", "random", "scatter", "sort")
#: bits of the key a radix sort's pass orders (CUB's onesweep sort, which ``torch.sort`` runs on a
#: GPU beyond a block's worth of keys: 8 passes for int64 keys, 4 for int32)
RADIX_BITS = 8


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


def local_numel(meta: Any, placement: Any, tp: int, rank: int | None = None) -> sympy.Expr:
    """Elements of ``meta`` on the largest rank (or on ``rank``) under ``placement`` (a sequence
    shard: 1/tp)."""
    value = sympy.Integer(1)
    for size in local_shape(meta, placement, tp, rank):
        value = value * size
    return value


def local_shape(meta: Any, placement: Any, tp: int, rank: int | None = None) -> tuple:
    """``meta``'s shape on the largest rank: a Shard's dim at its largest part (a sequence shard:
    1/tp); a Routed tensor's rows (a rank's experts' rows, held compactly) at 1/tp of them, as
    uniform routing deals them. With ``rank``, a static Shard's dim at that rank's part (an
    uneven split's parts differ, and rotate from layer to layer)."""
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
            size = size / tp
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


def _metas(out: Any) -> list:
    if out is None:
        return []
    if isinstance(out, tuple):
        return [o for o in out if o is not None and hasattr(o, "shape")]
    return [out] if hasattr(out, "shape") else []


def _flag(args: tuple, kwargs: dict, position: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


class _Op:
    """One op's tensors on a rank: bytes of each input and output, as priced."""

    def __init__(self, info: Any, strategy: Any, tp: int, dtype_bytes: int, train_dtype: Any,
                 rank: int | None = None):
        self.info, self.strategy, self.tp, self.rank = info, strategy, tp, rank
        outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
        self.inputs = list(info.inputs)
        self.in_place = list(strategy.inputs)
        self.outputs = _metas(info.output)
        self.out_place = list(outs) + [None] * (len(self.outputs) - len(outs))

        def nbytes(meta: Any, p: Any) -> sympy.Expr:
            return local_numel(meta, p, tp, rank) * element_bytes(meta.dtype, dtype_bytes, train_dtype)

        self.b_in = [nbytes(m, p) for m, p in zip(self.inputs, self.in_place)]
        self.b_out = [nbytes(m, p) for m, p in zip(self.outputs, self.out_place)]
        self.n_in = [local_numel(m, p, tp, rank) for m, p in zip(self.inputs, self.in_place)]
        self.n_out = [local_numel(m, p, tp, rank) for m, p in zip(self.outputs, self.out_place)]
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


def op_work(info: Any, strategy: Any, tp: int, dtype_bytes: int, train_dtype: Any = None,
            rank: int | None = None) -> OpWork:
    """What one op runs on the largest rank (or on ``rank``) under ``strategy``, forward and backward."""
    t = info.target
    if t in VIEWS or t is torch.ops.aten.sym_size.int:
        return NO_WORK
    op = _Op(info, strategy, tp, dtype_bytes, train_dtype, rank)
    name = str(t)
    if getattr(strategy, "fused", False):
        # a bias the rank adds inside its product (autotp/passes/fused_bias.py): the product's
        # epilogue writes the sum, no kernel of its own forward; backward as an add's (the bias's
        # gradient summed over the tokens)
        work = _elementwise_work(op)
        return OpWork(moved=work.moved[1:], launches=work.launches - 1)
    if t in PRODUCTS:
        return _product_work(op, dtype_bytes, train_dtype)
    if name in GROUPED_PRODUCTS:
        return _grouped_work(op, dtype_bytes, train_dtype)
    if t is ATTENTION:
        return _attention_work(op)
    if t in CASTS:
        return _cast_work(op)
    if t in COPIES:
        return OpWork(moved=(("elementwise", op.b_in[0] + op.main_out),), launches=1) if op.b_in else NO_WORK
    if t in _NORMS:
        return _norm_work(op)
    if t in _SOFTMAX:
        return _softmax_work(op)
    if t is aten.cross_entropy_loss.default:
        return _cross_entropy_work(op)
    if t in _RANDOM:
        return _dropout_work(op)
    if t is aten.embedding.default:
        return _embedding_work(op)
    if t in _REDUCTIONS:
        return _reduction_work(op)
    if t in _SORTS:
        return _sort_work(op, dtype_bytes, train_dtype)
    if t is aten.topk.default:
        return _topk_work(op)
    if t in (aten.histc.default, aten.bincount.default) and _counted_by_exchange(op):
        # routed_counts: the exchanged [tp, experts] int64 counts summed, and cast to the count's
        # dtype (a histc's float; a bincount's int64 needs none)
        tp, experts = op.tp, op.n_out[0]
        moved = [("reduction", 8 * tp * experts + 8 * experts)]
        if op.outputs[0].dtype != torch.long:
            moved.append(("cast", 8 * experts + op.out_bytes))
        return OpWork(moved=tuple(moved), launches=len(moved))
    if t in _SCATTERS:
        return OpWork(moved=(("scatter", sum(op.b_in, sympy.Integer(0)) + op.out_bytes),), launches=2)
    if t in _FACTORIES:
        return OpWork(moved=(("elementwise", op.out_bytes),), launches=1) if op.outputs else NO_WORK
    if not op.outputs:
        return NO_WORK
    if t in _GATHERS:
        fwd = ("elementwise", op.out_bytes + sum((b for b, m in zip(op.b_in, op.inputs) if not m.is_float),
                                                 sympy.Integer(0)) + op.out_bytes)
        # a gradient scattered back into its rows (a sorted scatter-add); rows reordered by a
        # permutation of them gather it back by the inverse permutation (permute_rows)
        back = "elementwise" if op.info.permutes_rows else "scatter"
        bwd = [(back, 2 * op.main_out + b) for b, g in zip(op.b_in, op.grad) if g]
        return OpWork(moved=(fwd, *bwd), launches=1 + 2 * len(bwd))
    return _elementwise_work(op)


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


def _elementwise_work(op: _Op) -> OpWork:
    """Forward: one kernel reads every input and writes the output. Backward, per input that
    carries a gradient: a kernel that writes it (reading the incoming gradient and what the
    formula saved), and a reduction where the input was broadcast."""
    t = op.info.target
    cls = _layout_class(op)
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


def _layout_class(op: _Op) -> str:
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


def _cast_work(op: _Op) -> OpWork:
    if not op.inputs or not op.outputs or op.inputs[0].dtype == op.outputs[0].dtype:
        return NO_WORK   # a cast to the dtype it has (or a device move on one device): the tensor itself
    moved = [("cast", op.b_in[0] + op.main_out)]
    if op.grad[0] and op.outputs[0].is_float:
        moved.append(("cast", op.b_in[0] + op.main_out))
    return OpWork(moved=tuple(moved), launches=len(moved))


def _norm_work(op: _Op) -> OpWork:
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


def _softmax_work(op: _Op) -> OpWork:
    moved = [("softmax", op.b_in[0] + op.main_out)]
    if op.grad[0]:
        moved.append(("softmax", 2 * op.main_out + op.b_in[0]))
    return OpWork(moved=tuple(moved), launches=len(moved))


def _cross_entropy_work(op: _Op) -> OpWork:
    """log_softmax over the logits and a gather of the targets' entries; backward a zero-filled
    gradient, the targets' entries set, and log_softmax's backward. Logits split by vocabulary:
    the kernels the rank's vocab-parallel loss runs (:func:`vocab_parallel_loss_work`)."""
    p = op.in_place[0]
    if isinstance(p, Shard) and p.dim == 1 and op.tp > 1:
        logits, target = op.inputs[0], op.inputs[1]
        rows, cols = local_shape(logits, p, op.tp, op.rank)
        vocab = int(logits.shape[1])
        runs = len(local_ranges(vocab, p, op.tp, 0 if op.rank is None else op.rank))
        reduction = _flag(op.info.args, op.info.kwargs, 3, "reduction", 1)
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


def _dropout_work(op: _Op) -> OpWork:
    info = op.info
    p = _flag(info.args, info.kwargs, 1, "p", 0.5)
    train = _flag(info.args, info.kwargs, 2, "train", True)
    if not train or not p:
        return NO_WORK
    mask = op.n_in[0]   # one byte an element
    moved = [("random", op.b_in[0] + op.main_out + mask)]
    if op.grad[0]:
        moved.append(("elementwise", 2 * op.main_out + mask))
    return OpWork(moved=tuple(moved), launches=len(moved))


def _embedding_work(op: _Op) -> OpWork:
    """A lookup reads the rows it writes; the weight's gradient is a zero-filled table into
    which the rows' gradients are scattered (sorted by index: a slow kernel)."""
    w, idx = op.b_in[0], op.b_in[1]
    moved = [("elementwise", 2 * op.main_out + idx)]
    launches = 1
    if op.grad[0]:
        moved += [("elementwise", w), ("scatter", 2 * op.main_out + idx)]
        launches += 3
    return OpWork(moved=tuple(moved), launches=launches)


def _topk_work(op: _Op) -> OpWork:
    """``topk``: one kernel reads the scores and writes the values and their positions; backward
    (where the scores carry a gradient) a zero-filled tensor of the scores' size, then the
    values' gradient scattered into a copy of it by the positions
    (``value_selecting_reduction_backward``, an out-of-place ``scatter``: it reads the zeros, the
    positions and the values' gradient, and writes the scores' gradient)."""
    moved = [("reduction", op.b_in[0] + op.out_bytes)]
    if op.grad[0] and len(op.b_out) > 1:
        values, positions = op.b_out[0], op.b_out[1]
        moved += [("elementwise", op.b_in[0]), ("scatter", 2 * op.b_in[0] + positions + values)]
    return OpWork(moved=tuple(moved), launches=len(moved))


def route_locally_work(n: Any, experts: int, tp: int) -> OpWork:
    """The kernels :func:`autotp.distributed.expert_routing.route_locally` runs around its sort of
    a rank's ``n`` own ids (one run of the sequence, as the rank's program calls it), each with
    the bytes it reads and writes (int64 throughout): each sorted row's key (its run, ``//``,
    ``*``, ``+``), its count per expert (a zero fill, a fill of ones, a scatter-add reading and
    writing the entries it adds to), and, after the counts' all-gather (a collective, priced as
    one), every expert's total and offsets, the blocks' starts among every rank's rows and among
    the rank's own (sums, cumulative sums and differences of ``tp * experts`` and ``experts``
    numbers), and each sorted row's global id (an ``arange``, a gather of its block's shift, an
    add). The sort itself is :func:`_sort_work`'s."""
    e, c = experts, tp * experts
    fill, ew, red = "elementwise", "elementwise", "reduction"
    kernels = [
        (ew, 16 * n), (ew, 16 * n), (ew, 24 * n),           # run = perm // n, run * experts, + ids
        (fill, 8 * e), (fill, 8 * n), ("scatter", 32 * n),   # zeros, ones_like, scatter_add_
        (red, 8 * c + 8 * e), (red, 16 * e),                # total = counts.sum, offs = total.cumsum
        (red, 16 * c), (ew, 24 * c),                        # blocks: exclusive cumsum over the ranks
        (ew, 24 * e), (ew, 16 * c + 8 * e),                 # + (offs - total)
        (red, 16 * e), (red, 16 * e), (ew, 24 * e),         # own.sum(0), its exclusive cumsum
        (red, 16 * e), (ew, 24 * e),                        # own's exclusive cumsum
        (ew, 24 * e), (ew, 24 * e),                         # local, shift = blocks[rank] - local
        (fill, 8 * n), (ew, 8 * e + 16 * n), (ew, 24 * n),  # arange(n) + shift[key]
    ]
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


def holders_order_work(rows: Any, tp: int) -> OpWork:
    """The counting pass :func:`autotp.distributed.gathered_rows.holders_order` runs on every rank
    over the ``rows`` gathered rows' int64 holders (in ``[0, tp)``), each kernel with the bytes it
    reads and writes: the holders compared with every rank (``tp`` booleans a row), counted
    cumulatively (``tp`` int64 counters a row), each row's counter picked (a gather reads the
    entries it picks), less one; every rank's first row from the last counters; each row's place
    (its rank's first row, gathered, plus the counter) and the order written by it (an
    ``arange`` scattered: the entries it writes)."""
    n = rows
    kernels = [
        ("elementwise", 8 * tp), ("elementwise", 8 * n + 8 * tp + n * tp),   # arange(tp), holder == rank
        ("reduction", 9 * n * tp),                                           # cumsum of the booleans
        ("elementwise", 24 * n), ("elementwise", 16 * n),                    # gather, - 1
        ("reduction", 16 * tp), ("elementwise", 24 * tp),                    # every rank's first row
        ("elementwise", 8 * tp + 16 * n), ("elementwise", 24 * n),           # its first row per row, + before
        ("elementwise", 8 * n), ("scatter", 24 * n),                         # order[place] = arange
    ]
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


def _counted_by_exchange(op: _Op) -> bool:
    """A ``histc`` (or ``bincount``) of a rank's own sorted ids made whole with no collective of
    its own: the counts its sort exchanged (``passes/rules/local_routing``, ``routed_counts``): no kernel."""
    return bool(op.in_place) and isinstance(op.in_place[0], Routed) and op.in_place[0].own \
        and not isinstance(op.out_place[0], Partial) and not op.strategy.internal


def sort_passes(key_bytes: int) -> int:
    """Passes of a radix sort over keys of ``key_bytes`` (every bit of the key type: torch sorts
    the whole width, whatever range the values take)."""
    return -(-8 * key_bytes // RADIX_BITS)


def sort_bytes(n: Any, key_bytes: int, value_bytes: int = 8) -> Any:
    """Bytes a radix sort of ``n`` (key, value) pairs moves (the values: the int64 positions
    ``sort`` returns): one histogram pass reading the keys, then each pass reading and writing
    every key and value (:func:`sort_passes`)."""
    return n * key_bytes + sort_passes(key_bytes) * 2 * n * (key_bytes + value_bytes)


def sort_launches(key_bytes: int) -> int:
    """Kernels of a radix sort: the histogram, its exclusive sum, and one per pass."""
    return 2 + sort_passes(key_bytes)


def _sort_work(op: _Op, dtype_bytes: int, train_dtype: Any) -> OpWork:
    """``sort``/``argsort`` as a GPU runs it: a radix sort, several passes over every key and
    value (:func:`sort_bytes`) at the ``sort`` class's rate, each pass a kernel that also waits
    on the earlier tiles' counts (``passes``); a float input's gradient is scattered back by the
    positions (a scatter of the values' gradient)."""
    if not op.inputs:
        return NO_WORK
    n = op.n_in[0]
    kb = element_bytes(op.inputs[0].dtype, dtype_bytes, train_dtype)
    moved = [("sort", sort_bytes(n, kb))]
    launches = sort_launches(kb)
    if op.grad[0] and op.outputs and op.outputs[0].is_float:
        moved.append(("scatter", 2 * op.main_out + 8 * n))
        launches += 2
    experts = getattr(op.info, "routing_experts", 0)
    if experts and _routes_locally(op):
        around = route_locally_work(n, experts, op.tp)
        moved += around.moved
        launches += around.launches
    return OpWork(moved=tuple(moved), launches=launches, passes=sort_passes(kb))


def _routes_locally(op: _Op) -> bool:
    """A sort of a rank's own router ids that the rank's program runs as ``route_locally``
    (``passes/rules/local_routing``: its counts' all-gather inside)."""
    return bool(op.in_place) and isinstance(op.in_place[0], Routed) and op.in_place[0].own \
        and any(kind == "all_gather" for kind, _ in op.strategy.internal)


def _reduction_work(op: _Op) -> OpWork:
    moved = [("reduction", op.b_in[0] + op.out_bytes)]
    launches = 1
    if op.grad and op.grad[0] and op.outputs and op.outputs[0].is_float \
            and op.info.target not in (aten.sum.dim_IntList, aten.sum.default):
        moved.append(("elementwise", op.b_in[0] + op.main_out))   # the gradient spread back (sum's is a view)
        launches += 1
    return OpWork(moved=tuple(moved), launches=launches)


def _attention_work(op: _Op) -> OpWork:
    info = op.info
    q_shape = local_shape(op.inputs[0], op.in_place[0], op.tp, op.rank)
    k_shape = local_shape(op.inputs[1], op.in_place[1], op.tp, op.rank)
    mask = _flag(info.args, info.kwargs, 3, "attn_mask", None)
    dropout = _flag(info.args, info.kwargs, 4, "dropout_p", 0.0)
    causal = _flag(info.args, info.kwargs, 5, "is_causal", False)
    head_dim = q_shape[-1]
    fwd = 4 * _prod(q_shape) * k_shape[-2]
    if causal and mask is None:
        fwd = fwd / 2   # the kernels skip the blocks above the diagonal
    total = fwd * (sympy.Rational(7, 2) if any(op.grad[:3]) else 1)   # backward: 5 products to forward's 2
    moved = sum(op.b_in, sympy.Integer(0)) + op.main_out
    if any(op.grad[:3]):
        moved += 2 * sum(op.b_in[:3], sympy.Integer(0)) + 2 * op.main_out
    d = int(head_dim) if getattr(head_dim, "is_Integer", False) else 128
    return OpWork(attention=(Attention(total, d, bool(dropout), moved),), launches=1 + 2 * any(op.grad[:3]))


def _prod(shape: Sequence) -> sympy.Expr:
    value = sympy.Integer(1)
    for s in shape:
        value = value * s
    return value


def _product_work(op: _Op, dtype_bytes: int, train_dtype: Any) -> OpWork:
    """``mm``, ``linear``, ``bmm``, ``matmul`` on the local shapes: the forward product, and in
    backward ``dX = dY·Wᵀ`` where x carries a gradient and ``dW = Xᵀ·dY`` where W does."""
    t = op.info.target
    x, w = (local_shape(m, p, op.tp, op.rank) for m, p in zip(op.inputs[:2], op.in_place[:2]))
    if t is aten.linear.default:
        k, n, batch, m = x[-1], w[0], sympy.Integer(1), _prod(x[:-1])
    elif len(x) >= 3 and len(w) >= 3:                       # batched
        k, n, m, batch = x[-1], w[-1], x[-2], _prod(x[:-2])
    else:
        k, n, batch, m = x[-1], w[-1], sympy.Integer(1), _prod(x[:-1])
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


def _grouped_work(op: _Op, dtype_bytes: int, train_dtype: Any) -> OpWork:
    """A grouped product (each row by its expert's matrix): priced as one product per expert this
    rank holds, of the rows an expert gets on average."""
    x = local_shape(op.inputs[0], op.in_place[0], op.tp, op.rank)
    w = local_shape(op.inputs[1], op.in_place[1], op.tp, op.rank)
    out = local_shape(op.outputs[0], op.out_place[0], op.tp, op.rank)
    rows, k, n = _prod(out[:-1]), x[-1], out[-1]
    groups = w[0] if len(w) >= 3 else sympy.Integer(1)               # this rank's experts
    experts = op.inputs[1].shape[0] if len(w) >= 3 else sympy.Integer(1)
    eb = element_bytes(op.inputs[0].dtype, dtype_bytes, train_dtype)
    ok = aligned(k, eb) and aligned(n, eb)
    m = _prod(op.outputs[0].shape[:-1]) / experts    # the rows an expert gets on average
    products = [Product(m, n, k, groups, ok, streamed=k * n)]
    if op.grad[0]:
        products.append(Product(m, k, n, groups, ok, streamed=k * n))
    if len(op.grad) > 1 and op.grad[1]:
        products.append(Product(k, n, m, groups, ok, streamed=k * n))
    return OpWork(products=tuple(products), launches=len(products))
