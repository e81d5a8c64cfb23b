"""A rank's expert routing is priced as the kernels it runs: the router's ``topk`` (forward and
backward), the rank's own rows routed alone (``distributed.expert_routing.route_locally``: its
sort and every small kernel around it), where the layer dispatches, the dispatch's split sizes and
plan from its exchanged counts (``local_dispatch_sizes`` and ``local_dispatch_plan``, priced once
a layer at the dispatching product: an expert-TP layer that sums its rows by a g runs neither),
every expert's count taken from the exchange (``routed_counts``), a token's top-k rows summed on its
rank (``distributed.experts.token_sums``, with its sort and gather where the rows do not lie in
their ids' order), and the whole sort's reorder of a rank's tokens' rows
(``distributed.experts.routed_reorder``, forward and backward). Every ATen call they dispatch on rank 0 of tp 8 on the fake backend
(collectives return at once) is a launch of the price, and the bytes each call touches sum to
the price's bytes; the one sort is the GPU's radix sort (``routing.sort_launches``,
``routing.sort_bytes``: ``tests/cost_model/test_sort_pricing.py``), one ATen call here.

Layouts: one MoE layer of Mixtral-8x7B (8 experts, top 2) and of Qwen3-30B-A3B (128 experts,
top 8) at 2 x 4096 tokens, each rank's tokens a sequence split's ``T/8``, its rows routed as
uniform routing deals them (the price's; on the fake backend every rank's counts are the rank's
own, so each of its experts gets ``T*k/8`` rows)."""
import pytest
import sympy
import torch

from autotp.cost_model.kernels import op_work
from autotp.cost_model.routing import holders_order_work
from autotp.distributed.gathered_rows import holders_order
from autotp.distributed.expert_routing import local_dispatch_plan, local_dispatch_sizes, route_locally, routed_counts
from autotp.distributed.experts import dispatch_plan, dispatch_sizes, token_sums, token_sums_in_order
from autotp.passes.rules import OpInfo, TensorMeta
from autotp.passes.rules.local_routing import ALONE, OWN, own_strategies
from autotp.passes.rules.contract import Strategy
from autotp.placements import REPLICATE, Routed, local_ranges, Shard
from tests.cost_model.kernel_counts import KernelCounter
from tests.helpers import fake_process_group

aten = torch.ops.aten
TP = 8
TOKENS = 2 * 4096
#: experts, top-k
LAYOUTS = {"mixtral-8x7b": (8, 2), "qwen3-30b-a3b": (128, 8)}
#: ops that fill a tensor without reading one, and allocations (no kernel runs)
FILLS = ("zeros", "new_zeros", "ones_like", "arange", "zeros_like", "full_like")
ALLOCATIONS = ("empty", "new_empty", "empty_like")
#: the rank's tokens (a sequence split)
TOKEN_ROWS = Routed(0, tokens=True)


@pytest.fixture(scope="module")
def fake_world():
    with fake_process_group(TP) as group:
        yield group


def _meta(*shape, dtype=torch.long) -> TensorMeta:
    return TensorMeta(tuple(sympy.Integer(s) for s in shape), dtype)


def _price(info: OpInfo, strategy: Strategy):
    work = op_work(info, strategy, TP, 2, torch.bfloat16)
    return work.launches, int(sum(b for _, b in work.moved))


def _priced_topk(experts: int, k: int):
    scores = _meta(TOKENS, experts, dtype=torch.float32)   # the router's float32 softmax
    info = OpInfo(aten.topk.default, (scores, k), {}, (scores,),
                  (_meta(TOKENS, k, dtype=torch.float32), _meta(TOKENS, k)), TP)
    info.grad_inputs = (True,)
    return _price(info, Strategy((TOKEN_ROWS,), (TOKEN_ROWS, TOKEN_ROWS)))


def _priced_sort(experts: int, k: int, target=aten.sort.stable):
    ids = _meta(TOKENS * k)
    out = (ids, _meta(TOKENS * k)) if target is aten.sort.stable else _meta(TOKENS * k)
    info = OpInfo(target, (ids,), {"stable": True}, (ids,), out, TP)
    info.routing_experts = experts
    (strategy,) = own_strategies(info, (OWN,))
    return _price(info, strategy)


def _priced_counts(experts: int, k: int):
    ids = _meta(TOKENS * k, dtype=torch.float32)   # transformers' histc of the sorted ids on CPU
    counts = _meta(experts, dtype=torch.float32)
    info = OpInfo(aten.histc.default, (ids, experts, 0, experts - 1), {}, (ids,), counts, TP)
    info.routing_experts = experts
    # every expert's rows whole on every rank, from the counts the sort exchanged
    (strategy,) = [s for s in own_strategies(info, (OWN,)) if s.output == REPLICATE]
    assert not strategy.internal
    return _price(info, strategy)


def _counted(fake_world, experts: int, k: int) -> dict[str, KernelCounter]:
    g = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(TOKENS // TP, experts, generator=g), -1).requires_grad_()
    with KernelCounter(FILLS, ALLOCATIONS) as topk:
        values, ids = torch.topk(scores, k)
    upstream = torch.randn(values.shape, generator=g)
    with KernelCounter(FILLS, ALLOCATIONS) as topk_backward:
        torch.autograd.grad(values, scores, upstream)
    # the rank's rows routed as uniform routing deals them: T*k/8/E rows of each expert
    own = ids.numel()
    balanced = (torch.arange(own) % experts)[torch.randperm(own, generator=g)]
    runs = tuple(local_ranges(experts, Shard(0), TP, r)[0] for r in range(TP))
    runs = tuple((a, b - a) for a, b in runs)
    local_dispatch_sizes(route_locally(balanced, 1, experts, fake_world, TP, 0), runs, 0)   # the holders, made once
    with KernelCounter(FILLS, ALLOCATIONS) as routing:
        local = route_locally(balanced, 1, experts, fake_world, TP, 0)
    with KernelCounter(FILLS, ALLOCATIONS) as dispatch:
        sizes = local_dispatch_sizes(local, runs, 0)
        local_dispatch_plan(local, runs, 0, sizes)
    assert sum(sizes.recv) == own   # the price's uniform routing
    with KernelCounter(FILLS, ALLOCATIONS) as counts:
        routed_counts(local, torch.float32)
    return {"topk": (topk.launches + topk_backward.launches, topk.bytes + topk_backward.bytes,
                     topk.calls + topk_backward.calls),
            "route_locally": (routing.launches, routing.bytes, routing.calls),
            "dispatch": (dispatch.launches, dispatch.bytes, dispatch.calls),
            "routed_counts": (counts.launches, counts.bytes, counts.calls)}


def _grouped_product(rows: int, experts: int) -> OpInfo:
    """A grouped gate|up product of ``rows`` (token, expert) rows over ``experts`` experts
    (transformers' int32 ``offs``)."""
    x, w = _meta(rows, 4096, dtype=torch.bfloat16), _meta(experts, 4096, 64, dtype=torch.bfloat16)
    offs = _meta(experts, dtype=torch.int32)
    return OpInfo("aten._grouped_mm.default", (x, w, offs), {}, (x, w, offs), _meta(rows, 64, dtype=torch.bfloat16),
                  TP)


def _priced_dispatch(experts: int, rows: int, x: Routed):
    """What a grouped product that sends its rows ``x`` to their experts' ranks is priced beyond
    the same product on rows gathered at its experts (no dispatch): the layer's dispatch's split
    sizes and plan."""
    info = _grouped_product(rows, experts)
    sends = Strategy((x, Shard(0), REPLICATE), Routed(0), internal=(("all_to_all", info.inputs[0]),))
    gathered = Strategy((Routed(0), Shard(0), REPLICATE), Routed(0))
    return tuple(a - b for a, b in zip(_price(info, sends), _price(info, gathered)))


@pytest.mark.parametrize("dispatching", [True, False], ids=["dispatching", "expert-tp"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_moe_layers_routing_is_priced_as_the_kernels_a_rank_runs(fake_world, layout, dispatching):
    # a rank routing its own rows: an expert-parallel layer dispatches them (route_locally, then
    # the dispatch's sizes and plan from its exchanged counts, at the dispatching product); an
    # expert-TP layer sums them whole by a g (route_locally alone). Before, the sort was priced
    # with the dispatch's kernels on both, though an expert-TP layer never runs them
    experts, k = LAYOUTS[layout]
    counted = _counted(fake_world, experts, k)
    priced = {"topk": _priced_topk(experts, k), "route_locally": _priced_sort(experts, k),
              "routed_counts": _priced_counts(experts, k)}
    if dispatching:
        priced["dispatch"] = _priced_dispatch(experts, TOKENS * k, ALONE)
    else:
        del counted["dispatch"]
    for part, (launches, moved, calls) in counted.items():
        assert priced[part] == (launches, moved), (part, calls)
    # the layer's routing as a whole
    assert tuple(map(sum, zip(*priced.values()))) == tuple(sum(c[i] for c in counted.values()) for i in (0, 1))


def test_an_argsort_of_own_ids_prices_the_same_routing_and_its_exchange():
    # a router sorting by argsort runs route_locally too (own_localizer): the same kernels, and
    # the counts' all-gather of tp * experts numbers
    experts, k = LAYOUTS["mixtral-8x7b"]
    ids = _meta(TOKENS * k)
    info = OpInfo(aten.argsort.stable, (ids,), {"stable": True}, (ids,), _meta(TOKENS * k), TP)
    info.routing_experts = experts
    (strategy,) = own_strategies(info, (OWN,))
    assert [(kind, tuple(m.shape)) for kind, m in strategy.internal] == [("all_gather", (TP * experts,))]
    assert _price(info, strategy) == _priced_sort(experts, k)


def test_a_bincount_of_the_sorted_ids_is_priced_as_the_exchanged_counts_summed(fake_world):
    # bincount(ids_sorted, minlength=E) whole on every rank from the sort's exchange
    # (routed_counts): the counts summed, already int64 (no cast)
    experts, k = LAYOUTS["qwen3-30b-a3b"]
    ids = _meta(TOKENS * k)
    info = OpInfo(aten.bincount.default, (ids, None, experts), {}, (ids,), _meta(experts), TP)
    info.routing_experts = experts
    (strategy,) = [s for s in own_strategies(info, (OWN,)) if s.output == REPLICATE]
    local = route_locally(torch.randint(0, experts, (TOKENS * k // TP,)), 1, experts, fake_world, TP, 0)
    with KernelCounter(FILLS, ALLOCATIONS) as counts:
        routed_counts(local, torch.long)
    assert _price(info, strategy) == (counts.launches, counts.bytes), counts.calls


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_tp_gathered_rows_order_is_priced_as_its_counting_pass(layout):
    # distributed/gathered_rows.GatherRowsTP on every rank: the T*k gathered rows laid out rank by
    # rank from their holders (no sort: tests/runtime/test_gathered_rows_order.py)
    experts, k = LAYOUTS[layout]
    rows = TOKENS * k
    holder = torch.randint(0, TP, (rows,), generator=torch.Generator().manual_seed(0))
    with KernelCounter(FILLS, ALLOCATIONS, picks=("index_select",)) as counted:   # its gather reads what it picks
        holders_order(holder, TP)
    work = holders_order_work(rows, TP)
    assert (work.launches, int(sum(b for _, b in work.moved))) == (counted.launches, counted.bytes), counted.calls


#: each layout's hidden width
HIDDEN = {"mixtral-8x7b": 4096, "qwen3-30b-a3b": 2048}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gathered_rows_are_priced_as_the_kernels_gather_rows_tp_runs(fake_world, layout):
    # expert-TP, the tokens split along the sequence: h[perm // k] whole on every rank from each
    # rank's own tokens' rows (distributed/gathered_rows.GatherRowsTP). Every rank gathers each
    # sorted row's holder, lays the rows out by a counting pass, takes its own rows' positions,
    # finds their tokens among its own (searchsorted), gathers them; after the all-gather, the
    # rows laid out in sorted order; backward, the gradient in rank order, then added into the
    # rank's tokens. Priced as the op's compute on the rank (routing.gathered_rows_work) and the
    # layout on every rank (routing.gathered_rows_layout_work, propagate.internal_copy_seconds).
    # Before, the rank's part was priced as one gather reading the whole index (3 kernels, no
    # search), and the layout's holders and its two gathers without their positions
    from autotp.cost_model.routing import gathered_rows_layout_work
    from autotp.distributed.gathered_rows import GatherRowsTP
    from autotp.passes.rules.gathered_rows import gathered_rows_strategies, rank_rows_work

    experts, k = LAYOUTS[layout]
    hidden, g = 256, torch.Generator().manual_seed(0)   # the price is linear in the width: exact at any
    ids = (torch.arange(TOKENS * k) % experts)[torch.randperm(TOKENS * k, generator=g)]   # uniform routing
    index = torch.sort(ids, stable=True)[1] // k
    seq = TOKENS // 2                                  # 2 sequences, each split in 8 runs
    mine = torch.cat([torch.arange(seq // TP), seq + torch.arange(seq // TP)])   # rank 0's tokens
    owners = torch.arange(TOKENS) % seq // (seq // TP)
    x = torch.randn(mine.numel(), hidden, generator=g, dtype=torch.bfloat16).requires_grad_()
    with KernelCounter(FILLS, ALLOCATIONS, picks=("index_select",)) as forward:   # gathers read what they pick
        rows = GatherRowsTP(fake_world, k)(x, index, mine, owners, [2], seq)
    upstream = torch.randn(rows.shape, generator=g, dtype=torch.bfloat16)
    with KernelCounter(FILLS, ALLOCATIONS, picks=("index_select",)) as backward:
        torch.autograd.grad(rows, x, upstream)

    h, idx = _meta(TOKENS, hidden, dtype=torch.bfloat16), _meta(TOKENS * k)
    out = _meta(TOKENS * k, hidden, dtype=torch.bfloat16)
    info = OpInfo(aten.index.Tensor, (h, [idx]), {}, (h, idx), out, TP)
    info.grad_inputs = (True, False)
    info.gathers_expert_rows, info.row_copies = True, k
    (strategy,) = gathered_rows_strategies(info, TOKEN_ROWS)
    own = _price(*rank_rows_work(info, strategy))
    layout_work = gathered_rows_layout_work(TOKENS * k, TOKENS * k * hidden * 2, TP)
    priced = (own[0] + layout_work.launches, own[1] + int(sum(b for _, b in layout_work.moved)))
    counted = (forward.launches + backward.launches, forward.bytes + backward.bytes)
    assert priced == counted, forward.calls + backward.calls


def _priced_token_sums(k: int, hidden: int, ascending: bool):
    rows = _meta(TOKENS, k, hidden, dtype=torch.bfloat16)
    info = OpInfo(aten.sum.dim_IntList, (rows, [1]), {}, (rows,), _meta(TOKENS, hidden, dtype=torch.bfloat16), TP)
    info.grad_inputs = (True,)
    back = Routed(0, span=2, tokens=True, reordered=True, ascending=ascending)
    return _price(info, Strategy((back,), Routed(0, tokens=True, reordered=True)))


@pytest.mark.parametrize("ascending", [True, False], ids=["own-routing", "whole-sort"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_tokens_top_k_sum_is_priced_as_its_rank_sums_them(layout, ascending):
    # the rows back on their tokens' rank: summed as they lie where a rank routed its own rows
    # (token_sums_in_order), sorted by id and gathered first where they came back in another
    # order (token_sums: the whole sort's path)
    _, k = LAYOUTS[layout]
    hidden, own = HIDDEN[layout], TOKENS * k // TP
    g = torch.Generator().manual_seed(0)
    x = torch.randn(own, hidden, generator=g, dtype=torch.bfloat16).requires_grad_()
    rows = torch.arange(own) if ascending else torch.randperm(own, generator=g)
    with KernelCounter(FILLS, ALLOCATIONS) as forward:
        sums, _ = (token_sums_in_order if ascending else token_sums)(x, rows, k)
    upstream = torch.randn(sums.shape, generator=g, dtype=torch.bfloat16)
    with KernelCounter(FILLS, ALLOCATIONS) as backward:
        torch.autograd.grad(sums, x, upstream)
    calls = forward.calls + backward.calls
    # the sum's gradient spread over each token's k rows is an expand the view back copies: the
    # view's backward, priced as nothing (the serial model's view back copies it alike)
    spread = [(name, moved) for name, moved in backward.calls if name == "clone"]
    assert spread == [("clone", 2 * x.numel() * x.element_size())], calls
    counted = (forward.launches + backward.launches - 1, forward.bytes + backward.bytes - spread[0][1])
    assert _priced_token_sums(k, hidden, ascending) == counted, calls


#: experts, top-k, tokens: the layouts above, and one whose experts tp does not divide (60
#: experts at tp 8: four ranks of 8, four of 7; Qwen1.5-MoE-A2.7B's), at 2 x 3840 tokens so that
#: uniform routing deals every expert as many rows
WHOLE_SORT_LAYOUTS = {"mixtral-8x7b": (8, 2, TOKENS), "qwen3-30b-a3b": (128, 8, TOKENS),
                      "qwen1.5-moe-a2.7b": (60, 4, 2 * 3840)}


def _priced_reorder(experts: int, k: int, tokens: int, dispatching: bool):
    # h[perm // k]: a rank's tokens' rows put in expert order by the whole sort's positions
    h, index = _meta(tokens, 4096, dtype=torch.bfloat16), _meta(tokens * k)
    info = OpInfo(aten.index.Tensor, (h, [index]), {}, (h, index), _meta(tokens * k, 4096, dtype=torch.bfloat16), TP)
    info.grad_inputs = (True, False)
    info.gathers_expert_rows, info.row_copies = True, k
    if dispatching:
        info.routing_experts, info.offs_bytes = experts, 4   # transformers' int32 offs
    return _price(info, Strategy((TOKEN_ROWS, REPLICATE), Routed(0, tokens=True, reordered=True)))


@pytest.mark.parametrize("layout", sorted(WHOLE_SORT_LAYOUTS))
def test_a_whole_sorts_dispatch_is_priced_as_the_kernels_a_rank_runs(layout):
    # the all-to-all dispatch from rows sorted whole on every rank: the layer's split sizes and
    # plan (distributed.experts.dispatch_sizes, dispatch_plan) priced at the product that sends
    # the rows (where the rank's program plans it), not at the reorder that puts the rank's
    # tokens' rows in expert order: that reorder is the same whether its rows are dispatched or
    # made whole by a g (which runs neither). Before, the reorder was priced with them
    experts, k, tokens = WHOLE_SORT_LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    rows = tokens * k
    ids = (torch.arange(rows) % experts)[torch.randperm(rows, generator=g)]   # uniform routing
    _, perm = torch.sort(ids, stable=True)
    seq = tokens // 2                                  # 2 sequences, each split in 8 runs
    owners = (perm // k) % seq // (seq // TP)          # the holder of each row sorted by expert
    offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0, dtype=torch.int32)
    runs = tuple((a, b - a) for ((a, b),) in (local_ranges(experts, Shard(0), TP, r) for r in range(TP)))
    own = (owners == 0).nonzero().flatten()            # rank 0's token rows, by their sorted ids
    with KernelCounter(FILLS, ALLOCATIONS) as counted:
        sizes = dispatch_sizes(owners, offs, runs, 0)
        dispatch_plan(own, owners, offs, runs, sizes)
    assert sizes.bounds == (0, rows * runs[0][1] // experts)   # the price's uniform routing
    assert _priced_reorder(experts, k, tokens, True) == _priced_reorder(experts, k, tokens, False)
    rows_sorted_whole = Routed(0, tokens=True, reordered=True)
    assert _priced_dispatch(experts, rows, rows_sorted_whole) == (counted.launches, counted.bytes), counted.calls


@pytest.mark.parametrize("dispatching", [False, True], ids=["made-whole-by-g", "dispatching"])
@pytest.mark.parametrize("layout", sorted(WHOLE_SORT_LAYOUTS))
def test_a_whole_sorts_reorder_is_priced_as_the_kernels_a_rank_runs(fake_world, layout, dispatching):
    # h[perm // k] on a rank's tokens' rows by the whole sort's positions (the plan that makes
    # them whole by a g, or dispatches them): distributed.experts.routed_reorder finds the
    # positions of the rank's rows in the whole index, which of them are its own (a nonzero, or
    # nonzero_static with the count a dispatching layer read), and gathers them; backward adds
    # the rows' gradient back into the rank's tokens. Before, only its last gather was priced
    # (and its nonzero's read to the host, rules/row_reads.host_reads, priced apart either way)
    from autotp.distributed.experts import routed_reorder

    experts, k, tokens = WHOLE_SORT_LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    ids = (torch.arange(tokens * k) % experts)[torch.randperm(tokens * k, generator=g)]   # uniform routing
    index = torch.sort(ids, stable=True)[1] // k
    seq = tokens // 2                                  # 2 sequences, each split in 8 runs
    mine = torch.cat([torch.arange(seq // TP), seq + torch.arange(seq // TP)])   # rank 0's tokens
    x = torch.randn(mine.numel(), 4096, generator=g, dtype=torch.bfloat16).requires_grad_()
    count = k * mine.numel() if dispatching else None   # the rows the layer's split sizes say it sends
    with KernelCounter(FILLS, ALLOCATIONS, picks=("index", "index_select")) as forward:   # gathers of rows
        rows, _ = routed_reorder(x, index, mine, tokens, count)
    upstream = torch.randn(rows.shape, generator=g, dtype=torch.bfloat16)
    with KernelCounter(FILLS, ALLOCATIONS) as backward:
        torch.autograd.grad(rows, x, upstream)
    assert rows.shape[0] == tokens * k // TP           # the price's rows: T*k/tp, as uniform routing deals them
    counted = (forward.launches + backward.launches, forward.bytes + backward.bytes)
    assert _priced_reorder(experts, k, tokens, dispatching) == counted, forward.calls + backward.calls


def test_rows_a_ranks_own_routing_sent_go_and_come_back_with_no_gather_of_its_own_rows():
    # a rank's own routing sorted its rows by expert, so by destination: its dispatch plan has no
    # order (expert_routing.local_dispatch_plan), the rows leave as they lie and the combine puts
    # them back there. The rows such a dispatch sends are marked (SENT_ALONE), so the product that
    # sends its output back prices no gather of the rank's own rows either; rows a whole sort
    # ordered keep both gathers, forward and backward
    import dataclasses

    from autotp.passes.propagate import internal_copy_seconds, sends_own_order
    from autotp.passes.rules import strategies
    from autotp.passes.rules.experts import SENT, SENT_ALONE
    from autotp.cost_model.devices import PROFILES

    info = _grouped_product(TOKENS * 2, 8)
    sending = [s for s in strategies(info, (ALONE, None, None)) if s.internal]
    assert {s.output for s in sending} == {Routed(0), SENT_ALONE} and all(sends_own_order(s) for s in sending)
    whole = Routed(0, tokens=True, reordered=True)
    assert {s.output for s in strategies(info, (whole, None, None)) if s.internal} == {Routed(0), SENT}
    combining = {s.inputs[0]: s for p in (SENT, SENT_ALONE) for s in strategies(info, (p, None, None))
                 if s.internal and s.inputs[0] == p}
    assert sends_own_order(combining[SENT_ALONE]) and not sends_own_order(combining[SENT])
    # priced: 4 gathers of the rows (forward and backward, either side) against 2
    bytes_only = dataclasses.replace(PROFILES["h100-dgx"], launch_s=0.0)
    full, rows = 2.0 * TOKENS * 2 * 4096, TOKENS * 2
    both, own_order = (internal_copy_seconds("all_to_all", full, bytes_only, rows, TP, alone=a) for a in (False, True))
    assert own_order == pytest.approx(both / 2, rel=1e-9)
