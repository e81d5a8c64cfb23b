"""The expert routing's kernels as a rank runs them: the router's ``topk``, a sort as the GPU's
radix sort, the small kernels around a rank's sort of its own rows (``route_locally``), every
expert's count taken from the exchange, and the counting pass that lays gathered rows out by
holder."""
from __future__ import annotations

from typing import Any

import sympy
import torch

from ..placements import Partial, Routed
from .work import NO_WORK, OpWork, RankOp, element_bytes

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
    (its rank's first row, gathered, plus the counter) and the order written by it (an
    ``arange`` scattered: the entries it writes)."""
    n = rows
    kernels = [
        ("elementwise", 8 * tp), ("elementwise", 8 * n + 8 * tp + n * tp),   # arange(tp), holder == rank
        ("reduction", 9 * n * tp),                                           # cumsum of the booleans
        ("elementwise", 24 * n), ("elementwise", 16 * n),                    # gather, - 1
        ("reduction", 16 * tp), ("elementwise", 24 * tp),                    # every rank's first row
        ("elementwise", 8 * tp + 16 * n), ("elementwise", 24 * n),           # its first row per row, + before
        ("elementwise", 8 * n), ("scatter", 24 * n),                         # order[place] = arange
    ]
    return OpWork(moved=tuple((cls, sympy.sympify(b)) for cls, b in kernels), launches=len(kernels))


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
        around = route_locally_work(n, experts, op.tp)
        moved += around.moved
        launches += around.launches
    return OpWork(moved=tuple(moved), launches=launches, passes=sort_passes(kb))


def routes_locally(op: RankOp) -> bool:
    """A sort of a rank's own router ids that the rank's program runs as ``route_locally``
    (``passes/rules/local_routing``: its counts' all-gather inside)."""
    return bool(op.in_place) and isinstance(op.in_place[0], Routed) and op.in_place[0].own \
        and any(kind == "all_gather" for kind, _ in op.strategy.internal)
