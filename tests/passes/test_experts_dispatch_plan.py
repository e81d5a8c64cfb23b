"""The all-to-all expert dispatch and combine in the plan: where the tokens arrive split along the
sequence, the solver weighs sending each (token, expert) row to its expert's rank (an all-to-all,
and the reverse one backward) against gathering every token on every rank, and sending each
expert's output row back to its token's rank (the reverse all-to-all) against the g of the
``[tokens, hidden]`` combine, by cost."""
import re

import pytest
import torch

import autotp
from autotp import zoo
from autotp.passes.rules.contract import Strategy

#: the workload and device where sequence parallelism pays (the regions between the products
#: split along s) and a rank's tokens are worth sending, not gathering
WORKLOAD = dict(seq=4096, profile="h100-dgx", sequence_parallel=True)
#: a tiny model's products pay for their collectives at a larger batch only
TINY_BATCH, BATCH = 64, 2
#: the dispatch's and the reverse combine's (source, destination) placements
SEND, BACK = ("P(tokens 0, reordered)", "P(sent 0)"), ("P(sent 0)", "P(tokens 0, reordered)")
#: a tiny Mixtral layer whose tokens are worth sending at tp 2 and batch 64 (not at batch 8): one
#: expert a token, so a rank sends (tp-1)/tp^2 = 1/4 of the T*k = T rows each way, half the
#: (tp-1)/tp of the [T, h] tokens an all-gather brings, and 128-byte rows (hidden 64), so the
#: row gathers around each all-to-all (a row's bytes read and written, 8 bytes of its position
#: read) cost less than the bytes the all-to-all spares. (At top-2 and hidden 32 an all-to-all's
#: rows weigh what the gather's tokens do at tp 2, and its row gathers tip it to gathering them.)
DISPATCHING = dict(layers=1, heads=4, kv_heads=2, head_dim=16, vocab=48, experts=4, top_k=1)


def dispatched(c) -> bool:
    """An all-to-all of (token, expert) rows, not a reshard of one split to another (both S)."""
    return c.kind == "all_to_all" and not c.src.startswith("S(")


def _dispatch_offered(monkeypatch, offered: bool) -> None:
    import autotp.passes.rules.token_rows as rules

    if not offered:   # the flattened tokens of a sequence split have no placement: gathered whole
        monkeypatch.setattr(rules, "token_rows", lambda info, p: None)


def _combine_offered(monkeypatch, offered: bool) -> None:
    import autotp.passes.rules.experts as rules
    import autotp.passes.rules.routed as routed

    if not offered:   # the experts' output rows stay on their ranks: summed by the g
        monkeypatch.setattr(rules, "combine_back", lambda info, inputs: [])
        # nor sent back after the product (the reverse all-to-all as a conversion)
        monkeypatch.setattr(routed, "_sent_back", lambda info, placements, rule: [])


def _expressions_agree(plan, batch: int) -> None:
    """The plan's cost expressions in b and s give the costs the solver priced, at the workload."""
    import sympy

    b, s = sympy.symbols("b s", integer=True, positive=True)
    for key in ("compute_s", "comm_s"):
        expr = sympy.sympify(plan.expressions[key], locals={"b": b, "s": s})
        assert float(expr.subs({b: batch, s: WORKLOAD["seq"]})) == pytest.approx(getattr(plan, key), rel=1e-4), key


def _plan(model, tp: int, **kwargs):
    return autotp.plan(model, tp=tp, layout={"*.experts.*": "expert"}, batch=TINY_BATCH if tp == 2 else BATCH,
                       **WORKLOAD, **kwargs)


def test_the_dispatch_is_priced_as_an_all_to_all_and_chosen_where_cheaper(monkeypatch):
    # one tiny Mixtral layer at tp 2: the rows a rank sends are its tokens' top-k rows bound for
    # the other rank's experts, (tp-1)/tp^2 of every (token, expert) row, each way
    config = zoo.tiny_config("mixtral", **DISPATCHING)
    model = zoo.build("mixtral", config, device="meta")
    plan = _plan(model, 2)
    a2a = [c for c in plan.comms if dispatched(c)]
    # the dispatch, and the combine by the reverse all-to-all (the experts' output rows, as wide)
    # (the rows a rank sends are its tokens' rows sorted by expert, not in sequence order)
    assert [(c.src, c.dst) for c in a2a] == [SEND, BACK], plan.comms
    rows = TINY_BATCH * WORKLOAD["seq"] * config.num_experts_per_tok
    for c in a2a:
        assert c.fwd_bytes == c.bwd_bytes == rows * config.hidden_size * 2 * (2 - 1) / 2 ** 2
    # the tokens are not gathered before the router (its softmax and top-k run on a rank's own)
    assert not [c for c in plan.comms if c.kind in ("all_gather", "all_gather_f") and ".mlp" in c.module
                and c.src.startswith("S(")]
    # the expert ids and routing weights stay on their tokens' ranks, each routing its own rows
    # (rules/local_routing.py): the one collective of the routing is the all-gather of the
    # experts' row counts (before, the ids and weights were all-gathered whole, T*k rows each)
    assert not [c for c in plan.comms if c.src == "P(tokens 0)"], plan.comms
    counts = [c for c in plan.comms if c.src == "P(tokens 0, reordered, own)"]
    assert [(c.kind, c.fwd_bytes, c.bwd_bytes) for c in counts] == [("all_gather", 2 * 4 * 8 / 2, 0.0)], plan.comms
    # 64 x 4096 rows of 64 bf16 numbers, a quarter of them sent each way: 8388608 bytes
    assert any(n.startswith("experts model.layers.0.mlp.experts: the tokens arrive split along the sequence")
               and "all-to-all (8.39 MB/rank each way per layer" in n for n in plan.notes), plan.notes
    gathered = _without_dispatch(monkeypatch, model, 2)
    assert not [c for c in gathered.comms if dispatched(c)]
    assert plan.cost["step_s"] < gathered.cost["step_s"]


def test_the_combine_by_the_reverse_all_to_all_replaces_the_g_where_cheaper(monkeypatch):
    # the experts' output rows go back to their tokens' ranks, where the routing weights' product
    # and the top-k sum run on the rank's own tokens: their [tokens, hidden] sum is the rank's run
    # of the sequence, with no collective of the combine at all (the experts' partial sum to the
    # residual add, reduce-scattered there along the sequence; before a cast to its own dtype
    # passed a Partial, a g, then the scatter to the sequence split)
    config = zoo.tiny_config("mixtral", **DISPATCHING)
    model = zoo.build("mixtral", config, device="meta")
    plan = _plan(model, 2)
    def combine(p):   # the g of the experts' Partial output or of their partial rows, and its scatter
        # to the sequence split, after the dispatch (the attention's residual may be cut from a
        # gather shared with the norm)
        first = next(i for i, c in enumerate(p.comms) if dispatched(c))
        return [(c.kind, c.src, c.fwd_bytes) for c in p.comms[first:]
                if (".mlp" in c.module and c.src in ("P", "P(routed 0)")) or c.kind == "scatter"
                or (c.kind == "reduce_scatter" and c.src == "P")]

    assert combine(plan) == [] and len([c for c in plan.comms if dispatched(c)]) == 2, plan.comms
    assert any(n.startswith("experts model.layers.0.mlp.experts: each expert's output row goes back to its token's "
                            "rank by the reverse all-to-all (8.39 MB/rank") for n in plan.notes), plan.notes
    # with no way back, the dispatch forced (unforced, the solver then gathers the tokens whole
    # after the router: the dispatch pays only with the combine by the reverse all-to-all): the
    # experts' partial rows are summed by the g, whole (one expert a token: the [T*k, h] rows are
    # as wide as the [T, h] sum, all-reduced in bf16), the routing weights' product on every row
    summed = _without_combine(monkeypatch, model, 2, expert_dispatch=True)
    assert [(c.src, c.dst) for c in summed.comms if dispatched(c)] == [(SEND[0], "P(routed 0)")]
    rows = TINY_BATCH * WORKLOAD["seq"] * config.num_experts_per_tok
    assert combine(summed) == [("g", "P(routed 0)", rows * config.hidden_size * 2)], summed.comms
    assert plan.cost["step_s"] < summed.cost["step_s"]
    assert plan.cost["step_s"] < _without_combine(monkeypatch, model, 2).cost["step_s"]


def _without_dispatch(monkeypatch, model, tp):
    with monkeypatch.context() as m:
        _dispatch_offered(m, False)
        return _plan(model, tp)


def _without_combine(monkeypatch, model, tp, **kwargs):
    with monkeypatch.context() as m:
        _combine_offered(m, False)
        return _plan(model, tp, **kwargs)


@pytest.mark.slow   # two real-size plans per model: 6-7 s each on two loaded cores
@pytest.mark.parametrize("size", ["mixtral-8x7b"])
def test_real_size_moe_at_tp8_takes_the_dispatch_under_sequence_parallelism(monkeypatch, size):
    # measured when written (h100-dgx, 2 layers, 2 x 4096): Mixtral-8x7B 21.76 ms/step with the
    # dispatch vs 23.40 gathering the tokens. With the combine by the reverse all-to-all:
    # Mixtral-8x7B 20.85 vs 21.82 with the dispatch and the g combine (h200: 18.23 vs 19.15).
    # Top-2 of 8 experts at tp 8: a rank sends 2 * 7/64 of a token's row each way, a quarter of
    # the 7/8 an all-gather of the tokens brings. (Qwen3-30B-A3B, top-8: the test below.)
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=2), device="meta")
    plan = _plan(model, 8)
    # one dispatch and one combine per layer
    assert [(c.src, c.dst) for c in plan.comms if dispatched(c)] == \
        [SEND, BACK] * 2
    assert plan.cost["step_s"] < _without_dispatch(monkeypatch, model, 8).cost["step_s"]
    assert plan.cost["step_s"] < _without_combine(monkeypatch, model, 8).cost["step_s"]


@pytest.mark.slow   # a real-size capture and two plans per length: about 15-25 s on two loaded cores
@pytest.mark.parametrize("seq, sends", [(4096, False), (8192, True)])
def test_real_size_qwen3_at_tp8_sends_its_rows_where_cheaper_than_gathering_its_tokens(seq, sends):
    # Qwen3-30B-A3B routes each token to 8 experts: at tp 8 a rank sends 8 * 7/64 = 7/8 of a
    # token's row each way, the bytes the all-gather of the tokens brings. At 2 x 4096 (h100-dgx)
    # the dispatch's row gathers (priced since) and its routing kernels tip it to gathering the
    # tokens whole after the router: 15.742 ms/step against 15.757 forced (h200: 13.297 against
    # 13.415; with the gathers priced at zero the dispatch was taken, 13.24). At 2 x 8192 the
    # dispatch is taken, by 0.328 ms/step (28.192 against 28.519), its rows summed by the g: the
    # reverse all-to-all, with its own row gathers, is not taken at this width (Mixtral-8x7B's
    # top-2 takes it above)
    size = "qwen3-30b-a3b"
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=2), device="meta")
    workload = dict(WORKLOAD, seq=seq)
    plan = autotp.plan(model, tp=8, layout={"*.experts.*": "expert"}, batch=BATCH, **workload)
    other = autotp.plan(model, tp=8, layout={"*.experts.*": "expert"}, batch=BATCH, expert_dispatch=not sends,
                        **workload)
    sending, gathering = (plan, other) if sends else (other, plan)
    # each layer sends its rows (and sums them back by the g), where the dispatch is taken or forced
    assert [(c.src, c.dst) for c in sending.comms if dispatched(c)] == [(SEND[0], "P(routed 0)")] * 2, sending.comms
    assert not [c for c in gathering.comms if dispatched(c)], gathering.comms
    note, word, _, so = _versus(plan)
    assert ("by an all-to-all" in note) is sends and ("are gathered whole after the router" in note) is not sends
    assert word == "cheaper than" and plan.cost["step_s"] < other.cost["step_s"], (plan.cost, other.cost)
    assert so == pytest.approx(other.cost["step_s"] * 1e3, abs=1e-3)


def test_the_dispatch_is_not_offered_without_a_sequence_split():
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    model = zoo.build("mixtral", config, device="meta", dtype=torch.float32)
    plan = autotp.plan(model, tp=2, layout={"*.experts.*": "expert"}, batch=2, seq=4096, profile="h100-dgx",
                       sequence_parallel=False)
    assert not [c for c in plan.comms if dispatched(c) or "tokens" in str(c.src)]


def test_a_dispatching_layer_is_priced_one_host_read():
    # a dispatching layer reads the host once (tests/runtime/test_host_syncs.py counts it): its
    # bounds, the split sizes and how many (token, expert) rows are of the rank's tokens, at once;
    # priced once, at the reorder of the rank's tokens' rows (before: three reads, all priced)
    from autotp.capture.cache import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.symbolic import step_breakdown
    from autotp.planner.planner import build_plan

    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    cap = capture(zoo.build("mixtral", config, device="meta"), (), None)
    h200 = get_profile("h200")
    _, index, prop = build_plan(cap, 2, batch=TINY_BATCH, seq=WORKLOAD["seq"], profile=h200,
                                layout={"*.experts.*": "expert"}, sequence_parallel=True)
    assert any(str(s.inputs[0]) == "P(tokens 0)" for s in prop.chosen.values() if s.inputs), "no dispatch chosen"
    assert step_breakdown(index, prop, h200)["host_reads"] == pytest.approx(h200.host_read_time())


def test_a_dispatch_whose_rows_no_reorder_gathered_for_it_prices_a_read_of_its_own():
    # the fold into one read needs the reorder of the rank's tokens' rows to reach the product
    # through casts alone (OpInfo.x_gathered): that reorder's read, priced there, is then the
    # layer's one; otherwise the reorder keeps its nonzero and the product reads its sizes itself
    from autotp.passes.rules.row_reads import host_reads
    from autotp.passes.rules.contract import OpInfo, Strategy
    from autotp.placements import REPLICATE, Routed, Shard

    dispatch = Strategy((Routed(0, tokens=True, reordered=True), Shard(0), REPLICATE), Routed(0, sent=True))
    info = OpInfo(torch.ops.aten._grouped_mm.default, (), {}, (), None, 2)
    assert host_reads(info, dispatch) == 1
    info.x_gathered = True
    assert host_reads(info, dispatch) == 0


#: the note's comparison: "... by X ms/step (every MoE layer so: Y ms)"
VERSUS = re.compile(r"(cheaper than|dearer than|tied with) (.+) by ([0-9.]+) ms/step \(every MoE layer so: ([0-9.]+) ms\)")


def _tiny_mixtral():
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    return zoo.build("mixtral", config, device="meta")


def _dispatching_mixtral():
    return zoo.build("mixtral", zoo.tiny_config("mixtral", **DISPATCHING), device="meta")


def _versus(plan) -> tuple[str, str, float, float]:
    (note,) = [n for n in plan.notes if n.startswith("experts ") and "split along the sequence" in n]
    word, other, delta, so = VERSUS.search(note).groups()
    return note, word, float(delta), float(so)


@pytest.mark.parametrize("batch, taken", [(TINY_BATCH, True), (8, False)])
def test_the_note_says_by_how_much_the_way_taken_beats_the_other(batch, taken):
    # a tiny top-1 Mixtral layer at tp 2 (DISPATCHING): the dispatch is chosen at batch 64 (5.612
    # ms/step on h100-dgx against 5.681 gathering the tokens whole after the router), the tokens
    # gathered whole at batch 8 (1.114 against 1.206: a rank's own routing, its dispatch's kernels
    # and its row gathers, priced as run, outweigh the rows it spares at so few); the note names
    # the way taken and what the plan forced the other way costs
    model = _dispatching_mixtral()
    plan = autotp.plan(model, tp=2, layout={"*.experts.*": "expert"}, batch=batch, **WORKLOAD)
    other = autotp.plan(model, tp=2, layout={"*.experts.*": "expert"}, batch=batch, expert_dispatch=not taken,
                        **WORKLOAD)
    assert any(dispatched(c) for c in plan.comms) is taken
    assert any(dispatched(c) for c in other.comms) is not taken   # the flag forces the other way
    note, word, delta, so = _versus(plan)
    # not taken, the tokens are gathered after the router, which runs on each rank's own tokens
    assert ("by an all-to-all" in note) is taken and ("are gathered whole after the router" in note) is not taken
    assert word == "cheaper than"
    assert so == pytest.approx(other.cost["step_s"] * 1e3, abs=1e-3)
    assert delta == pytest.approx((other.cost["step_s"] - plan.cost["step_s"]) * 1e3, abs=2e-3)


def test_the_note_solves_the_other_way_without_calling_a_rule_again(monkeypatch):
    # the note's second solve (expert_dispatch the other way: a filter on what the rules offer)
    # reads the strategies the first solve had the rules make: before, it cleared them and called
    # every rule again for every input it had seen (here three calls each: the plan's solve, the
    # solve without the dispatch and the one without the reverse all-to-all)
    import autotp.passes.propagate as propagate

    calls: dict = {}
    rule = propagate.strategies

    def counted(info, actual):
        calls[id(info), actual] = calls.get((id(info), actual), 0) + 1
        return rule(info, actual)

    monkeypatch.setattr(propagate, "strategies", counted)
    plan = autotp.plan(_tiny_mixtral(), tp=2, layout={"*.experts.*": "expert"}, batch=TINY_BATCH, **WORKLOAD)
    assert _versus(plan)[1] == "cheaper than"   # the note, and so the second solve, was made
    assert calls and max(calls.values()) == 1, sorted(calls.values())[-5:]


def test_expert_dispatch_false_gathers_the_tokens_and_forced_ways_say_so():
    plan = autotp.plan(_dispatching_mixtral(), tp=2, layout={"*.experts.*": "expert"}, batch=TINY_BATCH,
                       expert_dispatch=False, **WORKLOAD)
    # no all-to-all: the tokens are gathered whole for the experts (after the router, which runs on
    # each rank's own tokens where that is cheaper: here)
    assert not [c for c in plan.comms if dispatched(c) or "sent" in c.src + c.dst or "reordered" in c.src + c.dst]
    note, word, _, _ = _versus(plan)
    assert "are gathered whole after the router, which runs on each rank's own tokens (expert_dispatch=False)" \
        in note and word == "dearer than", note


@pytest.mark.parametrize("kwargs, says", [
    (dict(expert_dispatch="all_to_all"), "expert_dispatch='all_to_all': choose None"),
    (dict(expert_dispatch=True, host_reads=False), "expert_dispatch=True reads its split sizes on the host"),
    # (before: "no feasible plan: no strategy fits grouped_mm_fallback_default" under whole experts)
    (dict(expert_dispatch=True, sequence_parallel=False, layout={"*.experts.*": "expert"}),
     "expert_dispatch=True sends the tokens a rank holds along the sequence"),
])
def test_a_bad_expert_dispatch_is_a_config_error(kwargs, says):
    with pytest.raises(autotp.ConfigError, match=re.escape(says)):
        autotp.plan(_tiny_mixtral(), tp=2, batch=2, seq=16, profile="h100-dgx", **kwargs)


@pytest.fixture
def fake_rank():
    """One rank of tp 2 on torch's ``fake`` backend: parallelize plans and rewrites every
    program as it would on a real rank (its collectives return at once, so no value is checked)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_a_forced_dispatch_holds_in_the_inference_program(fake_rank, caplog):
    # expert_dispatch=True with sequence parallelism forced: the first program (the training
    # call) sends its rows by the all-to-all. The inference call's program was once planned by a
    # greedy walk under the plan's placements, which left its tokens whole (sequence parallelism
    # is forced in the first program alone) and took the gather of their rows routed; forced, the
    # cast after it had no strategy (a PlanError), so parallelize planned it by cost with a note
    # that the dispatch did not hold (planner/experts.forced_dispatch_dropped, still the way out
    # where no plan keeps it). The solver plans later programs under the placements now, and finds
    # the forced dispatch there too: the same all-to-alls, no note
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    model = zoo.build("mixtral", config, dtype=torch.float32, seed=1)
    pm = autotp.parallelize(model, 2, layout={"*.experts.*": "expert"}, batch=TINY_BATCH, expert_dispatch=True,
                            **WORKLOAD)
    batch = zoo.example_batch("mixtral", config, batch=2, seq=8, seed=2)
    pm(**batch).loss.backward()
    assert [(c.src, c.dst) for c in pm.plan.comms if dispatched(c)] == [SEND, BACK]
    with torch.no_grad(), caplog.at_level("WARNING", logger="autotp"):
        assert pm(input_ids=batch["input_ids"]).logits.shape == (2, 8, config.vocab_size)
    (program,) = [p for p in pm.programs if "labels" not in p.capture.input_keys]
    assert [(c.src, c.dst) for c in program.plan.comms if dispatched(c)] == [SEND, BACK]
    said = "expert_dispatch=True does not hold"
    assert not [n for n in program.plan.notes if said in n], program.plan.notes
    assert not [r for r in caplog.records if said in r.getMessage()]


@pytest.mark.parametrize("tp, rank", [(3, 1), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_a_forced_dispatch_summed_by_the_g_builds_each_ranks_program(monkeypatch, tp, rank):
    # expert_dispatch=True with the reverse all-to-all withdrawn (the combine by the g): the solver
    # makes the experts' output rows whole (the routing weights' product on every row) and each
    # rank takes its tokens' rows back by the inverse of its own sort, out[inv]: a gather of whole
    # rows by its positions among its sorted rows. The rank's program once refused it (a PlanError
    # deep in the rewrite, "index_tensor_2 gathers whole rows by a rank's own positions (sorted,
    # index_put__default)"): each position is now the global id its routing gave the row. A step
    # runs at lengths tp does and does not divide (its values against serial on gloo:
    # tests/e2e/test_forced_dispatch.py; tp 2 also in tests/runtime/test_host_syncs.py). On the
    # fake backend a rank receives its own blocks in place of the others' (the top-k ids the
    # router's all-gather brings among them), so the step runs only on a rank whose block of an
    # uneven length is no larger than the others': tp 2's rank 0, holding 3 of 5 tokens, made a
    # routing of more rows than the layer has (a row id 22 of 20)
    from tests.helpers import fake_process_group

    _combine_offered(monkeypatch, False)
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    model = zoo.build("mixtral", config, dtype=torch.float32, seed=1)
    with fake_process_group(tp, rank):
        pm = autotp.parallelize(model, tp, layout={"*.experts.*": "expert"}, batch=TINY_BATCH, expert_dispatch=True,
                                **WORKLOAD)
        kinds = [type(m).__name__ for m in pm.graph_module.modules()]
        assert kinds.count("RouteLocally") == kinds.count("DispatchRows") == 1 and "CombineRows" not in kinds, kinds
        assert ("g", "P(routed 0)", "R") in {(c.kind, c.src, c.dst) for c in pm.plan.comms}, pm.plan.comms
        for seq in (2 * tp, 2 * tp + 1):
            batch = zoo.example_batch("mixtral", config, batch=2, seq=seq, seed=2)
            pm(**batch).loss.backward()


def _routed_plan(model, tp: int, batch: int, **kwargs):
    from autotp.capture.cache import capture
    from autotp.planner.planner import build_plan

    plan, _, prop = build_plan(capture(model, (), None), tp, batch=batch, seq=4096, profile="h200",
                               layout={"*.experts.*": "expert"}, sequence_parallel=True, **kwargs)
    # what each top-k over the experts reads: a rank's own tokens (P(tokens 0)) or every token (R)
    topk = [str(s.inputs[0]) for n, s in prop.chosen.items() if n.target is torch.ops.aten.topk.default]
    return plan, topk


def test_gathered_experts_route_each_ranks_own_tokens(monkeypatch):
    # the tokens gathered whole for the experts (expert_dispatch=False: no all-to-all): the router,
    # its softmax and top-k run once per token, on the rank holding it, and the tokens and the
    # top-k ids and weights are all-gathered after it (Megatron's all-gather dispatcher), where
    # that is cheaper than gathering the tokens before the router. Before, expert_dispatch=False
    # offered no token rows at all, and the gather of the (token, expert) rows for a rank's
    # experts was offered from whole tokens alone: the router ran on every token on every rank
    config = zoo.tiny_config("qwen3-moe", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=16, top_k=4)
    model = zoo.build("qwen3-moe", config, device="meta")
    plan, topk = _routed_plan(model, 2, TINY_BATCH, expert_dispatch=False)
    assert topk == ["P(tokens 0)"], topk
    assert not [c for c in plan.comms if dispatched(c)]
    mlp = [(c.kind, c.src) for c in plan.comms if ".mlp" in c.module]
    assert ("all_gather_f", "P(tokens 0)") in mlp and ("all_gather", "S(1)") not in mlp, mlp
    assert any("gathered whole after the router, which runs on each rank's own tokens" in n for n in plan.notes)
    with monkeypatch.context() as m:   # the tokens gathered before the router, as before
        _dispatch_offered(m, False)
        before, before_topk = _routed_plan(model, 2, TINY_BATCH, expert_dispatch=False)
    assert before_topk == ["R"] and plan.cost["step_s"] < before.cost["step_s"]


@pytest.mark.slow   # a real-size capture and two plans: about 10 s on two loaded cores
def test_real_size_qwen3_gathering_its_tokens_routes_s_over_tp_tokens_per_rank(monkeypatch):
    # Qwen3-30B-A3B at tp 8, h200, 2 x 4096, whole experts per rank, the tokens gathered for them
    # (no all-to-all): each rank's router, softmax and top-k run on its s/tp tokens; its 8 ids and
    # weights per token are all-gathered, not its 2048-wide hidden state before the router.
    # Predicted when written: 13.17 ms/step against 13.34 with the router on every token.
    # (Mixtral-8x7B's top-k stays whole: its 8 probabilities per token gather in fewer bytes than
    # its 2 ids and 2 weights; its router product and softmax run on the rank's tokens.)
    size = "qwen3-30b-a3b"
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=2), device="meta")
    plan, topk = _routed_plan(model, 8, BATCH, expert_dispatch=False)
    assert topk == ["P(tokens 0)"] * 2, topk
    with monkeypatch.context() as m:
        _dispatch_offered(m, False)
        before, before_topk = _routed_plan(model, 8, BATCH, expert_dispatch=False)
    assert before_topk == ["R"] * 2 and plan.cost["step_s"] < before.cost["step_s"]


def test_a_rank_routes_its_own_rows_where_cheaper_than_the_whole_sort(monkeypatch):
    # The dispatching layer's routing (the flattened ids and weights, their sort, the counts, the
    # gathers, the inverse permutation) placed on each rank's own rows (rules/local_routing.py):
    # priced at 1/tp of the rows plus the all-gather of every rank's counts per expert, against
    # all-gathering every token's ids and sorting them whole on every rank, and taken
    config = zoo.tiny_config("mixtral", **DISPATCHING)
    model = zoo.build("mixtral", config, device="meta")
    plan = _plan(model, 2)
    own = [c for c in plan.comms if c.src.endswith(", own)")]
    # the all-gather of the counts is the sort's (route_locally exchanges them): tp * experts
    # int64 numbers, forward only, priced by the link; the histc of the sorted ids reads them
    from autotp.cost_model import get_profile

    counts = 2 * 4 * 8
    assert [(c.kind, c.tensor, c.fwd_bytes, c.bwd_bytes) for c in own] == [("all_gather", "sort_default", counts / 2,
                                                                          0.0)], plan.comms
    assert own[0].seconds == pytest.approx(get_profile("h100-dgx").all_gather_time(counts, 2))
    _expressions_agree(plan, TINY_BATCH)
    import autotp.passes.rules.routed as rules

    with monkeypatch.context() as m:   # the flattened ids and weights not offered to the rank's own routing
        m.setattr(rules, "own_merge", lambda info, p: None)
        # the dispatch forced: unforced, the whole sort's dispatch kernels (priced as run) tip
        # this tiny layer to gathering the tokens whole, dearer than the plan too
        assert plan.cost["step_s"] < _plan(model, 2).cost["step_s"]
        whole = _plan(model, 2, expert_dispatch=True)
    # every token's expert ids all-gathered (T*k int64 ids, a rank brings the other's half); the
    # routing weights stay on their tokens' ranks, where the rows come back by the reverse
    # all-to-all and are weighed
    ids = TINY_BATCH * WORKLOAD["seq"] * config.num_experts_per_tok * 8
    assert [(c.kind, c.fwd_bytes, c.bwd_bytes) for c in whole.comms if c.src == "P(tokens 0)"] == \
        [("all_gather", ids / 2, 0.0)], whole.comms
    assert [(c.src, c.dst) for c in whole.comms if dispatched(c)] == [SEND, BACK], whole.comms
    assert not [c for c in whole.comms if "own" in c.src]
    assert plan.cost["step_s"] < whole.cost["step_s"], (plan.cost, whole.cost)


def test_gpt_oss_sends_its_rows_back_after_the_bias_and_routes_its_own_where_cheaper(monkeypatch):
    # gpt-oss's down product adds its experts' biases after the product (transformers' add_), so
    # its rows cannot go back inside it (combine_back): the reverse all-to-all is a conversion of
    # the biased rows, P(sent 0) -> P(tokens 0, reordered), on the layer's dispatch plan, priced
    # as the combine's all-to-all; with it the routing weights' product and the top-k sum run on
    # each rank's own tokens, and each rank routes its own rows (its sort at T*k/tp, the counts
    # all-gathered), where the whole sort and the g of the [T*k, h] rows were taken before
    config = zoo.tiny_config("gpt-oss", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2,
                             output_router_logits=False)
    model = zoo.build("gpt-oss", config, device="meta")
    # the dispatch forced: at this tiny width the solver gathers the tokens whole, by 0.020
    # ms/step, since a rank's own routing and the dispatch's kernels are priced as run
    plan = _plan(model, 2, expert_dispatch=True)
    assert _plan(model, 2).cost["step_s"] < plan.cost["step_s"]
    a2a = [c for c in plan.comms if dispatched(c)]
    assert [(c.src, c.dst) for c in a2a] == [SEND, BACK], plan.comms
    send, back = a2a
    assert back.tensor.startswith("add__tensor"), back   # the bias added in place, then sent back
    # each way (tp-1)/tp^2 of the [T*k, h] rows, as the dispatch's of the rows it sent: the same shape
    assert back.fwd_bytes == back.bwd_bytes == send.fwd_bytes > 0, (send, back)
    assert [c.kind for c in plan.comms if c.src.endswith(", own)")] == ["all_gather"], plan.comms   # the counts
    assert not [c for c in plan.comms if ".mlp" in c.module and c.kind in ("g", "reduce_scatter")], plan.comms
    assert any("reverse all-to-all" in n for n in plan.notes), plan.notes
    _expressions_agree(plan, TINY_BATCH)
    import autotp.passes.rules.routed as rules

    with monkeypatch.context() as m:   # the conversion not offered: the plan this was before
        m.setattr(rules, "_sent_back", lambda info, placements, rule: [])
        before = _plan(model, 2, expert_dispatch=True)
    assert not [c for c in before.comms if dispatched(c) and (c.src, c.dst) == BACK], before.comms
    # each rank routes its own rows there too (the g of the combine after them): the whole sort's
    # dispatch kernels, priced as run, cost more (before they were priced, the whole sort was taken)
    assert [c.kind for c in before.comms if c.src.endswith(", own)")] == ["all_gather"], before.comms
    assert plan.cost["step_s"] < before.cost["step_s"], (plan.cost, before.cost)


def _top_k_sum(prop):
    """The node and strategy of the sum over a token's top-k rows (a routed input spanning two dims)."""
    from autotp.placements import Routed

    (found,) = [(n, s) for n, s in prop.chosen.items() if n.target is torch.ops.aten.sum.dim_IntList and s.inputs
                and isinstance(s.inputs[0], Routed) and s.inputs[0].span > 1]
    return found


@pytest.mark.parametrize("own", [True, False], ids=["own-routing", "whole-sort"])
def test_a_top_k_sum_is_priced_with_a_sort_where_its_rows_come_back_out_of_order(monkeypatch, own):
    # a rank routing its own rows puts the combine's rows back in its tokens' order by the inverse
    # of its sort (their ids ascending: token_sums_in_order sums them as they lie); the whole sort's
    # reorder renumbers them where they lie, so a top-k sum on its tokens' ranks would sort their
    # ids and gather them (token_sums): priced so, a radix sort's passes among its kernels. At
    # this tiny width that tips the whole sort's combine to the g (sent back, the rows cost the
    # sort and gather besides the same bytes at tp 2: (n-1)/n^2 of k rows a token against (n-1)/n)
    import autotp.passes.rules.routed as routed
    from autotp.capture.cache import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.symbolic import op_work
    from autotp.placements import PARTIAL, Routed
    from autotp.planner.planner import build_plan

    if not own:
        monkeypatch.setattr(routed, "own_merge", lambda info, p: None)
    cap = capture(_tiny_mixtral(), (), None)
    h200 = get_profile("h200")
    _, index, prop = build_plan(cap, 2, batch=TINY_BATCH, seq=WORKLOAD["seq"], profile=h200,
                                layout={"*.experts.*": "expert"}, sequence_parallel=True, expert_dispatch=True)
    node, chosen = _top_k_sum(prop)
    back = Routed(0, span=2, tokens=True, reordered=True, ascending=own)
    (on_tokens,) = [s for s in index.strategies(node, (back,)) if isinstance(s.output, Routed)]
    assert (op_work(index.infos[node], on_tokens, h200, 2).passes > 0) == (not own)
    assert chosen == (on_tokens if own else Strategy((Routed(0, span=2),), PARTIAL)), chosen


def _routing_nodes(index, prop, own: bool):
    """The nodes and strategies the plan prices a dispatching layer's routing kernels at: a rank's
    own sort of its ids (``route_locally``, where it routes its own rows), and the grouped
    product that sends the rows (the dispatch's split sizes and plan, from either routing)."""
    from autotp.cost_model.routing import dispatches, routes_locally
    from autotp.cost_model.work import RankOp

    def rank_op(n, s):
        return RankOp(index.infos[n], s, 2, 2, None, None)

    sorts = (torch.ops.aten.sort.default, torch.ops.aten.sort.stable)
    found = [(n, s) for n, s in prop.chosen.items() if n.target in sorts and routes_locally(rank_op(n, s))]
    assert len(found) == int(own), found
    (product,) = [(n, s) for n, s in prop.chosen.items() if dispatches(rank_op(n, s))]
    return found, product


@pytest.mark.parametrize("own", [True, False], ids=["own-routing", "whole-sort"])
def test_the_plan_prices_the_routings_kernels_as_a_rank_runs_them(monkeypatch, own):
    # the solver's price of a dispatching layer's routing is what the rank's program runs
    # (tests/cost_model/test_routing_pricing.py holds each to a tp-8 rank's ATen calls): a rank's
    # own sort with route_locally's kernels around it, and, at the product that sends the rows,
    # the dispatch's split sizes and plan, from the sort's exchanged counts where the rank
    # routed its own rows, from every row where they were sorted whole (dispatch_sizes'
    # bucketize and counts, dispatch_plan's two sorts). Before, the planner's copy of the op's
    # OpInfo dropped the router's experts (the own sort was priced as a bare radix sort, the
    # whole sort's dispatch kernels not at all); then the dispatch's kernels were priced at the
    # sort or the reorder, which do not know whether the layer dispatches (an expert-TP layer
    # that sums its rows by a g runs none)
    import dataclasses

    import autotp.passes.rules.routed as routed
    from autotp.capture.cache import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.kernels import op_work as kernels_work
    from autotp.cost_model.routing import (dispatch_plan_work, dispatch_sizes_work, local_dispatch_plan_work,
                                           local_dispatch_sizes_work, route_locally_work, sort_passes)
    from autotp.cost_model.symbolic import op_work
    from autotp.cost_model.work import RankOp
    from autotp.placements import Routed
    from autotp.planner.planner import build_plan

    if not own:
        monkeypatch.setattr(routed, "own_merge", lambda info, p: None)
    h200 = get_profile("h200")
    _, index, prop = build_plan(capture(_tiny_mixtral(), (), None), 2, batch=TINY_BATCH, seq=WORKLOAD["seq"],
                                profile=h200, layout={"*.experts.*": "expert"}, sequence_parallel=True,
                                expert_dispatch=True)
    sorts, (product, sends) = _routing_nodes(index, prop, own)
    for node, strategy in sorts:   # route_locally's kernels around the bare radix sort
        info = index.infos[node]
        assert info.routing_experts == 4
        planned = op_work(info, strategy, h200, 2)
        assert planned == kernels_work(info, strategy, 2, h200.dtype_bytes, info.train_dtype)
        bare = kernels_work(dataclasses.replace(info, routing_experts=0), strategy, 2, h200.dtype_bytes,
                            info.train_dtype)
        rows = RankOp(info, strategy, 2, h200.dtype_bytes, info.train_dtype, None).n_in[0]   # T*k/2
        around = route_locally_work(rows, 4, 2)
        assert (planned.launches, planned.passes, planned.moved) == \
            (bare.launches + around.launches, bare.passes, bare.moved + around.moved)
    info = index.infos[product]
    assert sends.inputs[0].alone == own, sends
    planned = op_work(info, sends, h200, 2)
    assert planned == kernels_work(info, sends, 2, h200.dtype_bytes, info.train_dtype)
    # the same product on rows gathered at its experts: no dispatch
    bare = kernels_work(info, dataclasses.replace(sends, inputs=(Routed(0),) + sends.inputs[1:], internal=()), 2,
                        h200.dtype_bytes, info.train_dtype)
    rows = info.inputs[0].shape[0]   # every (token, expert) row
    if own:
        around = [local_dispatch_sizes_work(4, 2), local_dispatch_plan_work(rows / 2, 4, 2)]
    else:
        around = [dispatch_sizes_work(rows, 4, 2, info.inputs[2].dtype.itemsize), dispatch_plan_work(rows, 4, 2)]
    assert planned.launches == bare.launches + sum(w.launches for w in around) > bare.launches
    assert planned.passes == bare.passes + (0 if own else 2 * sort_passes(8))
    assert planned.moved == bare.moved + tuple(m for w in around for m in w.moved)
    assert planned.products == bare.products


#: the combine note's comparison with the g
VERSUS_G = re.compile(r"no g of the combine — (cheaper than|dearer than|tied with) the g of the combine \(.+?\) "
                      r"by ([0-9.]+) ms/step \(every MoE layer so: ([0-9.]+) ms\)")


def test_the_combine_note_says_by_how_much_the_reverse_all_to_all_beats_the_g(monkeypatch):
    # the plan solved again with no row sent back (the combine inside the product or after it as a
    # conversion): the g of the combine, as the plan with the reverse all-to-all not offered costs
    model = _dispatching_mixtral()
    plan = _plan(model, 2)
    (note,) = [n for n in plan.notes if "by the reverse all-to-all" in n]
    word, delta, so = VERSUS_G.search(note).groups()
    summed = _without_combine(monkeypatch, model, 2)
    assert not [c for c in summed.comms if c.kind == "all_to_all" and c.dst.startswith("P(tokens")]
    assert word == "cheaper than"
    assert float(so) == pytest.approx(summed.cost["step_s"] * 1e3, abs=1e-3)
    assert float(delta) == pytest.approx((summed.cost["step_s"] - plan.cost["step_s"]) * 1e3, abs=2e-3)
