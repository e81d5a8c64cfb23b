"""Neural-network ops: embedding, normalization, attention, softmax, reductions, losses."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch

from ...placements import PARTIAL, REPLICATE, Shard, divides, local_ranges, local_size, resharded_by_all_to_all

from .contract import LocalContext, OpInfo, Strategy, TensorMeta, along_sequence
from .registry import is_partial, is_shard, norm_dim, register, register_localizer

aten = torch.ops.aten

#: an op's internal collective (``Strategy.internal``): a vocab-split table read by columns, one
#: all-to-all each way (:class:`~autotp.distributed.functional.EmbeddingByColumns`)
BY_COLUMNS = "all_to_all_columns"


@register(aten.embedding.default)
def embedding_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """weight [V, h], indices [...]: hidden-split weight -> output split on its last dim;
    vocab-split weight -> each rank looks up its own rows (others masked to 0) -> Partial, or
    reads the table by columns (:data:`BY_COLUMNS`) -> output split on its last dim;
    indices split on a dim -> output split on that dim.

    The second reading of a vocab-split table is for a table the head keeps split by vocabulary
    (GPT-2's ``wte`` tied to ``lm_head``): the masked lookup writes every token's whole row on
    every rank (``b·s·h``) and scatters every token's gradient row back, where the rank's share is
    ``1/tp`` of that. An all-to-all of the table inside the op ((tp-1)/tp² of it sent each way)
    hands each rank every row's ``h/tp`` columns, and its lookup of every id writes ``b·s·h/tp``;
    its gradient, scattered into those columns, goes back to the rows' ranks by the reverse
    all-to-all. The cost model weighs the table's bytes against the tokens' (a decode step of a
    few tokens keeps the masked lookup)."""
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
        held = is_shard(pw) and pw.dim == 0 and vocab // (pw.parts * pw.unit) >= info.tp
        w = pw if held else Shard(0)
        out.append(Strategy((w, REPLICATE), PARTIAL))
        if hidden is not None and resharded_by_all_to_all(w, hidden.with_dim(1)):
            out.append(Strategy((w, REPLICATE), hidden, internal=((BY_COLUMNS, info.inputs[0]),)))
    if is_shard(pi):
        out.append(Strategy((REPLICATE, pi), pi))
    return out


@register_localizer(aten.embedding.default)
def embedding_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    pw = strategy.inputs[0]
    if not (is_shard(pw) and pw.dim == 0):
        return info.target, args, kwargs
    if strategy.internal:   # the table read by columns: the op as it is, on the resharded table
        from ...distributed.functional import EmbeddingByColumns

        module = EmbeddingByColumns(ctx.group, pw, strategy.output.with_dim(1), info.inputs[0].static(0))
        return module, tuple(args), kwargs
    from ...distributed.functional import vocab_parallel_embedding

    ranges = local_ranges(info.inputs[0].static(0), pw, ctx.tp, ctx.rank)
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    return vocab_parallel_embedding, (args[0], args[1], tuple(ranges), padding_idx), {}


def _norm_rule(n_normalized: int):
    """A norm over the last ``n_normalized`` dims runs on whole rows: an input split along a dim
    before them passes through; one split along a normalized dim (an embedding split by hidden
    columns) is gathered whole, or resharded by one all-to-all into the sequence split where the
    program has a sequence to split (sequence parallelism's region, :func:`_into_sequence`). A
    partial sum meeting the norm first (a fused RMSNorm's statistic right after a row-parallel
    product and an add that kept it partial) may be reduce-scattered into that split too, and
    must be where sequence parallelism is forced, as a pointwise op's Partial is
    (``pointwise._with_sequence_entry``)."""
    def rule(info: OpInfo, placements: tuple) -> list[Strategy]:
        x = info.inputs[0]
        px = placements[0]
        n_params = len(info.inputs) - 1
        params = tuple(REPLICATE for _ in range(n_params))
        out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
        kept = x.ndim - n_normalized(info)
        if is_shard(px) and px.dim < kept:
            out.append(Strategy((px,) + params, px))
        elif is_shard(px):
            out += [Strategy((shard,) + params, shard) for shard in _into_sequence(info, kept)]
        elif is_partial(px):   # a partial sum met here first: reduce-scattered into the sequence split
            entry = [Strategy((shard,) + params, shard) for shard in _into_sequence(info, kept)]
            out = entry if entry and info.force_sequence else out + entry
        return out

    return rule


def _into_sequence(info: OpInfo, dims: int) -> list[Shard]:
    """Fresh sequence shards of the output among its first ``dims`` dims (none where the program
    offers no sequence parallelism: ``OpInfo.sequence`` empty)."""
    out = info.output
    return [shard for d in range(dims)
            if out.static(d) is None or along_sequence(out, d, info.sequence)
            for shard in (info.fresh_shard(d),) if shard is not None]


register(aten.layer_norm.default)(_norm_rule(lambda info: len(info.args[1])))


@register(aten.rms_norm.default)
def rms_norm_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``rms_norm(x, normalized_shape, weight, eps)`` splits along the dims it does not normalize.
    Without a weight (an RMSNorm's statistic, ``autotp/passes/norms.py``) also along a normalized
    dim split into whole heads (atoms of more than one element; OLMo2's q/k norms over all heads'
    width), as the written statistic does (:func:`mean_rule`): each rank's sum of squares, one
    number per row, all-reduced forward, and ``sum(dy * x)`` backward (``SplitRmsNorm``), in
    float32 at least. Not on a plain split (the residual stream's hidden dim), as the mean's."""
    k = len(info.args[1])
    out = _norm_rule(lambda _: k)(info, placements)
    x, px = info.inputs[0], placements[0]
    if len(info.inputs) == 1 and is_shard(px) and px.dim >= x.ndim - k and px.unit > 1 and not px.holds_whole \
            and px.outer < 0:
        computed = torch.promote_types(x.dtype, torch.float32)
        row = TensorMeta(tuple(x.shape[:x.ndim - k]) + (sympy.Integer(1),) * k, computed)
        out.append(Strategy((px,), px, internal=(("all_reduce", row), ("all_reduce", row))))
    return out


@register_localizer(aten.rms_norm.default)
def rms_norm_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    x, px = info.inputs[0], strategy.inputs[0]
    k = len(info.args[1])
    if not (is_shard(px) and px.dim >= x.ndim - k):
        return info.target, args, kwargs
    from ...distributed.functional import SplitRmsNorm

    count = 1
    for size in info.args[1]:
        count *= int(size)
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    if eps is None:   # aten.rms_norm's default: the epsilon of the type it computes in
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    return SplitRmsNorm(ctx.group, tuple(range(x.ndim - k, x.ndim)), count, eps), (args[0],), {}


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """q, k, v [b, heads, s, d] split alike on batch or heads; the mask broadcasts or follows.
    A k or v with one head for all (Falcon's multi-query attention broadcasts it) stays whole
    beside a heads split of q. Grouped-query attention (``enable_gqa``: k and v of fewer heads,
    each serving a group of consecutive query heads) splits by heads where every rank's query
    heads use exactly the key/value heads it holds (:func:`_gqa_strategies`)."""
    q, k, v = info.inputs[:3]
    nd = q.ndim   # [*batch, s, d]: 4-D [b, heads, s, d] in transformers, any batch dims in ATen
    out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
    dims = {p.dim: p for p in placements[:3] if is_shard(p) and p.dim < nd - 2}
    for dim, p in sorted(dims.items()):
        if not (q.shape[dim] == k.shape[dim] == v.shape[dim]) and \
                not (k.shape[dim] == v.shape[dim] == 1 and q.shape[dim] != 1):
            continue  # grouped-query attention: heads differ, see _gqa_strategies
        req = [p] + [p if m.shape[dim] == q.shape[dim] else REPLICATE for m in (k, v)]
        out.append(Strategy(tuple(req + _mask_placements(info, p, nd)), p))
    return out + _gqa_strategies(info, placements)


def _mask_placements(info: OpInfo, p: Shard, nd: int) -> list:
    """The attention mask (if any) beside a split of q's dim ``p.dim``: whole where it
    broadcasts over that dim, else split alike."""
    req = []
    for m in info.inputs[3:]:
        kdim = p.dim - (nd - m.ndim)
        req.append(REPLICATE if kdim < 0 or m.shape[kdim] == 1 else p.with_dim(kdim))
    return req


def _gqa_strategies(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``enable_gqa=True`` with q of ``g * kv`` heads and k, v of ``kv`` (query head i uses
    key/value head i // g): split by heads where each rank's query heads, in its local order,
    use its own key/value heads as the local op will (local query head j -> local kv head
    j // (local q / local kv)). Tried from q's split (k and v dealt alike, or one whole group
    per rank where ranks outnumber the groups: a slice of a replicated k and v) and from k's
    (q dealt by whole groups); :func:`_grouped_alike` checks every rank."""
    q, k, v = info.inputs[:3]
    gqa = info.kwargs.get("enable_gqa", False)
    h = q.ndim - 3
    if not gqa or h < 0 or k.ndim != q.ndim or k.shape[h] != v.shape[h]:
        return []
    hq, hkv = q.static(h), k.static(h)
    if hq is None or hkv is None or hkv <= 1 or hq == hkv or hq % hkv:
        return []
    g = hq // hkv
    pq, pk = placements[0], placements[1]
    pairs = []
    if is_shard(pq) and pq.dim == h:
        pairs += [(pq, pq), (pq, Shard(h)), (pq, Shard(h, hkv, 1, tail=1, per_block=True))]
        if pq.unit % g == 0:
            pairs.append((pq, replace(pq, unit=pq.unit // g)))
    if is_shard(pk) and pk.dim == h:
        pairs += [(Shard(h), pk), (replace(pk, unit=pk.unit * g, tail=0), pk)]
    out, seen = [], set()
    for a, b in pairs:
        if (a, b) in seen or not _grouped_alike(a, b, hq, hkv, info.tp):
            continue
        seen.add((a, b))
        out.append(Strategy((a, b, b) + tuple(_mask_placements(info, a, q.ndim)), a))
    if is_shard(pq) and pq.dim == h and pq.outer < 0 and divides(hq, pq) \
            and all(local_ranges(hq, pq, info.tp, rank) for rank in range(info.tp)):
        # any split of q (a head or more on every rank) beside whole k and v: each rank picks
        # the key/value heads its query heads use (sdpa_localizer), as repeating k and v to
        # every head and slicing would
        out.append(Strategy((pq, REPLICATE, REPLICATE) + tuple(_mask_placements(info, pq, q.ndim)), pq))
    return out


def _grouped_alike(pq: Shard, pk: Shard, hq: int, hkv: int, tp: int) -> bool:
    """Whether, on every rank, the query heads ``pq`` gives it map onto the key/value heads
    ``pk`` gives it as ``enable_gqa`` maps local heads (see :func:`_gqa_strategies`)."""
    if pq.outer >= 0 or pk.outer >= 0 or not (divides(hq, pq) and divides(hkv, pk)):
        return False
    g = hq // hkv
    for rank in range(tp):
        qh, kh = _held(hq, pq, tp, rank), _held(hkv, pk, tp, rank)
        if not qh or not kh or len(qh) % len(kh):
            return False
        per = len(qh) // len(kh)
        if any(i // g != kh[j // per] for j, i in enumerate(qh)):
            return False
    return True


def _kv_heads_used(hq: int, hkv: int, pq: Shard, tp: int, rank: int) -> list[int]:
    """The key/value head each of ``rank``'s query heads under ``pq`` uses, in local order."""
    g = hq // hkv
    return [i // g for i in _held(hq, pq, tp, rank)]


def _held(size: int, p: Shard, tp: int, rank: int) -> list[int]:
    """The indices of a dim of ``size`` that ``rank`` holds under ``p``, in local order."""
    return [i for a, b in local_ranges(size, p, tp, rank) for i in range(a, b)]


@register_localizer(aten.scaled_dot_product_attention.default)
def sdpa_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """Grouped-query attention with q split by heads beside whole k and v: this rank's k and
    v become the heads its query heads use. Every rank's graph has the same ops (the ranks
    check that before their first collective; their int arguments may differ): where on every
    rank each used head serves the same number of local query heads (a rank inside one group,
    or holding whole groups) a ``narrow`` of k and v, and the op keeps ``enable_gqa``;
    otherwise (some rank's run straddling groups unevenly) the used heads as the same number
    of pieces on every rank, each a one-head ``narrow`` repeated for its query heads (none for
    a rank with fewer pieces), joined, and ``enable_gqa`` off."""
    pq, pk = strategy.inputs[0], strategy.inputs[1]
    q, k = info.inputs[0], info.inputs[1]
    h = q.ndim - 3
    if not (kwargs.get("enable_gqa", False) and is_shard(pq) and pq.dim == h and pk == REPLICATE):
        return info.target, args, kwargs
    hq, hkv = q.static(h), k.static(h)
    if hq is None or hkv is None or hq == hkv:
        return info.target, args, kwargs
    runs = [_kv_runs(hq, hkv, pq, ctx.tp, rank) for rank in range(ctx.tp)]
    regular = all(len({n for _, n in r}) == 1 and r[-1][0] - r[0][0] == len(r) - 1 for r in runs)
    mine, pieces = runs[ctx.rank], max(len(r) for r in runs)
    graph = ctx.graph

    def pick(kv: Any) -> Any:
        if regular:
            return graph.call_function(aten.narrow.default, (kv, h, mine[0][0], len(mine)))
        padded = mine + [(mine[-1][0], 0)] * (pieces - len(mine))
        parts = [graph.call_function(aten.repeat_interleave.self_int,
                                     (graph.call_function(aten.narrow.default, (kv, h, head, 1)), n, h))
                 for head, n in padded]
        return graph.call_function(aten.cat.default, (parts, h))

    args = (args[0], pick(args[1]), pick(args[2])) + tuple(args[3:])
    return info.target, args, {**kwargs, "enable_gqa": regular}


def _kv_runs(hq: int, hkv: int, pq: Shard, tp: int, rank: int) -> list[tuple[int, int]]:
    """(key/value head, how many of ``rank``'s query heads use it), in local order."""
    runs: list[list[int]] = []
    for head in _kv_heads_used(hq, hkv, pq, tp, rank):
        if runs and runs[-1][0] == head:
            runs[-1][1] += 1
        else:
            runs.append([head, 1])
    return [(head, n) for head, n in runs]


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
register(aten.amax.default, aten.amin.default, aten.var.correction)(_reduction_rule(linear=False))


@register(aten.mean.dim)
def mean_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """A mean keeps a split of the dims it does not reduce. Over a dim split into whole heads (atoms
    of more than one element: a head-split projection's output) it is a Partial, each rank's sum
    divided by the whole count (:func:`mean_localizer`): the per-token statistic of a norm over all
    heads' width (OLMo2's ``q_norm``/``k_norm``), made whole by a g of one number per token instead
    of a gather of q and a scatter back (vLLM's way). Not offered on a plain split (atoms of one
    element, the residual stream's hidden dim): there it would let the solver run every norm on a
    hidden-split stream, a layout Megatron does not use, for a gain the cost model cannot see."""
    out = _reduction_rule(linear=False)(info, placements)
    px = placements[0]
    if is_shard(px) and px.unit > 1 and not px.holds_whole and px.outer < 0 and px.dim in _reduced_dims(info)[0]:
        out.append(Strategy((px,), PARTIAL))
    return out


@register_localizer(aten.mean.dim)
def mean_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    """This rank's share of a mean over a split dim: its own sum over the reduced dims divided by
    their whole count (a local mean would divide by its own count, unequal on uneven shards)."""
    if strategy.output != PARTIAL or not is_shard(strategy.inputs[0]):
        return info.target, args, kwargs
    from ...distributed.functional import mean_share

    dims, keep = _reduced_dims(info)
    count = sympy.Integer(1)
    for d in dims:
        count = count * info.inputs[0].shape[d]
    return mean_share, (args[0], tuple(dims), keep, ctx.size(count)), {"dtype": kwargs.get("dtype")}


@register(aten.max.dim, aten.min.dim)
def max_dim_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """The largest (smallest) entry along one dim and its index: a shard of another dim stays
    where it is, in both outputs (gpt-oss subtracts each row's max from its scores and sinks
    before the softmax, the heads split)."""
    px = placements[0]
    out = [Strategy((REPLICATE,), (REPLICATE, REPLICATE))]
    dims, keep = _reduced_dims(info)
    if is_shard(px) and px.dim not in dims:
        shifted = px.with_dim(px.dim - (0 if keep else sum(1 for d in dims if d < px.dim)))
        out.append(Strategy((px,), (shifted, shifted)))
    return out


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
    """logits [N, V] split by vocabulary -> the loss, whole, from two all-reduces: the row max (N
    numbers), then the sums of exps and the target logits together (2N), in float32 at least:
    Megatron's vocab-parallel cross-entropy, as ``distributed.functional.VocabParallelCrossEntropy``
    runs it."""
    out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
    weight, reduction, _, smoothing = _ce_options(info)
    logits = info.inputs[0]
    if weight is not None or smoothing or logits.ndim != 2 or len(info.inputs) != 2:
        return out
    p = placements[0]
    shard = p if is_shard(p) and p.dim == 1 else info.fresh_shard_of(0, 1)
    if shard is not None:
        # the sums travel in the dtype the loss computes in: float32 for half-precision logits
        computed = torch.promote_types(logits.dtype, torch.float32) if logits.is_float else logits.dtype
        n = TensorMeta(logits.shape[:1], computed)
        two_n = TensorMeta((sympy.Integer(2),) + tuple(logits.shape[:1]), computed)
        out.append(Strategy((shard, REPLICATE), REPLICATE, internal=(("all_reduce", n), ("all_reduce", two_n))))
    return out


@register_localizer(aten.cross_entropy_loss.default)
def cross_entropy_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    p = strategy.inputs[0]
    if not is_shard(p):
        return info.target, args, kwargs
    from ...distributed.functional import VocabParallelCrossEntropy

    _, reduction, ignore_index, _ = _ce_options(info)
    ranges = local_ranges(info.inputs[0].static(1), p, ctx.tp, ctx.rank)
    module = VocabParallelCrossEntropy(ctx.group, ranges, ignore_index, reduction)
    return module, (args[0], args[1]), {}


def _depthwise_channels(info: OpInfo) -> int | None:
    """The channel count of a depthwise ``conv1d`` (every channel its own group: Mamba's and the
    linear-attention mixers' causal convolution over the sequence), else None."""
    x, w = info.inputs[0], info.inputs[1]
    groups = info.args[6] if len(info.args) > 6 else info.kwargs.get("groups", 1)
    channels = w.static(0)
    if x.ndim != 3 or w.ndim != 3 or w.static(1) != 1 or channels is None or groups != channels \
            or x.static(1) != channels:
        return None
    return channels


@register(aten.conv1d.default)
def conv1d_rule(info: OpInfo, placements: tuple) -> list[Strategy]:
    """``conv1d(x [b, C, s], weight [C_out, C/groups, k], bias)``: a batch split of x passes
    through; a depthwise convolution (groups == C) splits by channel, x, weight and bias alike,
    each rank convolving its own channels (the localizer gives it its local group count)."""
    out = [Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)]
    px = placements[0]
    if is_shard(px) and px.dim == 0:
        out.append(Strategy((px,) + tuple(REPLICATE for _ in info.inputs[1:]), px))
    if _depthwise_channels(info) is not None:
        shard = next((p.with_dim(1) for p, dim in zip(placements, (1, 0, 0)) if is_shard(p) and p.dim == dim),
                     None) or info.fresh_shard(1)
        channels = _depthwise_channels(info)
        # every rank holds a channel: a convolution of zero groups does not run
        if shard is not None and all(local_size(channels, shard.with_dim(0), info.tp, r) for r in range(info.tp)):
            params = tuple(shard.with_dim(0) for _ in info.inputs[1:])
            out.append(Strategy((shard,) + params, shard))
    return out


@register_localizer(aten.conv1d.default)
def conv1d_localizer(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, ctx: LocalContext):
    px = strategy.inputs[0]
    channels = _depthwise_channels(info)
    if not (is_shard(px) and px.dim == 1) or channels is None:
        return info.target, args, kwargs
    args = list(args) + [None] * (7 - len(args))
    defaults = (None, None, None, [1], [0], [1], 1)
    args = [a if a is not None or i < 3 else defaults[i] for i, a in enumerate(args)]
    args[6] = ctx.local(channels, info.inputs[1].shape[0], px.with_dim(0))
    kwargs = {k: v for k, v in kwargs.items() if k != "groups"}
    return info.target, tuple(args), kwargs
