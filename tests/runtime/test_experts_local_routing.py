"""The all-to-all dispatcher's routing from a rank's own rows (autotp/distributed/expert_routing.py)
against the whole routing it stands for, on gloo ranks.

Hypothesis draws a batch of sequences split along the sequence (a rank's tokens: ``b`` runs of
``s/tp`` positions, the first ``s % tp`` one longer; a rank may hold none), top-k, experts (uneven
runs of them, a rank with none where they are fewer than the ranks) and every token's experts.
Each rank sorts and counts its own rows, exchanges the counts, and must then know what the whole
routing says of it: the offsets, each of its rows' place among every row sorted by expert (a
stable sort's), the layer's one read (bounds, split sizes) and the dispatch plan; its rows sent
by that plan arrive as the rows of its experts in sorted order.
"""
from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.helpers import AtenOps, expert_runs

HIDDEN = 3


def _whole(case: dict) -> dict:
    """The layer's routing, whole: every token's expert ids, sorted stably, counted."""
    gen = torch.Generator().manual_seed(case["seed"])
    tokens, k, experts = case["batch"] * case["seq"], case["k"], case["experts"]
    # a few experts get no row at all where the draw says so (ids from a subset)
    used = torch.randperm(experts, generator=gen)[:max(1, experts - case["idle"])]
    ids = used[torch.randint(0, used.numel(), (tokens * k,), generator=gen)]
    _, perm = torch.sort(ids, stable=True)
    offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0)
    h = torch.randn((tokens, HIDDEN), generator=gen, dtype=torch.float64)
    return dict(ids=ids, perm=perm, offs=offs, h=h)


def _runs(case: dict) -> tuple[tuple[int, int], ...]:
    return expert_runs(case["experts"], case["tp"])


def route_on_each_rank(case: dict) -> dict:
    """On each rank: its own rows routed locally (sort, counts, their exchange), the read and the
    plan made from that, its rows sent by the plan; and the whole routing's read and plan."""
    from autotp.distributed import expert_routing as R
    from autotp.distributed import experts as E
    from autotp.distributed.mesh import get_mesh

    mesh = get_mesh(case["tp"])
    group, rank, tp = mesh.tp_group, mesh.tp_rank, case["tp"]
    w, (b, s, k) = _whole(case), (case["batch"], case["seq"], case["k"])
    mine = E.token_rows(torch.empty(b, (s + tp - 1 - rank) // tp), 1, [b], s, tp, rank)   # the rank's tokens
    flat = (mine.unsqueeze(1) * k + torch.arange(k)).reshape(-1)     # its (token, expert) rows, token order
    routing = R.route_locally(w["ids"].index_select(0, flat), b, case["experts"], group, tp, rank)
    sizes = R.local_dispatch_sizes(routing, _runs(case), rank)
    plan = R.local_dispatch_plan(routing, _runs(case), rank, sizes)
    x = w["h"].index_select(0, flat.index_select(0, routing.perm) // k)   # its rows, sorted by expert
    sent = E.dispatch_rows(x, plan, group)
    # the whole routing's (every row's holder, the read, the rank's rows and their plan)
    held = E.token_owners(w["h"], [b], s, tp)[w["perm"] // k]
    whole_sizes = E.dispatch_sizes(held, w["offs"], _runs(case), rank)
    whole_rows = torch.nonzero(held == rank).squeeze(1)
    whole_plan = E.dispatch_plan(whole_rows, held, w["offs"], _runs(case), whole_sizes)
    return dict(routing=routing, flat=flat, sizes=sizes, plan=plan, sent=sent, whole_sizes=whole_sizes,
                whole_rows=whole_rows, whole_plan=whole_plan)


@settings(max_examples=10, deadline=None)
@given(case=st.fixed_dictionaries(dict(
    tp=st.sampled_from([2, 3, 4]), batch=st.integers(1, 3), seq=st.integers(1, 9), k=st.integers(1, 3),
    experts=st.integers(1, 7), idle=st.integers(0, 3), seed=st.integers(0, 2**16))))
@example(case=dict(tp=4, batch=2, seq=9, k=2, experts=3, idle=0, seed=1))   # a rank with no expert
@example(case=dict(tp=3, batch=3, seq=2, k=2, experts=5, idle=2, seed=7))   # a rank with no token, idle experts
def test_a_rank_routing_its_own_rows_knows_what_the_whole_routing_says(cluster_of, case):
    results = cluster_of(case["tp"]).run(route_on_each_rank, case)
    w = _whole(case)
    place = torch.empty_like(w["perm"]).scatter_(0, w["perm"], torch.arange(w["perm"].numel()))
    gathered = w["h"][w["perm"] // case["k"]]
    for got in results:
        routing = got["routing"]
        # the exchanged counts give every expert's rows, and each own row its stable sorted place
        assert torch.equal(routing.offs, w["offs"])
        assert torch.equal(routing.rows, place.index_select(0, got["flat"].index_select(0, routing.perm)))
        assert torch.equal(routing.rows, got["whole_rows"])   # the rank's rows, ascending
        # the one read and the plan: the whole routing's
        assert got["sizes"][:3] == got["whole_sizes"][:3]
        for name in ("place", "arrival", "send", "recv"):
            mine, whole = getattr(got["plan"], name), getattr(got["whole_plan"], name)
            assert (torch.equal(mine, whole) if isinstance(mine, torch.Tensor) else mine == whole), name
        # its rows leave as they lie (no gather by an order): the whole routing's order is the identity on them
        assert got["plan"].order is None and got["plan"].unorder is None
        assert torch.equal(got["whole_plan"].order, torch.arange(routing.rows.numel()))
        # its experts' rows arrive, in sorted order
        start, end = got["sizes"].bounds
        torch.testing.assert_close(got["sent"], gathered[start:end], rtol=0, atol=0)


def count_on_each_rank(case: dict) -> dict:
    """On each rank, the ATen ops of routing its own rows and planning the dispatch, and the
    host reads they make."""
    from autotp.distributed import expert_routing as R
    from autotp.distributed.mesh import get_mesh

    mesh = get_mesh(case["tp"])
    group, rank, tp = mesh.tp_group, mesh.tp_rank, case["tp"]
    w, (b, s, k) = _whole(case), (case["batch"], case["seq"], case["k"])
    mine = (s + tp - 1 - rank) // tp                                   # its positions of each sequence
    start = sum((s + tp - 1 - r) // tp for r in range(rank))
    ids = w["ids"].view(b, s * k)[:, start * k:(start + mine) * k].reshape(-1)   # its rows' ids, token order
    n = ids.numel()
    reads = []
    plain = R.host_ints
    R.host_ints = lambda values: reads.append(values.numel()) or plain(values)
    try:
        R.local_dispatch_sizes(R.route_locally(ids, b, case["experts"], group, tp, rank), _runs(case), rank)
        reads.clear()   # a layer of a later step: the experts' holders made once, reused
        with AtenOps() as ops:
            routing = R.route_locally(ids, b, case["experts"], group, tp, rank)
            sizes = R.local_dispatch_sizes(routing, _runs(case), rank)
            R.local_dispatch_plan(routing, _runs(case), rank, sizes)
    finally:
        R.host_ints = plain
    return dict(ops=ops.seen, reads=reads, rows=n, received=sum(sizes.recv))


def test_the_sort_and_the_counts_run_on_a_ranks_own_rows_not_every_token(cluster_of):
    # the whole routing sorts and counts b*s*k rows on every rank (transformers' sort and histc,
    # then dispatch_sizes' bucketize and scatter of every sorted row); routing its own, a rank's
    # sort and counts see its b*s/tp*k rows, the exchange b*experts counts a rank, and nothing
    # passes over more rows than its own or its experts' received ones; one read to the host
    case = dict(tp=4, batch=2, seq=64, k=2, experts=8, idle=0, seed=11)
    whole = case["batch"] * case["seq"] * case["k"]
    for got in cluster_of(4).run(count_on_each_rank, case):
        ops = dict(got["ops"])
        assert got["rows"] == whole // 4
        assert [r for name, r in got["ops"] if name == "sort"] == [got["rows"]], got["ops"]
        assert [r for name, r in got["ops"] if name == "scatter_add_"] == [got["rows"]], got["ops"]
        assert "bucketize" not in ops and "histc" not in ops, got["ops"]
        assert max(r for _, r in got["ops"]) <= max(got["rows"], got["received"], case["tp"] * case["batch"] * 8)
        assert max(r for _, r in got["ops"]) < whole
        assert got["reads"] == [2 + 2 * case["tp"]]
        assert "lift_fresh" not in ops, got["ops"]   # no copy from the host a layer (the experts' holders)


def _products(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each expert's rows (``offs``: cumulative rows per expert of ``weight``'s experts) times its
    matrix: the grouped product, as transformers' fallback computes it."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ weight[e])
        start = end
    # a rank holding no expert: no rows, still in autograd's graph (its backward all-to-alls run)
    return torch.cat(out) if out else x.new_zeros(0, weight.shape[-1]) + (x.sum() + weight.sum()) * 0


def _layer(case: dict, dtype=torch.float64) -> dict:
    """An expert layer's inputs (every token's hidden state, top-k ids and weights, the experts'
    matrices, the output's upstream gradient), drawn alike on every rank."""
    w = _whole(case)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    tokens, k = case["batch"] * case["seq"], case["k"]
    return dict(ids=w["ids"], h=torch.randn(tokens, HIDDEN, generator=gen, dtype=dtype),
                weights=torch.rand(tokens, k, generator=gen, dtype=dtype),
                experts=torch.randn(case["experts"], HIDDEN, 2, generator=gen, dtype=dtype),
                grad=torch.randn(tokens, 2, generator=gen, dtype=dtype))


def serial_layer(case: dict, dtype=torch.float64) -> dict:
    """transformers' grouped experts on every token: sort (not stable), gather, products, routing
    weights, back to token order, each token's k rows summed; the outputs and every gradient."""
    L, k = _layer(case, dtype), case["k"]
    h, weights, experts = (L[n].clone().requires_grad_() for n in ("h", "weights", "experts"))
    ids_g, perm = torch.sort(L["ids"])
    offs = torch.cumsum(torch.bincount(ids_g, minlength=case["experts"]), 0)
    y = _products(h[perm // k], experts, offs) * weights.reshape(-1)[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    out = y[inv].view(h.shape[0], k, -1).sum(1)
    (out * L["grad"]).sum().backward()
    return dict(out=out.detach(), h=h.grad, weights=weights.grad, experts=experts.grad)


def local_layer_on_each_rank(case: dict) -> dict:
    """The same layer on each rank from its own tokens alone: its rows sorted and counted
    locally, the counts exchanged, its rows dispatched to their experts' ranks, its experts'
    products, the rows combined back, weighted and summed per token, all in its local terms."""
    from autotp.distributed import expert_routing as R
    from autotp.distributed import experts as E
    from autotp.distributed.mesh import get_mesh

    mesh = get_mesh(case["tp"])
    group, rank, tp = mesh.tp_group, mesh.tp_rank, case["tp"]
    L, (b, s, k) = _layer(case), (case["batch"], case["seq"], case["k"])
    mine = E.token_rows(torch.empty(b, (s + tp - 1 - rank) // tp), 1, [b], s, tp, rank)
    first, count = _runs(case)[rank]
    h = L["h"].index_select(0, mine).requires_grad_()
    weights = L["weights"].index_select(0, mine).requires_grad_()
    experts = L["experts"][first:first + count].clone().requires_grad_()
    ids = L["ids"].view(-1, k).index_select(0, mine).reshape(-1)
    # the rows numbered as a stable sort of every token's would (per run of the sequence), or
    # rank-major within an expert (one run: what a rank knowing nothing of the batch can number)
    routing = R.route_locally(ids, b if case.get("stable", True) else 1, case["experts"], group, tp, rank)
    sizes = R.local_dispatch_sizes(routing, _runs(case), rank)
    plan = R.local_dispatch_plan(routing, _runs(case), rank, sizes)
    start, _ = sizes.bounds
    sent = E.dispatch_rows(h[routing.perm // k], plan, group)
    y = _products(sent, experts, routing.offs[first:first + count] - start)
    back = E.combine_rows(y, plan, group) * weights.reshape(-1)[routing.perm].unsqueeze(-1)
    inv = torch.empty_like(routing.perm)
    inv[routing.perm] = torch.arange(routing.perm.numel())
    out = back[inv].view(h.shape[0], k, back.shape[-1]).sum(1)
    (out * L["grad"].index_select(0, mine)).sum().backward()
    return dict(mine=mine, experts_at=(first, count), out=out.detach(), h=h.grad, weights=weights.grad,
                experts=experts.grad)


@settings(max_examples=8, deadline=None)
@given(case=st.fixed_dictionaries(dict(
    tp=st.sampled_from([2, 3, 4]), batch=st.integers(1, 3), seq=st.integers(1, 9), k=st.integers(1, 3),
    experts=st.integers(1, 7), idle=st.integers(0, 3), seed=st.integers(0, 2**16), stable=st.booleans())))
@example(case=dict(tp=3, batch=2, seq=64, k=2, experts=5, idle=0, seed=2, stable=True))   # torch.sort not stable
@example(case=dict(tp=3, batch=2, seq=64, k=2, experts=5, idle=0, seed=2, stable=False))  # ... rank-major
@example(case=dict(tp=4, batch=2, seq=9, k=2, experts=3, idle=1, seed=1, stable=True))    # a rank with no expert
def test_an_expert_layer_routed_from_each_ranks_own_rows_equals_serial(cluster_of, case):
    # forward and every gradient, float64: the rows of an expert reach it in a stable order where
    # the serial sort's may differ; each row's product is the same, the expert's weight gradient
    # sums its rows in another order (rounding alone)
    want = serial_layer(case)
    for got in cluster_of(case["tp"]).run(local_layer_on_each_rank, case):
        first, count = got["experts_at"]
        for name in ("out", "h", "weights"):
            torch.testing.assert_close(got[name], want[name].index_select(0, got["mine"]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["experts"], want["experts"][first:first + count], rtol=1e-12, atol=1e-12)


def test_a_sequence_splits_flat_rows_are_made_once_and_reused():
    # the row map of a rank's tokens' top-k rows flattened (rules/local_routing's flatten): made
    # from the token rows' layout once per shape, device and top-k, then reused by every later
    # call and layer as the token rows are (3 kernels a step each call, before)
    from autotp.distributed.expert_routing import flat_rows, token_flat_rows
    from autotp.distributed.experts import token_rows
    from tests.cost_model.kernel_counts import KernelCounter

    for rank in range(3):
        x = torch.zeros(2, 3 if rank < 2 else 2, 4)   # [b, s/tp, h]: seq 8 at tp 3, the first two ranks one longer
        want = flat_rows(token_rows(x, 1, [2], 8, 3, rank), 2)
        torch.testing.assert_close(token_flat_rows(x, 1, [2], 8, 3, rank, 1, 2), want, rtol=0, atol=0)
        with KernelCounter(fills=("arange",)) as later:
            again = token_flat_rows(x, 1, [2], 8, 3, rank, 1, 2)
        assert later.launches == 0, later.calls
        torch.testing.assert_close(again, want, rtol=0, atol=0)
