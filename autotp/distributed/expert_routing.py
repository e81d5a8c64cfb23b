"""The all-to-all dispatcher's routing from a rank's own (token, expert) rows alone.

Under sequence parallelism a rank holds its tokens (``b`` runs of ``s/tp`` positions,
autotp.distributed.experts.token_rows) and, after its router's top-k, their ``k`` expert ids
each. transformers' grouped experts sort every (token, expert) row by expert (``sort``) and count
rows per expert (``histc``, ``cumsum``: the grouped product's ``offs``); the dispatch of
autotp.distributed.experts (:func:`~autotp.distributed.experts.dispatch_sizes`,
:func:`~autotp.distributed.experts.dispatch_plan`) numbers the rows by that global sorted order,
which every rank computes whole from every token's ids.

Here a rank routes only its share (Megatron's ``MoEAlltoAllTokenDispatcher``, DeepSeek's EP
dispatcher): it sorts its own rows by expert, counts them per (run of the sequence, expert),
and exchanges those counts (an all-gather of ``b * experts`` numbers a rank, the only
collective). From every rank's counts it knows, with no pass over another rank's rows:

* ``offs``, the cumulative rows per expert of every rank's rows (the grouped product's offsets);
* where each of its rows stands among every row sorted by expert, numbered as a *stable* sort of
  the whole ids would number it (by expert, then token, then top-k slot), so its rows map onto
  the same global row ids the rest of the expert layer uses (:func:`route_locally`);
* the split sizes of the dispatch and the bounds of its experts' rows, read to the host at once
  (:func:`local_dispatch_sizes`, the same :class:`~autotp.distributed.experts.DispatchSizes`
  the whole count gives);
* the order in which its experts' rows arrive from each rank, so that it lays them out by expert
  (:func:`local_dispatch_plan`, the same
  :class:`~autotp.distributed.experts.DispatchPlan` as the whole count's).

No tensor here has more rows than the rank's own rows or the rows its experts receive; the
whole path sorts, counts and buckets ``b * s * k`` rows on every rank.

Within an expert the rows are in stable order. The serial model's ``torch.sort`` (not stable)
may order an expert's rows otherwise (on CPU it does for 100 to about 10**5 ids): each row's
products are the same, but the expert's weight gradient sums its rows in another order (float
rounding alone: ``tests/runtime/test_experts_local_routing.py``).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import torch

from .comm_modules import _CommModule
from .gather_scatter import _gather_into
from .experts import DispatchPlan, DispatchSizes, _cached_token_rows, _inverse, _layout_cached, token_rows
from .reads import host_ints


class LocalRouting(NamedTuple):
    """A rank's own (token, expert) rows sorted by expert, placed among every rank's
    (:func:`route_locally`)."""

    perm: torch.Tensor     # the rank's flat rows (token-major, then top-k slot) sorted by expert: a local sort's indices
    experts: torch.Tensor  # the sorted rows' expert ids (the local sort's values)
    rows: torch.Tensor     # each sorted row's global row id among every row sorted by expert (stable; one run: rank-major)
    offs: torch.Tensor     # the cumulative rows per expert of every rank's rows
    counts: torch.Tensor   # [tp, runs, experts]: every rank's rows per (run of the sequence, expert), exchanged
    blocks: torch.Tensor   # [runs, tp, experts]: the global row id where each (run, rank, expert) block starts


def _exclusive(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The exclusive cumulative sum along ``dim`` (what comes before each entry)."""
    return x.cumsum(dim) - x


def route_locally(ids: torch.Tensor, runs: int, experts: int, group: Any, tp: int, rank: int) -> LocalRouting:
    """The rank's (token, expert) rows sorted by expert and numbered among every rank's.

    ``ids``: the expert id (in ``[0, experts)``) of each of the rank's rows, flattened in token
    order: its ``runs`` runs of the sequence (a batch's ``b``), each of its ``s_r`` tokens' ``k``
    ids (``ids.numel() == runs * s_r * k``). Every rank's runs interleave in the whole token
    order (run ``o`` of rank 0, then of rank 1, ..., then run ``o + 1``), so a row's place among
    every row of its expert is the rows of that expert in earlier (run, rank) pairs plus the
    rank's own before it: the counts per (run, expert), exchanged, say the first; the local
    sort the second. The global row ids equal a stable sort's of the whole ids.

    ``runs=1`` (a rank that does not know the batch) numbers an expert's rows rank-major
    instead (rank 0's, then rank 1's, each in its token order): another order of rows within an
    expert, as valid for the dispatch and the products (each row's product is the same; the
    expert's weight gradient sums its rows in that order), and only ``experts`` counts a rank
    to exchange (Megatron's dispatcher lays its rows out so)."""
    ids = ids.reshape(-1)
    n = ids.numel()
    experts_sorted, perm = torch.sort(ids, stable=True)
    # each sorted row's run of the sequence (its rows are runs * s_r * k in token order)
    per_run = n // runs if runs else 0
    run = perm // per_run if per_run else torch.zeros_like(perm)
    key = run * experts + experts_sorted
    mine = torch.zeros(runs * experts, dtype=torch.long, device=ids.device)
    mine.scatter_add_(0, key, torch.ones_like(key))
    # the exchange: every rank's counts per (run, expert), [tp, runs, experts]
    counts = _gather_into(mine, group, "all_gather of routed rows per expert (expert dispatch counts)",
                          tp=tp).view(tp, runs, experts)
    total = counts.sum((0, 1))                       # every rank's rows per expert
    offs = total.cumsum(0)
    # where each (run, rank, expert) block starts among every row sorted by expert: past every
    # row of earlier experts and of its expert's earlier (run, rank) pairs (the whole token order)
    blocks = _exclusive(counts.transpose(0, 1).reshape(runs * tp, experts), 0).view(runs, tp, experts) \
        + (offs - total)
    # ... and among the rank's own sorted rows: past its rows of earlier experts and earlier runs
    own = counts[rank]
    local = _exclusive(own.sum(0), 0) + _exclusive(own, 0)
    # a sorted row's global id: its local position, shifted from its block's local start to its global one
    shift = (blocks.select(1, rank) - local).reshape(-1)
    rows = torch.arange(n, device=ids.device) + shift.index_select(0, key)
    return LocalRouting(perm, experts_sorted, rows, offs, counts, blocks)


def _rank_of_experts(runs_of_ranks: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The rank holding each expert (``runs_of_ranks``: every rank's (first expert, experts), in
    expert order). It depends on the runs and the device alone: made once and reused by every
    layer and step (a copy from the host each time, before), not while torch.compile traces (the
    graph makes it) nor on the meta device; inference tensors apart, as the token maps'."""
    # the graph's constant (pairs of ints) made hashable without a Python frame: a generator over
    # the pairs was ten Python calls a layer and call at tp 8
    runs = tuple(map(tuple, runs_of_ranks))
    if torch.compiler.is_compiling() or device.type == "meta":
        return _holders(runs, device)
    return _cached_holders(runs, device, torch.is_inference_mode_enabled())


def _holders(runs: tuple, device: torch.device) -> torch.Tensor:
    counts = [count for _, count in runs]
    sizes = torch.tensor(counts, device=device)
    # the length given: a size known here, not read from ``sizes`` (under torch.compile a read
    # of data is a graph break, and on a GPU a host sync)
    return torch.repeat_interleave(torch.arange(len(runs), device=device), sizes, output_size=sum(counts))


@functools.lru_cache(maxsize=32)
def _cached_holders(runs: tuple, device: torch.device, inference: bool) -> torch.Tensor:
    return _holders(runs, device)


def local_dispatch_sizes(routing: LocalRouting, runs_of_ranks: Sequence[tuple[int, int]],
                         rank: int) -> DispatchSizes:
    """The layer's one read to the host (:func:`autotp.distributed.experts.dispatch_sizes`'s
    numbers), from the exchanged counts: the bounds of this rank's experts' rows among the rows
    sorted by expert, the rows it sends to each rank (its rows of that rank's experts) and
    receives from each (that rank's rows of its experts)."""
    tp = len(runs_of_ranks)
    counts = routing.counts
    holder = _rank_of_experts(runs_of_ranks, counts.device)
    per_rank = torch.zeros((tp, tp), dtype=torch.long, device=counts.device)
    # [source rank, destination rank]: rows each rank sends to each
    per_rank.index_add_(1, holder, counts.sum(1))
    ends = per_rank.sum(0).cumsum(0)
    start = ends[rank - 1] if rank else ends.new_zeros(())
    read = host_ints(torch.cat([start.view(1), ends[rank].view(1), per_rank[rank], per_rank[:, rank]]))
    return DispatchSizes((read[0], read[1]), read[2:2 + tp], read[2 + tp:])


def local_dispatch_plan(routing: LocalRouting, runs_of_ranks: Sequence[tuple[int, int]], rank: int,
                        sizes: DispatchSizes) -> DispatchPlan:
    """The dispatch of the rank's rows, in the order :func:`route_locally` sorted them (by
    expert, so by destination, then global id: already the order they are sent in), to their
    experts' ranks, laid out there by expert. A rank's experts' rows arrive from each rank in
    turn, each rank's in its sorted order; where each lands among the rows ``[start, end)`` of
    its experts is known from the exchanged counts alone: rank ``q``'s rows of expert ``e`` in
    run ``o`` are one block, at the rows of ``e`` before them (earlier (run, rank) pairs).
    The plan :func:`autotp.distributed.experts.dispatch_plan` makes from the whole routing."""
    counts = routing.counts
    first, count = runs_of_ranks[rank]
    start, _ = sizes.bounds
    # the blocks of the rank's experts as they arrive: by source rank, then expert, then run
    # ([tp, count, runs]), where each starts among the rank's experts' rows
    at = routing.blocks.permute(1, 2, 0)[:, first:first + count].reshape(-1) - start
    size = counts.permute(0, 2, 1)[:, first:first + count].reshape(-1)
    received = sum(sizes.recv)
    # each arriving row's block (a search of the blocks' ends: no size read from the device)
    row = torch.arange(received, device=counts.device)
    block = torch.searchsorted(size.cumsum(0), row, right=True)
    arrival = at.index_select(0, block) + row - _exclusive(size, 0).index_select(0, block)
    # the rows leave in the order they lie (by expert, so by destination) and come back into it
    return DispatchPlan(None, None, _inverse(arrival), arrival, sizes.send, sizes.recv)


# ---- what a rank's program runs for the ops of the routing (autotp/passes/rules/local_routing.py) ----
def flat_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The row map of a rank's tokens' ``[rows, k]`` flattened to ``[rows * k]``: token ``t``'s
    ``k`` entries are the global flat rows ``t * k .. t * k + k - 1`` (ascending where ``rows`` is)."""
    return (rows.unsqueeze(1) * k + torch.arange(k, device=rows.device)).reshape(-1)


def token_flat_rows(x: torch.Tensor, dim: int, outer: Sequence[int], seq: int, tp: int, rank: int, unit: int,
                    k: int) -> torch.Tensor:
    """:func:`flat_rows` of a sequence split's tokens' row map
    (:func:`~autotp.distributed.experts.token_rows` of the same arguments): made once per shape,
    device and top-k, then reused by every later call and layer as that map is (3 kernels a step,
    before)."""
    if not _layout_cached(x):
        return flat_rows(token_rows(x, dim, outer, seq, tp, rank, unit), k)
    return _cached_flat_rows(x.device, tuple(map(int, outer)), int(seq), tp, unit, rank, int(x.shape[dim]), k,
                             torch.is_inference_mode_enabled())


@functools.lru_cache(maxsize=32)
def _cached_flat_rows(device: torch.device, outer: tuple, seq: int, tp: int, unit: int, rank: int, n: int, k: int,
                      inference: bool) -> torch.Tensor:
    return flat_rows(_cached_token_rows(device, outer, seq, tp, unit, rank, n, inference), k)


def flat_tokens(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The global token ids of a rank's tokens from its flat rows' map (:func:`flat_rows`)."""
    return flat.view(-1, k)[:, 0] // k


def sorted_locally(routing: LocalRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort``'s (values, indices) of the rank's own flat expert ids, from its routing."""
    return routing.experts, routing.perm


def routed_counts(routing: LocalRouting, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's rows per expert (``histc`` of every token's ids), from the exchanged counts:
    no pass over any row."""
    return routing.counts.sum((0, 1)).to(dtype)


def own_arange(routing: LocalRouting, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``arange`` over the rank's own flat rows (what ``arange(T * k)`` numbers whole)."""
    return torch.arange(routing.perm.numel(), device=routing.perm.device,
                        dtype=dtype if dtype is not None else torch.long)


def sorted_pick(weight: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor, first: int) -> torch.Tensor:
    """``stack[ids_sorted]`` at the rows ``rows`` of every row sorted by expert (``offs``: the
    cumulative rows per expert, every rank's; ``weight``: the rank's run of experts, the first
    expert ``first``): each row's expert is the first whose end lies past it, so no rank needs
    every row's id (gpt-oss's biases, picked where the rank routed its own rows)."""
    experts = torch.searchsorted(offs.to(rows.dtype), rows, right=True)
    return weight.index_select(0, experts - first)


def gathered_histc(x: torch.Tensor, bins: int, low: float, high: float, group: Any, tp: int) -> torch.Tensor:
    """``histc`` of every rank's rows from each rank's own: the ranks' histograms all-gathered
    and summed (counts of whole rows: exact in any order)."""
    from .experts import histc

    mine = histc(x, bins, low, high)
    return _gather_into(mine, group, "all_gather of routed rows' histograms", tp=tp).view(tp, -1).sum(0)


class RouteLocally(_CommModule):
    """:func:`route_locally` as a node of the rank's graph (its one collective, the counts'
    all-gather, numbered and agreed as any)."""

    kind = "all_gather"

    def __init__(self, group: Any, runs: int, experts: int, tp: int, rank: int) -> None:
        super().__init__(group)
        self.runs, self.experts, self.tp, self.rank = runs, experts, tp, rank

    def forward(self, ids: torch.Tensor) -> LocalRouting:
        return route_locally(ids, self.runs, self.experts, self.group, self.tp, self.rank)


class GatheredHistc(_CommModule):
    """:func:`gathered_histc` as a node of the rank's graph."""

    kind = "all_gather"

    def __init__(self, group: Any, bins: int, low: float, high: float, tp: int) -> None:
        super().__init__(group)
        self.bins, self.low, self.high, self.tp = bins, low, high, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gathered_histc(x, self.bins, self.low, self.high, self.group, self.tp)
