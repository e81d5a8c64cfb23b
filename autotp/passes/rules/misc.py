"""Ops with no tensor data to split: size queries, factories, metadata; and the ops of the
attention-mask prelude, which run replicated on small integer tensors."""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree

from ...placements import PARTIAL, REPLICATE, Shard
from .contract import LocalContext, OpInfo, Strategy
from .registry import is_partial, is_shard, norm_dim, register, register_localizer, replicate_all
from .pieces import tail_part, tail_position, tail_whole

aten = torch.ops.aten


@register(aten.sym_size.int)
def sym_size_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # The graph wants the global size: a split dim would report the local one.
    p = placements[0]
    dim = info.args[1] % info.inputs[0].ndim
    if p is None or (is_shard(p) and p.dim == dim):
        return [Strategy((REPLICATE,), None)]
    return [Strategy((p,), None)]


@register(aten.sym_numel.default, aten.sym_stride.int)
def sym_other_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return [Strategy((REPLICATE,), None)]


FACTORIES = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
    aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.eye.default, aten.eye.m,   # Gated DeltaNet's chunk: attn + eye(64)
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
]


@register(*FACTORIES)
def factory_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # A tensor argument only lends its dtype/device (new_ones, zeros_like ...): leave it as it is.
    if info.target in (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                       aten.empty_like.default):
        # a tensor of one value: split as its model is split, each rank makes its own shape of it
        # (Mamba2's scan starts its chunk states from ``zeros_like`` of one chunk's, per head)
        out = replicate_all(info, placements)
        if is_shard(placements[0]):
            out.append(Strategy((placements[0],) + tuple(REPLICATE for _ in placements[1:]), placements[0]))
        return out
    return [Strategy(tuple(p if p is not None else REPLICATE for p in placements), REPLICATE)]


REPLICATED = [
    aten.diff.default, aten.index_select.default, aten.argsort.default, aten.argsort.stable,
    aten.sort.default, aten.sort.stable, aten.argmax.default, aten.any.default, aten.all.default,
    aten.flip.default, aten.roll.default,
]


@register(*REPLICATED)
def replicated_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # Correct whole; a sharded form would need index arithmetic these ops do not expose.
    return replicate_all(info, placements)


@register(aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default)
def along_dim_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``gather``/``scatter`` along one dim (DeepSeek-V3's router picks its scores at the top-k
    ids, ``scores.gather(1, ids)``, and marks its chosen expert groups, ``mask.scatter_(1,
    group_ids, 1)``): each slice along another dim reads and writes that slice alone, so a
    shard of another dim is kept where every tensor operand (self, index, src) has the dim's
    size and is split alike; the in-place ``scatter_`` takes this rule through its twin.
    Anything else runs replicated."""
    out = replicate_all(info, placements)
    x = info.inputs[0]
    dim = norm_dim(info.args[1], max(x.ndim, 1))
    p = next((q for q in placements if is_shard(q)), None)
    if p is None or p.dim == dim or p != Shard(p.dim) or not all(q is None or q == p for q in placements):
        return out
    if all(m.ndim == x.ndim and sympy.expand(m.shape[p.dim] - x.shape[p.dim]) == 0 for m in info.inputs):
        out.append(Strategy(tuple(p for _ in placements), p))
    return out


@register(aten.topk.default)
def topk_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """The k largest along one dim (a router's experts per token): a shard of another dim is
    kept by both the values and their indices, each row's k picked from its own row."""
    x = info.inputs[0]
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", -1)
    dim = dim % max(x.ndim, 1)
    out = replicate_all(info, placements)
    p = placements[0]
    if is_shard(p) and p.dim != dim and p == Shard(p.dim):
        out.append(Strategy((p,), (p, p)))
    return out


@register(aten.cumsum.default)
def cumsum_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """A running sum along one dim (Mamba2's chunked scan: ``cumsum`` of A over each chunk's
    positions, per head): a shard of another dim is kept, a Partial passes (the sum is linear)."""
    dim = info.args[1] % max(info.inputs[0].ndim, 1)
    out = replicate_all(info, placements)
    p = placements[0]
    if is_shard(p) and p.dim != dim:
        out.append(Strategy((p,), p))
    elif is_partial(p) and info.output.dtype == info.inputs[0].dtype:
        out.append(Strategy((PARTIAL,), PARTIAL))
    return out


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Padding of some dims (Mamba2 pads the sequence to a whole number of chunks; its scan pads
    the chunk states): a shard of a dim padded by nothing is kept; a Partial passes a constant
    pad of zeros (the pad of a sum is the sum of the pads)."""
    nd = info.inputs[0].ndim
    pads = list(info.args[1]) if len(info.args) > 1 else []
    out = replicate_all(info, placements)
    p = placements[0]
    if is_shard(p):
        k = nd - 1 - p.dim          # pads run (left, right) from the last dim backwards
        pair = pads[2 * k:2 * k + 2]
        if all(isinstance(x, int) and x == 0 for x in pair):
            out.append(Strategy((p,), p))
    elif is_partial(p) and _pads_with_zeros(info):
        out.append(Strategy((PARTIAL,), PARTIAL))
    return out


def _pads_with_zeros(info: OpInfo) -> bool:
    if info.target is aten.constant_pad_nd.default:
        value = info.args[2] if len(info.args) > 2 else info.kwargs.get("value", 0)
        return value == 0
    mode = info.args[2] if len(info.args) > 2 else info.kwargs.get("mode", "constant")
    value = info.args[3] if len(info.args) > 3 else info.kwargs.get("value", None)
    return mode == "constant" and (value is None or value == 0)


@register(aten.index.Tensor)
def index_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``x[:, :, idx]`` (Falcon picks k and v out of its fused heads so): a shard of a dim left
    whole (``None``) before the first index tensor keeps its place in the output; index
    tensors stay whole. Anything else runs replicated."""
    indices = info.args[1]
    first = next((i for i, t in enumerate(indices) if t is not None), len(indices))
    out = replicate_all(info, placements)
    p = placements[0]
    if is_shard(p) and p.dim < first and info.output is not None and \
            info.output.shape[p.dim] == info.inputs[0].shape[p.dim]:
        out.append(Strategy((p,) + tuple(REPLICATE for _ in info.inputs[1:]), p))
    if is_shard(p) and p.tail and info.picks is not None and info.picks[0] == p.dim == first:
        # Falcon's k and v picked from the end of a fused group (``x[..., [-2], :]``): every rank
        # holds the tail whole, so the pick is whole (a narrow at the rank's own offset).
        dim, positions = info.picks
        contiguous = list(positions) == list(range(positions[0], positions[0] + len(positions)))
        whole = tail_whole(p)
        if contiguous and tail_part(p, info.inputs[0].shape[dim], positions) == whole:
            out.append(Strategy((p,) + tuple(REPLICATE for _ in info.inputs[1:]), whole))
    return out


@register_localizer(aten.index.Tensor)
def index_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    p = strategy.inputs[0]
    if info.permutes_rows and not (is_shard(p) and p.dim == 0):
        # rows reordered by a permutation (the experts' output back to token order, whole or a
        # partial sum on every rank): backward a gather by the inverse, not a scatter-add
        from ...distributed.functional import permute_rows

        inverse = _held_inverse(ctx, args[1][0])
        return permute_rows, (args[0], args[1][0]) + ((inverse,) if inverse is not None else ()), {}
    if not (is_shard(p) and p.tail and info.picks is not None and info.picks[0] == p.dim):
        return info.target, args, kwargs
    dim, positions = info.picks
    start = tail_position(p, int(info.inputs[0].shape[dim]), positions[0], ctx)
    return aten.narrow.default, (args[0], dim, start, len(positions)), {}


def _held_inverse(ctx: LocalContext, index: Any) -> Any:
    """The node of the rank's graph holding the inverse of the permutation ``index`` (the rank's
    own index of a reorder), or None: the first node the captured graph makes that inverse
    (:func:`.row_reads.inverse_permutations`: ``p`` for ``inv[p] = arange``, ``inv_perm`` for
    ``perm``) that the rank's program has made by then (``passes/rewrite._inverses_first`` makes
    it before the reorder where it can), where the rank's graph made the index and that inverse
    exactly as captured, from the same nodes (no conversion between, no arange of its own: the
    values are the captured ones on this rank too); its backward then gathers by it."""
    from .routing import inverted
    from .row_reads import inverse_permutations

    captured, env = getattr(ctx, "node", None), getattr(ctx, "env", None)
    if captured is None or env is None or env.get(captured.args[1][0]) is not index:
        return None
    made = captured.args[1][0]
    for inverse in inverse_permutations(made):
        if inverse not in env:
            continue   # made after the reorder in the rank's program
        # the one of the two made from the other, back to it
        later, earlier = (made, inverse) if inverted(made) is inverse else (inverse, made)
        if _as_captured(later, env, earlier):
            return env[inverse]
    return None


def _as_captured(made: Any, env: dict, source: Any) -> bool:
    """Whether the rank's graph made ``env[made]`` from ``env[source]`` as the captured graph made
    ``made`` from ``source``: the same op of the rank's nodes of the same inputs, through the
    clones, sorts, scatters and aranges that carry the values (a device argument aside)."""
    from torch import fx

    from .routing import INVERTERS, SORTS

    carries = INVERTERS | SORTS | {aten.clone.default, aten.alias.default, aten.arange.default,
                                   aten.arange.start, aten.arange.start_step, operator.getitem}
    ours = env.get(made)
    if made is source or ours is None:
        return ours is not None
    if getattr(ours, "target", None) is not made.target:
        return False
    haves = pytree.tree_leaves((ours.args, _no_device(ours.kwargs)))
    wants = pytree.tree_leaves((made.args, _no_device(made.kwargs)))
    if len(haves) != len(wants):
        return False
    for have, want in zip(haves, wants):
        if isinstance(want, fx.Node):
            if env.get(want) is not have:
                return False
            if want.op == "call_function" and want.target in carries and not _as_captured(want, env, source):
                return False
        elif have != want:
            return False
    return True


def _no_device(kwargs: dict) -> dict:
    # where a factory runs, not what it makes: the rank's program puts its own device there
    return {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "layout")}


def _region_calls() -> list:
    from ...capture.higher_order import REGION_CALLS

    return list(REGION_CALLS)


@register(*_region_calls())
def region_call_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # Grad-mode and autocast switches around an inlined region (autotp.capture.higher_order): no data.
    return [Strategy(tuple(REPLICATE for _ in info.inputs), None)]


def _data_dependent_ops() -> list:
    hop = torch.ops.higher_order
    return [getattr(hop, name) for name in ("cond", "while_loop", "map_impl", "scan") if hasattr(hop, name)]


@register(*_data_dependent_ops())
def data_dependent_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # Which branch runs depends on values: the op runs whole on every rank, its branch
    # submodules carried into the rank's program by the rewrite.
    return replicate_all(info, placements)
