"""View-like ops: a shard follows its data through reshapes, transposes, squeezes and expands.

Each rule offers R -> R, P -> P and the shard moved to where the op puts its dim (:func:`follow`);
where a reshape moves it is :func:`.view_map.map_view_shard`'s answer. The localizers turn the
size lists of ``view``, ``reshape``, ``expand`` and ``broadcast_to`` into this rank's sizes.
Ops that take pieces of a dim (slices, splits, chunks) are in :mod:`.pieces`, joins and
repeats in :mod:`.joins`; both build on :func:`follow`.
"""
from __future__ import annotations

import torch

from ...placements import PARTIAL, REPLICATE, Shard
from .contract import LocalContext, OpInfo, Strategy, along_sequence
from .registry import (
    is_partial,
    is_shard,
    norm_dim,
    register,
    register_localizer,
)
from .view_map import map_view_shard, plain_if_same

aten = torch.ops.aten


def follow(info: OpInfo, placements: tuple, mapped) -> list[Strategy]:
    """R -> R, P -> P, and S -> mapped(S) where the shard survives the op. Forced sequence
    parallelism passes a partial sum on as P alone into a view with a sequence dim: all-reduced
    there, the add behind it (an MoE combine's ``[tokens, hidden]`` sum viewed back to
    ``[b, s, h]``) meets no partial sum to reduce-scatter along the sequence
    (``pointwise._with_sequence_entry``)."""
    p = placements[0]
    out = [Strategy((REPLICATE,), REPLICATE)]
    if is_partial(p):
        out = out[:0 if _into_sequence_forced(info, p) else 1] + [Strategy((PARTIAL,), PARTIAL)]
    elif is_shard(p):
        target = mapped(p)
        if target is not None:
            out.append(Strategy((p,), target))
    return out


def _into_sequence_forced(info: OpInfo, p) -> bool:
    """Whether the partial sum ``p`` must stay Partial through this view: sequence parallelism
    forced, a plain partial sum (not routed rows) and a sequence dim in the view's output."""
    out = info.output
    return info.force_sequence and p == PARTIAL and any(along_sequence(out, d, info.sequence) for d in range(out.ndim))


def _mapped_view(info: OpInfo):
    src, dst = info.inputs[0].shape, info.output.shape

    def mapped(s: Shard) -> Shard | None:
        out = map_view_shard(src, dst, s)
        return out if out is None else plain_if_same(out, dst[out.dim], info.tp)

    return mapped


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def view_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return follow(info, placements, _mapped_view(info))


def _size_list_localizer(list_pos: int):
    def localize(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
        out = strategy.output
        if not is_shard(out):
            return info.target, args, kwargs
        sizes = list(args[list_pos])
        sizes[out.dim] = ctx.local(sizes[out.dim], info.output.shape[out.dim], out)
        if out.outer >= 0 and not (isinstance(sizes[out.outer], int) and sizes[out.outer] == -1):
            sizes[out.outer] = 1   # a per-block shard's blocks on a dim of their own: one per rank
        if isinstance(sizes[out.dim], int) and sizes[out.dim] == 0:
            # A rank holding none of the dim: a -1 elsewhere would be ambiguous; spell it out.
            sizes = [int(g) if isinstance(a, int) and a == -1 and g.is_Integer else a
                     for a, g in zip(sizes, info.output.shape)]
        elif not isinstance(sizes[out.dim], int):
            # A dynamic local size (a sequence shard) may be 0 on some ranks at some lengths.
            sizes = [ctx.size(g) if isinstance(a, int) and a == -1 else a
                     for a, g in zip(sizes, info.output.shape)]
        args = args[:list_pos] + (sizes,) + args[list_pos + 1:]
        return info.target, args, kwargs

    return localize


register_localizer(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)(
    _size_list_localizer(1)
)


@register(aten.alias.default, aten.contiguous.default, aten.clone.default, aten.detach.default,
          aten.lift_fresh_copy.default, aten.detach_.default)
def identity_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return follow(info, placements, lambda s: s)


@register(aten.transpose.int)
def transpose_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    nd = info.inputs[0].ndim
    a, b = norm_dim(info.args[1], nd), norm_dim(info.args[2], nd)
    swap = {a: b, b: a}
    out = follow(info, placements, lambda s: s.with_dim(swap.get(s.dim, s.dim)))
    if placements[0] is None and nd == 3 and 0 not in swap and info.inputs[0].static(0) not in (None, 1):
        # a free stack of matrices transposed per matrix (a mixture's experts read as
        # ``w.transpose(-2, -1)``) may be split by whole matrices: expert parallelism
        out.append(Strategy((Shard(0),), Shard(0)))
    if nd == 3 and set(swap) == {1, 2} and info.inputs[0].static(0) is not None and (
            placements[0] is None or (is_shard(placements[0]) and placements[0].dim in swap
                                      and (placements[0].chunks, placements[0].unit) == (1, 1))):
        # ... or inside every matrix (expert tensor parallelism): a fresh shard of either matrix
        # dim, in the blocks the product's output shows (gate|up: two), see rules/experts.py
        for d in (1, 2):
            fresh = info.fresh_shard(d)
            if fresh is not None and not fresh.holds_whole and not fresh.per_block and \
                    (placements[0] is None or placements[0].dim == swap[d]):
                strategy = Strategy((fresh.with_dim(swap[d]),), fresh)
                if strategy not in out:
                    out.append(strategy)
    return out


@register(aten.permute.default)
def permute_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    nd = info.inputs[0].ndim
    perm = [norm_dim(d, nd) for d in info.args[1]]
    return follow(info, placements, lambda s: s.with_dim(perm.index(s.dim)))


@register(aten.unsqueeze.default)
def unsqueeze_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    d = norm_dim(info.args[1], info.output.ndim)
    return follow(info, placements, lambda s: s.with_dim(s.dim + 1 if s.dim >= d else s.dim))


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    src, dst = info.inputs[0].shape, info.output.shape
    return follow(info, placements, lambda s: map_view_shard(src, dst, s))


@register_localizer(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    # Squeeze the dims of global size 1 only: a rank holding one element of a split dim keeps it.
    if not is_shard(strategy.inputs[0]):
        return info.target, args, kwargs
    shape = info.inputs[0].shape
    asked = args[1] if len(args) > 1 else range(len(shape))
    asked = {norm_dim(d, len(shape)) for d in ([asked] if isinstance(asked, int) else asked)}
    return aten.squeeze.dims, (args[0], [d for d in sorted(asked) if shape[d] == 1]), {}


@register(aten.expand.default)
def expand_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    src, dst = info.inputs[0].shape, info.output.shape
    lead = len(dst) - len(src)

    def mapped(s: Shard):
        return s.with_dim(s.dim + lead) if src[s.dim] == dst[s.dim + lead] else None

    out = follow(info, placements, mapped)
    if placements[0] is None or placements[0] == REPLICATE:
        # A whole tensor broadcast along a new or size-1 dim (one key/value head for every query
        # head: multi-query attention's repeat) may give each rank only its own copies: no data
        # moves forward, and the f's backward all-reduce sums the copies' gradients, a tensor of
        # the unexpanded size (a scatter of the copies would all-gather every copy's instead).
        # Offered where every dim between the first and the broadcast one has size 1: the copies
        # a rank keeps are then one contiguous run of heads once the dims merge, as a
        # column-parallel q's heads are. With several kv groups a rank's query heads need copies
        # of one group, a run no shard of the broadcast dim describes: a scatter covers that.
        for d in range(len(dst)):
            if (d < lead or src[d - lead] == 1) and dst[d] != 1 and all(x == 1 for x in dst[1:d]):
                fresh = info.fresh_shard(d)
                if fresh is not None:
                    out.append(Strategy((REPLICATE,), fresh))
    return out


@register(aten.flatten.using_ints)
def flatten_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """A reshape whose arguments name dims, not sizes: no localizer needed (dims untouched by
    the shard keep their sizes; a merged shard is the view's ``(chunks, unit)`` mapping)."""
    return follow(info, placements, _mapped_view(info))


@register(aten.numpy_T.default, aten.t.default)
def weight_transpose_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``x @ weight.T`` (Falcon's linear): the shard follows the transpose. A free weight (or
    one split on the matching dim) may also be cut afresh on either dim, in the form the
    product hints for its output features (fused q/k/v, whole heads): column- and
    row-parallel products then find their weight already laid out."""
    nd = info.inputs[0].ndim
    out = follow(info, placements, lambda s: s.with_dim(nd - 1 - s.dim) if nd == 2 or
                  info.target is aten.numpy_T.default else s)
    p = placements[0]
    if nd != 2 or is_partial(p):
        return out
    for od in range(nd):
        fresh = info.fresh_shard(od)
        if fresh is not None and (p is None or (is_shard(p) and p.dim == nd - 1 - od)) and \
                not any(s.output == fresh for s in out):
            out.append(Strategy((fresh.with_dim(nd - 1 - od),), fresh))
    return out


@register(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """Rotary embeddings as complex products (Llama-4): ``[..., n, 2]`` real pairs read as ``[..., n]``
    complex numbers and back. Every dim but the pairs keeps its index, so a shard of one (the heads)
    passes as it is; the pairs' dim is whole on every rank."""
    pairs = info.inputs[0].ndim - 1 if info.target is aten.view_as_complex.default else info.inputs[0].ndim
    return follow(info, placements, lambda s: s if s.dim < pairs else None)


@register(aten.broadcast_to.default)
def broadcast_to_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    return expand_rule(info, placements)


register_localizer(aten.broadcast_to.default)(_size_list_localizer(1))
