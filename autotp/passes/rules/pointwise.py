"""Elementwise ops, with broadcasting: a shard passes through when every input either holds
the same shard of that dim or broadcasts along it (and then stays replicated).

Partial values pass through the ops that are linear in them: a sum of partials is partial,
a partial times a replicated factor is partial. ``add(Partial, Replicate)`` is *not* sound
(the replicated term would be added tp times): that is why a row-parallel bias is added
after the all-reduce.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx

from ...placements import PARTIAL, REPLICATE, Partial, Placement, Replicate, Routed
from .contract import LocalContext, OpInfo, Strategy, TensorMeta, along_sequence
from .registry import is_partial, is_shard, register, register_localizer

aten = torch.ops.aten

# Linear in all tensor operands together (sum of partials is partial).
ADDITIVE = [aten.add.Tensor, aten.sub.Tensor]
# Linear in exactly one operand, the others replicated factors.
MULTIPLICATIVE = [aten.mul.Tensor, aten.div.Tensor]
# Unary and linear.
LINEAR_UNARY = [aten.neg.default, aten.mul.Scalar, aten.div.Scalar]

UNARY = [
    aten.tanh.default, aten.exp.default, aten.log.default, aten.sqrt.default, aten.rsqrt.default,
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.abs.default,
    aten.pow.Tensor_Scalar, aten.sin.default, aten.cos.default, aten.erf.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default,
    aten.dropout.default, aten.add.Scalar, aten.sub.Scalar, aten.reciprocal.default,
    aten.ne.Scalar, aten.eq.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar,
    aten.logical_not.default, aten.bitwise_not.default, aten.clamp.default, aten.square.default,
    aten.softplus.default, aten.floor.default, aten.log1p.default,
]
BINARY = [
    aten.pow.Tensor_Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor,
    aten.gt.Tensor, aten.ge.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
    aten.logical_or.default, aten.maximum.default, aten.minimum.default, aten.where.self,
    aten.where.ScalarOther,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.polar.default,
]


def _shard_strategies(info: OpInfo, placements: tuple) -> list[Strategy]:
    """For each output dim some input is sharded on: the strategy that shards it everywhere."""
    out_shape = info.output.shape
    nd = len(out_shape)
    seen, out = set(), []
    for meta, p in zip(info.inputs, placements):
        if not is_shard(p):
            continue
        od = p.dim + nd - meta.ndim
        if meta.shape[p.dim] != out_shape[od] or (od, p.chunks, p.unit, p.tail, p.sizes, p.whole) in seen:
            continue
        seen.add((od, p.chunks, p.unit, p.tail, p.sizes, p.whole))
        shard_out = p.with_dim(od)
        req = []
        for m in info.inputs:
            k = od - (nd - m.ndim)
            if k < 0 or (m.shape[k] == 1 and out_shape[od] != 1):
                req.append(REPLICATE)  # broadcast along the sharded dim
            else:
                req.append(shard_out.with_dim(k))
        out.append(Strategy(tuple(req), shard_out))
    return out


def _all_replicate(info: OpInfo) -> Strategy:
    return Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)


@register(*BINARY)
def pointwise_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return [_all_replicate(info), *_shard_strategies(info, placements)]


@register(*UNARY)
def unary_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # a row-parallel product's partial sum met by a dropout (Phi-3's output projections have no
    # bias to add first) or a cast (a post-norm's float32 upcast: OLMo-2) before the residual add:
    # sequence parallelism's entry, as at an add
    out = pointwise_rule(info, placements)
    if is_partial(placements[0]) and _keeps_dtype(info):
        out.append(Strategy((PARTIAL,), PARTIAL))
    return _with_sequence_entry(info, placements, out)


#: casts that are the identity (or a copy) where the dtype they ask for is the input's own
CASTS = frozenset((aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default))


def _keeps_dtype(info: OpInfo) -> bool:
    """Whether ``info`` is a cast to its input's own dtype: the identity on each summand, so a
    Partial passes exactly (an MoE layer's combine ``.to(hidden.dtype)`` in front of the view
    back to ``[b, s, h]``: the partial sum then reaches the residual add, where sequence
    parallelism reduce-scatters it, not all-reduced whole and sliced). A cast that changes the
    dtype would round each rank's summand apart, not the sum: not offered."""
    return (info.target in CASTS and len(info.inputs) == 1 and isinstance(info.output, TensorMeta)
            and info.output.dtype == info.inputs[0].dtype)


def _with_sequence_entry(info: OpInfo, placements: tuple, out: list[Strategy]) -> list[Strategy]:
    """``out`` and, where a Partial operand meets the op, the reduce-scatter along the sequence
    into it (:func:`_sequence_parallel`); forced (``sequence_parallel=True``), the Partial is
    reduce-scattered there along the sequence (or stays Partial): never all-reduced whole, nor
    reduce-scattered along another dim (a residual stream split by its hidden features, which
    Llama-4 at tp 2 took instead, the cheaper of the two at its width)."""
    if not any(is_partial(p) for p in placements):
        return out
    passes = _passes_partial(placements, out)
    sequence = _sequence_parallel(info, merged=not passes)
    if info.force_sequence and (sequence or passes):
        # an op with no sequence dim to split that passes the Partial on (a same-dtype cast of
        # an MoE combine's flat [tokens, hidden] sum) must pass it on forced: all-reduced there,
        # the add after it, where the sequence is, never meets a partial sum to reduce-scatter
        out = [s for s in out if _along_sequence(info, placements, s)]
    return out + sequence


def _along_sequence(info: OpInfo, placements: tuple, strategy: Strategy) -> bool:
    """Whether ``strategy`` keeps each Partial operand Partial or reduce-scatters it along a
    sequence dim."""
    for meta, have, want in zip(info.inputs, placements, strategy.inputs):
        split_along_s = is_shard(want) and along_sequence(meta, want.dim, info.sequence)
        if is_partial(have) and not (is_partial(want) or split_along_s):
            return False
    return True


@register(aten.tril.default, aten.triu.default)
def triangle_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # Which elements survive depends on their global (row, column): only batch dims may be split.
    nd = info.output.ndim
    return [s for s in pointwise_rule(info, placements) if not (is_shard(s.output) and s.output.dim >= nd - 2)]


@register(*ADDITIVE)
def additive_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    out = pointwise_rule(info, placements)
    if not any(is_partial(p) for p in placements):
        return out
    # P + P -> P; a scalar operand other than 0 would be added tp times.
    scalars = [a for a in info.args[:2] if isinstance(a, (int, float, bool))]
    if all(a == 0 for a in scalars):
        out.append(Strategy(tuple(PARTIAL for _ in info.inputs), PARTIAL))
    return _with_sequence_entry(info, placements, out)


def _passes_partial(placements: tuple, out: list[Strategy]) -> bool:
    """Whether one of ``out`` takes every operand as it is and leaves a Partial (a sum of partial
    sums, a cast to the dtype it has): the partial sum passes on to where it must be resolved."""
    return any(s.output == PARTIAL and all(w == p for w, p in zip(s.inputs, placements)) for s in out)


def _sequence_parallel(info: OpInfo, merged: bool = True) -> list[Strategy]:
    """Sequence parallelism's entry: a Partial operand (a row-parallel product, a vocab-parallel
    lookup) is reduce-scattered along the sequence instead of all-reduced, and the add runs on
    this rank's tokens; replicated operands that span the sequence are sliced, ones that
    broadcast along it (a bias) stay whole. ``merged``: also into the tokens' rows of a batch
    and a sequence merged (:func:`merged_sequence_rows`), offered where the Partial cannot pass
    on as it is (a bias add, a dropout): where it can (the top-k sum of an MoE layer's combine,
    its cast to its own dtype), it reaches the view back to ``[b, s, h]`` and the residual add,
    reduce-scattered along ``s`` there, as before."""
    out_shape = info.output.shape
    nd = len(out_shape)
    found = []
    for d in range(nd):
        shard = info.fresh_shard(d) if info.output.static(d) is None or along_sequence(info.output, d, info.sequence) \
            else None
        if shard is None:
            continue
        req = []
        for m in info.inputs:
            k = d - (nd - m.ndim)
            req.append(REPLICATE if k < 0 or (m.shape[k] == 1 and out_shape[d] != 1) else shard.with_dim(k))
        found.append(Strategy(tuple(req), shard))
    rows = merged_sequence_rows(info) if merged else None
    if rows is not None:
        # operands along the rows take the rank's rows; ones broadcast along them stay whole
        req = [REPLICATE if m.ndim < nd or m.shape[0] == 1 else rows if m.shape[0] == out_shape[0] else None
               for m in info.inputs]
        if None not in req:
            found.append(Strategy(tuple(req), rows))
    return found


def merged_sequence_rows(info: OpInfo) -> Routed | None:
    """The rank's tokens' rows (``Routed(0, tokens=True)``) where the op's output rows are the
    batch and a sequence dim merged (``[b*s, h]``: OPT's decoder layer flattens the residual stream
    around its MLP): the rows of ``[b, s, h]`` split along the sequence and flattened, ``b`` runs
    of ``s/tp`` each. No Shard says that split where the batch is dynamic (a Shard of ``b``
    blocks); the token rows do, with a row map computed from the shapes. A Partial operand is
    reduce-scattered into it (the rows viewed as ``[b, s, h]``, reduce-scattered along ``s``:
    :func:`~autotp.distributed.experts.sequence_rows`), the same bytes as along ``s`` itself."""
    if info.tp < 2 or not info.uneven or not isinstance(info.output, TensorMeta) or info.output.ndim < 2:
        return None
    return Routed(0, tokens=True) if sequence_factors(info.output.shape[0], info.sequence) is not None else None


def partial_into_rows(info: OpInfo, placements: tuple) -> list[Strategy]:
    """An add (or sub) of the rank's tokens' rows (``P(tokens 0)``, the residual of a block on
    ``[b*s, h]``) and a plain partial sum (a bias-free fc2's): the sum reduce-scattered into the
    rows and added row by row, the rows' result. Routed rows reach the rules as a Partial (rows
    scattered into zeros: rules/experts), where a sum of partial sums passes on whole and
    :func:`_sequence_parallel` offers no rows: the sum would be all-reduced later, not
    reduce-scattered. Operands broadcast along the rows stay whole."""
    rows = merged_sequence_rows(info) if info.target in ADDITIVE else None
    if rows is None or rows not in placements or any(isinstance(p, Routed) and p != rows for p in placements) \
            or not any(is_partial(p) and not isinstance(p, Routed) for p in placements):
        return []
    nd = info.output.ndim
    req = [REPLICATE if m.ndim < nd or m.shape[0] == 1 else rows if m.shape[0] == info.output.shape[0] else None
           for m in info.inputs]
    return [] if None in req else [Strategy(tuple(req), rows)]


def sequence_factors(rows: Any, sequence: frozenset) -> tuple[Any, sympy.Symbol] | None:
    """``(outer, s)`` where ``rows`` (a dim's size) is ``outer * s`` for a sequence symbol ``s``,
    ``outer`` a product of other symbols alone (the batch): the dim holds flattened tokens ``[b,
    s] -> [b*s]``, read batch first as a view of ``[b, s, ...]`` to ``[-1, ...]`` makes it. None
    otherwise: a static size, a sum, a dim with no sequence in it, or a number in the product
    (``[b*s*k]``, a token's top-k rows side by side: runs of ``s/tp`` of it would cut a token's
    rows apart)."""
    if not isinstance(rows, sympy.Expr):
        return None
    for s in sorted(sequence, key=str):
        outer = sympy.cancel(rows / s)
        factors = outer.args if outer.is_Mul else (outer,)
        if s in outer.free_symbols or not all(f.is_Symbol for f in factors):
            continue
        return outer, s
    return None


def reduce_scatters_tokens(have: Any, want: Any) -> bool:
    """Whether turning ``have`` into ``want`` is a plain Partial reduce-scattered along the
    sequence into the rank's tokens' rows (``P(tokens 0)``: :func:`merged_sequence_rows`, the
    combine at its narrowing cast; rewrite.scatter_tokens)."""
    return (isinstance(have, Partial) and not isinstance(have, Routed) and isinstance(want, Routed)
            and want.tokens and not want.reordered and want.span == 1 and want.dim == 0 and want.unit == 1)


def scatters_tokens(have: Any, want: Any) -> bool:
    """Whether turning ``have`` into ``want`` is a whole tensor sliced to the rank's tokens' rows
    (``R -> P(tokens 0)``: a residual ``[b*s, h]`` every rank holds, added to the rows; free
    forward, its gradient all-gathered along the sequence; rewrite.slice_tokens). Only where its
    rows are flattened tokens (:func:`sequence_factors`: propagate.conversion_seconds asks)."""
    return (isinstance(have, Replicate) and isinstance(want, Routed) and want.tokens and not want.reordered
            and not want.own and want.span == 1 and want.dim == 0 and want.unit == 1)


@register_localizer(aten.add.Tensor)
def add_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """A bias with a tail (a fused multi-query projection's k and v columns) added along the
    rows: its gradient sums the tail's columns on their own (``tail_exact_add``), so that every
    rank's copy of the tail stays bitwise the same when the ranks' widths differ."""
    out = strategy.output
    nd = info.output.ndim
    if not (is_shard(out) and out.tail and out.dim == nd - 1 and len(info.inputs) == 2 and not kwargs
            and all(isinstance(a, fx.Node) for a in args[:2])):
        return info.target, args, kwargs
    x, b = info.inputs
    if b.ndim >= x.ndim and not any(b.shape[i] == 1 and x.shape[i] != 1 for i in range(b.ndim - 1)):
        return info.target, args, kwargs
    from ...placements import local_ranges
    from ...distributed.functional import tail_exact_add

    size = int(info.output.shape[out.dim])
    ranges = local_ranges(size, out, ctx.tp, ctx.rank)
    block = size // out.chunks
    tails, at = [], 0
    for a, z in ranges:
        if a % block >= block - out.tail * out.unit:
            tails.append((at, at + z - a))
        at += z - a
    return tail_exact_add, (args[0], args[1], tuple(tails)), {}


@register(*MULTIPLICATIVE)
def multiplicative_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    out = pointwise_rule(info, placements)
    n = len(info.inputs)
    for i, p in enumerate(placements):
        if is_partial(p) and not (info.target is aten.div.Tensor and i == 1):
            out.append(Strategy(tuple(PARTIAL if j == i else REPLICATE for j in range(n)), PARTIAL))
    return out


@register(aten.copy_.default, aten.copy.default)
def copy_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``dest.copy_(src)``: src, cast to dest's dtype and broadcast to its shape, written over all
    of dest (transformers writes a recurrent layer's conv and SSM states so into the cache). The
    two take one placement: dest's, src converted to it (a whole dest from a split src is a
    gather, a split dest from a whole src a slice) - dest is written in place, so it stays as it
    is, and views of it see the update. Where nothing else reads dest (``writes_alone``: a fresh
    ``zeros`` buffer) it may take src's placement instead: a split src is written into its
    rank's slice of dest, nothing gathered. A Partial passes (the copy is linear)."""
    dest, src = info.inputs[0], info.inputs[1]
    nd, have = dest.ndim, placements[0]

    def src_of(p: Placement) -> Placement:
        """The placement src takes for dest placed ``p``: a dim src broadcasts along stays whole."""
        if not is_shard(p):
            return p
        k = p.dim - (nd - src.ndim)
        return REPLICATE if k < 0 or (src.shape[k] == 1 and dest.shape[p.dim] != 1) else p.with_dim(k)

    wanted = [have]
    p = placements[1]
    if info.writes_alone and is_shard(p) and src.shape[p.dim] == dest.shape[p.dim + nd - src.ndim]:
        wanted.append(p.with_dim(p.dim + nd - src.ndim))
    out = [Strategy((REPLICATE, REPLICATE), REPLICATE)]
    for p in wanted:
        if (is_shard(p) or is_partial(p)) and Strategy((p, src_of(p)), p) not in out:
            out.append(Strategy((p, src_of(p)), p))
    return out


@register(*LINEAR_UNARY)
def linear_unary_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    out = pointwise_rule(info, placements)
    if is_partial(placements[0]):
        out.append(Strategy((PARTIAL,), PARTIAL))
    return out
