"""A rank's program refuses what it cannot run: each PlanError the rewrite and the local routing's
localizer (autotp/passes/rewrite.py, autotp/passes/rules/local_routing.py) raise on a bad input
names the op, the cause and what must hold instead.

The local routing's checks guard an invariant the rules cannot see: an index placed on a rank's
own rows (``OWN``) holds *local* positions, so each op of the chain must read the kind of values
it was made for. A graph whose values are not those (the sort's positions counted, a top-k of
another size, an inverse written with other values) reaches them; here the localizer is handed
such an op directly, on a rank's graph of placeholders, with what the rewrite would know of its
inputs (``ctx.own``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import sympy
import torch
from torch import fx

from autotp.errors import PlanError
from autotp.passes.rewrite import GraphLocalContext
from autotp.passes.rules.local_routing import FIX, OWN, ROWS, OwnLayer, own_localizer
from autotp.passes.rules.contract import Strategy, TensorMeta
from autotp.placements import PARTIAL, REPLICATE, Routed, Shard

#: a rank's tokens' rows in sequence order (a flattened sequence split)
TOKEN_ROWS = Routed(0, tokens=True)

aten = torch.ops.aten


def _localize(target, kinds: list[str | None], strategy: Strategy, args: tuple | None = None, k: int = 2,
              **info: object):
    """``own_localizer`` on one captured op ``target`` whose inputs the rank holds with the values
    ``kinds`` (None: made by no op of the local routing); returns the error it raises. ``info``:
    what the op's OpInfo says beyond its target (its inputs' and output's metas)."""
    captured, rank = fx.Graph(), fx.Graph()
    inputs = [captured.placeholder(f"x{i}") for i in range(len(kinds))]
    node = captured.call_function(target, tuple(inputs) if args is None else args(inputs))
    ctx = GraphLocalContext(2, 0, rank)
    ctx.node = node
    ctx.inputs = [rank.placeholder(f"local_x{i}") for i in range(len(kinds))]
    flat = rank.placeholder("flat_rows")
    layer = OwnLayer(k, flat, routing=None, sorted_rows=rank.placeholder("sorted_rows"), experts=4)
    for local, kind in zip(ctx.inputs, kinds):
        if kind is not None:
            ctx.own[local] = (kind, layer)
    ctx.rows[ctx.inputs[0]] = flat
    info = SimpleNamespace(target=target, **{"inverts": False, **info})
    with pytest.raises(PlanError) as caught:
        own_localizer(info, strategy, tuple(ctx.inputs) if args is None else args(ctx.inputs), {}, ctx)
    message = str(caught.value)
    assert message.endswith(f"; {FIX}"), message   # what the user can do
    return message


def test_a_sort_of_what_is_no_routers_top_k_ids_is_refused():
    # the rank's flat positions sorted (not its top-k ids): the exchange of counts per expert
    # would count positions
    message = _localize(aten.sort.stable, ["flat"], Strategy((OWN,), (OWN, OWN)))
    assert message.startswith("sort_stable sorts a rank's own rows routed alone, but its values are not a router's "
                              "top-k expert ids"), message
    assert "it must sort every row" in message


def test_a_count_of_a_ranks_own_positions_is_refused():
    message = _localize(aten.histc.default, ["flat"], Strategy((OWN,), PARTIAL))
    assert message.startswith("histc_default counts a rank's own positions (flat), which mean nothing on another "
                              "rank"), message
    assert "it must count every row" in message


def test_positions_divided_by_another_number_than_the_top_k_are_refused():
    # flattened by top-2, divided by 3: the quotients would be no token of the rank's
    message = _localize(aten.floor_divide.default, ["flat"], Strategy((OWN,), OWN),
                        args=lambda xs: (xs[0], 3))
    assert message.startswith("floor_divide_default divides a rank's own row positions by 3, not by the top-k 2 "
                              "its rows were flattened by"), message
    assert "it must run on every row" in message


@pytest.mark.parametrize("kinds", [["unset", "flat", None], ["unset", "tokens", None]],
                         ids=["values-not-arange", "at-token-positions"])
def test_an_inverse_written_with_other_values_or_positions_is_refused(kinds):
    # inv[perm] = v: the values a placeholder (not arange(n)), or the positions a token's: no
    # inverse of a permutation the graph proves (rules/routing.inverted, the one recognizer; what
    # the base held does not matter, every entry of it is written)
    message = _localize(aten.index_put_.default, kinds, Strategy((OWN, OWN, REPLICATE), OWN),
                        args=lambda xs: (xs[0], [xs[1]], xs[2]))
    assert message.startswith("index_put__default makes no inverse of a permutation the graph proves"), message
    assert "it must run on every row" in message


@pytest.mark.parametrize("kind", ["values", "ids"])
def test_whole_rows_gathered_by_values_that_number_none_of_them_are_refused(kind):
    # the flattened top-k ids (or the sorted ids) are no positions: they number no row of the
    # whole tensor (positions among the rank's flat rows, its tokens or its sorted rows do: each
    # is the global id its routing gave the row, tests/e2e/test_forced_dispatch.py)
    message = _localize(aten.index.Tensor, [None, kind], Strategy((REPLICATE, OWN), ROWS),
                        args=lambda xs: (xs[0], [xs[1]]))
    assert message.startswith(f"index_tensor gathers whole rows by a rank's own positions ({kind}, x1), which "
                              "number no rows of the whole"), message
    assert "it must gather every row" in message


def test_own_rows_gathered_by_positions_of_other_rows_are_refused():
    # the flat ids or weights gathered by token positions (perm // k), not by the sort's positions
    message = _localize(aten.index.Tensor, ["values", "tokens"], Strategy((OWN, OWN), OWN),
                        args=lambda xs: (xs[0], [xs[1]]))
    assert message.startswith("index_tensor gathers by a rank's own positions (tokens, x1) from rows they do not "
                              f"number (x0, {OWN})"), message
    assert "it must gather every row" in message


@pytest.mark.parametrize("held, kind", [(TOKEN_ROWS, "flat"), (ROWS, "sorted")],
                         ids=["tokens-by-flat", "combined-by-other-sort"])
def test_rows_gathered_by_positions_that_do_not_number_them_are_refused(held, kind):
    # the rank's tokens in sequence order gathered by flat positions (not perm // k); rows the
    # combine brought back gathered by sorted positions of another layer's sort than theirs
    message = _localize(aten.index.Tensor, [None, kind], Strategy((held, OWN), ROWS),
                        args=lambda xs: (xs[0], [xs[1]]))
    assert message.startswith(f"index_tensor gathers by a rank's own positions ({kind}, x1) from rows they do not "
                              f"number (x0, {held})"), message
    assert "it must gather every row" in message


@pytest.mark.parametrize("kind", ["flat", "ids"], ids=["by-positions", "ids-not-counted-into-offs"])
def test_a_stack_of_experts_picked_by_other_than_its_counted_sorted_ids_is_refused(kind):
    # gpt-oss's bias pick (routing.counted_pick): the rank's experts' rows come from the grouped
    # products' offs; by positions, or by ids no cumsum(histc(...)) counted, there are none to take
    stack = TensorMeta((sympy.Integer(4), sympy.Integer(8)), torch.float64)
    message = _localize(aten.index.Tensor, [None, kind], Strategy((Shard(0), OWN), Routed(0)),
                        args=lambda xs: (xs[0], [xs[1]]), inputs=(stack,))
    assert message.startswith(f"index_tensor picks a stack of 4 experts by a rank's own {kind} (not the sorted expert "
                              "ids counted into a grouped product's offs)"), message
    assert "it must pick by every row's ids" in message


def test_a_bincount_of_a_ranks_own_positions_is_refused():
    counts = TensorMeta((sympy.Integer(4),), torch.long)
    message = _localize(aten.bincount.default, ["flat"], Strategy((OWN,), PARTIAL), output=counts)
    assert message.startswith("bincount_default counts a rank's own positions (flat), which mean nothing on another "
                              "rank"), message
    assert "it must count every row" in message


@pytest.mark.parametrize("kind, length", [("values", 4), ("ids", 6)], ids=["unsorted-ids", "longer-than-experts"])
def test_a_bincount_made_whole_of_other_than_the_sorted_ids_over_every_expert_is_refused(kind, length):
    # whole from the sort's exchange only where it counts the sorted ids over the layer's 4 experts
    counts = TensorMeta((sympy.Integer(length),), torch.long)
    message = _localize(aten.bincount.default, [kind], Strategy((OWN,), REPLICATE), output=counts)
    assert message.startswith("bincount_default counts a rank's own rows whole, but not the sorted expert ids of its "
                              "routing over its 4 experts"), message
    assert "it must count every row (pass bincount's minlength as the number of experts)" in message


def test_rows_gathered_whole_from_tokens_of_no_sequence_split_are_refused():
    """Expert-TP's all-gather of a rank's tokens' rows (rules/gathered_rows.py) counts each rank's
    rows from the sequence split's shapes; rows whose map is another (here a flat row map) have
    no such count, and the rank's program says so rather than gather a wrong number of rows."""
    from autotp.passes.rules.gathered_rows import gathered_rows_localizer

    captured, rank = fx.Graph(), fx.Graph()
    node = captured.call_function(aten.index.Tensor, (captured.placeholder("h"), [captured.placeholder("perm")]))
    ctx = GraphLocalContext(2, 0, rank)
    ctx.node = node
    ctx.inputs = [rank.placeholder("local_h"), rank.placeholder("local_index")]
    ctx.rows[ctx.inputs[0]] = rank.placeholder("flat_rows")
    info = SimpleNamespace(target=aten.index.Tensor, row_copies=2)
    with pytest.raises(PlanError) as caught:
        gathered_rows_localizer(info, Strategy((TOKEN_ROWS, REPLICATE), REPLICATE), tuple(ctx.inputs), {}, ctx)
    message = str(caught.value)
    assert message.startswith(f"index_tensor gathers the rows of tokens held as {TOKEN_ROWS} whose row map is not a "
                              "sequence split's (flat_rows)"), message
    assert message.endswith("(an autotp bug: please report it); plan with sequence_parallel=False to gather the "
                            "tokens whole"), message


def test_own_rows_that_no_op_of_the_local_routing_made_are_refused():
    message = _localize(aten.histc.default, [None], Strategy((OWN,), PARTIAL))
    assert message.startswith("histc_default reads a rank's own rows routed alone (local_x0) that no op of the local "
                              "routing made"), message


def test_a_partial_sum_scattered_into_token_rows_its_program_cannot_number_is_refused():
    """OPT's MLP region reduce-scatters fc2's partial sum into the rank's tokens' rows ``[b*s, h]``;
    rewritten with an index that knows no sequence dim (the plan solved for another program), the
    rows' count is no sequence times a batch there, and the rewrite says so, naming the tensor and
    the fix, instead of cutting rows that are no rank's run of the sequence."""
    from autotp import zoo
    from autotp.capture import capture
    from autotp.passes.rewrite import rewrite
    from autotp.planner import build_plan

    config = zoo.tiny_config("opt", layers=1, heads=4, kv_heads=None, head_dim=8, vocab=61)
    cap = capture(zoo.build("opt", config, device="meta", dtype=torch.float64))
    plan, index, prop = build_plan(cap, 2, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True,
                                   layout={"*.out_proj.weight": "row", "*.fc2.weight": "row"}, align=None)
    scattered = [c.tensor for c in plan.comms if (c.kind, c.src, c.dst) == ("reduce_scatter", "P", "P(tokens 0)")]
    assert len(scattered) == 1, plan.comms
    rewrite(index, prop, 0, None, None)   # the index the plan was solved on: rewritten
    index.sequence = frozenset()
    with pytest.raises(PlanError) as caught:
        rewrite(index, prop, 0, None, None)
    message = str(caught.value)
    assert f"rows of {scattered[0]} into a sequence split's tokens' rows" in message, message
    assert "their count is no sequence times a batch in this program (its sequence dims: none)" in message
    assert message.endswith("plan with sequence_parallel=False to keep the rows whole"), message


def test_rows_put_back_in_token_order_from_tokens_out_of_sequence_order_are_refused():
    # out[inv] planned to put the combine's rows back in the rank's tokens' order (their ids
    # ascending: the top-k sum is priced with no sort), where the rank's flat rows were not in its
    # tokens' sequence order: the plan's promise cannot hold, so the program says so
    from autotp.passes.rules.local_routing import IN_TOKEN_ORDER

    captured, rank = fx.Graph(), fx.Graph()
    out, inv = captured.placeholder("out"), captured.placeholder("inv")
    node = captured.call_function(aten.index.Tensor, (out, [inv]))
    ctx = GraphLocalContext(2, 0, rank)
    ctx.node = node
    ctx.inputs = [rank.placeholder("local_out"), rank.placeholder("local_inv")]
    flat, sorted_rows = rank.placeholder("flat_rows"), rank.placeholder("sorted_rows")   # flat: no order known
    layer = OwnLayer(2, flat, routing=None, sorted_rows=sorted_rows, experts=4)
    ctx.own[ctx.inputs[1]] = ("sorted", layer)
    ctx.rows[ctx.inputs[0]], ctx.rows[ctx.inputs[1]] = sorted_rows, flat
    back = Routed(0, tokens=True, reordered=True)
    info = SimpleNamespace(target=aten.index.Tensor)
    with pytest.raises(PlanError) as caught:
        own_localizer(info, Strategy((back, OWN), IN_TOKEN_ORDER), (ctx.inputs[0], [ctx.inputs[1]]), {}, ctx)
    message = str(caught.value)
    assert message.startswith("index_tensor is planned to put the rows back in the rank's tokens' order, but its "
                              "tokens' rows were not in sequence order (inv)"), message
    assert message.endswith(f"; {FIX}"), message


def test_rows_sent_back_that_no_dispatch_of_their_layer_sent_are_refused(monkeypatch):
    """gpt-oss's down product adds its experts' biases on their ranks, then its rows go back to their
    tokens' ranks by the reverse all-to-all on the layer's dispatch plan (``rewrite.send_back``).
    Every rows-sent value's row map is its layer's dispatching product's (the rules mark rows sent
    only there and on ops keeping their rows), and that product is rewritten before any reader of
    its rows, so no planned graph reaches the check; a rewrite whose dispatching product recorded
    no plan (here: its record dropped) names the value and the fix instead of sending rows by
    no plan."""
    from autotp import zoo
    from autotp.capture import capture
    from autotp.passes import rewrite as R
    from autotp.planner import build_plan

    config = zoo.tiny_config("gpt-oss", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    cap = capture(zoo.build("gpt-oss", config, device="meta", dtype=torch.float64))
    plan, index, prop = build_plan(cap, 2, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True,
                                   layout={"*.experts.*": "expert"}, expert_dispatch=True)
    back = [c.tensor for c in plan.comms if (c.kind, c.src, c.dst) == ("all_to_all", "P(sent 0)",
                                                                      "P(tokens 0, reordered)")]
    assert len(back) == 1, plan.comms
    R.rewrite(index, prop, 0, None, None)   # as planned: rewritten

    class _Unrecorded(dict):
        def __setitem__(self, key, value):   # the dispatching product's plan, never kept
            pass

    made = R.GraphLocalContext.__init__

    def forgetting(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.sent = _Unrecorded()

    monkeypatch.setattr(R.GraphLocalContext, "__init__", forgetting)
    with pytest.raises(PlanError) as caught:
        R.rewrite(index, prop, 0, None, None)
    message = str(caught.value)
    assert message.startswith(f"{back[0]} is placed as rows an all-to-all dispatch sent to their experts' ranks, "
                              "but no dispatching product of its layer made its rows"), message
    assert message.endswith("plan with expert_dispatch=False to combine the rows by a g"), message


def test_an_inverse_of_other_positions_than_the_sorts_is_refused():
    # argsort(p): the inverse of the permutation p, but p a rank's token positions (not the
    # positions its own sort gave its flat rows): its values would number no sorted row
    captured, rank = fx.Graph(), fx.Graph()
    ids = captured.placeholder("ids")
    ids.meta["val"] = torch.empty(8, dtype=torch.long)
    p = captured.call_function(aten.argsort.default, (ids,))
    node = captured.call_function(aten.argsort.default, (p,))
    p.meta["val"] = node.meta["val"] = torch.empty(8, dtype=torch.long)
    ctx = GraphLocalContext(2, 0, rank)
    ctx.node, ctx.inputs = node, [rank.placeholder("local_p")]
    layer = OwnLayer(2, rank.placeholder("flat_rows"), routing=None, sorted_rows=None, experts=4)
    ctx.env[p], ctx.own[ctx.inputs[0]] = ctx.inputs[0], ("tokens", layer)
    info = SimpleNamespace(target=aten.argsort.default, inverts=True)
    with pytest.raises(PlanError) as caught:
        own_localizer(info, Strategy((OWN,), OWN), tuple(ctx.inputs), {}, ctx)
    message = str(caught.value)
    assert message.startswith("argsort_default_1 inverts argsort_default, not the positions the rank's own sort "
                              "gave its rows"), message
    assert message.endswith(f"; {FIX}"), message
