"""The all-to-all dispatch of an expert layer and the combine by the reverse all-to-all
(autotp/distributed/experts.py) against the whole tensors they stand for, on gloo ranks.

Hypothesis draws a batch of sequences split along the sequence (a rank's tokens: ``b`` runs of
``s/tp`` positions, the first ``s % tp`` one longer), top-k, experts (3 on 4 ranks: one holds
none) and every token's experts. Each rank holds its tokens' (token, expert) rows sorted by
expert; the dispatch must hand each rank exactly the rows of its experts, in sorted order, and
the combine must give each rank back the rows of its tokens as the dispatch took them, each
row's expert-side product applied. Backward, each side gets its rows' gradient of the whole
computation: the dispatch's backward is the combine's all-to-all and the other way round.
"""
from __future__ import annotations

import zlib

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.helpers import AtenOps, expert_runs

HIDDEN = 3


def _tensor(seed: int, shape, *key) -> torch.Tensor:
    """A float64 tensor determined by (seed, key): ranks and this process draw the same one."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seed,) + key).encode()))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def _whole(case: dict) -> dict:
    """The layer's routing, whole (what every rank computes alike from the routing it holds)."""
    gen = torch.Generator().manual_seed(case["seed"])
    tokens, k, experts = case["batch"] * case["seq"], case["k"], case["experts"]
    ids = torch.randint(0, experts, (tokens * k,), generator=gen)
    _, perm = torch.sort(ids, stable=True)
    offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0)
    h = _tensor(case["seed"], (tokens, HIDDEN), "h")
    scale = _tensor(case["seed"], (tokens * k, 1), "scale")   # an expert-side factor per sorted row
    grad = _tensor(case["seed"], (tokens * k, HIDDEN), "grad")   # the upstream gradient per sorted row
    return dict(perm=perm, offs=offs, h=h, scale=scale, grad=grad)


def _runs(case: dict) -> tuple[tuple[int, int], ...]:
    return expert_runs(case["experts"], case["tp"])


def run_dispatch_and_combine(case: dict) -> dict:
    """On each rank of its TP group: its token rows dispatched to their experts' ranks, scaled
    there, combined back; the rows and gradients each side ends with."""
    from autotp.distributed import experts as E
    from autotp.distributed.mesh import get_mesh

    mesh = get_mesh(case["tp"])
    group, rank, tp = mesh.tp_group, mesh.tp_rank, case["tp"]
    w = _whole(case)
    b, s, k = case["batch"], case["seq"], case["k"]
    mine = E.token_rows(torch.empty(b, (s + tp - 1 - rank) // tp), 1, [b], s, tp, rank)   # the rank's tokens
    owners = E.token_owners(w["h"], [b], s, tp)
    x = w["h"].index_select(0, mine).requires_grad_()
    # every sorted row's holder, the layer's one read (bounds, split sizes), and the rank's
    # (token, expert) rows in sorted order, counted by that read
    held = owners[w["perm"] // k]
    sizes = E.dispatch_sizes(held, w["offs"], _runs(case), rank)
    rows_x, rows = E.routed_reorder(x, w["perm"] // k, mine, b * s, sizes.sent)
    plan = E.dispatch_plan(rows, held, w["offs"], _runs(case), sizes)
    sent = E.dispatch_rows(rows_x, plan, group)
    sent.retain_grad()
    first, count = _runs(case)[rank]
    start, end = sizes.bounds
    # the same as a gathering layer's bounds (a rank with no expert: no rows either way), and
    # the same rows as the reorder counting them itself (a nonzero)
    gathering = E.expert_bounds(w["offs"], first, count)
    assert (start, end) == gathering if count else start == end and gathering[0] == gathering[1]
    assert torch.equal(rows, E.routed_reorder(x, w["perm"] // k, mine, b * s)[1])
    back = E.combine_rows(sent * w["scale"][start:end], plan, group)
    (back * w["grad"].index_select(0, rows)).sum().backward()
    return dict(rows=rows, bounds=(start, end), sent=sent.detach(), sent_grad=sent.grad, back=back.detach(),
                x_grad=x.grad, mine=mine)


@settings(max_examples=12, deadline=None)
@given(case=st.fixed_dictionaries(dict(
    tp=st.sampled_from([2, 4]), batch=st.integers(1, 3), seq=st.integers(1, 7), k=st.integers(1, 3),
    experts=st.integers(1, 5), seed=st.integers(0, 2**16))))
@example(case=dict(tp=4, batch=2, seq=9, k=2, experts=3, seed=1))   # a rank with no expert: sends all, gets none
def test_the_combine_returns_each_row_to_its_token_and_both_backwards_mirror(cluster, case):
    results = cluster.run(run_dispatch_and_combine, case)
    w = _whole(case)
    k = case["k"]
    gathered = w["h"][w["perm"] // k]                          # every (token, expert) row, sorted by expert
    rows_grad = w["grad"] * w["scale"]
    for got in results:
        start, end = got["bounds"]
        # the dispatch: the rank's experts' rows, in sorted order
        torch.testing.assert_close(got["sent"], gathered[start:end], rtol=0, atol=0)
        # the combine: the rank's tokens' rows back, in the order the dispatch took them, scaled
        torch.testing.assert_close(got["back"], (gathered * w["scale"]).index_select(0, got["rows"]), rtol=0, atol=0)
        # backward through the combine (the dispatch's all-to-all): the experts' side's rows
        torch.testing.assert_close(got["sent_grad"], rows_grad[start:end], rtol=0, atol=0)
        # and through the dispatch (the combine's all-to-all) to the rank's tokens, each token's k rows summed
        want = torch.zeros_like(w["h"]).index_add(0, w["perm"] // k, rows_grad).index_select(0, got["mine"])
        torch.testing.assert_close(got["x_grad"], want, rtol=1e-12, atol=1e-12)


def test_even_runs_of_experts_count_their_rows_off_the_cumulative_counts_without_a_sum_per_rank():
    # the dispatch plan's rows per rank: tp dividing the experts, each rank's rows are the
    # cumulative counts at its last expert (a view), not a slice and a sum per rank (16 scalar
    # sums a step in benchmarks/moe_rank.md's Mixtral dispatch); uneven runs keep the sums
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotp.distributed.experts import _expert_ranks

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    counts = torch.tensor([3, 0, 5, 2, 7, 1, 0, 4])
    offs = counts.cumsum(0)
    for runs in (((0, 2), (2, 2), (4, 2), (6, 2)), tuple((r, 1) for r in range(8)),
                 ((0, 3), (3, 3), (6, 2)), ((0, 4), (4, 4), (8, 0))):
        with Ops() as ops:
            ends = _expert_ranks(offs, runs)
        want = torch.stack([counts[a:a + n].sum() for a, n in runs])
        assert torch.equal(ends, want.cumsum(0))
        even = len({n for _, n in runs}) == 1
        assert ("sum" in ops.names) is not even, (runs, ops.names)


def _dispatched_on_fake_rank(case: dict):
    """Rank 0 of ``case``'s routing on the fake backend (world of 2): its rows dispatched, scaled,
    combined back and their backward, with the ATen ops each way ran."""
    import torch.distributed as dist

    from autotp.distributed import experts as E

    w, (b, s, k) = _whole(case), (case["batch"], case["seq"], case["k"])
    mine = E.token_rows(torch.empty(b, (s + 1) // 2), 1, [b], s, 2, 0)
    held = E.token_owners(w["h"], [b], s, 2)[w["perm"] // k]
    x = w["h"].index_select(0, mine).requires_grad_()
    sizes = E.dispatch_sizes(held, w["offs"], _runs(case), 0)
    rows_x, rows = E.routed_reorder(x, w["perm"] // k, mine, b * s, sizes.sent)
    plan = E.dispatch_plan(rows, held, w["offs"], _runs(case), sizes)
    with AtenOps() as forward:
        back = E.combine_rows(E.dispatch_rows(rows_x, plan, dist.group.WORLD) * 2, plan, dist.group.WORLD)
    with AtenOps() as backward:
        back.sum().backward()
    return forward.names, backward.names


def test_the_dispatch_and_the_combine_gather_rows_and_call_one_all_to_all_each_way(fake_rank):
    # each permutation of the plan is held with its inverse: rows are gathered (index_select) both
    # ways, never scattered into a fresh buffer (index_copy: 4 a layer a step, 2.7 ms of the
    # Qwen3 dispatch rank's step in benchmarks/moe_rank.md); and eager code calls c10d's
    # all-to-all, one ATen call, not the functional one (its op, _wrap_tensor_autograd and
    # wait_tensor, about 0.2 ms of host time each call on one CPU thread)
    case = dict(tp=2, batch=2, seq=8, k=2, experts=4, seed=3)
    for names in _dispatched_on_fake_rank(case):
        assert "index_copy" not in names and "new_empty" in names, names
        assert not [n for n in names if "_c10d_functional" in n], names
        assert names.count("c10d.alltoall_base_") == 2, names   # the dispatch's and the combine's
        assert names.count("index_select") == 4, names


def test_the_dispatch_counts_each_rows_destination_once_against_a_contiguous_boundary(monkeypatch):
    # the split sizes and the dispatch plan both need the rank each sorted row goes to: counted
    # once a layer (dispatch_sizes), not again in dispatch_plan (a second _expert_ranks and
    # bucketize a layer, every step), and against a contiguous boundary (the even runs' ends are
    # a strided view of offs: bucketize copied it on every call, and warned)
    from autotp.distributed import experts as E

    calls = []
    plain = torch.bucketize

    def bucketize(values, boundaries, **kwargs):
        calls.append(boundaries.is_contiguous())
        return plain(values, boundaries, **kwargs)

    monkeypatch.setattr(torch, "bucketize", bucketize)
    for case in (dict(tp=4, batch=2, seq=6, k=2, experts=8, seed=5), dict(tp=3, batch=2, seq=5, k=2, experts=4, seed=1)):
        w, (b, s, k), tp = _whole(case), (case["batch"], case["seq"], case["k"]), case["tp"]
        held = E.token_owners(w["h"], [b], s, tp)[w["perm"] // k]
        rows = torch.nonzero(held == 0).squeeze(1)   # rank 0's token rows, ids among the sorted rows
        calls.clear()
        sizes = E.dispatch_sizes(held, w["offs"], _runs(case), 0)
        plan = E.dispatch_plan(rows, held, w["offs"], _runs(case), sizes)
        assert calls == [True], calls
        ends = torch.cat([torch.zeros(1, dtype=torch.long), w["offs"]])[[a + n for a, n in _runs(case)]]
        dest = plain(rows, ends, right=True)
        assert torch.equal(plan.order, torch.argsort(dest * held.numel() + rows))
        assert plan.send == [int((dest == r).sum()) for r in range(tp)]


def test_a_sequence_splits_row_maps_are_made_once_for_every_layer_and_call():
    # token_rows and token_owners depend on the shapes, tp, the rank and the device alone: made
    # once, then every layer of every later call takes the same tensors, no ATen call (12 a call
    # before); inference mode keeps its own (an inference tensor may not meet autograd)
    from autotp.distributed import experts as E

    local = torch.empty(3, 4)
    with AtenOps() as first:
        rows = E.token_rows(local, 1, [3], 7, 2, 0)
        owners = E.token_owners(local, [3], 7, 2)
    with AtenOps() as again:
        assert E.token_rows(local, 1, [3], 7, 2, 0) is rows and E.token_owners(local, [3], 7, 2) is owners
    assert first.names and again.names == [], (first.names, again.names)
    assert torch.equal(rows, torch.tensor([0, 1, 2, 3, 7, 8, 9, 10, 14, 15, 16, 17]))
    assert torch.equal(owners, torch.tensor([0, 0, 0, 0, 1, 1, 1] * 3))
    other = E.token_rows(torch.empty(3, 3), 1, [3], 7, 2, 1)   # the other rank's run: its own map
    assert torch.equal(other, torch.tensor([4, 5, 6, 11, 12, 13, 18, 19, 20]))
    with torch.inference_mode():
        inferred = E.token_rows(local, 1, [3], 7, 2, 0)
    assert inferred is not rows and inferred.is_inference() and not rows.is_inference()
    assert not E.token_rows(torch.empty(3, 4, device="meta"), 1, [3], 7, 2, 0) is \
        E.token_rows(torch.empty(3, 4, device="meta"), 1, [3], 7, 2, 0)   # nothing kept of a meta tensor
