"""What a rank runs of an expert layer under expert parallelism: its own experts' rows, nothing else.

A rank holds a contiguous run of whole experts (``first``, ``count`` of them). A tensor of
(token, expert) rows placed ``Routed`` (autotp.placements.Routed) is held *compactly*: the
rank's local tensor has only the rows routed to its experts, and a *row map* (a 1-D int64
tensor, one global row id per local row) says which rows those are. The rows of every rank
together are each row once; scattered into zeros and summed over ranks (a g) they are the
whole tensor.

Under sequence parallelism the tokens themselves arrive as compact rows
(``Routed(tokens=True)``: a rank's ``b`` runs of ``s/tp`` flattened tokens, :func:`token_rows`,
every token's holder known from the shapes, :func:`token_owners`); an expert product reading
them first sends each (token, expert) row to its expert's rank (:class:`DispatchRows`, an
all-to-all planned once per layer by :func:`dispatch_plan` on the layer's one read to the host,
:func:`dispatch_sizes`; backward the reverse one), and the
next product may send its output rows back to their tokens' ranks on the same plan
(:class:`CombineRows`, the mirror), where each token's top-k rows are summed
(:func:`token_sums`). Token rows in sequence order are made whole by an all-gather along the
sequence (:func:`sequence_runs`).

The rewritten graph makes the row maps (:func:`expert_rows` for the rows a grouped product
sorted by expert, from the bounds :func:`expert_bounds` reads once per layer, which also gather
those rows alone where the model gathers every row for the product, :func:`gather_rows`; :func:`picked_rows`
for the rows whose expert id is the rank's own), runs the ops on the local rows (the reorder back
to token order by :func:`routed_permute` where the index is a permutation, the inverse of the sort
by expert: the rows stay as they are, renumbered, their count unread; :func:`routed_reorder`
for any other index), and leaves the region by :func:`routed_combine` (a token's top-k
rows summed straight into ``[tokens, ...]``: the Partial a g makes whole) or
:func:`routed_scatter` (the rows put back in place, zero elsewhere). Every function is plain
torch, differentiable through autograd: the gradient of a rank's experts comes from its rows
alone, and a replicated operand sliced to the rank's rows gets its gradient on those rows
(the f in front of it sums the ranks' rows).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .collectives import traced_as_now
from .comm import _comm
from .comm_modules import _CommModule
from .reads import host_ints, nonzero_rows


def expert_bounds(offs: torch.Tensor, first: int, count: int) -> tuple[int, int]:
    """The rows ``[start, end)`` of experts ``first .. first + count - 1`` among rows sorted by
    expert (``offs``: cumulative rows per expert). The one read to the host of an expert layer
    (two numbers, or one on the rank holding the first experts; a dispatching layer's bounds
    are read with its split sizes instead, :func:`dispatch_sizes`): the local rows' count sizes
    every tensor after it. The rewritten graph makes it once per layer; both products and the
    row map take it."""
    if count == 0:
        start = host_ints(offs[first - 1:first])[0] if first > 0 else 0
        return start, start
    if first == 0:
        return 0, host_ints(offs[count - 1:count])[0]
    start, end = host_ints(offs[first - 1:first + count:count])
    return start, end


def expert_rows(offs: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    """The row map of a grouped product's rows on this rank: ``arange(start, end)``, the rows
    of rows sorted by expert that its experts own (``bounds``: :func:`expert_bounds`)."""
    start, end = bounds
    return torch.arange(start, end, device=offs.device)


def gather_rows(x: torch.Tensor, index: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    """``x[index]`` at the rows ``[start, end)`` alone (``bounds``: :func:`expert_bounds`): the
    rows a grouped product of this rank's experts reads, gathered where the model gathers every
    (token, expert) row (transformers' ``hidden_states[perm // top_k]``)."""
    start, end = bounds
    return x[index[start:end]]


def picked_rows(index: torch.Tensor, first: int, count: int, total: int) -> torch.Tensor:
    """The row map of ``weight[index]`` on this rank: the positions of ``index`` (expert ids of
    ``total`` experts, negative ones counting from the end) naming one of its experts."""
    ids = torch.where(index < 0, index + total, index)
    return nonzero_rows((ids >= first) & (ids < first + count))


def routed_pick(weight: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, first: int,
                total: int) -> torch.Tensor:
    """``weight_full[index]`` at the rows ``rows`` only (``weight``: this rank's run of experts,
    the first of them expert ``first``): transformers' batched experts pick each (token,
    expert) row's matrices so; a rank copies its rows' matrices, not every row's."""
    ids = index.index_select(0, rows)
    return weight.index_select(0, torch.where(ids < 0, ids + total, ids) - first)


def routed_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, bounds: tuple[int, int],
                      first: int, count: int, op: str, x_routed: bool, **kwargs: Any) -> torch.Tensor:
    """A grouped product over this rank's experts only (``offs``: the cumulative rows per expert
    of every expert; ``weight``: the rank's run of experts; ``bounds``: its rows ``[start, end)``,
    :func:`expert_bounds`). ``x`` is every row sorted by expert (its rows ``[start, end)`` are
    taken, a view) or, ``x_routed``, the rank's rows already. Returns the rank's rows of the
    product, through the product the model's program uses (``op``, by name:
    ``"aten._grouped_mm.default"``)."""
    namespace, name, overload = op.split(".")
    target = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    start, end = bounds
    mine = x if x_routed else x[start:end]
    # no row routed to this rank's experts: no rows, still in autograd's graph. Under
    # torch.compile the count is an unbacked size, unknown while tracing: the product runs on
    # however many rows arrive (zero included: the products take zero rows), so only a rank
    # holding no expert (no groups at all) is decided here
    if count == 0 or guard_or_false(end == start):
        return mine.new_zeros(0, weight.shape[-1]) + (weight.sum() + mine.sum()) * 0
    return target(mine, weight, offs=offs[first:first + count] - start, **kwargs)


def take_rows(x: torch.Tensor, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """A replicated operand's rows ``rows`` along ``dim``: what meets a rank's rows in an op on
    rows alone (the routing weights, the tokens of a batched product)."""
    return x.index_select(dim, rows)


def _positions(have: torch.Tensor, want: torch.Tensor, size: int) -> torch.Tensor:
    """For each global row id in ``want``: its position in ``have`` (ids of ``size`` rows), or -1."""
    mark = torch.full((size,), -1, dtype=torch.long, device=have.device)
    mark[have] = torch.arange(have.numel(), device=have.device)
    return mark[want]


def match_rows(x: torch.Tensor, have: torch.Tensor, want: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x``'s rows (global ids ``have`` along ``dim``) in the order of the row map ``want``:
    two routed operands of one op (a bias picked by expert id, the product's rows) meet row by row.
    Under torch.compile nothing is read to the host (``torch.equal`` and the check would break
    the graph): the rows are always reordered, and rows the rank does not hold fail the device
    assertion in the graph."""
    if torch.compiler.is_compiling():
        where = _positions(have, want, size)
        torch._assert_async((where >= 0).all(), _OTHER_ROWS)
        return x.index_select(dim, where)
    if have.shape == want.shape and torch.equal(have, want):
        return x
    where = _positions(have, want, size)
    if bool((where < 0).any()):
        from ..errors import AutotpError

        raise AutotpError(_OTHER_ROWS)
    return x.index_select(dim, where)


_OTHER_ROWS = ("routed operands hold different rows on this rank: an op on rows alone met rows routed by two "
               "different expert assignments")


def routed_reorder(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, size: int,
                   count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_full[index]`` (rows reordered: transformers' inverse sort back to token order) on this
    rank's rows: (the local result, its row map). ``x``'s rows are ``rows`` of ``size``; the
    result holds the positions of ``index`` that name one of them, in ascending order. Their
    ``count`` where the host knows it already (a dispatching layer's, read with its split sizes,
    :func:`dispatch_sizes`): no read of its own; otherwise a ``nonzero``, whose size the host reads."""
    where = _positions(rows, index, size)
    held = where >= 0
    out_rows = nonzero_rows(held) if count is None else torch.nonzero_static(held, size=count).squeeze(1)
    return x.index_select(0, where.index_select(0, out_rows)), out_rows


def routed_permute(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, copy: bool) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """``x_full[index]`` on this rank's rows where ``index`` is a permutation of x's rows
    (transformers' inverse of the sort by expert): each of the rank's rows lands in one place,
    so the local result is x's rows as they are (a copy where the graph reads x again or writes
    the result), their row map where ``index`` sends them: no row counted, no read to the host."""
    inverse = torch.empty_like(index).scatter_(0, index, torch.arange(index.numel(), device=index.device))
    return (x.clone() if copy else x), inverse.index_select(0, rows)


def routed_scatter(x: torch.Tensor, rows: torch.Tensor, dim: int, span: int, shape: Sequence[int]) -> torch.Tensor:
    """The whole tensor of ``shape`` with this rank's rows in place and zero elsewhere (a routed
    value leaving the region as a plain Partial: a g sums the ranks' rows). ``span`` dims from
    ``dim`` on are the rows' dims (their ids count over them, row-major).

    A ``scatter`` by the row ids spread over x's shape, not ``index_copy``: autograd saves
    ``index_copy``'s source for its backward, and the model may write x in place after this
    conversion has read it (Mixtral's router sums its top-k weights, then divides them by the
    sum in place; under sequence parallelism the sum reads them through this scatter): backward
    then failed ("modified by an inplace operation"). ``scatter``'s backward gathers the
    gradient by the index alone."""
    shape = [int(s) for s in shape]
    rows_total = 1
    for s in shape[dim:dim + span]:
        rows_total *= s
    flat = shape[:dim] + [rows_total] + shape[dim + span:]
    index = rows.view([1] * dim + [-1] + [1] * (x.dim() - dim - 1)).expand(x.shape)
    return x.new_zeros(flat).scatter(dim, index, x).view(shape)


def routed_combine(x: torch.Tensor, rows: torch.Tensor, dim: int, group: int, shape: Sequence[int],
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum over each token's rows (``group`` consecutive row ids: a token's top-k experts),
    of this rank's rows alone, as the whole ``[tokens, ...]`` tensor of ``shape``: each row
    added into its token's place. Zero where the rank holds none of a token's rows: a Partial,
    which one g makes whole."""
    if dtype is not None:
        x = x.to(dtype)
    return x.new_zeros([int(s) for s in shape]).index_add(dim, torch.div(rows, group, rounding_mode="floor"), x)


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc`` on any device: CPU counts only floats. transformers' grouped experts count
    tokens per expert as floats on CPU and as ints elsewhere, and a later program, captured from
    the weightless meta twin, holds the int form; the counts are the same either way."""
    if x.dtype.is_floating_point or x.device.type != "cpu":
        return torch.histc(x, bins, min, max)
    return torch.histc(x.double(), bins, min, max).to(x.dtype)


def token_rows(x: torch.Tensor, dim: int, outer: Sequence[int], seq: int, tp: int, rank: int,
               unit: int = 1) -> torch.Tensor:
    """The row map of a rank's tokens under a sequence split, flattened: ``x`` is its
    ``[*outer, seq_local, ...]`` (split along ``dim`` in contiguous runs of ``unit``-element atoms,
    the first ``seq / unit % tp`` one atom longer), its rows ``o * seq + start + j`` for each outer
    index ``o`` and its ``j``-th position. Made once per shape and device, then reused by every
    later call and layer (:func:`_layout_cached`)."""
    shape = (tuple(map(int, outer)), int(seq), tp, unit) if _layout_cached(x) else None
    if shape is None:
        return _token_rows(x.device, outer, seq, tp, rank, unit, x.shape[dim])
    return _cached_token_rows(x.device, *shape, rank, int(x.shape[dim]), torch.is_inference_mode_enabled())


def token_owners(x: torch.Tensor, outer: Sequence[int], seq: int, tp: int, unit: int = 1) -> torch.Tensor:
    """The rank holding each of the ``prod(outer) * seq`` flattened tokens under a sequence split
    (contiguous runs of ``unit``-element atoms, the first ``seq / unit % tp`` one atom longer):
    every rank knows where every token is. Made once per shape and device, as :func:`token_rows`."""
    if not _layout_cached(x):
        return _token_owners(x.device, outer, seq, tp, unit)
    return _cached_token_owners(x.device, tuple(map(int, outer)), int(seq), tp, unit,
                                torch.is_inference_mode_enabled())


def _layout_cached(x: torch.Tensor) -> bool:
    """Whether a sequence split's row maps may come from the cache: they depend on the shapes,
    tp, the rank and the device alone, so a step's layers and every later call share one (12
    ATen calls a step, before: two arange, a repeat_interleave ... per program call). Not while
    torch.compile traces (the graph makes them, its sizes symbolic), nor for a fake or meta
    tensor (no real tensor to keep). Inference tensors are kept apart (they may not meet autograd)."""
    return type(x) is torch.Tensor and x.device.type != "meta" and not torch.compiler.is_compiling()


def _token_rows(device: torch.device, outer: Sequence[int], seq: int, tp: int, rank: int, unit: int,
                n: Any) -> torch.Tensor:
    atoms = seq // unit
    start = (rank * (atoms // tp) + min(rank, atoms % tp)) * unit
    count = 1
    for size in outer:
        count *= int(size)
    base = torch.arange(count, device=device).unsqueeze(1) * seq
    return (base + start + torch.arange(n, device=device)).reshape(-1)


def _token_owners(device: torch.device, outer: Sequence[int], seq: int, tp: int, unit: int) -> torch.Tensor:
    atoms = seq // unit
    sizes = torch.tensor([(atoms + tp - 1 - r) // tp * unit for r in range(tp)], device=device)
    of_position = torch.repeat_interleave(torch.arange(tp, device=device), sizes, output_size=seq)
    count = 1
    for size in outer:
        count *= int(size)
    return of_position.repeat(count)


@functools.lru_cache(maxsize=32)
def _cached_token_rows(device: torch.device, outer: tuple, seq: int, tp: int, unit: int, rank: int, n: int,
                       inference: bool) -> torch.Tensor:
    return _token_rows(device, outer, seq, tp, rank, unit, n)


@functools.lru_cache(maxsize=32)
def _cached_token_owners(device: torch.device, outer: tuple, seq: int, tp: int, unit: int,
                         inference: bool) -> torch.Tensor:
    return _token_owners(device, outer, seq, tp, unit)


def token_sums(x: torch.Tensor, rows: torch.Tensor, group: int,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over each token's rows (``group`` consecutive row ids: its top-k experts), where
    this rank holds every row of each of its tokens (rows back on their tokens' ranks after the
    combine's all-to-all): (the rank's tokens' sums, their token ids, ascending). Each token's
    rows are summed in top-k order, as the whole ``view(T, k, H).sum(1)`` does."""
    if dtype is not None:
        x = x.to(dtype)
    order = torch.argsort(rows)   # a token's rows next to each other, in top-k order
    tokens = x.shape[0] // group
    sums = x.index_select(0, order).view((tokens, group) + tuple(x.shape[1:])).sum(1)
    return sums, torch.div(rows.index_select(0, order[::group]), group, rounding_mode="floor")


def token_sums_in_order(x: torch.Tensor, rows: torch.Tensor, group: int,
                        dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_sums` where the row ids ``rows`` ascend (a rank routing its own rows puts
    them back in its tokens' order, ``out[inv]``): each token's rows are together already, in
    top-k order, so the same sums with no sort and no gather of the rows."""
    if dtype is not None:
        x = x.to(dtype)
    tokens = x.shape[0] // group
    sums = x.reshape((tokens, group) + tuple(x.shape[1:])).sum(1)
    return sums, torch.div(rows[::group], group, rounding_mode="floor")


def token_sum_owners(owners: torch.Tensor, group: int) -> torch.Tensor:
    """The holder of each token, from the holders of its rows (``group`` per token, one rank)."""
    return owners[::group]


def in_row_order(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x``'s rows in ascending order of their global ids ``rows``: a rank's tokens in sequence
    order, its ``b`` runs of ``s/tp`` positions (:func:`token_rows`)."""
    return x.index_select(0, torch.argsort(rows))


def sequence_runs(x: torch.Tensor, outer: Sequence[int]) -> torch.Tensor:
    """A rank's tokens' rows ``[b*s_r, ...]`` in sequence order (:func:`token_rows`) as its run of
    the sequence ``[b, s_r, ...]``: what an all-gather along the sequence makes whole, the
    variable runs of every rank known from ``s`` (the token rows' all-gather)."""
    return x.reshape(*map(int, outer), -1, *x.shape[1:])


# ---- the all-to-all dispatch: rows held by their tokens' ranks sent to their experts' ranks -------
class DispatchSizes(NamedTuple):
    """What the host must know of a dispatching expert layer, read at once (:func:`dispatch_sizes`),
    and the one device tensor its dispatch plan takes from the same count."""

    bounds: tuple   # the rows [start, end) of this rank's experts among the rows sorted by expert
    send: list      # rows this rank sends to each rank (its tokens' rows, by their experts' rank)
    recv: list      # rows it receives from each rank (its experts' rows, by their tokens' rank)
    dest: Any = None   # the rank of each sorted row's expert (a device tensor; not read)

    @property
    def sent(self) -> int:
        """How many (token, expert) rows of its tokens this rank holds (and sends)."""
        return sum(self.send)


def _expert_ranks(offs: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Where each rank's run of rows sorted by expert ends (``runs``: every rank's (first expert,
    experts), in order; ``offs``: the cumulative rows per expert): the rows of rank ``r``'s
    experts are ``[ends[r-1], ends[r])``. Where every rank holds as many experts, in rank order
    (tp divides the experts), the ends are ``offs`` at each run's last expert (a strided view of
    it, made contiguous: ``bucketize`` copies a boundary that is not, and warns), in place of a
    slice and a sum per rank (two ops a rank, every layer, every step)."""
    count = runs[0][1]
    if count and count * len(runs) == offs.numel() and all(r == (i * count, count) for i, r in enumerate(runs)):
        return offs.reshape(len(runs), count).select(1, count - 1).contiguous()
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.stack([counts[first:first + count].sum() for first, count in runs]).cumsum(0)


def dispatch_sizes(owners: torch.Tensor, offs: torch.Tensor, runs: Sequence[tuple[int, int]],
                   rank: int) -> DispatchSizes:
    """Everything the host must know of a dispatching expert layer, read to the host once (one
    ``tolist`` of ``2 + 2 * tp`` numbers): the bounds of this rank's experts' rows (what
    :func:`expert_bounds` reads for a layer that gathers), the rows it sends to each rank and
    receives from each (the split sizes of the rows' all-to-all; Megatron's and torchtitan's
    dispatchers read theirs too), and so how many rows of its tokens it holds (their sum).
    Every rank counts them itself from what it holds whole: ``owners``, the holder of each row
    sorted by expert, and ``offs``, the cumulative rows per expert (``runs``: every rank's
    (first expert, experts)); no exchange of counts. The reorder of its tokens' rows, both
    products, the dispatch, the combine back and their backwards reuse them; the dispatch plan
    the destination of each sorted row (``dest``, counted here once)."""
    tp = len(runs)
    ends = _expert_ranks(offs, runs)
    dest = torch.bucketize(torch.arange(owners.numel(), device=owners.device), ends, right=True)
    send = torch.zeros(tp, dtype=torch.long, device=owners.device).scatter_add_(0, dest, (owners == rank).long())
    recv = torch.zeros(tp, dtype=torch.long, device=owners.device).scatter_add_(0, owners, (dest == rank).long())
    start = ends[rank - 1] if rank else ends.new_zeros(())
    read = host_ints(torch.cat([start.view(1), ends[rank].view(1), send, recv]))
    return DispatchSizes((read[0], read[1]), read[2:2 + tp], read[2 + tp:], dest)


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any, op: str) -> torch.Tensor:
    """``x``'s rows, ``send[r]`` of them to rank ``r`` in turn, exchanged for ``recv[r]`` rows
    from each: a new tensor. Eager code calls c10d's all-to-all into a buffer it makes: the
    functional one wraps its output in an ``AsyncCollectiveTensor`` and runs its op and the wait
    through Python's dispatch (three ATen calls and about 0.2 ms of host time a call on one CPU
    thread, against one call; ``benchmarks/moe_rank.md``), for nothing eager needs. Under
    torch.compile, the functional one: the graph holds it as it is."""
    x = x.contiguous()
    with _comm(op, group):
        if torch.compiler.is_compiling():
            return funcol.wait_tensor(funcol.all_to_all_single(x, recv, send, group))
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, recv, send, group=group)
        return out


class DispatchPlan(NamedTuple):
    """How a layer's (token, expert) rows move between their tokens' ranks and their experts'
    ranks (:func:`dispatch_plan`): the dispatch sends them one way, the combine back the other.
    Each permutation is held with its inverse, so that both ways are a gather of rows
    (``index_select``), never a scatter into a fresh buffer (``index_copy``: 2-3x the time of
    the gather on CPU, and an allocation). ``order`` and ``unorder`` None: the rows are sent in the
    order the rank holds them (its own routing sorted them by expert, so by destination:
    ``expert_routing.local_dispatch_plan``), and neither side gathers them."""

    order: torch.Tensor | None     # this rank's token rows as it sends them: sorted by destination, then id
    unorder: torch.Tensor | None   # order's inverse: where each token row stands among the rows sent
    place: torch.Tensor     # the rows received, in the order they arrive, put in their experts' order
    arrival: torch.Tensor   # place's inverse: the experts' rows in the order they arrived
    send: list              # rows this rank sends to each rank (its tokens' rows)
    recv: list              # rows it receives from each rank (its experts' rows)


def _to_experts(x: torch.Tensor, plan: DispatchPlan, group: Any, what: str) -> torch.Tensor:
    """Rows of this rank's tokens (in ``plan.order``'s terms) to their experts' ranks."""
    sent = x if plan.order is None else x.index_select(0, plan.order)
    got = _all_to_all(sent, plan.send, plan.recv, group, what)
    return got.index_select(0, plan.place)


def _to_tokens(y: torch.Tensor, plan: DispatchPlan, group: Any, what: str) -> torch.Tensor:
    """Rows of this rank's experts (sorted by expert) back to their tokens' ranks, each landing
    in the row it left from: the exact reverse of :func:`_to_experts`."""
    got = _all_to_all(y.index_select(0, plan.arrival), plan.recv, plan.send, group, what)
    return got if plan.unorder is None else got.index_select(0, plan.unorder)


class _DispatchRows(torch.autograd.Function):
    """Forward: this rank's rows (``plan.order``: sorted by destination rank) to their experts'
    ranks, the rows received put in their experts' order (``plan.place``). Backward, the
    mirror: each row's gradient back to the rank that sent it (the reverse all-to-all), into its row."""

    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.plan, ctx.group = plan, group
        return _to_experts(x, plan, group, "all_to_all of rows (expert dispatch)")

    @staticmethod
    def backward(ctx, grad):
        return _to_tokens(grad, ctx.plan, ctx.group, "all_to_all of rows (expert dispatch, backward)"), None, None


class _CombineRows(torch.autograd.Function):
    """The dispatch's mirror (Megatron's token unpermutation, torchtitan's combine): forward, each
    of this rank's experts' output rows back to the rank of its token, into the row the dispatch
    sent it from; backward, each row's gradient to its expert's rank again (the dispatch)."""

    @staticmethod
    def forward(ctx, y, plan, group):
        ctx.plan, ctx.group = plan, group
        return _to_tokens(y, plan, group, "all_to_all of rows (expert combine)")

    @staticmethod
    def backward(ctx, grad):
        return _to_experts(grad, ctx.plan, ctx.group, "all_to_all of rows (expert combine, backward)"), None, None


def dispatch_plan(rows: torch.Tensor, owners: torch.Tensor, offs: torch.Tensor, runs: Sequence[tuple[int, int]],
                  sizes: DispatchSizes) -> DispatchPlan:
    """The all-to-all dispatch of an expert layer (Megatron's ``MoEAlltoAllTokenDispatcher``,
    torchtitan's expert parallel), planned: this rank holds rows of (token, expert) pairs
    sorted by expert (global ids ``rows``, ``owners``: every row's holder); each goes to the rank
    of its expert (``runs``: every rank's (first expert, experts); ``offs``: the cumulative rows
    per expert), and the rows of this rank's experts arrive in sorted order, the rows
    ``[start, end)`` :func:`routed_grouped_mm` takes as routed. Each rank sends its rows by
    destination, then id, so a receiver knows the order they arrive in: from each holder in
    turn, by id. Nothing is read here: the split sizes and bounds are the layer's one read
    (``sizes``, :func:`dispatch_sizes`), which the combine back (:class:`CombineRows`) and both
    backwards reuse."""
    total = owners.numel()
    # each row's destination, counted with the split sizes (one bucketize a layer, not two)
    dest = (sizes.dest if sizes.dest is not None
            else torch.bucketize(torch.arange(total, device=rows.device), _expert_ranks(offs, runs), right=True))
    dest = dest.index_select(0, rows)
    order = torch.argsort(dest * total + rows)
    start, end = sizes.bounds
    # the rows as they arrive: from each holder in turn, by id
    arrival = torch.argsort(owners[start:end], stable=True)
    return DispatchPlan(order, _inverse(order), _inverse(arrival), arrival, sizes.send, sizes.recv)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation ``perm`` (``out[perm[i]] = i``)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def dispatch_rows(x: torch.Tensor, plan: DispatchPlan, group: Any) -> torch.Tensor:
    """This rank's rows of its tokens (in the order of the plan's ``rows``) sent to their
    experts' ranks, :func:`dispatch_plan`'s rows of its experts received. Autograd-correct: the
    backward is the reverse all-to-all."""
    return _DispatchRows.apply(traced_as_now(x), plan, group)


def combine_rows(y: torch.Tensor, plan: DispatchPlan, group: Any) -> torch.Tensor:
    """The rows of this rank's experts (sorted by expert, as :func:`dispatch_rows` gave them)
    sent back to their tokens' ranks: the rank's token rows, in the order the dispatch took them.
    Autograd-correct: the backward is the dispatch's all-to-all."""
    return _CombineRows.apply(traced_as_now(y), plan, group)


class DispatchRows(_CommModule):
    """The all-to-all dispatch as a node of the rank's graph (:func:`dispatch_rows`), given the
    layer's :func:`dispatch_plan`."""

    kind = "all_to_all"

    def forward(self, x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return dispatch_rows(x, plan, self.group)


class CombineRows(_CommModule):
    """The combine by the reverse all-to-all as a node of the rank's graph (:func:`combine_rows`),
    given the plan of the layer's dispatch: no count read again."""

    kind = "all_to_all"

    def forward(self, y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return combine_rows(y, plan, self.group)
