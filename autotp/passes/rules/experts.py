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
  operands taken at the rank's rows (:func:`routed_strategies`); the rows reordered back to token
  order stay routed; where a token's top-k rows are summed (``view(T, k, H).sum(1)``) each rank
  adds its rows into ``[T, H]``: a plain Partial, made whole by a g like any row-parallel output;
* the router stays replicated: its scores meet the routed rows in a product, so their gradient
  is a summand and gets an f (summed over ranks), as any replicated input of sharded compute.

Under sequence parallelism the tokens arrive split along the sequence; flattened (``[b, s, h] ->
[b*s, h]``) they are a rank's compact rows too, held by their token's rank: ``Routed(0,
tokens=True)`` (:func:`token_rows`). The router, its softmax and top-k run on them as on any rows;
the grouped product takes them with an all-to-all inside (each (token, expert) row sent to its
expert's rank, :class:`autotp.distributed.experts.DispatchRows`), priced as one, against
gathering every token on every rank; the next product may send its output rows back by the
reverse all-to-all (:func:`combine_back`), where the routing weights' product and the top-k sum
run on the rank's own tokens and their sum views back to its run of the sequence
(:func:`token_sequence`), against the g of the combine.

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

import math
import operator
from dataclasses import replace
from typing import Any

import sympy
import torch

from ...placements import (PARTIAL, REPLICATE, REPLICATE_PARTIAL_GRAD, Partial, Routed, Shard, divides, is_even,
                           layout, local_ranges, same_placement)
from .gathered_rows import gathered_rows_localizer, gathered_rows_strategies, gathers_rows
from .local_routing import is_own, own_localizer, own_merge, own_strategies, owns
from .pointwise import partial_into_rows
from .routing import counted_by, index_length, is_permutation, written
from .registry import (LocalContext, OpInfo, Strategy, _RULES, functional_of, is_shard, op_name, register,
                       register_localizer, register_routed, register_routed_localizer)

aten = torch.ops.aten

#: ops whose result's rows depend on the same rows of their inputs alone
ROW_WISE = frozenset((
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.neg.default,
    aten.sigmoid.default, aten.exp.default,
    aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.pow.Tensor_Scalar,
    aten.square.default, aten.abs.default, aten.sin.default, aten.erf.default, aten.rsqrt.default,
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.detach.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.transpose.int,
    aten.permute.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.slice.Tensor, aten.sum.dim_IntList, aten.clamp.default,
    aten.dropout.default,   # each row's mask its own (a sequence split's rows: OPT's MLP on [b*s, h])
))
#: ops of several operands whose rows meet row by row (a product, a sum; bmm: its batch rows; a
#: linear's rows of x against a replicated weight: the router on the tokens a rank holds)
ROW_BY_ROW = frozenset((aten.mul.Tensor, aten.div.Tensor, aten.bmm.default, aten.add.Tensor, aten.sub.Tensor,
                        aten.linear.default, aten.mm.default, aten.addmm.default))
#: ops along another dim than the rows' that keep each row's result in its row (the router's
#: softmax and top-k over the experts of each token, a norm's mean over a head's features, a layer
#: norm over each token's features: OPT's MLP on a sequence split's rows, and an RMS norm's where
#: export keeps it one op: torch.nn.RMSNorm); their own rules say which dims
ROW_REDUCING = frozenset((aten._softmax.default, aten.softmax.int, aten.topk.default, aten.mean.dim,
                          aten.layer_norm.default, aten.rms_norm.default))
#: views whose size arguments the rank's rows change (the routed dim's size: -1)
SIZED_VIEWS = frozenset((aten.view.default, aten.reshape.default, aten._unsafe_view.default))

#: the grouped products by name: transformers registers its fallback op only once imported
GROUPED_MM = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")
#: ops that carry a gathered row to a grouped product unchanged but for its dtype or memory
CARRY_ROWS = frozenset((aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                        aten.contiguous.default, aten.alias.default))


def grouped_reader(node: Any) -> tuple[list, Any] | None:
    """``(chain, product)`` where ``node`` is ``h[idx]`` (rows gathered by one 1-D index) read by
    one grouped product of experts alone, as its x, through ``chain`` (casts and copies, each
    read once); None otherwise. Such a gather's rows are the product's rows, sorted by expert
    (the product's ``offs`` say whose): a rank under expert parallelism needs its own experts'
    rows alone, ``h[idx[start:end]]``, not every row to slice them. Its bounds come from
    ``offs``, which the model computes after the gather; nothing between the gather and the
    product may write ``h`` or ``idx`` or change the grad or autocast mode, so that the rank's
    program can gather there, right before the product (see autotp/passes/rewrite.py)."""
    from torch import fx

    from .registry import REGION_BOUNDS, aliases_first, mutates_first

    if not (isinstance(node, fx.Node) and node.target is aten.index.Tensor and len(node.args) == 2):
        return None
    h, indices = node.args
    if not (isinstance(h, fx.Node) and isinstance(indices, (list, tuple)) and len(indices) == 1
            and isinstance(indices[0], fx.Node)):
        return None
    hv, iv = h.meta.get("val"), indices[0].meta.get("val")
    if not (isinstance(hv, torch.Tensor) and hv.is_floating_point() and hv.ndim == 2
            and isinstance(iv, torch.Tensor) and not iv.is_floating_point() and iv.ndim == 1):
        return None
    chain, cur = [], node
    while True:
        users = list(cur.users)
        if len(users) != 1 or users[0].op != "call_function" or not users[0].args or users[0].args[0] is not cur:
            return None
        user = users[0]
        if op_name(user.target) in GROUPED_MM:
            break
        if user.target not in CARRY_ROWS:
            return None
        chain.append(user)
        cur = user
    read = {h, indices[0]}
    at = node.next
    while at is not user:
        if at.op == "call_function" and (at.target in REGION_BOUNDS or (
                (mutates_first(at.target) or aliases_first(at.target)) and at.args and at.args[0] in read)):
            return None
        at = at.next
    return chain, user


def reads_rows(node: Any) -> bool:
    """Whether ``node``, run on a rank's own experts' rows alone where its inputs hold every row,
    reads how many are the rank's on the host (the rewrite below): a grouped product or the
    gather in front of it (the layer's bounds, :func:`autotp.distributed.experts.expert_bounds`,
    read once: the first of them to take routed rows pays it), the first pick by a tensor of
    expert ids not sorted and counted by the layer's offsets (:func:`counted_by`; the picks by
    the same ids share the read), a reorder by an index not known a permutation."""
    from torch import fx

    from ...capture import shape_of

    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if op_name(node.target) in GROUPED_MM:
        return True
    if node.target is not aten.index.Tensor or len(node.args) != 2 or len(node.args[1]) != 1:
        return False
    index = node.args[1][0]
    stack = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if grouped_reader(node) is not None:
        return True
    if isinstance(stack, torch.Tensor) and stack.ndim >= 2 and isinstance(stack.shape[0], int):   # a pick
        earlier = [u for u in index.users if u.target is aten.index.Tensor and len(u.args) == 2
                   and list(u.args[1]) == [index] and _before(u, node)]
        return counted_by(index, stack.shape[0]) is None and not earlier
    # rows reordered: unread where the index keeps every row once (routed_permute)
    return not (isinstance(stack, torch.Tensor) and stack.ndim and is_permutation(index)
                and sympy.expand(index_length(index) - shape_of(node.args[0])[0]) == 0)


def permutes_rows(node: Any) -> bool:
    """Whether ``node`` is ``x[index]`` of float rows by one 1-D index the graph makes a
    permutation of x's rows (:func:`is_permutation`, as long as x's rows): every row kept once,
    so its backward is a gather by the inverse permutation (``distributed.functional.permute_rows``)."""
    from torch import fx

    from ...capture import shape_of

    if not (isinstance(node, fx.Node) and node.target is aten.index.Tensor and len(node.args) == 2
            and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) == 1):
        return False
    x, index = node.args[0], node.args[1][0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.ndim >= 1
            and isinstance(index, fx.Node) and is_permutation(index)):
        return False
    return sympy.expand(index_length(index) - shape_of(x)[0]) == 0


def _before(a: Any, b: Any) -> bool:
    """Whether node ``a`` comes before node ``b`` in their graph."""
    at = a.next
    while at.op != "root":
        if at is b:
            return True
        at = at.next
    return False


def host_reads(info: OpInfo, strategy: Strategy) -> int:
    """How many reads to the host ``strategy`` of the op ``info`` makes on a rank: one where it
    opens a run of routed rows (every input holds every row, its output only the rank's) and
    :attr:`~.registry.OpInfo.reads_rows`, or reorders routed rows by an index not known a
    permutation. A product that sends a rank's tokens' rows to their experts' ranks (the
    all-to-all dispatch) reads its bounds and split sizes at once, and with them how many rows
    the reorder of the rank's tokens in front of it (``h[perm // k]``) holds: that reorder's one
    read, priced at the reorder, where the product's x is rows gathered for it alone
    (:attr:`~.registry.OpInfo.x_gathered`: the rank's program runs the two together,
    passes/rewrite.py); one of its own otherwise."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    if any(isinstance(p, Routed) and p.tokens for p in strategy.inputs) and \
            any(isinstance(p, Routed) and not p.tokens for p in outs):
        return 0 if info.x_gathered else 1   # the all-to-all dispatch: the layer's one read
    if not info.reads_rows or not any(isinstance(p, Routed) for p in outs):
        return 0
    routed_in = [isinstance(p, Routed) for p in strategy.inputs]
    reorder = info.target is aten.index.Tensor and routed_in[:1] == [True]
    return int(reorder or not any(routed_in))


def reads_host(info: OpInfo, strategy: Strategy) -> bool:
    """Whether ``strategy`` of the op ``info`` may read a value on the host on a rank, which
    ``host_reads=False`` forbids: where it reads itself (:func:`host_reads`), and where it holds
    rows whose row map some op read (a rank's experts' rows, rows the dispatch sent: the layer's
    bounds read once and shared, so a later op of the run is priced no read of its own) or rows
    of their tokens reordered (meeting rows in the merge's order, they are matched by value).
    Rows of a merge of the batch with a split dim in its order (``Routed(tokens=True)``: the
    sequence-split tokens, Mamba2's heads merged with the batch) have a row map the shapes give:
    no read."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    if any(isinstance(p, Routed) and not (p.tokens and not p.reordered) for p in (*strategy.inputs, *outs)):
        return True
    return host_reads(info, strategy) > 0


def _kind(target):
    """The op a rule answers for: an in-place op's out-of-place twin (``add_`` -> ``add``)."""
    return functional_of(target) or target


@register_routed
def routed_strategies(info: OpInfo, placements: tuple, rule) -> list[Strategy]:
    """The strategies of an op meeting a Routed input: every strategy of the op for a plain
    Partial there (the rows scattered into zeros make one), and those that keep the rows routed:

    * an op on rows alone (:data:`ROW_WISE`, :data:`ROW_BY_ROW`): the strategy a Shard of the
      routed dim would take, with nothing to localize but the rows (a replicated operand with
      the rows' dim is taken at the rank's rows, one broadcast along them is left whole);
    * a grouped product of routed rows (its own rule: the next expert product);
    * the rows reordered by one index tensor (each keeps its holder);
    * a view splitting the rows' dim (``[T*k, H] -> [T, k, H]``), then the sum over the inner
      dims (a token's top-k rows): that sum is a plain Partial, each rank adding its rows into
      the whole ``[T, H]``."""
    if any(is_own(p) for p in placements):   # a rank's own rows routed alone: the routing's ops only
        return own_strategies(info, placements)
    if info.x_gathered and isinstance(placements[0], Routed) and not placements[0].tokens:
        # rows gathered at a grouped product's experts' bounds (through casts): only the
        # product's expert-parallel strategies have those experts; scattered and summed into a
        # whole x they would be rows of no rank's experts (the gather must then be replicated).
        # Rows gathered on their tokens' ranks are every row, each held once: made whole as any
        return [s for s in _routed_strategies(info, placements, rule)
                if any(isinstance(p, Routed) for p in (s.output if isinstance(s.output, tuple) else (s.output,)))]
    return _routed_strategies(info, placements, rule)


def _routed_strategies(info: OpInfo, placements: tuple, rule) -> list[Strategy]:
    found = list(rule(info, tuple(PARTIAL if isinstance(p, Routed) else p for p in placements)))
    routed = {i: p for i, p in enumerate(placements) if isinstance(p, Routed)}
    if op_name(info.target) in GROUPED_MM:
        return found + [s for s in rule(info, placements) if isinstance(s.output, Routed)]
    if any(p.span > 1 for p in routed.values()):
        return found + _combine(info, placements)
    found += partial_into_rows(info, placements)   # a partial sum added to token rows: reduce-scattered into them
    if info.target is aten.index.Tensor and set(routed) == {0} and routed[0].dim == 0 and routed[0].span == 1:
        indices = info.args[1]
        if len(indices) == 1 and indices[0] is not None and len(info.inputs) == 2:   # rows reordered
            p = placements[0]
            found.append(Strategy((p, REPLICATE), replace(p, reordered=True) if p.tokens else p))
            found += gathered_rows_strategies(info, p)   # each token's k rows all-gathered whole
            if info.gathers_expert_rows and info.tp > 1 and p.tokens and not p.reordered:
                # the tokens the router ran on where they are held (a rank's run of the
                # sequence), all-gathered along it for a rank's experts' rows to be cut from
                # them (Megatron's all-gather dispatcher): the gather before the router was the
                # one way, a gather of rows being offered only from whole tokens
                found.append(Strategy((REPLICATE, REPLICATE), Routed(0)))
        return found
    kind = _kind(info.target)
    if kind not in ROW_WISE and kind not in ROW_BY_ROW and kind not in ROW_REDUCING:
        return found
    if len(set(routed.values())) != 1:   # rows held by their experts' ranks never meet rows held by their tokens'
        return found
    if kind in SIZED_VIEWS and len(routed) == 1:
        own = own_merge(info, routed[0])   # the top-k ids or weights flattened, to be routed by the rank
        if own is not None:
            found.append(Strategy((placements[0],), own))
        split = _split_rows(info, routed[0])
        if split is not None:
            found.append(Strategy((placements[0],), split))
        back = token_split(info, routed[0])
        if back is not None:
            # a merge's rows split back into its dims: the shard it merged, first (at equal cost
            # a plan replayed op by op, a decode step's, keeps it, not the Partial of the rows
            # scattered into zeros, which costs its collective later)
            found.insert(0, Strategy((placements[0],), back))
        seq = token_sequence(info, routed[0])
        if seq is not None and seq != back:   # a rank's token rows back to its run of the sequence
            found.append(Strategy((placements[0],), seq))
    first = min(routed)
    rows = info.inputs[first].shape[routed[first].dim]
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
                wants.append(placements[i] if want == Shard(routed[i].dim) else None)
            elif is_shard(want) or want == REPLICATE:
                wants.append(REPLICATE)   # taken at the rank's rows, or broadcast along them
            else:
                wants.append(None)
        if None in wants:
            continue
        output = tuple(replace(placements[first], dim=o.dim) if o is not None else None for o in outs)
        found.append(Strategy(tuple(wants), output if isinstance(s.output, tuple) else output[0]))
    return found


def _split_rows(info: OpInfo, p: Routed) -> Routed | None:
    """``Routed(d, span)`` of a view that splits the rows' dim ``d`` into ``span`` dims and keeps
    every other dim (``[T*k, H] -> [T, k, H]``), else None."""
    before, after = info.inputs[0].shape, info.output.shape
    d = p.dim
    span = len(after) - len(before) + 1
    if p.span != 1 or span < 2 or tuple(after[:d]) != tuple(before[:d]) \
            or tuple(after[d + span:]) != tuple(before[d + 1:]):
        return None
    if sympy.expand(math.prod(after[d:d + span]) - before[d]) != 0:
        return None
    return replace(p, span=span)


def _combine(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``sum`` over the inner dims of routed rows that span several dims (a token's top-k): a
    plain Partial, each rank's rows added into the whole result; or, rows held by their tokens'
    ranks (every row of a token on one rank, after the combine's reverse all-to-all), the
    rank's own tokens' sums, rows held by their tokens' ranks again."""
    if info.target is not aten.sum.dim_IntList or len(placements) != 1:
        return []
    p = placements[0]
    dims = info.args[1] if len(info.args) > 1 else info.kwargs.get("dim")
    keepdim = info.args[2] if len(info.args) > 2 else info.kwargs.get("keepdim", False)
    ndim = info.inputs[0].ndim
    if dims is None or keepdim or sorted(d % ndim for d in dims) != list(range(p.dim + 1, p.dim + p.span)):
        return []
    if any(info.inputs[0].static(d) is None for d in range(p.dim + 1, p.dim + p.span)):
        return []
    if p.tokens and p.dim == 0:   # the sums' rows: the rank's tokens, ascending (no token_rows map)
        return [Strategy((p,), PARTIAL), Strategy((p,), Routed(0, tokens=True, reordered=True))]
    return [Strategy((p,), PARTIAL)]


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


def _run(info: OpInfo, strategy: Strategy, i: int, ctx: LocalContext) -> tuple[int, int]:
    """(first expert, experts) this rank holds of input ``i``'s stack."""
    size = int(info.inputs[i].shape[0])
    ((start, stop),) = local_ranges(size, strategy.inputs[i], ctx.tp, ctx.rank) or ((0, 0),)
    return start, stop - start


# ---- the tokens a rank holds under a sequence split, flattened -----------------------------------
_VIEW_RULES = {t: _RULES[t] for t in SIZED_VIEWS}


def token_rows(info: OpInfo, p) -> Routed | None:
    """``Routed(0, tokens=True)`` where a view merges dims ``0..d`` of a tensor split along ``d``
    into its rows (``[b, s, ...] -> [b*s, ...]``: the sequence-split tokens; ``[b, h, d, n] ->
    [b*h, d, n]``: Mamba2's split heads read for one ``bmm``), each row's elements kept; None
    otherwise. A rank's rows are then ``b`` runs of its share of ``d``, not a contiguous run: no
    Shard says them where a merged dim is dynamic (the batch), compact rows with a row map
    computed from the shapes do (:func:`token_localizer`). ``d`` split in contiguous runs: as a
    plain Shard deals them, or a static dim's runs of whole atoms, every rank holding some
    (Mamba2's heads dealt by group where tp divides neither: 8 heads of 4 groups at tp 3 hold 4,
    2 and 2 heads where a plain shard holds 3, 3 and 2)."""
    unit = _runs_unit(info.inputs[0], p, info.tp) if is_shard(p) and info.tp > 1 else None
    if unit is None:
        return None
    before, after = info.inputs[0].shape, info.output.shape
    d = p.dim
    if all(info.inputs[0].static(i) is not None for i in range(d + 1)):
        return None   # every merged dim static: a Shard of the merged dim says it (the view's own rule)
    if not after or sympy.expand(math.prod(before[:d + 1]) - after[0]) != 0 \
            or sympy.expand(math.prod(before[d + 1:]) - math.prod(after[1:])) != 0:
        return None
    return Routed(0, tokens=True, unit=unit)


def _runs_unit(meta, p, tp: int) -> int | None:
    """The atom ``u`` where shard ``p`` of ``meta`` deals its dim as ``Shard(p.dim, unit=u)``
    does, one contiguous run of whole atoms a rank, the first ``atoms % tp`` one atom longer
    (what the row maps compute from the shapes), every rank holding some: ``p.unit``, or 1 where
    ``p`` is laid out as a plain shard alone; a dynamic dim (the sequence) as a plain shard
    alone. None otherwise."""
    size = meta.static(p.dim)
    if size is None:
        return 1 if p == Shard(p.dim) else None
    for unit in dict.fromkeys((p.unit, 1)):
        runs = Shard(p.dim, unit=unit)
        if divides(size, runs) and size // unit >= tp and same_placement(p, runs, size, tp):
            return unit
    return None


def row_unit(size: Any, unit: int, tp: int) -> int:
    """The atom of the runs a merge's row map is computed from (:func:`_token_maps`): 1 where
    ``Shard(d, unit=unit)`` of ``size`` is laid out as a plain shard, else the smallest atom laid
    out as it is, so that merges holding the same rows share one row map whatever their units say."""
    if unit == 1 or not (isinstance(size, int) or getattr(size, "is_Integer", False)):
        return 1   # a dynamic dim (the sequence) is split as a plain shard (:func:`_runs_unit`)
    size = int(size)
    want = layout(size, Shard(0, unit=unit), tp)
    return next(u for u in range(1, unit + 1) if size % u == 0 and layout(size, Shard(0, unit=u), tp) == want)


def token_split(info: OpInfo, p: Routed) -> Shard | None:
    """The shard merged (``Shard(d, unit=p.unit)``) where a view splits the rows of
    :func:`token_rows` back into dims ``0..d`` (``[b*h, d, 1] -> [b, h, d]``), each row's
    elements kept; None otherwise. Sound where the rows are those a merge of the same dims made,
    in its order: the rank's program checks that the row map is that merge's
    (:func:`token_split_localizer`)."""
    if not (p.tokens and p.dim == 0 and p.span == 1 and info.tp > 1):
        return None
    before, after = info.inputs[0].shape, info.output.shape
    for d in range(1, len(after)):
        if sympy.expand(math.prod(after[:d + 1]) - before[0]) != 0:
            continue
        if sympy.expand(math.prod(after[d + 1:]) - math.prod(before[1:])) != 0:
            return None
        size = info.output.static(d)
        if size is None:   # as a fresh shard of a sequence dim
            return Shard(d) if info.uneven and after[d] in info.sequence else None
        back = Shard(d, unit=p.unit)   # the shard merged (Mamba2's heads in a group's units)
        unit = _runs_unit(info.output, back, info.tp)
        if unit is None or not (info.uneven or is_even(size, back, info.tp)):
            return None
        return Shard(d, unit=unit)
    return None


def token_sequence(info: OpInfo, p) -> Shard | None:
    """``Shard(d)`` where a view unflattens a rank's token rows ``[b*s, ...]`` (``Routed(0,
    tokens=True)``) back to ``[b, s, ...]`` split along the sequence dim ``d`` (dims ``0..d``
    from dim 0, the rest kept, ``d``'s size a sequence symbol): the inverse of
    :func:`token_rows`, the rank's rows its ``b`` runs of ``s/tp`` positions again, no collective
    (the combine by the reverse all-to-all leaves the experts' output so)."""
    if not (isinstance(p, Routed) and p.tokens and p.dim == 0 and p.span == 1 and info.tp > 1):
        return None
    before, after = info.inputs[0].shape, info.output.shape
    d = len(after) - len(before)
    if d < 1 or after[d] not in info.sequence or tuple(after[d + 1:]) != tuple(before[1:]):
        return None
    if sympy.expand(math.prod(after[:d + 1]) - before[0]) != 0:
        return None
    return Shard(d)


def sized_view_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Besides :func:`.view.view_rule`: the sequence-split tokens flattened to the rank's rows
    (:func:`token_rows`), which the router, its softmax and top-k then run on alone."""
    out = _VIEW_RULES[info.target](info, placements)
    tokens = token_rows(info, placements[0]) if placements else None
    if tokens is not None:
        out.append(Strategy((placements[0],), tokens))
    return out


for _target in SIZED_VIEWS:
    register(_target)(sized_view_rule)


def token_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's ``[b, s_local, ...]`` flattened to ``[b*s_local, ...]``, its row map the
    global ids ``i*s + start + j`` of its runs (``start``: where its run of the sequence begins).
    Merges of the same dims share one row map (and one map of holders): their rows meet row by
    row as they are (Mamba2's state and C at their ``bmm``), and the split back finds it."""
    p = strategy.inputs[0]
    before = info.inputs[0].shape
    sizes = [-1] + [ctx.size(s) for s in info.output.shape[1:]]
    ctx.made_rows, ctx.made_owners = _token_maps(ctx, ctx.inputs[0], p.dim, tuple(before[:p.dim]), before[p.dim],
                                                 p.unit)
    ctx.made_rows.meta[ASCENDING] = True   # the rank's rows in order: b runs of its s/tp (or h/tp)
    return info.target, (args[0], sizes) + tuple(args[2:]), kwargs


def _token_maps(ctx: LocalContext, x: Any, dim: int, outer: tuple, seq: Any, unit: int) -> tuple[Any, Any]:
    """(row map, holders) of the rows a merge of dims ``outer + (seq,)`` split along the last in
    runs of ``unit``-element atoms makes, one pair per merged shape and layout of the runs
    (``x``: the rank's tensor of the first merge, for its local length along ``dim``)."""
    from ...distributed import experts as E

    unit = row_unit(seq, unit, ctx.tp)
    key = _rows_key(outer, seq, unit)
    outer_sizes = [ctx.size(s) for s in outer]
    rows = ctx.shared_rows(key, lambda: (E.token_rows, (x, dim, outer_sizes, ctx.size(seq), ctx.tp, ctx.rank, unit)))
    owners = ctx.shared_rows(("owners",) + key[1:],
                             lambda: (E.token_owners, (x, outer_sizes, ctx.size(seq), ctx.tp, unit)))
    return rows, owners


def _rows_key(outer: tuple, seq: Any, unit: int) -> tuple:
    """The key of a merge's row map (:func:`_token_maps`): its dims and the atom of its runs."""
    return ("tokens", outer, seq) + ((unit,) if unit != 1 else ())


def token_split_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's rows of a merge split back into its dims (:func:`token_split`): a view, where
    they are that merge's rows in its order (the one row map of :func:`_token_maps`); otherwise
    first brought to that order (:func:`autotp.distributed.experts.match_rows`, which raises
    where the rank holds other rows); where no merge of those dims made a row map, a PlanError."""
    from ...distributed import experts as E

    d = strategy.output.dim
    after = info.output.shape
    x = ctx.inputs[0]
    want = ctx.found_rows(_rows_key(tuple(after[:d]), after[d], row_unit(after[d], strategy.output.unit, ctx.tp)))
    if want is None:
        from ...errors import PlanError

        raise PlanError(f"{info.target} splits rows back into {tuple(after[:d + 1])} that no merge of those dims "
                        f"made on this rank (they are {strategy.inputs[0]}): its input must be converted here "
                        "(an autotp bug: please report it)")
    if ctx.rows_of(x) is not want:
        x = ctx.graph.call_function(E.match_rows, (x, ctx.rows_of(x), want, 0, ctx.size(info.inputs[0].shape[0])))
    sizes = [ctx.size(s) for s in after]
    sizes[d] = -1
    return info.target, (x, sizes) + tuple(args[2:]), kwargs


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
            out.append(Strategy((px, Shard(0)) + rest, Routed(0, sent=sent),
                                internal=(("all_to_all", info.inputs[0]),)))
    if _experts(pw) and px == Routed(0, sent=True) and info.tp > 1:
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


# ---- what a rank runs of routed rows -------------------------------------------------------------
@register_routed_localizer
def routed_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """The rank's program for an op whose strategy holds a Routed placement: its rows alone.
    ``ctx`` (a graph's context) gives the row map of each routed input (``ctx.rows_of``) and
    takes the row map of the output where the op makes a new one (``ctx.made_rows``)."""
    from ...distributed import experts as E

    out = strategy.output
    if gathers_rows(strategy):
        return gathered_rows_localizer(info, strategy, args, kwargs, ctx)
    if owns(strategy):
        return own_localizer(info, strategy, args, kwargs, ctx)
    if isinstance(out, Routed) and out.tokens and is_shard(strategy.inputs[0]):
        return token_localizer(info, strategy, args, kwargs, ctx)
    if is_shard(out) and isinstance(strategy.inputs[0], Routed) and strategy.inputs[0].tokens:
        if info.output.static(out.dim) is None:   # back to the rank's run of the sequence
            return _token_sequence_localizer(info, strategy, args, kwargs, ctx)
        return token_split_localizer(info, strategy, args, kwargs, ctx)   # back to a dim split by head
    if op_name(info.target) in GROUPED_MM:
        return _grouped_localizer(info, strategy, args, kwargs, ctx)
    if info.target is aten.index.Tensor and isinstance(out, Routed):
        if isinstance(strategy.inputs[0], Routed):   # rows reordered
            x, index = ctx.inputs
            size = ctx.size(info.inputs[0].shape[0])
            if strategy.inputs[0].tokens:   # each row reordered is held where its token is
                ctx.made_owners = ctx.graph.call_function(E.take_rows, (ctx.owners[x], index, 0))
            if _permutes(info, ctx.node):   # every row kept once: the rank's rows stay, renumbered
                copy = len(ctx.node.args[0].users) > 1 or written(ctx.node)
                pair = ctx.graph.call_function(E.routed_permute, (x, index, ctx.rows_of(x), copy))
            else:
                # a rank's tokens' rows sorted by expert for a dispatching product (the rank's
                # program runs this reorder right before it, after its offs): how many are the
                # rank's is read with the layer's split sizes, one read; otherwise a nonzero
                reader = ctx.grouped_reader() if strategy.inputs[0].tokens else None
                count = None
                if reader is not None and dispatches_tokens(reader[1]):
                    sizes = _dispatch_sizes(*reader, ctx.made_owners, ctx)
                    count = ctx.graph.call_function(getattr, (sizes, "sent"))
                pair = ctx.graph.call_function(E.routed_reorder, (x, index, ctx.rows_of(x), size, count))
            ctx.made_rows = ctx.graph.call_function(operator.getitem, (pair, 1))
            return operator.getitem, (pair, 0), {}
        if strategy.inputs[0] == REPLICATE:   # rows gathered for a grouped product: its rank's rows
            product, product_strategy, offs = ctx.grouped_reader()
            if not isinstance(product_strategy.output, Routed):
                from ...errors import PlanError

                raise PlanError(f"{info.target} gathers its rows for a grouped product as routed rows, but the "
                                f"product does not run its experts' rows alone (it is {product_strategy}); the "
                                f"gather must be replicated here")
            bounds, ctx.made_rows = _expert_rows(product, product_strategy, offs, ctx)
            h, index = ctx.inputs
            return E.gather_rows, (h, index, bounds), {}
        first, count = _run(info, strategy, 0, ctx)
        total = int(info.inputs[0].shape[0])
        weight, index = ctx.inputs
        offs = counted_by(ctx.node.args[1][0], total)
        if offs is not None and offs in ctx.env:
            # ids sorted, each counted in offs: its experts' ids are the rows its products take,
            # the same bounds read once (gpt-oss's biases)
            _, ctx.made_rows = _sorted_rows(ctx.env[offs], first, count, ctx)
        else:
            ctx.made_rows = ctx.shared_rows(("picked", index, first, count),
                                            lambda: (E.picked_rows, (index, first, count, total)))
        return E.routed_pick, (weight, index, ctx.made_rows, first, total), {}
    if isinstance(out, Routed) and out.span > 1:   # [T*k, H] -> [T, k, H]: the rows as they are
        return aten.alias.default, (ctx.inputs[0],), {}
    if isinstance(out, Routed) and out.tokens and isinstance(strategy.inputs[0], Routed) \
            and strategy.inputs[0].span > 1:   # a token's rows summed on its own rank
        p = strategy.inputs[0]
        x = ctx.inputs[0]
        group = math.prod(int(info.inputs[0].shape[d]) for d in range(p.dim + 1, p.dim + p.span))
        pair = ctx.graph.call_function(E.token_sums, (x, ctx.rows_of(x), group, kwargs.get("dtype")))
        ctx.made_rows = ctx.graph.call_function(operator.getitem, (pair, 1))
        ctx.made_rows.meta[ASCENDING] = True
        if x in ctx.owners:   # rows a rank routed alone are all its own: no holders to carry
            ctx.made_owners = ctx.graph.call_function(E.token_sum_owners, (ctx.owners[x], group))
        return operator.getitem, (pair, 0), {}
    if out == PARTIAL and strategy.inputs and isinstance(strategy.inputs[0], Routed):   # a token's rows summed
        p = strategy.inputs[0]
        x = ctx.inputs[0]
        group = math.prod(int(info.inputs[0].shape[d]) for d in range(p.dim + 1, p.dim + p.span))
        shape = [ctx.size(s) for s in info.output.shape]
        return E.routed_combine, (x, ctx.rows_of(x), p.dim, group, shape, kwargs.get("dtype")), {}
    return _row_wise(info, strategy, args, kwargs, ctx)


#: a row map's node meta key: its rows ascending (a rank's tokens in sequence order, b runs of s/tp)
ASCENDING = "autotp_rows_ascending"


def _token_sequence_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """A rank's token rows ``[rows, ...]`` viewed back as its run of the sequence ``[b, s/tp,
    ...]``: its rows in ascending order are exactly that (:func:`token_rows`); rows in another
    order (a reorder's) are put in it first."""
    from ...distributed import experts as E

    x = ctx.inputs[0]
    rows = ctx.rows_of(x)
    if not rows.meta.get(ASCENDING):
        x = ctx.graph.call_function(E.in_row_order, (x, rows))
    sizes = [ctx.size(s) for s in info.output.shape]
    sizes[strategy.output.dim] = -1
    return info.target, (x, sizes) + tuple(args[2:]), kwargs


def _permutes(info: OpInfo, node: Any) -> bool:
    """Whether ``x[index]`` (``node``) reorders all of x's rows by a permutation (the index as
    long as x's rows, made a permutation by the graph: :func:`is_permutation`)."""
    index = node.args[1][0]
    return is_permutation(index) and sympy.expand(info.inputs[1].shape[0] - info.inputs[0].shape[0]) == 0


def _row_wise(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """An op on rows alone, on the rank's rows: other routed operands brought to the first one's
    row order, replicated operands with the rows' dim taken at the rank's rows, a view's size
    of the rows' dim left to the local rows (-1)."""
    from ...distributed import experts as E

    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    metas = info.output if isinstance(info.output, tuple) else (info.output,)
    out_p, out_meta = next((p, m) for p, m in zip(outs, metas) if isinstance(p, Routed))
    routed = [i for i, p in enumerate(strategy.inputs) if isinstance(p, Routed)]
    rows = ctx.rows_of(ctx.inputs[routed[0]])
    size = info.inputs[routed[0]].shape[strategy.inputs[routed[0]].dim]
    swap = {}
    for i, (node, meta, p) in enumerate(zip(ctx.inputs, info.inputs, strategy.inputs)):
        if isinstance(p, Routed) and ctx.rows_of(node) is not rows:
            swap[node] = ctx.graph.call_function(E.match_rows, (node, ctx.rows_of(node), rows, p.dim,
                                                                ctx.size(size)))
        elif p == REPLICATE and meta.ndim:
            d = out_p.dim - (out_meta.ndim - meta.ndim)   # the dim broadcast against the rows
            if 0 <= d < meta.ndim and meta.shape[d] == size and size != 1:
                swap[node] = ctx.graph.call_function(E.take_rows, (node, rows, d))
    args = tuple(_swapped(a, swap) for a in args)
    kwargs = {k: _swapped(v, swap) for k, v in kwargs.items()}
    if info.target in SIZED_VIEWS:
        sizes = [ctx.size(s) for s in info.output.shape]
        sizes[out_p.dim] = -1
        args = (args[0], sizes) + tuple(args[2:])
    return info.target, args, kwargs


def _swapped(a, swap: dict):
    if isinstance(a, (list, tuple)):
        return type(a)(_swapped(x, swap) for x in a)
    return swap.get(a, a) if not isinstance(a, (int, float, bool, str)) and a is not None else a


def _grouped_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """A grouped product on this rank's experts: x's rows ``[start, end)`` of the sorted rows (or
    x routed already, the rows of the same experts: the previous product's) through the model's
    product, offs rebased to them."""
    from ...distributed import experts as E

    if not isinstance(strategy.output, Routed):
        return info.target, args, kwargs
    kwargs = dict(kwargs)
    offs = args[2] if len(args) > 2 else kwargs.pop("offs")
    x = ctx.inputs[0]
    first, count = _run(info, strategy, 1, ctx)
    x_routed = isinstance(strategy.inputs[0], Routed)
    dispatch = dispatches_tokens(strategy)
    own = ctx.own_layers.get(ctx.rows_of(x)) if dispatch else None
    if own is not None:   # rows the rank routed alone: the read and the plan from its exchanged counts
        sizes = _local_dispatch_sizes(info, strategy, offs, own.routing, ctx)
    elif dispatch:   # the layer's one read (made first: the bounds below are read with it)
        sizes = _dispatch_sizes(info, strategy, offs, ctx.owners[x], ctx)
    bounds, ctx.made_rows = _expert_rows(info, strategy, offs, ctx)
    from ...errors import PlanError

    if dispatch:
        # the all-to-all dispatch: every rank's rows of its tokens to the ranks of their experts,
        # planned once per layer on its one read, the plan kept for the combine back
        rows, owners = ctx.rows_of(x), ctx.owners.get(x)
        if own is not None:
            from ...distributed.expert_routing import local_dispatch_plan

            plan = ctx.shared_rows(("dispatch", offs, first, count),
                                   lambda: (local_dispatch_plan, (own.routing, _expert_runs(info, strategy, ctx),
                                                                  ctx.rank, sizes)))
        else:
            plan = ctx.shared_rows(("dispatch", offs, first, count),
                                   lambda: (E.dispatch_plan, (rows, owners, offs, _expert_runs(info, strategy, ctx),
                                                              sizes)))
        ctx.dispatches[(offs, first, count)] = (plan, rows, owners)
        args = (ctx.comm(E.DispatchRows(ctx.group), x, plan),) + tuple(args[1:])
    elif x_routed and ctx.rows_of(x) is not ctx.made_rows:
        raise PlanError(f"the grouped product {info.target} reads routed rows that are not its own experts' "
                        f"rows sorted by expert (they were reordered or picked otherwise); its input must be "
                        f"replicated here")
    product = (E.routed_grouped_mm, (args[0], args[1], offs, bounds, first, count, op_name(info.target), x_routed),
               kwargs)
    if not strategy.output.tokens:
        return product
    # the combine by the reverse all-to-all: the rank's experts' output rows back to their
    # tokens' ranks, each into the row the dispatch took it from (its row map and holders)
    dispatched = ctx.dispatches.get((offs, first, count))
    if dispatched is None:
        raise PlanError(f"the grouped product {info.target} sends its rows back to their tokens' ranks, but no "
                        f"all-to-all dispatch of this layer sent them (the rows were gathered); its output must "
                        f"stay on its experts' ranks here")
    plan, ctx.made_rows, ctx.made_owners = dispatched
    return E.CombineRows(ctx.group), (ctx.graph.call_function(product[0], product[1], product[2]), plan), {}


def dispatches_tokens(strategy: Strategy) -> bool:
    """Whether a grouped product's strategy sends its rows of tokens to their experts' ranks (the
    all-to-all dispatch)."""
    x = strategy.inputs[0] if strategy.inputs else None
    return isinstance(x, Routed) and x.tokens and isinstance(strategy.output, Routed)


def _expert_runs(info: OpInfo, strategy: Strategy, ctx: LocalContext) -> tuple[tuple[int, int], ...]:
    """Every rank's (first expert, experts) of a grouped product's stack of experts, in rank order."""
    total = int(info.inputs[1].shape[0])
    runs = tuple(local_ranges(total, strategy.inputs[1], ctx.tp, r) or ((0, 0),) for r in range(ctx.tp))
    return tuple((a, b - a) for ((a, b),) in runs)


def _dispatch_sizes(info: OpInfo, strategy: Strategy, offs: Any, owners: Any, ctx: LocalContext) -> Any:
    """The node of a dispatching layer's one read (:func:`autotp.distributed.experts.dispatch_sizes`:
    its bounds, split sizes and so its tokens' rows' count), made once per layer by the first of
    the reorder of its tokens' rows and its dispatching product (``info``, ``strategy``: the
    product's; ``owners``: the holder of each row sorted by expert). The layer's bounds are
    taken from it, so the products read nothing of their own."""
    from ...distributed import experts as E

    first, count = _run(info, strategy, 1, ctx)
    key = ("dispatch sizes", offs, first, count)
    if ctx.found_rows(key) is None:
        sizes = ctx.shared_rows(key, lambda: (E.dispatch_sizes, (owners, offs, _expert_runs(info, strategy, ctx),
                                                                  ctx.rank)))
        ctx.shared_rows(("bounds", offs, first, count), lambda: (getattr, (sizes, "bounds")))
    return ctx.found_rows(key)


def _local_dispatch_sizes(info: OpInfo, strategy: Strategy, offs: Any, routing: Any, ctx: LocalContext) -> Any:
    """:func:`_dispatch_sizes` where the rank routed its own rows (``routing``: its
    :class:`~autotp.distributed.expert_routing.LocalRouting`): the same read, from the counts
    its sort exchanged (:func:`~autotp.distributed.expert_routing.local_dispatch_sizes`)."""
    from ...distributed.expert_routing import local_dispatch_sizes

    first, count = _run(info, strategy, 1, ctx)
    key = ("dispatch sizes", offs, first, count)
    if ctx.found_rows(key) is None:
        sizes = ctx.shared_rows(key, lambda: (local_dispatch_sizes, (routing, _expert_runs(info, strategy, ctx),
                                                                       ctx.rank)))
        ctx.shared_rows(("bounds", offs, first, count), lambda: (getattr, (sizes, "bounds")))
    return ctx.found_rows(key)


def _expert_rows(info: OpInfo, strategy: Strategy, offs: Any, ctx: LocalContext) -> tuple[Any, Any]:
    """(bounds, row map) of the rows of this rank's experts among a grouped product's rows sorted
    by expert: one pair of nodes per layer (``offs`` and the run of experts), shared by its two
    products and the gather in front of them, and read to the host once."""
    from ...distributed import experts as E

    first, count = _run(info, strategy, 1, ctx)
    return _sorted_rows(offs, first, count, ctx)


def _sorted_rows(offs: Any, first: int, count: int, ctx: LocalContext) -> tuple[Any, Any]:
    """(bounds, row map) of experts ``first .. first + count - 1`` among rows sorted by expert
    (``offs``: the cumulative rows per expert, in the rank's graph), made once per layer."""
    from ...distributed import experts as E

    bounds = ctx.shared_rows(("bounds", offs, first, count), lambda: (E.expert_bounds, (offs, first, count)))
    return bounds, ctx.shared_rows(("sorted", offs, first, count), lambda: (E.expert_rows, (offs, bounds)))
