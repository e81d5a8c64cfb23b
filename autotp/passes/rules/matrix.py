"""Matrix products: where column- and row-parallel come from.

For ``y = x @ W`` (GPT-2's Conv1D, ``mm``) or ``y = x @ W.T`` (``linear``):

* column-parallel: x replicated, W split on its output features -> y sharded on its last dim;
* row-parallel: x sharded on the contracted dim, W split the same way -> y Partial (the sum
  over ranks is the product; a g all-reduce makes it whole). x split as it arrives, or, where
  the weight is free, converted to a fresh split of its features (a whole x sliced on each rank:
  free forward, its gradient all-gathered), in whole heads where x was made of heads; where x
  arrives split unevenly (heads tp does not deal evenly), also an even split of x's features, x
  moved there by one all-to-all (the even row split);
* batch-parallel: x sharded on a row dim, W replicated -> y sharded on that dim.

A fresh column shard follows the hint for the output dim, so a fused q/k/v projection is
cut into each rank's own heads of q, k and v; a fused multi-query projection (q heads | k | v,
fewer key/value heads than ranks) into each rank's query heads with k and v whole (a tail).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ...placements import REPLICATE, Shard, is_even, resharded_by_all_to_all
from .contract import OpInfo, Strategy
from .registry import is_shard, register

aten = torch.ops.aten


def _matmul_strategies(info: OpInfo, placements: tuple, w_out: int, w_in: int) -> list[Strategy]:
    """x [..., K] times W, where W's dims ``w_out``/``w_in`` hold output/contracted features."""
    x_meta = info.inputs[0]
    px, pw = placements[0], placements[1]
    k = x_meta.ndim - 1
    out_last = info.output.ndim - 1
    out = [Strategy((REPLICATE, REPLICATE), REPLICATE)]
    col = info.fresh_shard(out_last)
    if col is not None:
        # A tail (a fused multi-query k and v) is computed whole on every rank: the rewrite
        # splits the product there, so that x's f sums the runs' gradient contributions alone.
        out.append(Strategy((REPLICATE, col.with_dim(w_out)), col, f_runs_only=col.holds_whole))
    if is_shard(pw) and pw.dim == w_out and (col is None or col.with_dim(w_out) != pw) and not pw.per_block \
            and (pw.chunks, pw.unit) != (1, 1):
        # column as W is split in blocks (a plan's weight, replayed in a program whose graph reads
        # the product's output otherwise: Mamba2's in-projection in a generation step, its conv
        # state cached): the output holds W's blocks. (A plain Shard is a layout pin of the dim
        # alone, its blocks read off the graph: the hint's column above.)
        out.append(Strategy((REPLICATE, pw), pw.with_dim(out_last), f_runs_only=pw.holds_whole))
    # Row-parallel: contracted features split alike in x and W; as x is split or, where W's
    # split differs (a plan's weight held in plain runs, x split by heads in another call's
    # program), as W is, x converted to it.
    if is_shard(px) and px.dim == k:
        out.append(Strategy((px, px.with_dim(w_in)), _partial()))
    if is_shard(pw) and pw.dim == w_in and not (is_shard(px) and px.dim == k and px.with_dim(w_in) == pw):
        size = x_meta.static(k)
        if size is not None and size // (pw.parts * pw.unit) >= info.tp and size % (pw.parts * pw.unit) == 0:
            out.append(Strategy((pw.with_dim(k), pw), _partial()))
        elif size is not None and size >= info.tp:
            out.append(Strategy((Shard(k), Shard(w_in)), _partial()))
    if pw is None and is_shard(px) and px.dim == k:
        even = _even_row(info, px, k)
        if even is not None:
            out.append(Strategy((even, even.with_dim(w_in)), _partial()))
    if pw is None and not (is_shard(px) and px.dim == k) and _row_may_pay(info, k, out_last):
        # Row-parallel with a free weight, x converted to a fresh split of its features (a whole
        # x sliced on each rank, free; a Partial reduce-scattered): what a weight pinned to its
        # input features gets above. Offered only as x arrived split, the solver could not reach
        # what a pin reaches (k and v row-parallel where there are fewer kv heads than ranks).
        # (x split on K already: the row split above costs no conversion, a fresh one a reshard)
        fresh = _fresh_row(info, k)
        if fresh is not None:
            out.append(Strategy((fresh, fresh.with_dim(w_in)), _partial()))
    # Batch-parallel: a row dim of x split, W whole.
    if is_shard(px) and px.dim < k:
        out.append(Strategy((px, REPLICATE), px))
    return out


def _row_may_pay(info: OpInfo, k: int, out_last: int) -> bool:
    """Whether a fresh row split (x converted, weight free) can beat the column split of the same
    product, by its collectives: from a whole x, row moves x's gradient (K, an all-gather) and its
    Partial y (2N: an all-reduce, or a reduce-scatter and its all-gather), column an f on x (2K)
    and at most an all-gather of y (N). Row is cheaper only where N < K; where N == K the two tie
    and row keeps a slice of x for backward, which a memory-tight plan may want where x is heads x
    head_dim (an output projection after attention computed whole). Where N > K (an MLP's up
    projection) row is dearer and not offered: every offer is a strategy more for every DP state."""
    n_in, n_out = info.inputs[0].static(k), info.output.static(out_last)
    if n_in is None or n_out is None:
        return False
    chunks, unit = info.input_hint(0, k)[:2]
    return n_out < n_in or (n_out == n_in and (chunks > 1 or unit > 1))


def _even_row(info: OpInfo, px: Shard, k: int) -> Shard | None:
    """An even split of x's contracted dim ``k`` for a free weight where x arrives split on it
    unevenly (heads that tp does not divide: Phi-3-medium's 10 groups at tp 8, 2 or 1 a rank):
    x moved to it by one all-to-all ((tp-1)/tp^2 of x each way), each rank's product then 1/tp of
    the work rather than the largest rank's share of the heads. The solver weighs the move against
    the imbalance; the row split along x's own split stays offered. None where x's split is even
    (no work to balance), K has no even split, or the move is not one all-to-all (a gather and a cut
    would make x whole, where column-parallel is the cheaper use of it)."""
    size = info.inputs[0].static(k)
    if size is None or is_even(size, px, info.tp):
        return None
    even = replace(info, input_hints={}, uneven=False).fresh_shard_of(0, k)
    if even is None or even == px or not resharded_by_all_to_all(px, even):
        return None
    return even


def _fresh_row(info: OpInfo, k: int) -> Shard | None:
    """A fresh split of x's contracted dim ``k``: whole heads where the dim's hint says it is heads x
    head_dim, else, where the heads cannot be dealt, even plain runs (any split of a whole x is
    sound; an uneven one without the hint's rotation would not follow the layer's)."""
    shard = info.fresh_shard_of(0, k)
    if shard is None or shard.holds_whole or shard.per_block:
        shard = replace(info, input_hints={}, uneven=False).fresh_shard_of(0, k)
    return shard


def _partial():
    from ...placements import PARTIAL

    return PARTIAL


@register(aten.mm.default)
def mm_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # W is [K, N] (GPT-2's Conv1D stores it transposed against nn.Linear).
    return _matmul_strategies(info, placements, w_out=1, w_in=0)


@register(aten.linear.default)
def linear_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    if len(info.inputs) != 2:
        from .registry import replicate_all

        return replicate_all(info, placements)  # capture splits the bias off; keep any other form whole
    return _matmul_strategies(info, placements, w_out=0, w_in=1)


@register(aten.bmm.default, aten.matmul.default)
def bmm_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    a, b = info.inputs
    pa, pb = placements
    if info.target is aten.matmul.default and a.ndim >= 2 and b.ndim == 2:
        # x [..., K] @ W [K, N]: Falcon's ``x @ weight.T``, column- or row-parallel like mm.
        return _matmul_strategies(info, placements, w_out=1, w_in=0)
    if info.target is aten.matmul.default and a.ndim == 2 and b.ndim >= 3:
        return _left_matrix_strategies(info, placements)
    if a.ndim < 2 or b.ndim < 2 or a.ndim != b.ndim:
        from .registry import replicate_all

        return replicate_all(info, placements)
    nd = a.ndim
    out = [Strategy((REPLICATE, REPLICATE), REPLICATE)]
    for p in (pa, pb):
        # A batch dim split alike on both operands.
        if is_shard(p) and p.dim < nd - 2 and a.shape[p.dim] == b.shape[p.dim]:
            out.append(Strategy((p, p), p))
    if nd == 3 and (pb is None or (is_shard(pb) and (pb.chunks, pb.unit, pb.tail) == (1, 1, 0))):
        out.extend(_free_stack(info, pa, pb))
    if is_shard(pa) and pa.dim == nd - 2:
        out.append(Strategy((pa, REPLICATE), pa))
    if is_shard(pb) and pb.dim == nd - 1:
        out.append(Strategy((REPLICATE, pb), pb))
    if is_shard(pa) and pa.dim == nd - 1:
        out.append(Strategy((pa, pa.with_dim(nd - 2)), _partial()))
    if is_shard(pb) and pb.dim == nd - 2 and not pb.holds_whole and not pb.per_block \
            and not (is_shard(pa) and pa.dim == nd - 1 and pa.with_dim(nd - 2) == pb):
        # row as b is split (a plan's down stack), x converted to it: a later program whose x
        # arrives whole (Llama-4's down_proj after a training call's plan) still has a strategy
        out.append(Strategy((pb.with_dim(nd - 1), pb), _partial()))
    return out


def _left_matrix_strategies(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``W [M, K] @ x [..., K, N]`` (a weight on the left, broadcast over x's leading dims: Mamba's
    ``dt_proj.weight @ time_step.transpose(1, 2)``, ``[d_inner, dt_rank] @ [b, dt_rank, s]``).
    Column-parallel: W split on its rows M, x whole -> y split on its rows; row-parallel: K split
    alike in W (dim 1) and x (dim -2) -> y Partial; a split of x's leading dims or of its columns N
    (W whole) passes through."""
    pw, px = placements
    nd = info.inputs[1].ndim
    rows = info.output.ndim - 2
    out = [Strategy((REPLICATE, REPLICATE), REPLICATE)]
    if is_shard(pw) and pw.dim == 0:
        out.append(Strategy((pw, REPLICATE), pw.with_dim(rows)))
    elif pw is None:
        col = info.fresh_shard(rows)
        if col is not None and not col.holds_whole and not col.per_block:
            out.append(Strategy((col.with_dim(0), REPLICATE), col))
    if is_shard(px) and px.dim == nd - 2:
        out.append(Strategy((px.with_dim(1), px), _partial()))
    elif is_shard(pw) and pw.dim == 1:
        out.append(Strategy((pw, pw.with_dim(nd - 2)), _partial()))
    if is_shard(px) and px.dim != nd - 2:
        # a leading (batch) dim or the columns: the output's dim of the same meaning
        out.append(Strategy((REPLICATE, px), px.with_dim(px.dim - nd + info.output.ndim)))
    return out


def _free_stack(info: OpInfo, pa, pb) -> list[Strategy]:
    """``x [n, rows, in] @ W [n, in, out]`` with W a parameter not yet placed (``pb`` None, or a
    pin's plain shard that the rule may still cut into blocks): a stack of ``n``
    matrices each applied to its own rows (Llama-4's experts, every token through every expert:
    gate|up ``[experts, hidden, 2*inter]``, down ``[experts, inter, hidden]``). Besides what the
    placements that arrived give: the stack split by whole matrices, x's matching rows sliced on
    each rank (expert parallelism: each rank computes its experts, their sum over the stack a
    Partial), and each matrix split on its output features, x whole (column: expert tensor
    parallelism's gate|up, in the blocks the output's hint reads off a following ``chunk``); the
    down product's row split follows from x arriving split on its features (above)."""
    from .experts import _matrix_shards

    out = []
    whole = info.fresh_shard_of(1, 0)
    if pb is None and whole is not None and info.inputs[1].static(0) is not None and info.inputs[1].static(0) >= 2 \
            and not whole.holds_whole and not whole.per_block and (pa == REPLICATE or pa == whole):
        out.append(Strategy((whole, whole), whole))   # (a pinned Shard(0): the batch split above)
    if info.inputs[1].static(0) is not None and pa == REPLICATE:
        for have, want in _matrix_shards(info, pb, (2,), lambda d: 2):
            out.append(Strategy((REPLICATE, have), want))
    return out


def _einsum_operands(equation: str, n: int) -> tuple[list[str], str] | None:
    """``"bclhn,bcshn->bclsh"`` -> (["bclhn", "bcshn"], "bclsh"); None for what the rule does
    not read (an ellipsis, an implicit output, a letter twice in one operand: a diagonal)."""
    if "..." in equation or "->" not in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    operands = lhs.split(",")
    if len(operands) != n or any(len(set(op)) != len(op) for op in operands + [out]):
        return None
    return operands, out


@register(aten.einsum.default)
def einsum_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``einsum(equation, operands)``: a letter split alike in every operand that holds it (the
    others whole) keeps the split in the output where the output holds the letter, and gives a
    Partial sum where it is contracted. Mamba2's chunked scan (``bclhn,bcshn->bclsh``, ...)
    thereby runs on each rank's heads; a letter of unequal sizes (a broadcast 1) is not split."""
    parsed = _einsum_operands(info.args[0], len(info.inputs)) if isinstance(info.args[0], str) else None
    out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
    if parsed is None:
        return out
    operands, result = parsed
    seen = set()
    for i, p in enumerate(placements):
        if not is_shard(p) or p.dim >= len(operands[i]):
            continue
        letter = operands[i][p.dim]
        sizes = {meta.shape[op.index(letter)] for meta, op in zip(info.inputs, operands) if letter in op}
        if letter in seen or len(sizes) != 1:
            continue
        seen.add(letter)
        ins = tuple(p.with_dim(op.index(letter)) if letter in op else REPLICATE for op in operands)
        out.append(Strategy(ins, p.with_dim(result.index(letter)) if letter in result else _partial()))
    return out
