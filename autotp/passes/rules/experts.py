"""Mixtures of experts: expert parallelism and expert tensor parallelism as placements.

transformers keeps an MoE layer's experts as 3-D weights (``[experts, out, in]``) and runs them
one of two ways the program shows: ``grouped_mm`` sorts the (token, expert) rows by expert and
calls one grouped product (``aten._grouped_mm``, or ``transformers::grouped_mm_fallback`` where
that kernel does not take the dtype), ``batched_mm`` picks each row's expert weights with
``weight[expert_ids]`` and runs a ``bmm``. Expert parallelism (HF's and torchtitan's EP layout) is:

* the weights ``Shard(0)``: each rank holds a run of whole experts (uneven where tp does not
  divide their number), split at the first op that reads them (a transpose keeps it);
* the product on a rank computes the rows routed to its experts and leaves the others zero: a
  :class:`~autotp.placements.Routed` Partial, which ops acting on rows alone carry on with no
  collective (:func:`routed_strategies`), and which becomes a plain Partial where rows are summed
  (the combine over a token's top-k experts), made whole by a g like any row-parallel output;
* the router stays replicated: its scores meet the routed rows in a product, so their gradient
  is a summand and gets an f (summed over ranks), as any replicated input of sharded compute.

Expert tensor parallelism (Megatron's expert-TP) is the familiar column/row split inside every
expert: the gate|up stack ``[experts, 2*inter, hidden]`` split on its output features, in two
blocks (each rank holds matching halves of gate and up, as a fused dense gate|up is split, the
blocks read off the ``chunk`` that follows: :func:`autotp.passes.hints.column_hint`), the down
stack on its input features. Every rank computes every routed row for its slice of every
expert; the down product's rows are a plain Partial, combined by the same g. The strategies
below carry a Shard of the stacks' matrix dims (1, 2) through the ops that read them: the pick
``weight[expert_ids]`` (the shard moves to the picked rows' matching dim), ``bmm`` (its own
rule: column and row), the grouped product, and the transpose in front of it
(autotp/passes/rules/view.py). Which of the two layouts a layer takes is the solver's choice.
"""
from __future__ import annotations

import torch

from ...placements import PARTIAL, REPLICATE, Partial, Routed, Shard, local_ranges
from .misc import index_localizer as _index_localizer
from .registry import LocalContext, OpInfo, Strategy, _RULES, is_shard, register, register_localizer, register_routed

aten = torch.ops.aten

#: ops whose result's rows depend on the same rows of their inputs alone and keep a zero row zero
ROW_WISE = frozenset((
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.neg.default,
    aten.mul.Scalar, aten.div.Scalar, aten.square.default, aten.abs.default, aten.sin.default, aten.erf.default,
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.detach.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.transpose.int,
    aten.permute.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.slice.Tensor, aten.sum.dim_IntList, aten.clamp.default,
))
#: products: a zero row times anything is a zero row, so the other operands may be replicated
PRODUCT_LIKE = frozenset((aten.mul.Tensor, aten.div.Tensor, aten.bmm.default))
#: sums: every operand must be routed alike (a replicated term would fill the zero rows)
SUM_LIKE = frozenset((aten.add.Tensor, aten.sub.Tensor))

#: the grouped products by name: transformers registers its fallback op only once imported
GROUPED_MM = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")


def _keeps_zero(info: OpInfo) -> bool:
    """Whether the op maps a zero row to a zero row, for the ops whose arguments decide it."""
    if info.target is aten.clamp.default:
        low = info.args[1] if len(info.args) > 1 else info.kwargs.get("min")
        high = info.args[2] if len(info.args) > 2 else info.kwargs.get("max")
        return (low is None or low <= 0) and (high is None or high >= 0)
    if info.target in SUM_LIKE:   # a scalar term (``up + 1``) fills the zero rows
        return all(not isinstance(a, (int, float)) or a == 0 for a in info.args[:2])
    if info.target is aten.div.Tensor:
        return len(info.inputs) == 1 or info.args[1] is not info.inputs[0]
    return True


@register_routed
def routed_strategies(info: OpInfo, placements: tuple, rule) -> list[Strategy]:
    """The strategies of an op meeting a Routed input: every strategy of the op for a plain
    Partial there (a routed Partial is one, for free), and, for ops on rows alone, the one
    that keeps the rows routed, found as the strategy a Shard of the routed dim would take
    (rows a rank holds are full size, so nothing is localized)."""
    found = list(rule(info, tuple(PARTIAL if isinstance(p, Routed) else p for p in placements)))
    routed = {i: p.dim for i, p in enumerate(placements) if isinstance(p, Routed)}
    if info.target is aten.index.Tensor and routed == {0: 0}:
        indices = info.args[1]
        if len(indices) == 1 and indices[0] is not None:   # rows reordered: each keeps its holder
            found.append(Strategy((placements[0],) + (REPLICATE,) * (len(info.inputs) - 1), placements[0]))
        return found
    kind = info.target in ROW_WISE or info.target in PRODUCT_LIKE or info.target in SUM_LIKE
    if not kind or len(set(routed.values())) != 1 or not _keeps_zero(info):
        return found
    if info.target is aten.div.Tensor and 1 in routed:
        return found
    first = min(routed)
    rows = info.inputs[first].shape[routed[first]]
    probe = tuple(Shard(p.dim) if isinstance(p, Routed) else p for p in placements)
    for s in rule(info, probe):
        outs = s.output if isinstance(s.output, tuple) else (s.output,)
        metas = info.output if isinstance(info.output, tuple) else (info.output,)
        if not all(o is None or (is_shard(o) and o == Shard(o.dim) and m is not None and m.shape[o.dim] == rows)
                   for o, m in zip(outs, metas)):
            continue
        wants = []
        for i, want in enumerate(s.inputs):
            if i in routed:
                wants.append(placements[i] if want == Shard(routed[i]) else None)
            elif is_shard(want) or want == REPLICATE:
                keep = info.target not in SUM_LIKE or not info.inputs[i].is_float
                wants.append(REPLICATE if keep else None)
            else:
                wants.append(None)
        if None in wants:
            continue
        output = tuple(Routed(o.dim) if o is not None else None for o in outs)
        found.append(Strategy(tuple(wants), output if isinstance(s.output, tuple) else output[0]))
    return found


def _experts(p) -> bool:
    """A placement of a stack of experts' weights the expert-parallel strategies take: free, or
    whole experts per rank."""
    return p is None or (is_shard(p) and p == Shard(0))


def _matrix_shards(info: OpInfo, p, dims: tuple[int, ...], out_dim) -> list[tuple[Shard, Shard]]:
    """(input shard, output shard) pairs that split a matrix dim of a stack of experts (expert
    tensor parallelism), for input placement ``p``: a placed shard of one of ``dims`` as it is,
    and where the stack is free (or pinned to a dim, which the rule may still cut into blocks) a
    fresh shard following the output dim's hint (gate|up: two blocks). ``out_dim(d)``: the
    output dim input dim ``d`` becomes."""
    pairs: list[tuple[Shard, Shard]] = []
    for d in dims:
        od = out_dim(d)
        if is_shard(p) and p.dim == d and not p.tail and not p.per_block:
            pairs.append((p, p.with_dim(od)))
        if p is None or (is_shard(p) and p.dim == d and (p.chunks, p.unit, p.tail) == (1, 1, 0)):
            fresh = info.fresh_shard(od)
            if fresh is not None and not fresh.tail and not fresh.per_block and fresh.with_dim(d) != p:
                pairs.append((fresh.with_dim(d), fresh))
    return pairs


def _run(info: OpInfo, strategy: Strategy, i: int, ctx: LocalContext) -> tuple[int, int]:
    """(first expert, experts) this rank holds of input ``i``'s stack."""
    size = int(info.inputs[i].shape[0])
    ((start, stop),) = local_ranges(size, strategy.inputs[i], ctx.tp, ctx.rank) or ((0, 0),)
    return start, stop - start


# ---- the batched path: weight[expert_ids] -> bmm -------------------------------------------------
_index_rule = _RULES[aten.index.Tensor]


@register(aten.index.Tensor)
def index_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Besides :func:`.misc.index_rule`: the rows of a stack of experts picked by expert id,
    each rank picking from the experts it holds (zero rows for the others' experts)."""
    out = _index_rule(info, placements)
    indices = info.args[1]
    x = info.inputs[0]
    picked = len(indices) == 1 and indices[0] is not None and not info.inputs[1].is_float
    if (_experts(placements[0]) and x.ndim >= 2 and picked
            and x.static(0) is not None and x.static(0) >= 2):
        out.append(Strategy((Shard(0), REPLICATE), Routed(0)))
    if picked and x.ndim == 3 and x.static(0) is not None:
        # expert tensor parallelism: every expert's matrices split alike, each picked row split so
        rank = info.inputs[1].ndim
        for have, want in _matrix_shards(info, placements[0], (1, 2), lambda d: d - 1 + rank):
            out.append(Strategy((have, REPLICATE), want))
    if picked and type(placements[0]) is Partial:
        # rows reordered (the grouped path's inverse sort): linear in x, so a Partial stays one
        out.append(Strategy((PARTIAL, REPLICATE), PARTIAL))
    return out




@register_localizer(aten.index.Tensor)
def index_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    if isinstance(strategy.output, Routed) and strategy.inputs[0] == Shard(0):
        from ...runtime.experts import routed_gather

        first, count = _run(info, strategy, 0, ctx)
        return routed_gather, (args[0], args[1][0], first, count, int(info.inputs[0].shape[0])), {}
    return _index_localizer(info, strategy, args, kwargs, ctx)


# ---- the grouped path: one product over rows sorted by expert ------------------------------------
def grouped_mm_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``out[rows of expert e] = x[rows of expert e] @ w[e]`` (x ``[rows, in]`` sorted by
    expert, w ``[experts, in, out]``, offs the cumulative rows per expert): replicated, or
    expert-parallel (w by whole experts, x replicated or already routed alike, offs whole), or
    expert tensor parallel: column (w split on its output features, x replicated, the rows'
    features split alike) or row (x's features and w's input features split alike: a Partial)."""
    out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
    if len(info.inputs) < 3 or info.inputs[1].ndim != 3 or info.inputs[0].ndim != 2:
        return out
    px, pw = placements[0], placements[1]
    rest = (REPLICATE,) * (len(info.inputs) - 2)
    if not all(p == REPLICATE or p is None for p in placements[2:]):
        return out
    if _experts(pw) and (px == REPLICATE or px == Routed(0)):
        out.append(Strategy((px, Shard(0)) + rest, Routed(0)))
    if info.inputs[1].static(0) is None:
        return out
    for have, want in _matrix_shards(info, pw, (2,), lambda d: 1):   # column
        out.append(Strategy((REPLICATE, have) + rest, want))
    if is_shard(px) and px.dim == 1 and not px.tail and not px.per_block:   # row, as x is split
        out.append(Strategy((px, px.with_dim(1)) + rest, PARTIAL))
    if pw is None:
        # row with a free stack, x converted to its split: what a stack pinned to its input features
        # gets below. Offered only as x is split, the solver could not reach a plan a pin reaches
        # (gpt-oss: its gate and up interleaved, [..., ::2] and [..., 1::2], x arrives whole)
        pw = info.fresh_shard_of(1, 1)
    if is_shard(pw) and pw.dim == 1 and not pw.tail and not pw.per_block \
            and not (is_shard(px) and px.with_dim(1) == pw):    # row, as w is split (x converted to it)
        out.append(Strategy((pw.with_dim(1), pw) + rest, PARTIAL))
    return out


def grouped_mm_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    if not isinstance(strategy.output, Routed):
        return info.target, args, kwargs
    from ...runtime.experts import routed_grouped_mm
    from .registry import op_name

    kwargs = dict(kwargs)
    offs = args[2] if len(args) > 2 else kwargs.pop("offs")
    first, count = _run(info, strategy, 1, ctx)
    return routed_grouped_mm, (args[0], args[1], offs, first, count, op_name(info.target)), kwargs


for _name in GROUPED_MM:
    register(_name)(grouped_mm_rule)
    register_localizer(_name)(grouped_mm_localizer)


# ---- index bookkeeping the grouped path runs on every rank ---------------------------------------
@register(aten.histc.default, aten.index_put_.default, aten.index_put.default, aten.bincount.default,
          aten.floor_divide.default)
def bookkeeping_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # tokens per expert, the inverse of the sort: small, whole on every rank
    return [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]


@register_localizer(aten.histc.default)
def histc_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """An int histc (the meta twin's program took the GPU branch) runs on CPU as a float one."""
    from ...runtime.experts import histc

    return histc, args, kwargs
