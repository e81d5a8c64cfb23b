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
import torch
from torch import fx

from autotp.errors import PlanError
from autotp.passes.rewrite import GraphLocalContext
from autotp.passes.rules.local_routing import OWN, ROWS, OwnLayer, own_localizer
from autotp.passes.rules.contract import Strategy
from autotp.placements import PARTIAL, REPLICATE

aten = torch.ops.aten


def _localize(target, kinds: list[str | None], strategy: Strategy, args: tuple | None = None, k: int = 2):
    """``own_localizer`` on one captured op ``target`` whose inputs the rank holds with the values
    ``kinds`` (None: made by no op of the local routing); returns the error it raises."""
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
    info = SimpleNamespace(target=target)
    with pytest.raises(PlanError) as caught:
        own_localizer(info, strategy, tuple(ctx.inputs) if args is None else args(ctx.inputs), {}, ctx)
    return str(caught.value)


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


@pytest.mark.parametrize("kinds", [["unset", "flat", None], ["unset", "tokens", None], ["flat", "flat", None]],
                         ids=["values-not-arange", "at-token-positions", "base-written-already"])
def test_an_inverse_written_with_other_values_or_positions_is_refused(kinds):
    # inv[perm] = v: the values a placeholder (not arange(n)), the positions a token's, or the
    # base not a fresh empty_like
    message = _localize(aten.index_put_.default, kinds, Strategy((OWN, OWN, REPLICATE), OWN),
                        args=lambda xs: (xs[0], [xs[1]], xs[2]))
    assert message.startswith("index_put__default writes a rank's own rows routed alone at positions that are not "
                              "its flat rows', or values other than arange(n)"), message
    assert "it must run on every row" in message


def test_whole_rows_gathered_by_positions_that_number_none_of_them_are_refused():
    # positions among the rank's sorted rows number no row of the whole tensor
    message = _localize(aten.index.Tensor, [None, "sorted"], Strategy((REPLICATE, OWN), ROWS),
                        args=lambda xs: (xs[0], [xs[1]]))
    assert message.startswith("index_tensor gathers whole rows by a rank's own positions (sorted), which number "
                              "no rows of the whole"), message
    assert "it must gather every row" in message


def test_own_rows_gathered_by_positions_of_other_rows_are_refused():
    # the flat ids or weights gathered by token positions (perm // k), not by the sort's positions
    message = _localize(aten.index.Tensor, ["values", "tokens"], Strategy((OWN, OWN), OWN),
                        args=lambda xs: (xs[0], [xs[1]]))
    assert message.startswith("index_tensor gathers by a rank's own positions (tokens) from rows they do not "
                              f"number ({OWN})"), message
    assert "it must gather every row" in message


def test_own_rows_that_no_op_of_the_local_routing_made_are_refused():
    message = _localize(aten.histc.default, [None], Strategy((OWN,), PARTIAL))
    assert message == "histc_default reads a rank's own rows routed alone that no op of the local routing made"


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
