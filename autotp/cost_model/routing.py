"""The expert routing's kernels as a rank runs them: the router's ``topk``, a sort as the GPU's
radix sort, the small kernels around a rank's sort of its own rows (``route_locally``), the
all-to-all dispatch's split sizes and plan (at the product that sends the rows, from whichever
routing ordered them), every expert's count taken from the exchange, and the counting pass that
lays gathered rows out by holder."""
from __future__ import annotations

from typing import Any

import sympy
import torch

from ..placements import Partial, Routed, Shard, local_size, max_local_size
from .work import NO_WORK, OpWork, RankOp, element_bytes, local_shape

#: bits of the key a radix sort's pass orders (CUB's onesweep sort, which ``torch.sort`` runs on a
#: GPU beyond a block's worth of keys: 8 passes for int64 keys, 4 for int32)
RADIX_BITS = 8


def topk_work(op: RankOp) -> OpWork:
    """``topk``: one kernel reads the scores and writes the values and their positions; backward
    (where the scores carry a gradient) a zero-filled tensor of the scores' size, then the
    values' gradient scattered into a copy of it by the positions
    (``value_selecting_reduction_backward``, an out-of-place ``scatter``: it reads the zeros, the
    positions and the values' gradient, and writes the scores' gradient)."""
    moved = [("reduction", op.b_in[0] + op.out_bytes)]
    if op.grad[0] and len(op.b_out) > 1:
        values, positions = op.b_out[0], op.b_out[1]
        moved += [("elementwise", op.b_in[0]), ("scatter", 2 * op.b_in[0] + positions + values)]
    return OpWork(moved=tuple(moved), launches=len(moved))


def route_locally_work(n: Any, experts: int, tp: int) -> OpWork:
    """The kernels :func:`autotp.distributed.expert_routing.route_locally` runs around its sort of
    a rank's ``n`` own ids (one run of the sequence, as the rank's program calls it), each with
    the bytes it reads and writes (int64 throughout): each sorted row's key (its run, ``//``,
    ``*``, ``+``), its count per expert (a zero fill, a fill of ones, a scatter-add reading and
    writing the entries it adds to), and, after the counts' all-gather (a collective, priced as
    one), every expert's total and offsets, the blocks' starts among every rank's rows and among
    the rank's own (sums, cumulative sums and differences of ``tp * experts`` and ``experts``
    numbers), and each sorted row's global id (an ``arange``, a gather of its block's shift, an
    add). The sort itself is :func:`sort_work`'s."""
    e, c = experts, tp * experts
    fill, ew, red = "elementwise", "elementwise", "reduction"
    kernels = [
        (ew, 16 * n), (ew, 16 * n), (ew, 24 * n),           # run = perm // n, run * experts, + ids
        (fill, 8 * e), (fill, 8 * n), ("scatter", 32 * n),   # zeros, ones_like, scatter_add_
        (red, 8 * c + 8 * e), (red, 16 * e),                # total = counts.sum, offs = total.cumsum
        (red, 16 * c), (ew, 24 * c),                        # blocks: exclusive cumsum over the ranks
        (ew, 24 * e), (ew, 16 * c + 8 * e),                 # + (offs - total)
        (red, 16 * e), (red, 16 * e), (ew, 24 * e),         # own.sum(0), its exclusive cumsum
        (red, 16 * e), (ew, 24 * e),                        # own's exclusive cumsum
        (ew, 24 * e), (ew, 24 * e),                         # local, shift = blocks[rank] - local
        (fill, 8 * n), (ew, 8 * e + 16 * n), (ew, 24 * n),  # arange(n) + shift[key]
    ]
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


def holders_order_work(rows: Any, tp: int) -> OpWork:
    """The counting pass :func:`autotp.distributed.gathered_rows.holders_order` runs on every rank
    over the ``rows`` gathered rows' int64 holders (in ``[0, tp)``), each kernel with the bytes it
    reads and writes: the holders compared with every rank (``tp`` booleans a row), counted
    cumulatively (``tp`` int64 counters a row), each row's counter picked (a gather reads the
    entries it picks), less one; every rank's first row from the last counters; each row's place
    (its rank's first row, gathered: the entries it picks, as every gather is priced, plus the
    counter) and the order written by it (an ``arange`` scattered: the entries it writes)."""
    n = rows
    kernels = [
        ("elementwise", 8 * tp), ("elementwise", 8 * n + 8 * tp + n * tp),   # arange(tp), holder == rank
        ("reduction", 9 * n * tp),                                           # cumsum of the booleans
        ("elementwise", 24 * n), ("elementwise", 16 * n),                    # gather, - 1
        ("reduction", 16 * tp), ("elementwise", 24 * tp),                    # every rank's first row
        ("elementwise", 24 * n), ("elementwise", 24 * n),                    # its first row per row, + before
        ("elementwise", 8 * n), ("scatter", 24 * n),                         # order[place] = arange
    ]
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


def gathered_rows_layout_work(rows: Any, full: Any, tp: int) -> OpWork:
    """The kernels :class:`autotp.distributed.gathered_rows.GatherRowsTP` runs on every rank over
    the ``rows`` (``T*k``) gathered rows, ``full`` their bytes: each sorted row's holder gathered
    (int64), their counting pass (:func:`holders_order_work`), and the rows all-gathered laid out
    in sorted order by one gather forward and the gradient in rank order by one backward (each
    reading its int64 positions and the rows it picks, all of them). The all-gather and the
    reduce-scatter are the internal collective's; the rank's own rows are :func:`gathered_rows_work`'s."""
    n = rows
    order = holders_order_work(n, tp)
    moved = ((("elementwise", sympy.sympify(24 * n)),) + order.moved
             + (("elementwise", sympy.sympify(8 * n + 2 * full)),) * 2)
    return OpWork(moved=moved, launches=1 + order.launches + 2)


def gathered_rows_work(op: RankOp) -> OpWork:
    """The kernels :class:`autotp.distributed.gathered_rows.GatherRowsTP` runs on a rank for its
    own tokens' rows (``op`` as :func:`autotp.passes.rules.gathered_rows.rank_rows_work` makes it:
    ``x`` the rank's ``t`` tokens, its ``m = T*k/tp`` rows out), each with the bytes it touches:
    the sorted positions of its rows' entries in the index gathered (int64), their tokens found
    among its own by a binary search (``searchsorted``: its tokens' ids and the ``m`` queries read,
    the positions written), its tokens' rows gathered by them (each gather reading the entries it
    picks); backward, where x carries a gradient, a zero fill of its tokens and the rows' gradient
    added into them (``index_add``). Where tp does not divide the sequence, the shift of the
    padded blocks (a fill per rank, a ``cat``, a gather, an add) and the rank's rows padded to the
    widest are left out: they run only then, and the planner's sequence is tp's multiple."""
    x, out = op.b_in[0], op.main_out
    t = local_shape(op.inputs[0], op.in_place[0], op.tp, op.rank, op.share)[0]   # the rank's tokens
    m = local_shape(op.outputs[0], op.out_place[0], op.tp, op.rank, op.share)[0]   # their rows
    ew = "elementwise"
    moved = [(ew, 24 * m), (ew, 8 * t + 16 * m), (ew, 8 * m + 2 * out)]   # index[mine], searchsorted, x[local]
    if op.grad[0]:
        moved += [(ew, x), ("scatter", 2 * x + 8 * m + out)]               # zeros, index_add
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in moved), launches=len(moved))


def local_dispatch_sizes_work(experts: int, tp: int, rank: int | None = None) -> OpWork:
    """The kernels :func:`autotp.distributed.expert_routing.local_dispatch_sizes` runs once a
    layer, each with the bytes it touches (int64 throughout): the rows every rank sends every
    rank (a zero fill of ``tp * tp``, the exchanged counts summed over the runs, added by the
    experts' holders: an ``index_add_`` reading and writing the whole table, the holders and the
    sums), the rows each rank's experts get and their ends (a sum, a cumulative sum), rank 0's
    start (a zero; another rank's is a view) and the numbers read to the host put together (a
    ``cat``). The experts' holders are made once per layout and reused (no kernel a step); the
    read itself is priced as the layer's one read (``rules/row_reads.host_reads``)."""
    e, t = experts, tp
    kernels = [
        ("elementwise", 8 * t * t), ("reduction", 16 * t * e),          # zeros, counts.sum(1)
        ("scatter", 16 * t * t + 8 * e + 8 * t * e),                     # index_add_ by the holders
        ("reduction", 8 * t * t + 8 * t), ("reduction", 16 * t),         # per_rank.sum(0).cumsum(0)
    ]
    if not rank:   # the largest rank's (rank 0's) start: a zero
        kernels.append(("elementwise", 8))
    kernels.append(("elementwise", 16 * (2 + 2 * t)))                  # cat of the numbers read
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


def received_rows(rows: Any, experts: int, tp: int, rank: int | None = None, share: float | None = None) -> Any:
    """The (token, expert) rows a rank's experts receive of a layer's ``rows``: ``c / experts``
    of them as uniform routing deals them (``c``: the largest rank's experts, or ``rank``'s), or
    ``share`` of them under a router's load (:mod:`autotp.planner.expert_load`: the busiest
    rank's share, or ``rank``'s, as ``RankOp.share`` takes it; a uniform load's is ``c /
    experts``). An all-to-all's dispatch plan sorts and indexes what arrives, so its kernels wait
    on the rank receiving most, as the dispatch's bytes do (``propagate.internal_bytes``)."""
    if share is not None:
        return rows * sympy.Float(share, 12)
    count = max_local_size(experts, Shard(0), tp) if rank is None else local_size(experts, Shard(0), tp, rank)
    return rows * count / experts


def local_dispatch_plan_work(rows: Any, experts: int, tp: int, rank: int | None = None,
                             share: float | None = None) -> OpWork:
    """The kernels :func:`autotp.distributed.expert_routing.local_dispatch_plan` runs once a
    layer for a rank of ``rows`` own (token, expert) rows, each with the bytes it touches (int64
    throughout). Its ``c`` experts (the largest rank's, or ``rank``'s) get ``tp * c`` blocks of
    rows, one a source rank and expert, and the rows :func:`received_rows` says of every rank's
    ``rows * tp`` (``rows * tp * c / experts`` as uniform routing deals them; ``share`` of them
    under a router's load): the blocks' starts and sizes (each a copy where ``c > 1``: a slice of a
    permuted table), the start subtracted, the sizes' cumulative sums, each arriving row's block
    found (``searchsorted``) and its place (two gathers of its block's start and offset, an add
    and a subtraction), and the arrival's inverse (an ``arange`` scattered: the entries it
    writes). The rows are sent in the order they lie: no order is made."""
    count = max_local_size(experts, Shard(0), tp) if rank is None else local_size(experts, Shard(0), tp, rank)
    b = tp * count                                     # blocks arriving
    got = received_rows(rows * tp, experts, tp, rank, share)   # rows arriving
    ew = "elementwise"
    kernels = [(ew, 16 * b)] * (2 if count > 1 else 0) + [
        (ew, 16 * b),                                   # at = blocks ... - start
        (ew, 8 * got), ("reduction", 16 * b),           # arange(received), size.cumsum
        (ew, 8 * b + 16 * got), (ew, 8 * b + 16 * got), (ew, 24 * got),   # searchsorted, at[block], + row
        ("reduction", 16 * b), (ew, 24 * b),            # the sizes' exclusive cumulative sum
        (ew, 8 * b + 16 * got), (ew, 24 * got),         # its entry at each row's block, subtracted
        (ew, 8 * got), ("scatter", 24 * got),           # the arrival's inverse
    ]
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


def dispatch_sizes_work(rows: Any, experts: int, tp: int, offs_bytes: int, rank: int | None = None) -> OpWork:
    """The kernels :func:`autotp.distributed.experts.dispatch_sizes` runs once a layer where the
    rows were sorted whole (every rank's ``rows`` (token, expert) rows, sorted by expert, with
    their holders), each with the bytes it touches: where the ranks end among the sorted rows
    (``_expert_ranks``: the cumulative counts at each run's last expert, a copy where a rank
    holds several experts; where tp does not divide the experts, every expert's count, a sum a
    rank and their cumulative sum, as ``int64``), each row's destination rank (an ``arange`` of
    every row, bucketized by the ends), the rows sent to each rank and received from each (each
    a zero fill, a comparison of every row's rank, its cast, a scatter-add reading and writing
    the entries it adds), rank 0's start (a zero of the ends' type; another rank's is a view),
    and the numbers read to the host put together (a ``cat``; the read itself is the layer's
    one read, ``rules/row_reads.host_reads``). ``offs_bytes``: the cumulative counts' element size."""
    n, t, e, ob = rows, tp, experts, offs_bytes
    count = max_local_size(experts, Shard(0), tp)
    ew = "elementwise"
    if count * tp == experts:
        kernels = [(ew, 2 * ob * t)] * (count > 1)                # the runs' ends made contiguous
        eb = ob
    else:   # counts = diff(offs, prepend=0): a zero, a cat, a subtraction; a sum a rank, stacked, cumsum
        sizes = [local_size(experts, Shard(0), tp, r) for r in range(tp)]
        kernels = [(ew, ob), (ew, ob + ob * e + ob * (e + 1)), (ew, 3 * ob * e)]
        kernels += [("reduction", ob * c + 8) for c in sizes]
        kernels += [(ew, 16 * t), ("reduction", 16 * t)]
        eb = 8
    kernels += [
        (ew, 8 * n), (ew, 16 * n + eb * t),                       # arange(rows), bucketize by the ends
        (ew, 8 * t), (ew, 9 * n), ("cast", 9 * n), ("scatter", 32 * n),   # send: zeros, owners == rank, .long()
        (ew, 8 * t), (ew, 9 * n), ("cast", 9 * n), ("scatter", 32 * n),   # recv: by the owners, dest == rank
    ]
    if not rank:   # rank 0's start: a zero
        kernels.append((ew, eb))
    kernels.append((ew, 2 * eb + 16 * t + 8 * (2 + 2 * t)))         # cat of the numbers read (int64)
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


def dispatch_plan_work(rows: Any, experts: int, tp: int, rank: int | None = None,
                       share: float | None = None) -> OpWork:
    """The kernels :func:`autotp.distributed.experts.dispatch_plan` runs once a layer where the
    rows were sorted whole, each with the bytes it touches (int64 throughout): of every rank's
    ``rows`` sorted rows, the rank's ``rows / tp`` token rows' destinations (an
    ``index_select`` of every row's, read whole), their sort key (``dest * rows + id``) and its
    sort, the arriving rows' holders sorted (a stable sort of the rows its experts get,
    :func:`received_rows`: ``rows * c / experts`` as uniform routing deals them to the largest
    rank's ``c`` experts, or ``rank``'s; ``share`` of them under a router's load), and both
    permutations' inverses (an ``arange`` scattered: the entries it writes). Both sorts are
    radix sorts (:func:`sort_bytes`, :func:`sort_passes` each)."""
    own = rows / tp                                    # the rank's token rows, sent
    got = received_rows(rows, experts, tp, rank, share)   # the rows its experts get
    ew = "elementwise"
    moved = [(ew, 8 * rows + 16 * own), (ew, 16 * own), (ew, 24 * own),   # dest[rows], * rows, + rows
             ("sort", sort_bytes(own, 8)), ("sort", sort_bytes(got, 8)),  # order, arrival
             (ew, 8 * own), ("scatter", 24 * own),                      # order's inverse
             (ew, 8 * got), ("scatter", 24 * got)]                      # arrival's inverse
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in moved),
                  launches=len(moved) + 2 * (sort_launches(8) - 1), passes=2 * sort_passes(8))


def dispatched_rows_work(full: Any, rows: Any, tp: int, share: float | None = None, grad: bool = True,
                         alone: bool = False) -> OpWork:
    """The row gathers around one all-to-all of an MoE layer's (token, expert) rows (the dispatch,
    or the combine back), as :func:`autotp.distributed.experts._to_experts` and ``_to_tokens`` run
    them on the rank whose experts receive most: the rows it sends put in the order they leave
    (an ``index_select`` by a permutation), and the rows it receives put in the order they go on
    in (another); each gather reads its rows and its int64 positions and writes the rows. Of the
    layer's ``rows`` rows (``full``: their bytes, all of them) the rank holds its tokens' ``1/tp``
    and receives its experts' ``share`` (the busiest rank's under a router's load,
    ``propagate.load_share``; a balanced router's ``1/tp`` where None), the same rows the
    all-to-all's bytes are priced at (``propagate.at_load``). Backward (``grad``) the reverse
    all-to-all runs the mirror: the same two gathers, each by the other permutation's inverse
    (``DispatchPlan``), never a scatter. ``alone``: the rank's own routing sorted its rows by
    expert, so by destination (``expert_routing.local_dispatch_plan``): they leave as they lie and
    come back into their places, with no gather of them."""
    own, got = rows / tp, (rows / tp if share is None else rows * sympy.Float(share, 15))
    row = full / rows                                   # bytes a row
    ew = "elementwise"
    leave = [] if alone else [(ew, 2 * row * own + 8 * own)]
    one_way = leave + [(ew, 2 * row * got + 8 * got)]   # what leaves; what arrives
    moved = one_way * (2 if grad else 1)
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in moved), launches=len(moved))


def dispatches(op: RankOp) -> bool:
    """A grouped product whose strategy sends its rows of tokens to their experts' ranks (the
    all-to-all dispatch, ``rules/dispatch_sizes.dispatches_tokens``): the op that makes the
    layer's split sizes and plan in the rank's program (``rules/routed_localizer``), once a
    layer, and so the op they are priced at, whichever routing ordered the rows. A rank that
    routed its own rows and sums them whole by a g, or a whole sort's reorder made whole by
    one, runs neither."""
    x = op.in_place[0] if op.in_place else None
    out = op.out_place[0] if op.out_place else None
    return op.tp > 1 and len(op.inputs) > 2 and isinstance(x, Routed) and x.tokens and x.span == 1 \
        and isinstance(out, Routed) and op.inputs[1].static(0) is not None


def dispatch_work(op: RankOp) -> OpWork:
    """The kernels a layer's dispatch plans with, once a layer at its dispatching product
    (:func:`dispatches`): where the rank routed its own rows (``Routed.alone``, a gather by its
    own sort's positions), the split sizes and plan from the counts its sort exchanged
    (:func:`local_dispatch_sizes_work`, :func:`local_dispatch_plan_work` of its ``T*k/tp`` own
    rows); where every row was sorted whole, from every row's holder
    (:func:`dispatch_sizes_work`, :func:`dispatch_plan_work` of the ``T*k`` rows; ``offs``' element
    size the product's). The plans' kernels on the rows that arrive take the rank's share of them
    under a router's load (``op.share``: the busiest rank's, or ``op.rank``'s); the split sizes
    count every row or every rank's counts, whatever the load."""
    experts = int(op.inputs[1].static(0))
    if op.in_place[0].alone:
        own = local_shape(op.inputs[0], op.in_place[0], op.tp, op.rank, op.share)[0]
        parts = (local_dispatch_sizes_work(experts, op.tp, op.rank),
                 local_dispatch_plan_work(own, experts, op.tp, op.rank, op.share))
    else:
        rows = op.inputs[0].shape[0]
        parts = (dispatch_sizes_work(rows, experts, op.tp, op.inputs[2].dtype.itemsize, op.rank),
                 dispatch_plan_work(rows, experts, op.tp, op.rank, op.share))
    return OpWork(moved=sum((w.moved for w in parts), ()), launches=sum(w.launches for w in parts),
                  passes=sum(w.passes for w in parts))


def reorders_rows(op: RankOp) -> bool:
    """``x[index]`` on routed rows by an index not known a permutation, its output the rank's
    rows again (``rules/routed_localizer``: transformers' ``h[perm // k]`` of a rank's tokens by
    the whole sort, made whole by a g or dispatched): the rank's program runs
    :func:`autotp.distributed.experts.routed_reorder`. Not the reorder by a permutation
    (``routed_permute``, ``kernels.permuted_rows_work``), the gather of a rank's own tokens'
    rows before their all-gather (``rules/gathered_rows``, ``GatherRowsTP``) or a gather of the
    rank's own routing (``rules/local_routing``, by its local positions): their own kernels."""
    from ..passes.rules.gathered_rows import gathers_rows
    from ..passes.rules.local_routing import owns

    x = op.in_place[0] if op.in_place else None
    out = op.out_place[0] if op.out_place else None
    return op.tp > 1 and len(op.inputs) == 2 and isinstance(x, Routed) and x.dim == 0 and isinstance(out, Routed) \
        and not op.info.permutes_rows and not gathers_rows(op.strategy) and not owns(op.strategy)


def routed_reorder_work(op: RankOp) -> OpWork:
    """The kernels :func:`autotp.distributed.experts.routed_reorder` runs on a rank (:func:`reorders_rows`),
    each with the bytes it touches: of the whole ``index`` (``n`` entries naming x's ``size``
    whole rows), the positions of the rank's ``r`` rows among them (a table of ``size`` int64
    filled with -1, an ``arange`` of the rank's rows written into it by their ids, the table read
    at every entry of the index), which entries name one of the rank's rows (a comparison of the
    ``n`` positions), their places (a ``nonzero`` of the ``n`` flags, or ``nonzero_static`` where
    a dispatching layer's split sizes give the count: the same bytes; the count's read to the host
    is priced apart, ``rules/row_reads.host_reads``), the positions at those places (a gather)
    and the rank's ``m`` rows gathered by them. Backward, where x carries a gradient: zeros of
    x's size and the rows' gradient added into them by the positions (``index_add``). Each
    gather reads the entries it picks, as a gather of rows is priced everywhere (``kernels``'
    gathers: serial's ``h[perm // k]`` among them)."""
    x, out = op.b_in[0], op.main_out
    r = local_shape(op.inputs[0], op.in_place[0], op.tp, op.rank, op.share)[0]    # the rank's rows of x
    size = op.inputs[0].shape[0]                                          # x's rows, whole
    n = op.inputs[1].shape[0]                                             # the index, whole
    m = local_shape(op.outputs[0], op.out_place[0], op.tp, op.rank, op.share)[0]   # the rank's rows of the result
    ew = "elementwise"
    moved = [(ew, 8 * size), (ew, 8 * r), ("scatter", 24 * r),            # mark = full(-1); mark[rows] = arange
             (ew, 24 * n), (ew, 9 * n),                                   # mark[index], >= 0
             ("reduction", n + 8 * m),                                    # nonzero: the places
             (ew, 24 * m), (ew, 2 * out + 8 * m)]                         # positions there; x's rows by them
    if op.grad[0]:
        moved += [(ew, x), ("scatter", 2 * x + 8 * m + out)]             # zeros, index_add_
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in moved), launches=len(moved))


def sums_token_rows(op: RankOp) -> bool:
    """A ``sum`` over a token's top-k rows held on its rank (``rules/routed._combine``): the
    rank's program sums them by :func:`autotp.distributed.experts.token_sums` (or
    ``token_sums_in_order``), its sums' rows the rank's tokens again."""
    p = op.in_place[0] if op.in_place else None
    out = op.out_place[0] if op.out_place else None
    return isinstance(p, Routed) and p.tokens and p.span > 1 and isinstance(out, Routed) and out.tokens


def token_sums_work(op: RankOp) -> OpWork:
    """A token's top-k rows summed on its rank, as run: the sum and each token's id (a division
    of its first row's id); where the rows do not lie in their ids' order (``Routed.ascending``,
    the rows a rank routed alone and put back in its tokens' order), first a sort of their int64
    ids (a radix sort of keys and positions), the rows gathered in that order and the ids picked
    (two ``index_select``), and backward the gather's gradient added into zeros (a fill, an
    ``index_add``). The gradient's spread back over the top-k rows is the view's (priced as
    nothing, as serial's)."""
    p = op.in_place[0]
    x, out = op.b_in[0], op.main_out
    group = 1
    for size in op.inputs[0].shape[p.dim + 1:p.dim + p.span]:
        group *= size
    shape = local_shape(op.inputs[0], p, op.tp, op.rank, op.share)
    rows = shape[p.dim] * group                       # the rank's rows
    tokens = shape[p.dim]
    moved = [("reduction", x + out), ("elementwise", 16 * tokens)]   # the sums, each token's id
    passes = 0
    if p.reordered and not p.ascending:
        moved += [("sort", sort_bytes(rows, 8)),
                  ("elementwise", 2 * x + 8 * rows),                 # the rows gathered by the order
                  ("elementwise", 8 * rows + 16 * tokens)]           # each token's first row's id
        passes = sort_passes(8)
        if op.grad[0] and op.outputs and op.outputs[0].is_float:
            moved += [("elementwise", x), ("scatter", 3 * x + 8 * rows)]   # zeros, index_add
    launches = len(moved) + (sort_launches(8) - 1 if passes else 0)
    return OpWork(moved=tuple(moved), launches=launches, passes=passes)


def counted_by_exchange(op: RankOp) -> bool:
    """A ``histc`` (or ``bincount``) of a rank's own sorted ids made whole with no collective of
    its own: the counts its sort exchanged (``passes/rules/local_routing``, ``routed_counts``): no kernel."""
    return bool(op.in_place) and isinstance(op.in_place[0], Routed) and op.in_place[0].own \
        and not isinstance(op.out_place[0], Partial) and not op.strategy.internal


def exchanged_counts_work(op: RankOp) -> OpWork:
    """A count made whole from the exchange (:func:`counted_by_exchange`), as ``routed_counts``
    runs it: the exchanged ``[tp, experts]`` int64 counts summed, and cast to the count's dtype
    (a histc's float; a bincount's int64 needs none)."""
    tp, experts = op.tp, op.n_out[0]
    moved = [("reduction", 8 * tp * experts + 8 * experts)]
    if op.outputs[0].dtype != torch.long:
        moved.append(("cast", 8 * experts + op.out_bytes))
    return OpWork(moved=tuple(moved), launches=len(moved))


def sort_passes(key_bytes: int) -> int:
    """Passes of a radix sort over keys of ``key_bytes`` (every bit of the key type: torch sorts
    the whole width, whatever range the values take)."""
    return -(-8 * key_bytes // RADIX_BITS)


def sort_bytes(n: Any, key_bytes: int, value_bytes: int = 8) -> Any:
    """Bytes a radix sort of ``n`` (key, value) pairs moves (the values: the int64 positions
    ``sort`` returns): one histogram pass reading the keys, then each pass reading and writing
    every key and value (:func:`sort_passes`)."""
    return n * key_bytes + sort_passes(key_bytes) * 2 * n * (key_bytes + value_bytes)


def sort_launches(key_bytes: int) -> int:
    """Kernels of a radix sort: the histogram, its exclusive sum, and one per pass."""
    return 2 + sort_passes(key_bytes)


def sort_work(op: RankOp, dtype_bytes: int, train_dtype: Any) -> OpWork:
    """``sort``/``argsort`` as a GPU runs it: a radix sort, several passes over every key and
    value (:func:`sort_bytes`) at the ``sort`` class's rate, each pass a kernel that also waits
    on the earlier tiles' counts (``passes``); a float input's gradient is scattered back by the
    positions (a scatter of the values' gradient)."""
    if not op.inputs:
        return NO_WORK
    n = op.n_in[0]
    kb = element_bytes(op.inputs[0].dtype, dtype_bytes, train_dtype)
    moved = [("sort", sort_bytes(n, kb))]
    launches = sort_launches(kb)
    if op.grad[0] and op.outputs and op.outputs[0].is_float:
        moved.append(("scatter", 2 * op.main_out + 8 * n))
        launches += 2
    experts = getattr(op.info, "routing_experts", 0)
    if experts and routes_locally(op):
        # the rank's own rows routed: the kernels around the sort (a dispatch's split sizes and
        # plan from its exchanged counts are the dispatching product's, dispatch_work: an
        # expert-TP layer that sums the rows by a g runs none)
        around = route_locally_work(n, experts, op.tp)
        moved += around.moved
        launches += around.launches
    return OpWork(moved=tuple(moved), launches=launches, passes=sort_passes(kb))


def routes_locally(op: RankOp) -> bool:
    """A sort of a rank's own router ids that the rank's program runs as ``route_locally``
    (``passes/rules/local_routing``: its counts' all-gather inside)."""
    return bool(op.in_place) and isinstance(op.in_place[0], Routed) and op.in_place[0].own \
        and any(kind == "all_gather" for kind, _ in op.strategy.internal)
