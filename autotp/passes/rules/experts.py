"""Mixtures of experts: expert parallelism and expert tensor parallelism as placements.

transformers keeps an MoE layer's experts as 3-D weights (``[experts, out, in]``) and runs them
one of two ways the program shows: ``grouped_mm`` sorts the (token, expert) rows by expert and
calls one grouped product (``aten._grouped_mm``, or ``transformers::grouped_mm_fallback`` where
that kernel does not take the dtype), ``batched_mm`` picks each row's expert weights with
``weight[expert_ids]`` and runs a ``bmm``. Expert parallelism (HF's and torchtitan's EP layout) is:

* the weights ``Shard(0)``: each rank holds a run of whole experts (uneven where tp does not
  divide their number), split at the first op that reads them (a transpose keeps it);
* the product on a rank computes the rows routed to its experts and nothing else: a
  :class:`~autotp.placements.Routed` Partial, held compactly (a rank's local tensor is its rows,
  a row map says which). Any op on rows alone carries it with no collective, its replicated
  operands taken at the rank's rows (:func:`.routed.routed_strategies`); the rows reordered back
  to token order stay routed; where a token's top-k rows are summed (``view(T, k, H).sum(1)``) each
  rank adds its rows into ``[T, H]``: a plain Partial, made whole by a g like any row-parallel output;
* the router stays replicated: its scores meet the routed rows in a product, so their gradient
  is a summand and gets an f (summed over ranks), as any replicated input of sharded compute.

Under sequence parallelism the tokens arrive split along the sequence; flattened (``[b, s, h] ->
[b*s, h]``) they are a rank's compact rows too, held by their token's rank: ``Routed(0,
tokens=True)`` (:func:`.token_rows.token_rows`). The router, its softmax and top-k run on them as on
any rows; the grouped product takes them with an all-to-all inside (each (token, expert) row sent to
its expert's rank, :class:`autotp.distributed.experts.DispatchRows`), priced as one, against
gathering every token on every rank; the next product may send its output rows back by the
reverse all-to-all (:func:`combine_back`), or, where an op must run on the experts' ranks after it
(gpt-oss's biases added after the down product), the op after that receive them back by it as a
conversion (:func:`sends_back`), where the routing weights' product and the top-k sum run on the
rank's own tokens and their sum views back to its run of the sequence
(:func:`.token_rows.token_sequence`), against the g of the combine.

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

This file holds the rules of the experts' own ops (the pick, the grouped product, the index
bookkeeping); the rest of the family, each one idea, imported downward:

* :mod:`.row_reads`: which ops of a layer read or reorder rows, and which strategies read the host;
* :mod:`.token_rows`: the sequence-split tokens flattened to a rank's rows, split back, localized;
* :mod:`.routed`: the strategies of any op meeting routed rows, and the top-k combine;
* :mod:`.routed_localizer`: what a rank's program runs of routed rows;
* :mod:`.dispatch_sizes`: a rank's run of experts, its rows' bounds and the dispatch's split sizes,
  nodes made once per layer;
* :mod:`.routing`, :mod:`.local_routing`, :mod:`.gathered_rows`: what the graph proves of a layer's
  routing, the router run on a rank's own tokens, each token's rows all-gathered inside the gather.
"""
from __future__ import annotations

import torch

from ...placements import PARTIAL, REPLICATE, REPLICATE_PARTIAL_GRAD, Partial, Routed, Shard
from .contract import LocalContext, OpInfo, Strategy
from .registry import _RULES, is_shard, register, register_localizer
from .row_reads import GROUPED_MM

aten = torch.ops.aten


#: rows a grouped product sent from their tokens' ranks (the all-to-all dispatch), and the same
#: rows back on their tokens' ranks, in the order the dispatch took them
SENT, SENT_BACK = Routed(0, sent=True), Routed(0, tokens=True, reordered=True)
#: rows the dispatch sent where the rank's own routing ordered them (``Routed.alone``)
SENT_ALONE = Routed(0, sent=True, alone=True)


def is_sent(p) -> bool:
    """Rows the dispatch sent (:data:`SENT`, or :data:`SENT_ALONE`): rows along dim 0, one dim of them."""
    return isinstance(p, Routed) and p.sent and p.dim == 0 and p.span == 1


def _experts(p) -> bool:
    """A placement of a stack of experts' weights the expert-parallel strategies take: free, or
    whole experts per rank."""
    return p is None or (is_shard(p) and p == Shard(0))


def _experts_whole(info: OpInfo) -> Strategy:
    """Whole experts per rank at tp 1: the one rank holds every expert (a stack pinned 'expert'
    is whole there), so the op reads it as it is and its result is whole. No rows are routed: the
    rank's program is the captured op, as any layout pinned at tp 1 (passes/rewrite.py)."""
    stack = 0 if info.target is aten.index.Tensor else 1
    return Strategy(tuple(Shard(0) if i == stack else REPLICATE for i in range(len(info.inputs))), REPLICATE)


def _matrix_shards(info: OpInfo, p, dims: tuple[int, ...], out_dim) -> list[tuple[Shard, Shard]]:
    """(input shard, output shard) pairs that split a matrix dim of a stack of experts (expert
    tensor parallelism), for input placement ``p``: a placed shard of one of ``dims`` as it is,
    and where the stack is free (or pinned to a dim, which the rule may still cut into blocks) a
    fresh shard following the output dim's hint (gate|up: two blocks). ``out_dim(d)``: the
    output dim input dim ``d`` becomes."""
    pairs: list[tuple[Shard, Shard]] = []
    for d in dims:
        od = out_dim(d)
        if is_shard(p) and p.dim == d and not p.holds_whole and not p.per_block:
            pairs.append((p, p.with_dim(od)))
        if p is None or (is_shard(p) and p.dim == d and (p.chunks, p.unit, p.tail) == (1, 1, 0)):
            fresh = info.fresh_shard(od)
            if fresh is not None and not fresh.holds_whole and not fresh.per_block and fresh.with_dim(d) != p:
                pairs.append((fresh.with_dim(d), fresh))
    return pairs


# ---- the batched path: weight[expert_ids] -> bmm -------------------------------------------------
_index_rule = _RULES[aten.index.Tensor]


@register(aten.index.Tensor)
def index_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Besides :func:`.misc.index_rule`: the rows of a stack of experts picked by expert id,
    each rank picking its own experts' rows (by one index tensor of ids)."""
    out = _index_rule(info, placements)
    indices = info.args[1]
    x = info.inputs[0]
    picked = len(indices) == 1 and indices[0] is not None and not info.inputs[1].is_float
    if (_experts(placements[0]) and x.ndim >= 2 and picked and info.inputs[1].ndim == 1
            and x.static(0) is not None and x.static(0) >= 2):
        if info.tp > 1:
            out.append(Strategy((Shard(0), REPLICATE), Routed(0)))
            if info.counted_pick:
                # the ids sorted and counted into the products' offs (gpt-oss's biases): the
                # products' rows, so also the rows the dispatch sent (a product adding them may
                # send its rows back after, :func:`sends_back`)
                out += [Strategy((Shard(0), REPLICATE), sent) for sent in (SENT, SENT_ALONE)]
        elif is_shard(placements[0]):
            out.append(_experts_whole(info))
    if picked and x.ndim == 3 and x.static(0) is not None:
        # expert tensor parallelism: every expert's matrices split alike, each picked row split so
        rank = info.inputs[1].ndim
        for have, want in _matrix_shards(info, placements[0], (1, 2), lambda d: d - 1 + rank):
            out.append(Strategy((have, REPLICATE), want))
    if info.gathers_expert_rows and info.tp > 1 and placements[0] in (REPLICATE, None) \
            and placements[1] in (REPLICATE, None):
        # rows gathered for a grouped product alone: a rank gathers its experts' rows (the
        # product takes them as routed rows, the same row map)
        out.append(Strategy((REPLICATE, REPLICATE), Routed(0)))
    if info.gathers_expert_rows and info.tp > 1 and info.inputs[0].is_float:
        # every row gathered whole (an expert-TP product reads them all), its f on the tokens
        # [T, h] in front (k times fewer bytes summed backward than on the [T*k, h] rows): the
        # gather's backward, a scatter-add, carries each rank's gradient summand back to it
        out.append(Strategy((REPLICATE, REPLICATE), REPLICATE_PARTIAL_GRAD))
    if picked and type(placements[0]) is Partial:
        # rows reordered (the grouped path's inverse sort): linear in x, so a Partial stays one
        out.append(Strategy((PARTIAL, REPLICATE), PARTIAL))
    return out


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
        if info.tp > 1:
            out.append(Strategy((px, Shard(0)) + rest, Routed(0)))
        elif is_shard(pw):
            out.append(_experts_whole(info))
    if _experts(pw) and isinstance(px, Routed) and px.tokens and (px.dim, px.span) == (0, 1) and info.tp > 1:
        # rows held by their tokens' ranks (a sequence split): each sent to its expert's rank
        # first, an all-to-all of the rows (and back, backward), priced as one inside the op;
        # the rows then marked sent, for a later product to send its output back the same way
        for sent in (False, True):
            out.append(Strategy((px, Shard(0)) + rest, Routed(0, sent=sent, alone=sent and px.alone),
                                internal=(("all_to_all", info.inputs[0]),)))
    if _experts(pw) and is_sent(px) and info.tp > 1:
        out.append(Strategy((px, Shard(0)) + rest, px))
        out += combine_back(info, (px, Shard(0)) + rest)
    if info.inputs[1].static(0) is None:
        return out
    for have, want in _matrix_shards(info, pw, (2,), lambda d: 1):   # column
        out.append(Strategy((REPLICATE, have) + rest, want))
    if is_shard(px) and px.dim == 1 and not px.holds_whole and not px.per_block:   # row, as x is split
        out.append(Strategy((px, px.with_dim(1)) + rest, PARTIAL))
    if pw is None:
        # row with a free stack, x converted to its split: what a stack pinned to its input features
        # gets below. Offered only as x is split, the solver could not reach a plan a pin reaches
        # (gpt-oss: its gate and up interleaved, [..., ::2] and [..., 1::2], x arrives whole)
        pw = info.fresh_shard_of(1, 1)
    if is_shard(pw) and pw.dim == 1 and not pw.holds_whole and not pw.per_block \
            and not (is_shard(px) and px.with_dim(1) == pw):    # row, as w is split (x converted to it)
        out.append(Strategy((pw.with_dim(1), pw) + rest, PARTIAL))
    return out


def combine_back(info: OpInfo, inputs: tuple) -> list[Strategy]:
    """A grouped product of rows the dispatch sent (``Routed(0, sent=True)``) that sends its
    output rows back to their tokens' ranks (the combine by the reverse all-to-all, the
    dispatch's plan reused: no count read again), where the routing weights' product and the
    top-k sum then run on the rank's own tokens: no g of the ``[tokens, hidden]`` combine.
    Priced as an all-to-all of the product's output inside the op, forward and backward."""
    return [Strategy(inputs, Routed(0, tokens=True, reordered=True), internal=(("all_to_all", info.output),))]


def sends_back(have, want) -> bool:
    """Whether turning ``have`` into ``want`` sends rows the dispatch sent back to their tokens'
    ranks by the reverse all-to-all (``P(sent 0) -> P(tokens 0, reordered)``, on the layer's
    dispatch plan: rewrite.send_back): the combine after an op that must run on the experts'
    ranks first (gpt-oss's down product adds its experts' biases after the product, so the rows
    cannot go back inside it, :func:`combine_back`). Priced as :func:`combine_back`'s all-to-all."""
    return is_sent(have) and want == SENT_BACK


for _name in GROUPED_MM:
    register(_name)(grouped_mm_rule)


# ---- index bookkeeping the grouped path runs on every rank ---------------------------------------
@register(aten.histc.default, aten.index_put_.default, aten.index_put.default, aten.bincount.default,
          aten.floor_divide.default)
def bookkeeping_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # tokens per expert, the inverse of the sort: small, whole on every rank
    return [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]


@register_localizer(aten.histc.default)
def histc_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """An int histc (the meta twin's program took the GPU branch) runs on CPU as a float one."""
    from ...distributed.experts import histc

    return histc, args, kwargs
