"""The strategies of an op meeting routed rows (:class:`~autotp.placements.Routed`): a rank's rows
of its experts (expert parallelism) or of its tokens (a sequence split flattened), held compactly.

An op on rows alone carries them with no collective (:data:`ROW_WISE`, :data:`ROW_BY_ROW`,
:data:`ROW_REDUCING`), its replicated operands taken at the rank's rows; the rows reordered keep
their holders; a view splitting the rows' dim and the sum over a token's top-k rows make the
combine: a plain Partial (each rank adds its rows into the whole ``[T, H]``), or, rows held by
their tokens' ranks, the rank's own tokens' sums. Every strategy the op has for a plain Partial is
offered too (the rows scattered into zeros make one). Registered as the registry's one routed
hook (:func:`~.registry.register_routed`); the rank's program is :mod:`.routed_localizer`'s."""
from __future__ import annotations

import math
from dataclasses import replace

import sympy
import torch

from ...placements import PARTIAL, REPLICATE, Routed, Shard
from .gathered_rows import gathered_rows_strategies
from .local_routing import is_own, own_merge, own_strategies
from .pointwise import partial_into_rows
from .experts import SENT_BACK, is_sent
from .contract import OpInfo, Strategy
from .registry import functional_of, is_shard, mutates_first, op_name, register_routed
from .row_reads import GROUPED_MM
from .token_rows import SIZED_VIEWS, token_sequence, token_split

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
    # DeepSeek-V3's group-limited router: its groups' mask made per token (rules/misc.along_dim_rule)
    aten.zeros_like.default, aten.bitwise_not.default, aten.logical_not.default, aten.expand.default,
))
#: ops of several operands whose rows meet row by row (a product, a sum; bmm: its batch rows; a
#: linear's rows of x against a replicated weight: the router on the tokens a rank holds)
ROW_BY_ROW = frozenset((aten.mul.Tensor, aten.div.Tensor, aten.bmm.default, aten.add.Tensor, aten.sub.Tensor,
                        aten.linear.default, aten.mm.default, aten.addmm.default, aten.masked_fill.Scalar,
                        aten.masked_fill.Tensor, aten.gather.default, aten.scatter.value, aten.scatter.src))
#: ops along another dim than the rows' that keep each row's result in its row (the router's
#: softmax and top-k over the experts of each token, a norm's mean over a head's features, a layer
#: norm over each token's features: OPT's MLP on a sequence split's rows, and an RMS norm's where
#: export keeps it one op: torch.nn.RMSNorm); their own rules say which dims
ROW_REDUCING = frozenset((aten._softmax.default, aten.softmax.int, aten.topk.default, aten.mean.dim,
                          aten.layer_norm.default, aten.rms_norm.default))


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
        return own_strategies(info, placements) + _sent_back(info, placements, rule)
    if info.x_gathered and isinstance(placements[0], Routed) and not placements[0].tokens:
        # rows gathered at a grouped product's experts' bounds (through casts): only the
        # product's expert-parallel strategies have those experts; scattered and summed into a
        # whole x they would be rows of no rank's experts (the gather must then be replicated).
        # Rows gathered on their tokens' ranks are every row, each held once: made whole as any
        return [s for s in _routed_strategies(info, placements, rule)
                if any(isinstance(p, Routed) for p in (s.output if isinstance(s.output, tuple) else (s.output,)))]
    return _routed_strategies(info, placements, rule) + _sent_back(info, placements, rule)


def _sent_back(info: OpInfo, placements: tuple, rule) -> list[Strategy]:
    """The strategies of an op reading rows the dispatch sent (``P(sent 0)``) as the same rows
    back on their tokens' ranks (``P(tokens 0, reordered)``, by the reverse all-to-all: a
    conversion, :func:`.experts.sends_back`): the combine after an op its experts' ranks ran
    (gpt-oss's down product, then its bias ``add_``), where the rows could not go back inside the
    product (:func:`.experts.combine_back`). Not offered to a grouped product (its own rule sends
    its output back) nor to an in-place op (whose written input would be a copy sent back)."""
    sent = [i for i, p in enumerate(placements) if is_sent(p)]
    if not sent or op_name(info.target) in GROUPED_MM or mutates_first(info.target):
        return []
    back = tuple(SENT_BACK if i in sent else p for i, p in enumerate(placements))
    return [s for s in routed_strategies(info, back, rule) if all(s.inputs[i] == SENT_BACK for i in sent)]


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
            # rows the dispatch sent, renumbered, are no longer numbered as it sent them: the
            # reverse all-to-all (its plan's order) cannot send them back (:func:`_sent_back`)
            found.append(Strategy((p, REPLICATE), replace(p, reordered=True) if p.tokens else replace(p, sent=False, alone=False)))
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
