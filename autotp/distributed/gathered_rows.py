"""The (token, expert) rows of a rank's own tokens, all-gathered whole in their sorted order.

Under expert-TP with the tokens split along the sequence, every rank's column-parallel gate|up
product reads every row of ``h[perm // k]`` (the tokens' hidden states in the order of the sort by
expert), and its gradient there is a summand on each rank. Each rank holds its own tokens, so it
can take its tokens' rows alone (``k`` rows a token: ``perm`` is a permutation of the ``T*k``
rows), and one all-gather makes them whole on every rank; backward, the summands of the rows'
gradient are reduce-scattered back to the ranks of their tokens (the f, fused in). That is half
the bytes of the g of the rows scattered into zeros and the f at the product it replaces, and no
count is read to the host: rank ``r`` holds ``k`` times its tokens' count, which the shapes give.

Every rank knows where every token is (``owners``: the holder of each token, from the shapes), so
every rank computes the same order of the gathered rows: rank by rank, each rank's rows in
ascending sorted position (``order``, a stable sort of the rows' holders, made by a counting pass:
:func:`holders_order`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from .comm import _comm, group_rank, group_size
from .gather_scatter import _c10d_all_gather_single, _c10d_reduce_scatter_tensor


def run_lengths(seq: int, tp: int) -> list[int]:
    """Each rank's run of a sequence of ``seq`` positions split in contiguous runs, the first
    ``seq % tp`` one longer (the sequence split's layout, :func:`.experts.token_rows`)."""
    return [seq // tp + (1 if r < seq % tp else 0) for r in range(tp)]


def holders_order(holder: Tensor, tp: int) -> tuple[Tensor, Tensor]:
    """The rows laid out rank by rank, each rank's in ascending position: ``order`` (what a stable
    sort of ``holder`` returns) and ``place``, its inverse (each row's position there), by one
    counting pass, not a sort (``cost_model.routing.holders_order_work``): a cumulative count of each rank's
    rows (``tp`` counters a row) gives each row the rows of its rank before it, and its last row
    every rank's count, so its first row. No read to the host, no copy from it: one graph under
    torch.compile."""
    if holder.numel() == 0:
        return holder.clone(), holder.clone()
    mine = holder.unsqueeze(1) == torch.arange(tp, device=holder.device)          # [rows, tp]
    seen = mine.cumsum(0)                                                         # [rows, tp]
    before = seen.gather(1, holder.unsqueeze(1)).squeeze(1) - 1                   # rows of its rank before it
    counts = seen[-1]                                                             # [tp]: every rank's rows
    place = (counts.cumsum(0) - counts).index_select(0, holder) + before
    order = torch.empty_like(place)
    order[place] = torch.arange(place.numel(), device=place.device)
    return order, place


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows (``counts[r]`` of them, padded to the largest) all-gathered and
    laid out whole by ``place`` (a row's position among the gathered rows). Backward: the whole
    gradient's summands laid out by rank (``order``), reduce-scattered: each rank gets the summed
    gradient of its own rows."""

    @staticmethod
    def forward(ctx, y: Tensor, order: Tensor, place: Tensor, counts: tuple, group: Any) -> Tensor:
        tp, rank = group_size(group), group_rank(group)
        width = max(counts)
        send = y if y.shape[0] == width else torch.cat([y, y.new_zeros((width - y.shape[0], *y.shape[1:]))])
        send = send.contiguous()
        if torch.compiler.is_compiling():
            got = funcol.wait_tensor(funcol.all_gather_tensor(send, 0, group))
        else:
            got = send.new_empty((tp * width, *send.shape[1:]))
            with _comm("all_gather of (token, expert) rows", group):
                _c10d_all_gather_single(got, send, group=group)
        ctx.save_for_backward(order)
        ctx.counts, ctx.group, ctx.width, ctx.rank = counts, group, width, rank
        return got.index_select(0, place)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        counts, group, width, rank = ctx.counts, ctx.group, ctx.width, ctx.rank
        tp = len(counts)
        blocks = grad.index_select(0, order)   # rank by rank
        if width * tp != blocks.shape[0]:   # uneven runs: each rank's block padded to the widest
            padded = grad.new_zeros((tp * width, *grad.shape[1:]))
            at = 0
            for r, n in enumerate(counts):
                padded[r * width:r * width + n] = blocks[at:at + n]
                at += n
            blocks = padded
        blocks = blocks.contiguous()
        if torch.compiler.is_compiling():
            out = funcol.wait_tensor(funcol.reduce_scatter_tensor(blocks, "sum", 0, group))
        elif grad.device.type != "cpu" and dist.get_backend(group) == "gloo":
            # gloo reduce-scatters CPU tensors only (ranks sharing one GPU): all-reduce, keep ours
            with _comm("all_reduce of (token, expert) rows' gradient", group):
                dist.all_reduce(blocks, group=group)
            out = blocks[rank * width:(rank + 1) * width]
        else:
            out = blocks.new_empty((width, *blocks.shape[1:]))
            with _comm("reduce_scatter of (token, expert) rows' gradient", group):
                _c10d_reduce_scatter_tensor(out, blocks, group=group)
        return out[:counts[rank]], None, None, None, None


class GatherRowsTP(nn.Module):
    """``h[index]`` whole on every rank, where ``h`` is this rank's tokens (``x``: its rows of the
    flattened ``[b*s, ...]`` tokens, ``rows`` their global ids ascending, ``owners`` every token's
    rank) and ``index`` is ``perm // copies`` for a permutation ``perm`` of ``T*copies`` rows (every
    token taken ``copies`` times): each rank takes its tokens' rows, in their sorted positions'
    order, and one all-gather lays every rank's out whole (backward: a reduce-scatter of the
    gradient's summands, the f fused in). ``outer``, ``seq``: the merged dims the rows came from
    (``[b, s]``), whose split gives every rank's count of rows with no read."""

    kind = "all_gather_rows"

    def __init__(self, group: Any, copies: int) -> None:
        super().__init__()
        self.group, self.copies = group, copies

    def forward(self, x: Tensor, index: Tensor, rows: Tensor, owners: Tensor, outer: Sequence[int],
                seq: int) -> Tensor:
        tp, rank = group_size(self.group), group_rank(self.group)
        # lists, not generators: torch.compile breaks its graph at a generator passed to a call
        tokens = math.prod([int(o) for o in outer])
        counts = tuple([self.copies * tokens * n for n in run_lengths(int(seq), tp)])
        holder = owners.index_select(0, index)   # the rank of each sorted row's token
        starts = [sum(counts[:r]) for r in range(tp)]
        order, place = holders_order(holder, tp)
        width = max(counts)
        if min(counts) != width:   # the gathered rows are padded blocks of the widest
            shift = torch.cat([torch.full((n,), r * width - s, dtype=place.dtype, device=place.device)
                               for r, (n, s) in enumerate(zip(counts, starts))])   # sizes known: one graph
            place = place + shift[place]
        mine = order[starts[rank]:starts[rank] + counts[rank]]   # this rank's rows, by sorted position
        local = torch.searchsorted(rows, index.index_select(0, mine))   # their tokens among its rows
        y = x.index_select(0, local)
        return _GatherRows.apply(y, order, place, counts, self.group)

    def extra_repr(self) -> str:
        return f"copies={self.copies}"
