"""A rank's rows of experts (autotp/distributed/experts.py) against the whole tensors they stand for.

Hypothesis draws tokens, top-k, experts, ranks (more than experts too: ranks without one) and
an expert for every (token, slot) row. For each rank the row-map functions give its rows; the
ranks' results, put in place and summed (what a g does), equal the whole computation: the
grouped product over the rows sorted by expert, the pick of each row's matrix, the reorder back
to token order and the sum of a token's top-k rows, forward and backward.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

from autotp.placements import Shard, local_ranges
from autotp.distributed import experts as E


def _grouped_mm(x, w, offs):
    """The whole grouped product, one expert at a time (transformers' fallback does the same)."""
    out, start = x.new_zeros(x.shape[0], w.shape[-1]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _run(experts: int, tp: int, rank: int) -> tuple[int, int]:
    ((start, stop),) = local_ranges(experts, Shard(0), tp, rank) or ((0, 0),)
    return start, stop - start


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 6), k=st.integers(1, 3), experts=st.integers(1, 5), tp=st.integers(1, 4),
       seed=st.integers(0, 2**16), permute=st.booleans())
def test_ranks_rows_add_up_to_the_whole(tokens, k, experts, tp, seed, permute):
    """The reorder back to token order either way: any index, its rows found and counted
    (``routed_reorder``), or the inverse of the sort, a permutation, the rows kept as they are and
    renumbered (``routed_permute``: no count of the rank's rows read)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, out = 3, 4
    ids = torch.randint(0, experts, (tokens * k,), generator=gen)
    weight = torch.randn(experts, hidden, out, dtype=torch.float64, generator=gen)
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=gen)
    sorted_ids, perm = torch.sort(ids)
    offs = torch.cumsum(torch.bincount(sorted_ids, minlength=experts), 0).to(torch.int32)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())

    def whole(x, weight):
        rows = _grouped_mm(x[perm // k], weight, offs)           # (T*k, out), sorted by expert
        return rows[inverse].view(tokens, k, out).sum(1)         # back in token order, top-k summed

    def rank_part(x, weight, rank):
        first, count = _run(experts, tp, rank)
        bounds = E.expert_bounds(offs, first, count)
        mine = E.expert_rows(offs, bounds)
        rows = E.routed_grouped_mm(x[perm // k], weight[first:first + count], offs, bounds, first, count,
                                   "transformers.grouped_mm_fallback.default", False)
        if permute:
            rows, back = E.routed_permute(rows, inverse, mine, copy=False)
        else:
            rows, back = E.routed_reorder(rows, inverse, mine, tokens * k)
        return E.routed_combine(rows, back, 0, k, [tokens, out])

    xw = (x.clone().requires_grad_(), weight.clone().requires_grad_())
    want = whole(*xw)
    want.square().sum().backward()
    parts = [(x.clone().requires_grad_(), weight.clone().requires_grad_()) for _ in range(tp)]
    got = sum(rank_part(px, pw, r) for r, (px, pw) in enumerate(parts))
    # a g: every rank's loss sees the whole output, so each rank's gradient is its own rows' share
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(px.grad for px, _ in parts), xw[0].grad, rtol=1e-12, atol=1e-12)
    for rank, (_, pw) in enumerate(parts):
        first, count = _run(experts, tp, rank)
        torch.testing.assert_close(pw.grad[first:first + count], xw[1].grad[first:first + count])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), experts=st.integers(1, 5), tp=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_picked_rows_scatter_and_match_to_the_whole(rows, experts, tp, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-experts, experts, (rows,), generator=gen)   # negative ids count from the end
    weight = torch.randn(experts, 2, 3, dtype=torch.float64, generator=gen)
    total = torch.zeros(rows, 2, 3, dtype=torch.float64)
    for rank in range(tp):
        first, count = _run(experts, tp, rank)
        mine = E.picked_rows(ids, first, count, experts)
        picked = E.routed_pick(weight[first:first + count], ids, mine, first, experts)
        total += E.routed_scatter(picked, mine, 0, 1, [rows, 2, 3])
        # the same rows in another order come back in this one
        shuffled = mine.flip(0)
        torch.testing.assert_close(E.match_rows(picked.flip(0), shuffled, mine, 0, rows), picked)
    torch.testing.assert_close(total, weight[ids])


@settings(max_examples=30, deadline=None)
@given(outer=st.integers(0, 2), rows=st.integers(1, 8), inner=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_routed_scatter_keeps_no_copy_of_rows_the_model_then_writes_in_place(outer, rows, inner, seed):
    """Mixtral's router sums its top-k weights, then divides them by the sum in place: where the
    sum reads them through ``routed_scatter`` (sequence parallelism), backward needs nothing of
    the rows the division then writes (``index_copy`` saved them: "modified by an inplace
    operation"). The rows lie along ``dim`` (0 or 1); gradients equal the whole scatter's."""
    gen = torch.Generator().manual_seed(seed)
    dim = 1 if outer else 0
    lead = [outer] if outer else []
    mine = torch.randperm(rows, generator=gen)[: max(1, rows // 2)]
    x = torch.randn(*lead, mine.numel(), inner, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = x * 1.0
    total = E.routed_scatter(weights, mine, dim, 1, lead + [rows, inner]).sum(-1, keepdim=True)
    weights.div_(2.0)   # the model's in-place write, after the scatter read the rows
    grad = torch.randn(total.shape, dtype=torch.float64, generator=gen)
    (total * grad).sum().add(weights.sum()).backward()
    want = grad.index_select(dim, mine).expand(x.shape) + 0.5
    torch.testing.assert_close(x.grad, want)


def test_routed_operands_with_other_rows_are_an_error_not_a_misaligned_sum():
    import pytest

    from autotp.errors import AutotpError

    x = torch.arange(6.0).view(3, 2)
    with pytest.raises(AutotpError, match="routed operands hold different rows on this rank"):
        E.match_rows(x, torch.tensor([0, 2, 4]), torch.tensor([0, 1, 2]), 0, 6)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 7), k=st.integers(1, 3), tp=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_token_rows_summed_on_their_ranks_view_back_to_their_run_of_the_sequence(batch, seq, k, tp, seed):
    """After the combine's reverse all-to-all a rank holds every (token, expert) row of its tokens,
    in any order: their top-k sums (``token_sums``) are its tokens' sums, in sequence order, which
    ``sequence_runs`` views as its run ``[b, s_r, h]``; rows in another order are put in sequence
    order first (``in_row_order``)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden = batch * seq, 3
    rows = torch.randn(tokens * k, hidden, dtype=torch.float64, generator=gen)   # row t*k + j
    whole = rows.view(tokens, k, hidden).sum(1).view(batch, seq, hidden)
    for rank in range(tp):
        start, local = rank * (seq // tp) + min(rank, seq % tp), (seq + tp - 1 - rank) // tp
        mine = E.token_rows(torch.empty(batch, local), 1, [batch], seq, tp, rank)
        ids = (mine.unsqueeze(1) * k + torch.arange(k)).reshape(-1)
        ids = ids[torch.randperm(ids.numel(), generator=gen)]   # as the combine left them
        sums, held = E.token_sums(rows[ids], ids, k)
        assert torch.equal(held, mine)
        torch.testing.assert_close(E.sequence_runs(sums, [batch]), whole[:, start:start + local], rtol=0, atol=0)
        shuffled = torch.randperm(held.numel(), generator=gen)
        assert torch.equal(E.in_row_order(sums[shuffled], held[shuffled]), sums)


@settings(max_examples=60, deadline=None)
@given(outer=st.integers(1, 3), atoms=st.integers(1, 9), unit=st.integers(1, 3), tp=st.integers(1, 4),
       inner=st.integers(1, 2))
def test_token_rows_of_a_merge_are_the_ranks_runs_of_whole_atoms(outer, atoms, unit, tp, inner):
    """A merge of ``[outer, size, inner]`` split along ``size`` in runs of ``unit``-element atoms
    (Mamba2's heads by group, ``view(b * h, ...)``): the row map is the rank's rows of the whole
    merge, in order, the holders say the rank of every row, and the map computed in the smallest
    atom laid out alike (``row_unit``, which keys a shared map) is the same."""
    from autotp.passes.rules.token_rows import row_unit

    size = atoms * unit
    shard = Shard(1, unit=unit)
    whole = torch.arange(outer * size * inner).view(outer, size, inner)
    ids = torch.arange(outer * size).view(outer, size)   # the merged rows' global ids
    owners = E.token_owners(whole, [outer], size, tp, unit)
    for rank in range(tp):
        ranges = local_ranges(size, shard, tp, rank)
        local = torch.cat([whole[:, a:b] for a, b in ranges], 1) if ranges else whole[:, :0]
        rows = E.token_rows(local, 1, [outer], size, tp, rank, unit)
        want = torch.cat([ids[:, a:b] for a, b in ranges], 1).reshape(-1) if ranges else ids[:, :0].reshape(-1)
        assert torch.equal(rows, want)
        assert torch.equal(local.reshape(-1, inner), whole.reshape(-1, inner)[rows])
        assert bool((owners[rows] == rank).all())
        same = row_unit(size, unit, tp)
        assert torch.equal(E.token_rows(local, 1, [outer], size, tp, rank, same), rows)


def _rank_of_a_layer(x, weight, bias, ids, offs, perm, inverse, owners, *, first, count, experts, k, tp, rank):
    """One rank's rows of a layer through every function that reads the host: the bounds of its
    rows (``expert_bounds``) for the gather in front of its grouped product and the product, the
    rows its experts' ids pick (``picked_rows``, a bias picked by id) brought to the product's
    rows (``match_rows``), the reorder back found and counted (``routed_reorder``), and the
    sizes a dispatching layer reads at once (``dispatch_sizes``)."""
    tokens = x.shape[0]
    bounds = E.expert_bounds(offs, first, count)
    mine = E.expert_rows(offs, bounds)
    rows = E.routed_grouped_mm(E.gather_rows(x, perm // k, bounds), weight, offs, bounds, first, count,
                               "transformers.grouped_mm_fallback.default", True)
    sorted_ids = ids[perm]
    picked = E.picked_rows(sorted_ids, first, count, experts)
    rows = rows + E.match_rows(E.routed_pick(bias, sorted_ids, picked, first, experts), picked, mine, 0, tokens * k)
    rows, back = E.routed_reorder(rows, inverse, mine, tokens * k)
    runs = [_run(experts, tp, r) for r in range(tp)]
    sizes = E.dispatch_sizes(owners, offs, runs, rank)
    moved = torch.stack([x.new_ones(n).sum() for n in (*sizes.bounds, *sizes.send, *sizes.recv)])
    return E.routed_combine(rows, back, 0, k, [tokens, weight.shape[-1]]), moved


def test_every_read_of_a_ranks_rows_compiles_to_one_graph_with_dynamos_defaults():
    """``torch.compile`` without ``fullgraph`` and without dynamo's capture flags: the reads are
    autotp's opaque ops (autotp/distributed/reads.py), never a ``.tolist()`` or ``nonzero`` dynamo
    would break the graph at; one graph, the eager result and gradients, and a batch routed
    otherwise reuses it (its sizes unbacked, not guarded on)."""
    from torch._dynamo.utils import counters

    tokens, k, experts, tp, hidden, out = 6, 2, 5, 2, 3, 4   # 3 experts and 2: uneven
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_rank_of_a_layer, backend="aot_eager")
    # a traced size is unbacked (at least 0): the graph traced on the first routing runs the others,
    # rank 1 (experts 3, 4) given no row, then one row
    routings = {0: None, 1: None, 2: torch.tensor([0, 1, 2] * 4), 3: torch.tensor([0, 1, 2] * 3 + [0, 4, 1])}
    for seed, routed in routings.items():
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, experts, (tokens * k,), generator=gen) if routed is None else routed
        sorted_ids, perm = torch.sort(ids)
        offs = torch.cumsum(torch.bincount(sorted_ids, minlength=experts), 0).to(torch.int32)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        owners = torch.randint(0, tp, (tokens * k,), generator=gen)
        x = torch.randn(tokens, hidden, dtype=torch.float64, generator=gen)
        weight = torch.randn(experts, hidden, out, dtype=torch.float64, generator=gen)
        bias = torch.randn(experts, out, dtype=torch.float64, generator=gen)
        for rank in range(tp):
            first, count = _run(experts, tp, rank)
            results = []
            for fn in (_rank_of_a_layer, compiled):
                leaves = [t.clone().requires_grad_() for t in (x, weight[first:first + count], bias[first:first + count])]
                y, moved = fn(*leaves, ids, offs, perm, inverse, owners, first=first, count=count, experts=experts,
                              k=k, tp=tp, rank=rank)
                y.square().sum().backward()
                results.append([y, moved] + [t.grad for t in leaves])
            for got, want in zip(results[1], results[0]):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert dict(counters["graph_break"]) == {}
    # one graph per rank's run of experts (first and count are constants of the trace), not per batch
    assert counters["stats"]["unique_graphs"] == tp


def test_routed_operands_with_other_rows_fail_under_compile_too():
    x = torch.arange(6.0).view(3, 2)
    compiled = torch.compile(E.match_rows, backend="aot_eager")
    import pytest

    # a device assertion in the compiled graph (eager raises AutotpError), the same message
    with pytest.raises(Exception, match="routed operands hold different rows on this rank"):
        compiled(x, torch.tensor([0, 2, 4]), torch.tensor([0, 1, 2]), 0, 6)
