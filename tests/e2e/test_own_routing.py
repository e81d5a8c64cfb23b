"""A rank routing its own (token, expert) rows beyond the zoo's tiny defaults, against serial.

DeepSeek-V3 with its router group-limited (4 experts in 2 groups, each token's 2 experts from its
best group: the tiny config's one group makes the group mask trivial) routes its own rows by
cost, every call exact in float64 at tp 2 (tests/e2e/test_experts.py's harness; slow tier).

gpt-oss's biases picked where a rank routes its own rows: the pick equals serial's.

gpt-oss adds a bias per expert to each grouped product's rows, picked by the sorted expert ids
(``gate_up_proj_bias[expert_ids_g]``, counted into the products' ``offs``). Where the rank routes
its own (token, expert) rows (rules/local_routing.py), the pick takes its experts' rows among
every row sorted by expert from the ``offs`` every rank holds (``expert_routing.sorted_pick``).
The down product's bias is added after the product, so its rows go back to their tokens' ranks
by the reverse all-to-all as a conversion of the biased rows (``P(sent 0) -> P(tokens 0,
reordered)``, ``CombineRows`` on the layer's dispatch plan), and the solver takes that routing by
cost: the training program against serial in float64, loss, logits and every gradient, tp 2
(uneven runs) and tp 3, and the later programs (inference, padded call, generate). Drawn (slow
tier): experts, top-k, tp 2-3, the length and the weights, with the router loss, on the harness
of tests/e2e/test_experts.py. Before, the solver kept the whole sort and summed the ``[T*k, h]``
rows by a g (a test withheld the whole sort to run the rank's own routing at all).

A layer that counts its sorted rows per expert by ``bincount`` with ``minlength`` every expert
(tests/test_experts_local_routing_work.bincount_experts, on Mixtral) takes the counts its sort
exchanged, as a ``histc`` does: hypothesis draws tp 2-3, the length and the seed, float64 against
serial (slow tier); before, its ids were all-gathered and sorted whole on every rank.

A router that sorts by ``argsort`` and gathers its ids by it (transformers' grouped experts so
written, tests/test_experts_local_routing_work.argsort_experts, on Mixtral) routes its own rows
by cost, float64 against serial at tp 2 (slow tier); before, ``argsort`` ran whole on every rank.
"""
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autotp.testing import TOLERANCE
from tests.test_experts_local_routing_work import ARGSORT, BINCOUNT, STABLE

#: the reverse all-to-all of the biased rows, a conversion (the plan's collective)
SENT_BACK = ("all_to_all", "P(sent 0)", "P(tokens 0, reordered)")


def check_own_routing(case: dict) -> dict:
    import autotp
    from autotp import zoo
    from autotp.testing import equivalence_errors, relative_error, tolerance, keep_loss_precision

    family, impl = case.get("family", "gpt-oss"), "eager"
    if case.get("counting"):   # an experts implementation of the tests' own (argsort, bincount)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        from tests.test_experts_local_routing_work import IMPLEMENTATIONS

        impl, forward = IMPLEMENTATIONS[case["counting"]]
        ALL_EXPERTS_FUNCTIONS.register(impl, forward)
    config = zoo.tiny_config(family, layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2,
                             output_router_logits=False)
    config._experts_implementation = impl
    model = zoo.build(family, config, dtype=torch.float64, seed=case["seed"])
    batch = zoo.example_batch(family, config, batch=2, seq=case["seq"], seed=case["seed"] + 1)
    keep_loss_precision(model)
    pm = autotp.parallelize(model, case["tp"], layout={"*.experts.*": "expert"}, batch=64, seq=4096,
                            sequence_parallel=True, profile="h100-dgx", expert_dispatch=True)
    errors = equivalence_errors(model, pm, batch)
    program = pm.programs[0].graph_module
    ran = sorted({getattr(n.target, "__name__", "") for n in program.graph.nodes if n.op == "call_function"}
                 | {type(program.get_submodule(n.target)).__name__ for n in program.graph.nodes
                    if n.op == "call_module"})
    ids = batch["input_ids"]
    with torch.no_grad():
        errors["inference logits"] = relative_error(pm(input_ids=ids).logits, model(input_ids=ids).logits)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        got, want = pm(input_ids=ids, attention_mask=mask), model(input_ids=ids, attention_mask=mask)
        errors["padded logits"] = relative_error(got.logits[mask.bool()], want.logits[mask.bool()])
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    got = pm.generate(ids, max_new_tokens=3, do_sample=False)
    return {"errors": errors, "ran": ran, "generate": bool(torch.equal(want, got)),
            "bound": tolerance(model, batch)}


# slow tier: 25 s on two cores; the fast tier runs a rank routing its own rows against serial
# (tests/e2e/test_experts.py, mixtral-etp-tokens-own-routing-offered) and plans gpt-oss's own routing
# (tests/passes/test_experts_dispatch_plan.py)
@pytest.mark.slow
@pytest.mark.parametrize("tp, seq, seed", [(2, 7, 1), (3, 8, 2)])
def test_a_rank_routing_its_own_rows_picks_gpt_oss_biases_as_serial(cluster_of, tp, seq, seed):
    for rank, result in enumerate(cluster_of(tp).run(check_own_routing, dict(tp=tp, seq=seq, seed=seed))):
        assert {"RouteLocally", "sorted_pick", "DispatchRows", "CombineRows"} <= set(result["ran"]), (rank, result["ran"])
        bound = result["bound"] or TOLERANCE[torch.float64]
        for key, error in result["errors"].items():
            assert error <= bound, (rank, key, error, bound)
        assert result["generate"], (rank, "greedy generate differs from serial")


@pytest.mark.slow   # 30 s on two loaded cores; the fast tier counts its sort (tests/test_experts_local_routing_work.py)
@pytest.mark.parametrize("counting", [ARGSORT, STABLE])
def test_a_router_sorting_by_argsort_routes_its_own_rows_as_serial(cluster_of, counting):
    # argsort, or a sort asked stable (aten.sort.stable: before, no rule, run whole with a warning)
    case = dict(family="mixtral", counting=counting, tp=2, seq=7, seed=3)
    for rank, result in enumerate(cluster_of(2).run(check_own_routing, case)):
        assert {"RouteLocally", "DispatchRows"} <= set(result["ran"]), (rank, result["ran"])
        bound = result["bound"] or TOLERANCE[torch.float64]
        for key, error in result["errors"].items():
            assert error <= bound, (rank, key, error, bound)
        assert result["generate"], (rank, "greedy generate differs from serial")


@pytest.mark.slow   # 40 s on two loaded cores; the fast tier runs its router's ops (tests/passes/test_router_rows.py)
def test_a_group_limited_router_routes_its_own_rows_as_serial(cluster_of):
    from tests.e2e.test_experts import assert_experts_case

    assert_experts_case(cluster_of, dict(
        family="deepseek-v3", impl="eager", dtype="float64", tp=2, experts=4, top_k=2, kv_heads=2, seq=6, seed=5,
        layers=1, plan_batch=64, plan_seq=4096, sp=True, config=dict(n_group=2, topk_group=1),
        # the dispatch forced: by cost (the gathers around the all-to-all priced since a9ea17a) this
        # tiny layer gathers its tokens whole instead, and the case is here for the rank's own routing
        # (and its rows sent as they lie: no row map of the tokens, token_rows, since f062c02)
        dispatch=True,
        routed=("route_locally", "dispatch_rows", "combine_rows", "token_sums_in_order")))


def _assert_routes_its_own_rows_as_serial(cluster_of, case: dict) -> None:
    for rank, result in enumerate(cluster_of(case["tp"]).run(check_own_routing, case)):
        assert {"RouteLocally", "routed_counts", "DispatchRows"} <= set(result["ran"]), (rank, result["ran"])
        bound = result["bound"] or TOLERANCE[torch.float64]
        for key, error in result["errors"].items():
            assert error <= bound, (rank, key, error, bound)
        assert result["generate"], (rank, "greedy generate differs from serial")


@pytest.mark.slow   # 30-60 s an example on two loaded cores; the fast tier counts its sort and count
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(tp=st.sampled_from([2, 3]), seq=st.integers(5, 9), seed=st.integers(0, 50))
def test_a_bincount_of_the_sorted_ids_takes_the_exchanged_counts_as_serial(cluster_of, tp, seq, seed):
    _assert_routes_its_own_rows_as_serial(cluster_of, dict(family="mixtral", counting=BINCOUNT, tp=tp, seq=seq, seed=seed))


@pytest.mark.slow   # about a minute an example on two loaded cores
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.fixed_dictionaries({"tp": st.sampled_from([2, 3]), "experts": st.sampled_from([3, 4]),
                                   "top_k": st.sampled_from([1, 2]), "seq": st.integers(4, 9),
                                   "seed": st.integers(0, 2**16)}))
@example(case={"tp": 3, "experts": 4, "top_k": 2, "seq": 8, "seed": 5})   # tp 3 in every run
def test_gpt_oss_rows_sent_back_after_the_bias_equal_serial_drawn(cluster_of, case):
    # each rank routes its own rows, sends them to their experts' ranks, adds the down product's
    # biases there and sends the rows back by the reverse all-to-all (a conversion, by cost), where
    # the routing weights' product and the top-k sum run on its own tokens: training with the router
    # loss (loss, logits, every gradient), inference, the padded call and generate against serial,
    # float64 (3 experts at tp 2: uneven runs of experts; at tp 3 one each). The dispatch is forced:
    # by cost it loses where it sends more than gathering the tokens does (top-1 at tp 2 with 3
    # experts: the busiest rank's 2 of 3 experts receive 2/3 of the rows), and the path is what is
    # checked here; generate's decode step, with no sequence to split, is planned by cost and says so.
    # Top-1: one row a token, no top-k sum
    from tests.e2e.test_experts import assert_experts_case

    sums = ("token_sums_in_order",) if case["top_k"] > 1 else ()
    assert_experts_case(cluster_of, dict(
        family="gpt-oss", impl="eager", dtype="float64", kv_heads=2, layers=1, plan_batch=64, plan_seq=4096, sp=True,
        dispatch=True, dropped=("expert_dispatch=True does not hold in the program of a generation step",),
        routed=("token_rows", "route_locally", "dispatch_rows", "combine_rows") + sums,
        comms={SENT_BACK: True}, **case))


def check_with_every_top_k_sum_sorted(case: dict) -> dict:
    """:func:`check_own_routing` planned as if every top-k sum on its tokens' ranks sorted and
    gathered its rows (an earlier pricing's, blind to the rows a rank routed alone coming back in
    its tokens' order): the solver then views the top-k rows by token and sums them otherwise."""
    import dataclasses

    import autotp.cost_model.kernels as kernels

    priced = kernels.token_sums_work

    def sorted_always(op):
        op.in_place[0] = dataclasses.replace(op.in_place[0], ascending=False)
        return priced(op)

    kernels.token_sums_work = sorted_always   # every program of the case, then restored (a worker runs many)
    try:
        return check_own_routing(case)
    finally:
        kernels.token_sums_work = priced


@pytest.mark.slow   # about a minute an example on two loaded cores
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(tp=st.sampled_from([2, 3]), seq=st.integers(5, 9), seed=st.integers(0, 50))
def test_a_top_k_sum_priced_dearer_takes_a_plan_its_ranks_build_as_serial(cluster_of, tp, seq, seed):
    # that pricing once tipped the view of the top-k rows [T*k, h] -> [T, k, h] to a "merge split
    # along k" (rules/token_rows.token_split), which no rank could build: its programs raised
    # "splits rows back ... that no merge of those dims made" (tests/passes/test_token_split_rows.py)
    case = dict(family="mixtral", tp=tp, seq=seq, seed=seed)
    for rank, result in enumerate(cluster_of(tp).run(check_with_every_top_k_sum_sorted, case)):
        assert {"RouteLocally", "DispatchRows"} <= set(result["ran"]), (rank, result["ran"])
        bound = result["bound"] or TOLERANCE[torch.float64]
        for key, error in result["errors"].items():
            assert error <= bound, (rank, key, error, bound)
        assert result["generate"], (rank, "greedy generate differs from serial")
