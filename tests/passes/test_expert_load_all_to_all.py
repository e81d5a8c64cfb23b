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

#: a tiny gpt-oss at a workload where the solver sends the biased rows back by the reverse
#: all-to-all (the dispatch forced). It does from 224 x 32 tokens; at 208 x 32 it sums them by the
#: g instead, the row gathers around the reverse all-to-all (four launches a layer) priced
#: (``propagate.dispatched_rows_seconds``; before, it sent them back from 8 x 32)
TP, BATCH, SEQ, EXPERTS, TOP_K = 2, 256, 32, 4, 2
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
        with torch.no_grad():   # expert 0 (rank 0's at tp 2) in every token's top-k: rank 0 the busiest;
            # expert 1 (rank 0's too) picked less, so that the busiest rank's share (about 0.6) still
            # sends its rows back by the reverse all-to-all (at about 0.68, the g of the combine is cheaper)
            model.model.layers[0].mlp.router.bias[0] += 10.0
            model.model.layers[0].mlp.router.bias[1] -= 0.1
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
    dispatch inside the product, the combine a conversion, each at the busiest rank's rows). At a
    stronger skew (rank 0's experts 40 of 56 rows or more) the combine by the g is the cheaper:
    the reverse all-to-all's bytes and its row gathers grow with the busiest rank's rows."""
    model = _gpt_oss()
    plan = autotp.plan(model, tp=TP, **PLANNING, expert_load={LAYER: [20, 15, 12, 9]})
    a2a = [c for c in plan.comms if c.kind == "all_to_all" and "tokens" in c.src + c.dst]
    assert [(c.src, c.dst) for c in a2a][-1] == BACK, plan.comms
    balanced = autotp.plan(model, tp=TP, **PLANNING)
    rows = {(c.src, c.dst): c.fwd_bytes for c in balanced.comms if c.kind == "all_to_all"}
    for c in a2a:   # rank 0's experts get 35 of 56 rows: 35/56 * 2 of a balanced router's
        assert c.fwd_bytes == pytest.approx(rows[(c.src, c.dst)] * 35 / 56 * TP, rel=1e-12), c
    b, s = sympy.symbols("b s", integer=True, positive=True)
    for key in ("compute_s", "comm_s"):
        expr = sympy.sympify(plan.expressions[key], locals={"b": b, "s": s})
        assert float(expr.subs({b: BATCH, s: SEQ})) == pytest.approx(getattr(plan, key), rel=1e-4), key


@pytest.fixture(scope="module")
def _fake_rank_step():
    """One training step of the tiny gpt-oss on the fake backend's rank 0 (its peers routing as it
    does, benchmarks/fake_peers.py), the busiest rank (expert 0 in every token's top-k): every
    row move around an all-to-all of rows it calls (``experts._to_experts``, ``_to_tokens``), as
    ``(what, send, recv, row width, bytes its kernels read and wrote, kernels)``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autotp.distributed.experts as E
    from autotp.testing.work import WorkCounter
    from benchmarks.fake_peers import fake_rank, mirrored_peers
    from benchmarks.op_timer import module_step

    model = _gpt_oss("cpu")
    batch = zoo.example_batch("gpt-oss", model.config, batch=BATCH, seq=SEQ, seed=0)
    calls: list[tuple[str, list, list, int, int, int]] = []

    class Kernels(WorkCounter):   # the bytes, and every kernel that moves them (not allocations, collectives)
        kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.moved
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.kernels += self.moved > before
            return out

    def counted(move, back):
        def run(x, plan, group, what):
            with Kernels() as work:
                out = move(x, plan, group, what)
            send, recv = (plan.recv, plan.send) if back else (plan.send, plan.recv)   # as its all-to-all sends
            calls.append((what, list(send), list(recv), x.shape[-1], work.moved, work.kernels))
            return out
        return run

    dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    try:
        with fake_rank(0, TP), mirrored_peers(), pytest.MonkeyPatch.context() as m:
            m.setattr(E, "_to_experts", counted(E._to_experts, False))
            m.setattr(E, "_to_tokens", counted(E._to_tokens, True))
            pm = autotp.parallelize(model, TP, device="cpu", **PLANNING)
            module_step(pm, batch)()
            del pm
    finally:
        dist.destroy_process_group()
    return calls


def test_the_busiest_ranks_combine_sends_back_the_rows_the_cost_model_prices(_fake_rank_step):
    """On the fake backend's rank 0 (its peers routing as it does, benchmarks/fake_peers.py), the
    rows its experts receive in the dispatch and send back in the combine, counted off the
    all-to-alls it calls; planned at the load that describes that world (rank 0's experts those
    rows, the rest evenly), the plan's combine sends exactly the rows it counted to the other rank."""
    model = _gpt_oss()
    calls = _fake_rank_step
    (_, _, got, hidden, _, _), = [c for c in calls if c[0] == "all_to_all of rows (expert dispatch)"]
    (_, sent, _, _, _, _), = [c for c in calls if c[0] == "all_to_all of rows (expert combine)"]
    received, total = sum(got), BATCH * SEQ * TOP_K
    assert sum(sent) == received > total / TP, (sent, got)   # the busiest rank sends back what it received
    rest = (total - received) / 2
    plan = autotp.plan(model, tp=TP, **PLANNING, expert_load={LAYER: [received / 2, received / 2, rest, rest]})
    (back,) = [c for c in plan.comms if c.kind == "all_to_all" and (c.src, c.dst) == BACK]
    row_bytes = hidden * autotp.cost_model.get_profile("h200").dtype_bytes
    assert back.fwd_bytes == pytest.approx((received - sent[0]) * row_bytes, rel=1e-12), (back, sent)


def test_the_row_gathers_around_each_all_to_all_are_priced_as_the_busiest_rank_runs_them(_sending_back,
                                                                                        _fake_rank_step):
    """The rows the busiest rank receives are put in their experts' order by a gather (``experts.
    _to_experts``; the combine and every backward the mirror, ``_to_tokens``); the rows it sends
    leave as they lie, its own routing having sorted them by expert (no ``DispatchPlan.order``). Counted on the fake backend's rank 0 (the bytes its kernels read
    and write, float32 rows), and priced at the load that describes that world (rank 0's experts
    the rows they received, the rest evenly) with the dispatch inside the product
    (``internal_copy_seconds``) and the combine a conversion (``layout_copy_seconds``): the priced
    bytes and kernels are the counted ones, forward and backward. A uniform load prices as a
    balanced router."""
    import dataclasses

    from autotp.cost_model.symbolic import numel
    from autotp.passes.propagate import (at_load, internal_copy_seconds, layout_copy_seconds, load_share, moved_bytes,
                                         sends_own_order)
    from autotp.passes.rules.experts import SENT_ALONE, SENT_BACK, sends_back
    from autotp.planner.expert_load import apply_load

    index, prop, h200 = _sending_back
    node, (product, sends) = _sent_back(index, prop)
    calls = {c[0]: c for c in _fake_rank_step}
    dispatch = [calls["all_to_all of rows (expert dispatch)"], calls["all_to_all of rows (expert dispatch, backward)"]]
    combine = [calls["all_to_all of rows (expert combine)"], calls["all_to_all of rows (expert combine, backward)"]]
    assert len(calls) == 4 and all(sum(c[2]) > BATCH * SEQ * TOP_K / TP for c in dispatch[:1] + combine[1:])
    assert all(sum(c[1]) > BATCH * SEQ * TOP_K / TP for c in dispatch[1:] + combine[:1])   # sent back
    received, total = sum(dispatch[0][2]), BATCH * SEQ * TOP_K
    rest = (total - received) / 2
    # seconds that are the bytes moved (launches free), or the kernels launched (bytes free);
    # rows of float32 at 4 bytes, as the fake rank runs them
    as_bytes = dataclasses.replace(h200, dtype_bytes=4, mem_bw=1.0, class_bw=(("elementwise", 1.0),), launch_s=0.0)
    as_kernels = dataclasses.replace(as_bytes, mem_bw=float("inf"), launch_s=1.0)
    (kind, meta), = sends.internal
    back = index.infos[node].output

    def priced(profile, load):
        apply_load(index, load, {LAYER: EXPERTS})
        try:
            share = load_share(index, product)
            assert share == load_share(index, node)
            sent = internal_copy_seconds(kind, at_load(moved_bytes(index, profile, meta), share, TP), profile,
                                         numel(meta.shape[:1], index.env), TP, alone=sends_own_order(sends),
                                         share=share)
            full = at_load(moved_bytes(index, profile, back), share, TP)
            returned = layout_copy_seconds("all_to_all", back, sent_rows, SENT_BACK, full, profile, TP,
                                           node in index.grads, index, share)
            return sent, returned
        finally:
            apply_load(index, None, {LAYER: EXPERTS})

    # the rank's own routing ordered the rows: they leave as they lie, and the rows sent back (marked
    # so) come back into those places, neither by a gather
    assert kind == "all_to_all" and node in index.grads and sends_own_order(sends)
    (sent_rows,) = {c.src for c in prop.comms if sends_back(c.src, c.dst)}
    assert sent_rows == SENT_ALONE
    world = ExpertLoad({LAYER: [received / 2, received / 2, rest, rest]})
    for profile, counted in ((as_bytes, 4), (as_kernels, 5)):
        sent, returned = priced(profile, world)
        assert sent == pytest.approx(sum(c[counted] for c in dispatch), rel=1e-12), (sent, dispatch)
        assert returned == pytest.approx(sum(c[counted] for c in combine), rel=1e-12), (returned, combine)
        uniform = priced(profile, ExpertLoad({LAYER: [1] * EXPERTS}))
        assert uniform == pytest.approx(priced(profile, None), rel=1e-12)
        if profile is as_bytes:   # the busiest rank receives more than 1/tp of the rows (as many kernels)
            assert uniform[0] < sent and uniform[1] < returned
