"""Peers that mirror the measured rank, for one rank of tp=N timed alone on torch's ``fake`` backend.

On the fake process-group backend a rank runs alone: its collectives return at once and move
nothing real. What they leave behind (torch 2.13's ``FakeProcessGroup``, checked in
``tests/test_fake_peers.py``): an all-gather fills every rank's block with this rank's own
input (the peers *mirror* the rank); a reduce-scatter returns the input's first block; an
all-reduce returns the input as it is; an all-to-all fills the block received from each peer
with the first rows of this rank's send buffer.

That is enough to size a rank's compute everywhere but one place: a tensor held as a rank's
own *token rows* (the tokens of a sequence split, flattened: ``Routed(tokens=True)``: the
router's top-k ids and weights, or the tokens themselves, under sequence parallelism) made whole by scattering the rows
into zeros and all-reducing (``autotp/distributed/experts.routed_scatter`` then a g). Alone,
the all-reduce leaves the peers' tokens zero: every peer's token routed to expert 0, so rank 0
of an expert-parallel layer would receive every peer's rows and the others none.

:func:`mirrored_peers` makes that all-reduce's result what the fake all-gather already makes of
a sequence shard: every peer holds its tokens routed as this rank's are (this rank's rows
written at each peer's positions, ``tp`` copies along the sequence). Then, on rank 0:

* the expert ids and routing weights of every token are real-sized, the routing of the same
  tokens the gathering layouts see where the rest of the plan is the same (their router runs on
  the fake all-gather's ``tp`` copies; other collectives before it can leave other values);
* the all-to-all dispatch (``autotp/distributed/experts.dispatch_rows``) counts, from that
  routing, the rows it receives from each peer: the rows its own tokens send its own experts,
  once per peer (never a fixed count); the fake all-to-all then fills each peer's block with
  the first rows of the rank's send buffer, which are sorted by destination rank, so on rank 0
  they are exactly those rows. Backward, the reverse all-to-all's blocks have the right sizes;
  their values are the rank's first rows again (real numbers, not the peers' gradients).

What it does not emulate: a peer's own draw of routing (the peers' loads are copies of this
rank's, so the rank's experts get ``tp`` times its own tokens' rows for them: its share with
its own tokens' imbalance, not the average over ranks), and the time the collectives take
(none is run). The benchmark reports the rank's product FLOPs against its share, which says
how far its experts' rows were from the even share in each run.

One case the fake backend refuses: an all-to-all whose send buffer is empty while it expects rows
from a peer (``alltoall_base: inputBuffer is empty``). Under the mirror that is the combine of a
rank whose experts got no row of its own tokens (so none of any peer's): it has nothing to send
back, and its tokens' rows come from the peers' experts, which it never computes. The fake
backend would fill them with the first rows of the send buffer; with no such rows,
:func:`mirrored_peers` fills them with zeros instead (one write of the rows received, as the
fake copy of them costs). The rank's product FLOPs then say its experts did nothing that step.

Since the rewrite all-gathers a rank's token rows along the sequence where it must make them
whole (``autotp/passes/rewrite.gather_tokens``), the fake all-gather mirrors them by itself: the
rank runs its real program there, and the mirrored scatter stands only for a scatter and
all-reduce the real program runs. (Before 2026-11-29 the patch hid the row map's function from
the rewrite, which then fell back to a scatter and an all-reduce of those rows, logged as "holds
token rows without their sequence's row map": the benchmark's rank ran a program the real one
does not, its mirroring counted in the rank's figure.)

Only the benchmarks use this (and its test): it patches four names of autotp's rewrite while the rank's programs
are written (the graph's nodes keep the functions they were made with), and needs every rank's
sequence run of equal length (``seq % tp == 0``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

#: how many token-row tensors the mirrored scatter made whole (forward calls)
EMULATED = {"scatters": 0}
#: autotp's own functions, while patched (set by :func:`mirrored_peers`)
_PLAIN: dict = {}


def _token_rows(x: torch.Tensor, dim: int, outer: Sequence[int], seq: int, tp: int, rank: int,
                unit: int = 1) -> torch.Tensor:
    rows = _PLAIN["token_rows"](x, dim, outer, seq, tp, rank, unit)
    rows._fake_peers = (int(seq), tp, rank, unit)   # the map of a sequence split's tokens, as made
    return rows


class _Mirrored(torch.autograd.Function):
    """Forward: the whole ``[outer * tp * run, ...]`` tensor with this rank's ``[outer * run,
    ...]`` rows at every rank's positions (one write of the whole, as the real scatter's zeros
    and its rows). Backward: the rank's own rows of the gradient (the real scatter's backward,
    the all-reduce's being the identity): the emulation costs what the scatter it stands for
    costs, so it does not weigh on the timing."""

    @staticmethod
    def forward(ctx, x, rows, tp, run):
        ctx.save_for_backward(rows)
        rest = tuple(x.shape[1:])
        outer = x.shape[0] // run
        return x.reshape(outer, 1, run, *rest).expand(outer, tp, run, *rest).reshape(outer * tp * run, *rest)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None, None


def _mirrored_scatter(x: torch.Tensor, rows: torch.Tensor, dim: int, span: int, shape: Sequence[int]) -> torch.Tensor:
    routed_scatter = _PLAIN["routed_scatter"]
    layout = getattr(rows, "_fake_peers", None)
    if layout is None:   # rows of experts: the rank's own, zero elsewhere, as on a real world
        return routed_scatter(x, rows, dim, span, shape)
    seq, tp, rank, unit = layout
    if seq % tp or unit != 1 or dim != 0 or span != 1:
        raise ValueError(f"mirrored peers need equal sequence runs (seq {seq}, tp {tp}) and token rows along "
                         f"dim 0 (got dim {dim}, span {span})")
    EMULATED["scatters"] += 1
    # each peer p holds its positions [p*run, (p+1)*run) of every sequence: this rank's rows there
    return _Mirrored.apply(x, rows, tp, seq // tp).view([int(s) for s in shape])


def _all_to_all(x: torch.Tensor, send: list, recv: list, group, op: str) -> torch.Tensor:
    if x.shape[0] == 0 and sum(recv) > 0:   # nothing to send, rows expected: the peers' rows, zero
        return x.new_zeros((sum(recv),) + tuple(x.shape[1:]))
    return _PLAIN["all_to_all"](x, send, recv, group, op)


@contextlib.contextmanager
def mirrored_peers() -> Iterator[None]:
    """While a rank's programs are written (``parallelize`` and its first call) and run: make the
    whole of every token-row tensor as if every peer routed its tokens as this rank does, and an
    all-to-all with nothing to send return the rows it expects as zeros."""
    from autotp.distributed import experts as E
    from autotp.passes import rewrite

    saved = E.token_rows, rewrite.token_rows, rewrite.routed_scatter, E._all_to_all
    _PLAIN.update(token_rows=E.token_rows, routed_scatter=rewrite.routed_scatter, all_to_all=E._all_to_all)
    # the rewrite knows a sequence split's row map by its function: patched there too, so the rank
    # all-gathers its token rows as its real program does (the fake all-gather mirrors them), and
    # falls back to the mirrored scatter only where the real one would scatter
    E.token_rows, rewrite.token_rows, rewrite.routed_scatter, E._all_to_all = \
        _token_rows, _token_rows, _mirrored_scatter, _all_to_all
    try:
        yield
    finally:
        E.token_rows, rewrite.token_rows, rewrite.routed_scatter, E._all_to_all = saved


@contextlib.contextmanager
def fake_rank(rank: int, tp: int) -> Iterator[None]:
    """While inside: the default process group is torch's fake backend as ``rank`` of ``tp``
    (the one before it, a fake world's rank, is put back after). Nothing in the fake world or the
    mirror is rank 0's alone: a rank's expert-parallel experts are its own Shard(0) of the stacks;
    under sequence parallelism its tokens are its run of each sequence (the fake reduce-scatter
    returns the first block's values, the same size); the mirrored peers copy whichever rank runs.
    A rank program made inside must be dropped before it ends (its group is destroyed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    before = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    if before == (rank, tp):
        yield
        return
    if before is not None:
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        if before is not None:
            dist.init_process_group("fake", rank=before[0], world_size=before[1], store=FakeStore())
