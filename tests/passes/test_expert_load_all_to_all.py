"""The all-to-all dispatch and combine at the router's load (autotp/planner/expert_load.py): the rank
whose experts receive the most rows sets the dispatch's time, sends the same rows back in the combine,
and sorts and indexes them in the dispatch's plan. gpt-oss's combine is a conversion after the
experts' biases (``rules/experts.sends_back``), priced apart from the products' own all-to-alls."""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import autotp
from autotp import zoo
from autotp.plan.expert_load import ExpertLoad
from autotp.planner.expert_load import shares

#: a tiny gpt-oss at the smallest workload where the solver sends the biased rows back by the
#: reverse all-to-all (the dispatch forced; at 2 x 16 tokens it sums them by the g instead)
TP, BATCH, SEQ, EXPERTS, TOP_K = 2, 8, 32, 4, 2
PLANNING = dict(batch=BATCH, seq=SEQ, profile="h200", layout={"*.experts.*": "expert"}, sequence_parallel=True,
                expert_dispatch=True)
LAYER = "model.layers.0.mlp.experts"
#: the reverse all-to-all as a plan lists it
BACK = ("P(sent 0)", "P(tokens 0, reordered)")


def _gpt_oss(device: str = "meta"):
    config = zoo.tiny_config("gpt-oss", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=EXPERTS,
                             top_k=TOP_K, output_router_logits=False)
    torch.manual_seed(0)
    model = zoo.build("gpt-oss", config, device=device, dtype=torch.float32)
    if device != "meta":
        with torch.no_grad():   # expert 0 (rank 0's at tp 2) in every token's top-k: rank 0 the busiest
            model.model.layers[0].mlp.router.bias[0] += 10.0
    return model


def _memory_seconds(work, profile) -> float:
    """An OpWork's seconds as the cost model prices memory-bound kernels (cost_model.symbolic.split_seconds)."""
    return (sum(float(b) / profile.bandwidth(cls) for cls, b in work.moved) + work.launches * profile.launch_s
            + work.passes * profile.sort_pass_s)


# ---- the dispatch plan's integer kernels ----------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([2, 4, 8]), per_rank=st.sampled_from([1, 2, 3]), uneven=st.booleans(),
       tokens=st.integers(8, 1 << 16), k=st.sampled_from([1, 2, 8]), data=st.data())
def test_the_dispatch_plans_kernels_grow_with_the_busiest_ranks_share(tp, per_rank, uneven, tokens, k, data):
    """Both dispatch plans (a whole sort's and a rank's own routing's) sort and index the rows that
    arrive: priced at the busiest rank's share of them, they cost a balanced router's at a uniform
    load (to rounding) and never less for a larger share."""
    from autotp.cost_model import get_profile
    from autotp.cost_model.routing import dispatch_plan_work, local_dispatch_plan_work

    profile = get_profile("h200")
    experts = tp * per_rank + (1 if uneven else 0)   # uneven: rank 0 holds one more
    rows = sympy.Integer(tokens * k)
    uniform = max(shares([1.0] * experts, tp))
    low = data.draw(st.floats(uniform, 1.0), label="share")
    high = data.draw(st.floats(low, 1.0), label="busier share")
    for plan in (lambda share: dispatch_plan_work(rows, experts, tp, None, share),
                 lambda share: local_dispatch_plan_work(rows / tp, experts, tp, None, share)):
        balanced = _memory_seconds(plan(None), profile)
        assert _memory_seconds(plan(uniform), profile) == pytest.approx(balanced, rel=1e-9)
        at_low, at_high = _memory_seconds(plan(low), profile), _memory_seconds(plan(high), profile)
        assert balanced * (1 - 1e-9) <= at_low <= at_high * (1 + 1e-9), (balanced, at_low, at_high)
    if high > 2 * uniform:   # the rows that arrive are the load's, not a balanced router's
        assert _memory_seconds(dispatch_plan_work(rows, experts, tp, None, high), profile) > balanced


# ---- the combine by the reverse all-to-all, a conversion ------------------------------------------
@pytest.fixture(scope="module")
def _sending_back():
    """The tiny gpt-oss planned with the dispatch forced: its index, propagation and profile."""
    from autotp.api import capture_model
    from autotp.cost_model import get_profile
    from autotp.planner.planner import build_plan

    class Planned(tuple):
        def __repr__(self) -> str:   # hypothesis prints a failing case's arguments
            return "<the tiny gpt-oss's index, propagation and profile>"

    cap = capture_model(_gpt_oss(), (), None)
    _, index, prop = build_plan(cap, TP, **PLANNING)
    return Planned((index, prop, get_profile("h200")))


def _sent_back(index, prop):
    """The tensor the plan sends back by the reverse all-to-all (the experts' biased rows), and the
    grouped product that dispatched the rows."""
    from autotp.cost_model.routing import dispatches
    from autotp.cost_model.work import RankOp
    from autotp.passes.rules.experts import sends_back

    nodes = {n.name: n for n in prop.chosen}
    (node,) = [nodes[c.tensor] for c in prop.comms if sends_back(c.src, c.dst)]
    (product,) = [(n, s) for n, s in prop.chosen.items()
                  if dispatches(RankOp(index.infos[n], s, TP, 2, None, None))]
    return node, product


@settings(max_examples=10, deadline=None)
@given(rows=st.lists(st.integers(0, 60), min_size=EXPERTS, max_size=EXPERTS).filter(lambda r: sum(r) > 0),
       more=st.integers(1, 60))
def test_the_combine_and_the_dispatch_plan_grow_with_the_busiest_ranks_share(_sending_back, rows, more):
    """At a load, the reverse all-to-all (the conversion the solver and the plan's walk price) and the
    dispatching product's kernels cost what a balanced router's do at a uniform load, never less at a
    skewed one, and more again where the busiest rank's experts get more rows."""
    from autotp.cost_model.symbolic import split_seconds
    from autotp.passes.propagate import conversion_seconds, load_share, pay
    from autotp.passes.rules.experts import SENT, SENT_BACK
    from autotp.planner.expert_load import apply_load

    index, prop, profile = _sending_back
    node, (product, sends) = _sent_back(index, prop)
    meta, grad = index.infos[node].output, node in index.grads

    def priced(load):
        apply_load(index, load, {LAYER: EXPERTS})
        share = load_share(index, node)
        combine = pay(index, profile, meta, SENT, frozenset(), SENT_BACK, False, grad, share)[0]
        assert combine == conversion_seconds(index, profile, meta, SENT, SENT_BACK, False, grad, share)
        kernels = split_seconds(index.infos[product], sends, index.env, profile, TP, index.align)["memory"]
        return share, combine, kernels

    try:
        _, balanced, balanced_kernels = priced(None)
        _, uniform, uniform_kernels = priced(ExpertLoad({LAYER: [1] * EXPERTS}))
        share, at, at_kernels = priced(ExpertLoad({LAYER: rows}))
        busiest = max(range(TP), key=lambda r: shares(rows, TP)[r])
        busier = [r + (more if e // (EXPERTS // TP) == busiest else 0) for e, r in enumerate(rows)]
        more_share, at_more, more_kernels = priced(ExpertLoad({LAYER: busier}))
    finally:
        apply_load(index, None, {LAYER: EXPERTS})
    assert share == pytest.approx(max(shares(rows, TP)), rel=1e-12)
    assert uniform == pytest.approx(balanced, rel=1e-12)
    assert uniform_kernels == pytest.approx(balanced_kernels, rel=1e-9)
    assert balanced * (1 - 1e-12) <= at <= at_more, (balanced, at, at_more, rows)
    assert balanced_kernels * (1 - 1e-9) <= at_kernels <= more_kernels, (balanced_kernels, at_kernels, more_kernels)
    if share < 1:   # rows added to the busiest rank's experts: more to receive, sort and send back
        assert more_share > share and at < at_more and at_kernels < more_kernels


def test_the_plans_cost_expressions_price_both_all_to_alls_at_the_load():
    """The plan's expressions in b and s give the predicted seconds at a skewed load too (the
    dispatch inside the product, the combine a conversion, each at the busiest rank's rows)."""
    model = _gpt_oss()
    plan = autotp.plan(model, tp=TP, **PLANNING, expert_load={LAYER: [30, 20, 5, 1]})
    a2a = [c for c in plan.comms if c.kind == "all_to_all" and "tokens" in c.src + c.dst]
    assert [(c.src, c.dst) for c in a2a][-1] == BACK, plan.comms
    balanced = autotp.plan(model, tp=TP, **PLANNING)
    rows = {(c.src, c.dst): c.fwd_bytes for c in balanced.comms if c.kind == "all_to_all"}
    for c in a2a:   # rank 0's experts get 50 of 56 rows: 50/56 * 2 of a balanced router's
        assert c.fwd_bytes == pytest.approx(rows[(c.src, c.dst)] * 50 / 56 * TP, rel=1e-12), c
    b, s = sympy.symbols("b s", integer=True, positive=True)
    for key in ("compute_s", "comm_s"):
        expr = sympy.sympify(plan.expressions[key], locals={"b": b, "s": s})
        assert float(expr.subs({b: BATCH, s: SEQ})) == pytest.approx(getattr(plan, key), rel=1e-4), key


def test_the_busiest_ranks_combine_sends_back_the_rows_the_cost_model_prices():
    """On the fake backend's rank 0 (its peers routing as it does, benchmarks/fake_peers.py), the
    rows its experts receive in the dispatch and send back in the combine, counted off the
    all-to-alls it calls; planned at the load that describes that world (rank 0's experts those
    rows, the rest evenly), the plan's combine sends exactly the rows it counted to the other rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autotp.distributed.experts as E
    from benchmarks.fake_peers import fake_rank, mirrored_peers
    from benchmarks.op_timer import module_step

    model = _gpt_oss("cpu")
    batch = zoo.example_batch("gpt-oss", model.config, batch=BATCH, seq=SEQ, seed=0)
    calls: list[tuple[str, list, list, int]] = []
    exchange = E._all_to_all

    def counted(x, send, recv, group, op):
        calls.append((op, list(send), list(recv), x.shape[-1]))
        return exchange(x, send, recv, group, op)

    dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    try:
        with fake_rank(0, TP), mirrored_peers(), pytest.MonkeyPatch.context() as m:
            m.setattr(E, "_all_to_all", counted)
            pm = autotp.parallelize(model, TP, device="cpu", **PLANNING)
            module_step(pm, batch)()
            del pm
    finally:
        dist.destroy_process_group()
    (_, _, got, hidden), = [c for c in calls if c[0] == "all_to_all of rows (expert dispatch)"]
    (_, sent, _, _), = [c for c in calls if c[0] == "all_to_all of rows (expert combine)"]
    received, total = sum(got), BATCH * SEQ * TOP_K
    assert sum(sent) == received > total / TP, (sent, got)   # the busiest rank sends back what it received
    rest = (total - received) / 2
    plan = autotp.plan(model, tp=TP, **PLANNING, expert_load={LAYER: [received / 2, received / 2, rest, rest]})
    (back,) = [c for c in plan.comms if c.kind == "all_to_all" and (c.src, c.dst) == BACK]
    row_bytes = hidden * autotp.cost_model.get_profile("h200").dtype_bytes
    assert back.fwd_bytes == pytest.approx((received - sent[0]) * row_bytes, rel=1e-12), (back, sent)
