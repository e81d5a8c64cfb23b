"""Plain functions the rewritten graph calls where a sharded op needs more than its ATen op."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import traced_as_now


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor,
                             ranges: tuple[tuple[int, int], ...], padding_idx: int = -1) -> torch.Tensor:
    """Look up the rows this rank holds (``ranges`` of the full vocabulary, in local order);
    rows held elsewhere give 0, so the sum over ranks (a g all-reduce) is the full lookup.
    ``padding_idx`` (of the full vocabulary, -1: none) is the row that gets no gradient
    (``nn.Embedding(padding_idx=...)``: BERT's, OPT's pad token): the rank holding it passes
    its local index on; elsewhere no row of this rank's table is the padding row."""
    local = torch.zeros_like(indices)
    mask = torch.zeros_like(indices, dtype=torch.bool)
    offset, local_padding = 0, None
    for start, stop in ranges:
        hit = (indices >= start) & (indices < stop)
        local = torch.where(hit, indices - start + offset, local)
        mask = mask | hit
        if padding_idx >= 0 and start <= padding_idx < stop:
            local_padding = padding_idx - start + offset
        offset += stop - start
    out = F.embedding(local, weight, padding_idx=local_padding)
    # rows held elsewhere zeroed in place (as Megatron's VocabParallelEmbedding does): no cast
    # of the mask, no second [b, s, h] tensor; embedding's backward does not read its output
    return out.masked_fill_(~mask.unsqueeze(-1), 0)


class EmbeddingByColumns(torch.nn.Module):
    """``aten.embedding`` of a table split by rows (``rows``: the vocabulary, as a vocab-parallel
    head holds it) read by columns: one all-to-all turns the rank's rows into every row's
    ``columns`` part (:func:`~autotp.distributed.collectives.reshard_tp`), and the lookup of every
    id writes the rank's columns of the output (``b·s·h/tp``, where a masked lookup of its own rows
    writes ``b·s·h``). The table's gradient, the tokens' rows scattered into those columns, goes
    back to the rows' ranks by the reverse all-to-all, each element summed on one rank alone:
    serial's sums, exact. ``padding_idx`` counts in the whole vocabulary, which every rank's
    resharded table holds."""

    kind = "embedding_by_columns"

    def __init__(self, group, rows, columns, vocab: int):
        super().__init__()
        self.group, self.rows, self.columns, self.vocab = group, rows, columns, int(vocab)

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        return new

    def forward(self, weight: torch.Tensor, indices: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
        from .collectives import reshard_tp

        table = reshard_tp(weight, self.group, self.rows, self.columns, self.vocab)   # [V, h/tp]
        return torch.ops.aten.embedding(table, indices, *rest, **kwargs)

    def extra_repr(self) -> str:
        return f"rows={self.rows!r}, columns={self.columns!r}, vocab={self.vocab}"


def mean_share(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool, count: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's share of a mean over dims it holds part of: its sum over them divided by their
    whole ``count``; the shares sum over ranks (a g) to the mean."""
    return torch.sum(x, list(dims), keepdim, dtype=dtype) / count


class _SplitRmsNorm(torch.autograd.Function):
    """``rms_norm(x, normalized_shape, None, eps)`` of an ``x`` split along normalized dims: each
    rank sums its own squares (one number per row), the sums are all-reduced, and each rank
    normalizes its own part, ``x * rsqrt(S / count + eps)``. Backward needs the rows' whole
    ``sum(dy * x)`` too, all-reduced the same way: ``dx = r dy - x r^3 sum(dy x) / count``. In
    float32 at least, as ``aten.rms_norm`` computes a half-precision input."""

    @staticmethod
    def forward(ctx, x, group, dims, count, eps):
        from .comm import _all_reduce

        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        squares = xf.square().sum(dims, keepdim=True)
        squares = _all_reduce(squares, group, "all_reduce(sum of squares) in a split rms_norm", in_place=True)
        rstd = torch.rsqrt(squares.div_(count).add_(eps))
        ctx.save_for_backward(x, rstd)
        ctx.dims, ctx.count, ctx.group = dims, count, group
        return (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        from .comm import _all_reduce

        x, rstd = ctx.saved_tensors
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        gf = grad.to(xf.dtype)
        dot = (gf * xf).sum(ctx.dims, keepdim=True)
        dot = _all_reduce(dot, ctx.group, "all_reduce(sum of dy * x) in a split rms_norm backward", in_place=True)
        dx = gf * rstd - xf * (rstd.pow(3) * dot.div_(ctx.count))
        return dx.to(x.dtype), None, None, None, None


class SplitRmsNorm(torch.nn.Module):
    """``aten.rms_norm`` (no weight) of an input split along normalized dims, as a named node of
    the rewritten graph: ``dims`` the normalized dims, ``count`` their whole number of elements."""

    kind = "split_rms_norm"

    def __init__(self, group, dims: tuple[int, ...], count: int, eps: float):
        super().__init__()
        self.group, self.dims, self.count, self.eps = group, tuple(dims), int(count), float(eps)

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SplitRmsNorm.apply(traced_as_now(x), self.group, list(self.dims), self.count, self.eps)

    def extra_repr(self) -> str:
        return f"dims={list(self.dims)}, count={self.count}, eps={self.eps}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split by vocabulary (Megatron's vocab-parallel loss).

    Forward: each rank takes its rows' local max ``m_r`` and its local softmax
    ``exp(x - m_r) / s_r`` in one fused kernel (whose entry at the max is ``1 / s_r``); the
    row max ``M`` is all-reduced, then each rank's share of the sum of exps,
    ``s_r exp(m_r - M)``, and the target's logit (from the rank that holds it) are all-reduced
    together (b*s numbers, then 2*b*s, never b*s*V). Three passes over the logits (the max, the
    softmax, backward's product) where ``max, logits - max, exp, sum`` took five. Backward needs
    no communication: the gradient of a rank's logits is its slice of softmax - one_hot, the
    local softmax rescaled by ``s_r exp(m_r - M) / S``.
    """

    @staticmethod
    def forward(ctx, logits, target, group, ranges, ignore_index, reduction):
        import torch.distributed as dist

        from .comm import _comm, group_size

        many = group_size(group) > 1
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        local_max, at_max = logits.max(dim=-1)
        softmax = torch.softmax(logits, -1)                                  # kept for backward
        inv_sum = softmax.gather(-1, at_max.unsqueeze(-1)).squeeze(-1)      # exp(0) / s_r
        row_max = local_max
        if many:
            row_max = local_max.clone()
            with _comm("all_reduce(max) in vocab-parallel cross-entropy", group):
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # the targets' local columns (0 where another rank holds them), range by range
        local_target = in_range = None
        offset = 0
        for start, stop in ranges:
            shifted = target - (start - offset)
            hit = (target >= start) & (target < stop)
            if local_target is None:
                local_target, in_range = shifted * hit, hit
            else:
                local_target = torch.where(hit, shifted, local_target)
                in_range |= hit
            offset += stop - start
        if local_target is None:   # no columns held
            local_target, in_range = torch.zeros_like(target), torch.zeros_like(target, dtype=torch.bool)
        picked = (logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max) * in_range
        sum_exp = torch.sub(local_max, row_max).exp_().div_(inv_sum)         # s_r exp(m_r - M)
        share = sum_exp
        if many:
            both = torch.stack([sum_exp, picked])
            with _comm("all_reduce(sum) in vocab-parallel cross-entropy", group):
                dist.all_reduce(both, group=group)
            sum_exp, picked = both[0], both[1]
        losses = sum_exp.log() - picked
        # the local softmax's part of the whole one: s_r exp(m_r - M) / S
        share = share / sum_exp
        valid = target != ignore_index
        losses = losses * valid
        count = valid.sum()
        ctx.save_for_backward(softmax, share, local_target, in_range, valid, count)
        ctx.reduction = reduction
        if reduction == 1:   # mean over non-ignored targets
            return losses.sum() / count
        if reduction == 2:
            return losses.sum()
        return losses

    @staticmethod
    def backward(ctx, grad):
        softmax, share, local_target, in_range, valid, count = ctx.saved_tensors
        # d loss_i / d logit_ij = scale_i * (softmax_ij - [j is i's target]): one full-size
        # tensor (the local softmax scaled by scale_i * share_i), the target's entry lowered in place
        scale = torch.where(valid, grad / count if ctx.reduction == 1 else grad, 0)   # no cast of the mask
        out = softmax * (scale * share).unsqueeze(-1)
        out.scatter_add_(-1, local_target.unsqueeze(-1), -(scale * in_range).unsqueeze(-1))
        return out, None, None, None, None, None


class VocabParallelCrossEntropy(torch.nn.Module):
    """``cross_entropy_loss`` on vocab-split logits, as a named node of the rewritten graph."""

    kind = "vocab_parallel_cross_entropy"

    def __init__(self, group, ranges: tuple[tuple[int, int], ...], ignore_index: int, reduction: int):
        super().__init__()
        self.group, self.ranges = group, tuple(ranges)
        self.ignore_index, self.reduction = ignore_index, reduction

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        return new

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = _VocabParallelCrossEntropy.apply(traced_as_now(logits), target, self.group, self.ranges,
                                               self.ignore_index, self.reduction)
        return out

    def extra_repr(self) -> str:
        return f"ranges={list(self.ranges)}, ignore_index={self.ignore_index}"


class _TailExactAdd(torch.autograd.Function):
    """``x + b`` where ``b`` broadcasts along x's leading dims and both hold a tailed layout on
    the last dim (a fused multi-query bias: k and v whole on every rank). The gradient of b's
    tail is summed from a contiguous copy of its columns alone, a tensor of the same shape on
    every rank, so the ranks' copies of the tail get bitwise the same gradient (summed inside the
    whole gradient, the tail's rounding would follow each rank's own width)."""

    @staticmethod
    def forward(ctx, x, b, tails):
        ctx.tails, ctx.b_shape = tails, b.shape
        return x + b

    @staticmethod
    def backward(ctx, grad):
        lead = tuple(range(grad.dim() - len(ctx.b_shape)))
        keep = tuple(i for i, n in enumerate(ctx.b_shape) if n == 1)
        grad_b = grad.sum(lead) if lead else grad.clone()
        if keep:
            grad_b = grad_b.sum(keep, keepdim=True)
        for start, stop in ctx.tails:
            tail = grad.narrow(-1, start, stop - start).contiguous()
            tail = tail.sum(lead) if lead else tail
            grad_b.narrow(-1, start, stop - start).copy_(tail.sum(keep, keepdim=True) if keep else tail)
        return grad, grad_b, None


def tail_exact_add(x: torch.Tensor, b: torch.Tensor, tails: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``x + b`` with b's gradient over the local ``tails`` ranges of the last dim summed alone
    (see :class:`_TailExactAdd`)."""
    return _TailExactAdd.apply(traced_as_now(x), traced_as_now(b), tails)


def repeat_rows(x: torch.Tensor, repeats: int, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The rows ``ranges`` (of dim ``dim``, in order) of ``x.repeat_interleave(repeats, dim)``,
    repeating only the groups they read: one rank's heads' copies of whole groups."""
    parts = []
    for start, stop in ranges:
        first, last = start // repeats, (stop - 1) // repeats
        part = x.narrow(dim, first, last - first + 1).repeat_interleave(repeats, dim)
        parts.append(part.narrow(dim, start - first * repeats, stop - start))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class _GradIf(torch.autograd.Function):
    """``x`` forward; backward the gradient where ``keep``, else none. A per-block tail (one group's
    k and v, whole on each rank of the group's set) has a whole gradient on each of those ranks:
    the product computing it passes it to x's gradient from the set's first rank alone, so that
    x's f, summing over all ranks, counts every group once."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.keep else None), None


def grad_if(x: torch.Tensor, keep: int) -> torch.Tensor:
    """``x``, passing its gradient back only where ``keep`` is 1 (see :class:`_GradIf`); an int,
    which the ranks' graph agreement reads as a size, since it differs between ranks."""
    return _GradIf.apply(traced_as_now(x), bool(keep))


def rank_slice(full: torch.Tensor, dim: int, chunks: int, unit: int, rotate: int, sizes: tuple, tp: int,
               rank: int) -> torch.Tensor:
    """This rank's part of ``full`` under ``Shard(dim, chunks, unit, rotate, sizes=sizes)`` (no tail, no
    block held by several ranks), cut by plain autograd ops: its gradient comes back zero-padded,
    a summand whose sum over the ranks is the whole gradient. The rewrite cuts a tensor gathered
    into sharded compute so (``all_gather_f``, whose backward reduce-scatters summands) where
    another consumer wants it split another way: no scatter, and no second gather to feed one."""
    from ..placements import Shard
    from .shards import local_shard

    return local_shard(full, Shard(dim, chunks, unit, rotate, sizes=tuple(sizes)), tp, rank)


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` where ``index`` is a permutation of x's rows: forward a gather, backward a
    gather by the inverse permutation (each row's gradient lands in one row, so no scatter-add:
    autograd's backward of ``x[index]``, ``index_put(accumulate=True)`` into zeros, is a sorted
    scatter, several times slower on CUDA and on CPU). The same values: 0 + g is g. The inverse is
    ``inverse``, a value the graph makes (transformers' ``inv_perm`` for ``w[perm]``, made first in
    the rank's program, and ``perm`` for ``out[inv_perm]``; an ``argsort`` or a scatter of an
    arange alike); without it each gradient row is copied to its row (``index_copy_``: one
    kernel, no accumulation, every row written once), not the inverse made first (an arange
    scattered)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(index if inverse is None else inverse)
        ctx.held = inverse is not None
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        if ctx.held:   # index is the inverse
            return grad.index_select(0, index), None, None
        return grad.new_empty(grad.shape).index_copy_(0, index, grad), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """``x[index]`` for a permutation ``index`` of x's rows (the graph proves it:
    autotp/passes/rules/routing.is_permutation), its backward a gather (:class:`_PermuteRows`) by
    ``inverse``, the inverse permutation, where the caller holds it (the graph proves that too:
    autotp/passes/rules/row_reads.inverse_permutations); a copy of each row to its row otherwise."""
    return _PermuteRows.apply(x, index, inverse)
