"""Neural-network ops: embedding, normalization, attention, softmax, reductions, losses."""
from __future__ import annotations

import torch

from ...placements import PARTIAL, REPLICATE, Shard
from typing import Any

from . import LocalContext, OpInfo, Strategy, TensorMeta, is_shard, norm_dim, register, register_localizer

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """weight [V, h], indices [...]: hidden-split weight -> output split on its last dim;
    vocab-split weight -> each rank looks up its own rows (others masked to 0) -> Partial;
    indices split on a dim -> output split on that dim."""
    pw, pi = placements[0], placements[1]
    last = info.output.ndim - 1
    out = [Strategy((REPLICATE, REPLICATE), REPLICATE)]
    hidden = info.fresh_shard(last)
    if hidden is not None:
        out.append(Strategy((hidden.with_dim(1), REPLICATE), hidden))
    vocab = info.inputs[0].static(0)
    # aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False): a
    # vocab split counts each rank's token frequencies over the positions it does not hold too
    # (they look up its row 0), and a sparse gradient is not split by rows here
    plain = not any(info.args[3:5]) and not any(info.kwargs.get(k) for k in ("scale_grad_by_freq", "sparse"))
    if vocab is not None and vocab >= info.tp and plain:
        # Every rank must hold a row: a lookup in an empty local table fails.
        held = is_shard(pw) and pw.dim == 0 and vocab // (pw.chunks * pw.unit) >= info.tp
        w = pw if held else Shard(0)
        out.append(Strategy((w, REPLICATE), PARTIAL))
    if is_shard(pi):
        out.append(Strategy((REPLICATE, pi), pi))
    return out


@register_localizer(aten.embedding.default)
def embedding_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    pw = strategy.inputs[0]
    if not (is_shard(pw) and pw.dim == 0):
        return info.target, args, kwargs
    from ...placements import local_ranges
    from ...runtime.functional import vocab_parallel_embedding

    ranges = local_ranges(info.inputs[0].static(0), pw, ctx.tp, ctx.rank)
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    return vocab_parallel_embedding, (args[0], args[1], tuple(ranges), padding_idx), {}


def _norm_rule(n_normalized: int):
    def rule(info: OpInfo, placements: tuple) -> list[Strategy]:
        x = info.inputs[0]
        px = placements[0]
        n_params = len(info.inputs) - 1
        out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
        if is_shard(px) and px.dim < x.ndim - n_normalized(info):
            out.append(Strategy((px,) + tuple(REPLICATE for _ in range(n_params)), px))
        return out

    return rule


register(aten.layer_norm.default)(_norm_rule(lambda info: len(info.args[1])))
register(aten.rms_norm.default)(_norm_rule(lambda info: len(info.args[1])))


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """q, k, v [b, heads, s, d] split alike on batch or heads; the mask broadcasts or follows.
    A k or v with one head for all (Falcon's multi-query attention broadcasts it) stays whole
    beside a heads split of q."""
    q, k, v = info.inputs[:3]
    nd = q.ndim   # [*batch, s, d]: 4-D [b, heads, s, d] in transformers, any batch dims in ATen
    out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
    dims = {p.dim: p for p in placements[:3] if is_shard(p) and p.dim < nd - 2}
    for dim, p in sorted(dims.items()):
        if not (q.shape[dim] == k.shape[dim] == v.shape[dim]) and \
                not (k.shape[dim] == v.shape[dim] == 1 and q.shape[dim] != 1):
            continue  # grouped-query attention: heads differ, keep whole
        req = [p] + [p if m.shape[dim] == q.shape[dim] else REPLICATE for m in (k, v)]
        for m in info.inputs[3:]:  # the attention mask, if any
            kdim = dim - (nd - m.ndim)
            req.append(REPLICATE if kdim < 0 or m.shape[kdim] == 1 else p.with_dim(kdim))
        out.append(Strategy(tuple(req), p))
    return out


@register(aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int)
def softmax_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    x = info.inputs[0]
    dim = norm_dim(info.args[1], x.ndim)
    px = placements[0]
    out = [Strategy((REPLICATE,), REPLICATE)]
    if is_shard(px) and px.dim != dim:
        out.append(Strategy((px,), px))
    return out


def _reduced_dims(info: OpInfo) -> tuple[list[int], bool]:
    x = info.inputs[0]
    dims = info.args[1] if len(info.args) > 1 else info.kwargs.get("dim")
    keep = info.args[2] if len(info.args) > 2 else info.kwargs.get("keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):   # dim=[] reduces every dim
        return list(range(x.ndim)), bool(keep)
    if isinstance(dims, int):
        dims = [dims]
    return [norm_dim(d, x.ndim) for d in dims], bool(keep)


def _reduction_rule(linear: bool):
    def rule(info: OpInfo, placements: tuple) -> list[Strategy]:
        px = placements[0]
        out = [Strategy((REPLICATE,), REPLICATE)]
        if not is_shard(px):
            if px == PARTIAL and linear:
                out.append(Strategy((PARTIAL,), PARTIAL))
            return out
        dims, keep = _reduced_dims(info)
        if px.dim in dims:
            if linear:  # a sum over a split dim is the sum of the ranks' sums
                out.append(Strategy((px,), PARTIAL))
        else:
            shift = 0 if keep else sum(1 for d in dims if d < px.dim)
            out.append(Strategy((px,), px.with_dim(px.dim - shift)))
        return out

    return rule


register(aten.sum.dim_IntList)(_reduction_rule(linear=True))
register(aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.correction)(_reduction_rule(linear=False))


@register(aten.nll_loss_forward.default, aten.nll_loss.default)
def loss_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    # A mean over non-ignored targets needs the whole batch.
    return [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]


def _ce_options(info: OpInfo) -> tuple[Any, int, int, float]:
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    defaults = [None, 1, -100, 0.0]
    for i, name in enumerate(names):
        if len(info.args) > 2 + i:
            defaults[i] = info.args[2 + i]
        elif name in info.kwargs:
            defaults[i] = info.kwargs[name]
    return tuple(defaults)


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """logits [N, V] split by vocabulary -> the loss, whole, from three all-reduces of N numbers
    (row max, sum of exps, target logit): Megatron's vocab-parallel cross-entropy."""
    out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
    weight, reduction, _, smoothing = _ce_options(info)
    logits = info.inputs[0]
    if weight is not None or smoothing or logits.ndim != 2 or len(info.inputs) != 2:
        return out
    p = placements[0]
    shard = p if is_shard(p) and p.dim == 1 else info.fresh_shard_of(0, 1)
    if shard is not None:
        n = TensorMeta(logits.shape[:1], logits.dtype)
        out.append(Strategy((shard, REPLICATE), REPLICATE,
                            internal=(("all_reduce", n), ("all_reduce", n), ("all_reduce", n))))
    return out


@register_localizer(aten.cross_entropy_loss.default)
def cross_entropy_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    p = strategy.inputs[0]
    if not is_shard(p):
        return info.target, args, kwargs
    from ...placements import local_ranges
    from ...runtime.functional import VocabParallelCrossEntropy

    _, reduction, ignore_index, _ = _ce_options(info)
    ranges = local_ranges(info.inputs[0].static(1), p, ctx.tp, ctx.rank)
    module = VocabParallelCrossEntropy(ctx.group, ranges, ignore_index, reduction)
    return module, (args[0], args[1]), {}
