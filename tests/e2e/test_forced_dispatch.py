"""A forced all-to-all dispatch whose experts' output rows are summed whole, against serial.

``expert_dispatch=True`` sends each (token, expert) row from its token's rank to its expert's by
the all-to-all, the rank having routed its own rows (``rules/local_routing.py``). With the
reverse all-to-all withdrawn (the combine by the g, what a plan takes where sending the rows back
does not pay), a tiny Mixtral layer planned at 64 x 4096 on h100-dgx makes the experts' output
rows whole (their routing weights' product run on every row) and each rank takes its own
tokens' rows back by the inverse of its sort, ``out[inv]``: a gather of whole rows by the
rank's positions among its *sorted* rows, each the row its routing numbered globally
(``LocalRouting.rows``). The rank's program once refused that gather (a ``PlanError``
"index_tensor_2 gathers whole rows by a rank's own positions (sorted, index_put__default)"): it
took the whole rows by the rank's flat rows' or tokens' positions alone. Every call (training
with the router loss, inference, a padded call, generate) equals serial in float64, forward and
every gradient, on gloo (the harness of ``tests/e2e/test_experts.py``): tp 2 in the fast tier,
tp 2-3 with drawn lengths and weights in the slow one.
"""
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autotp.testing import TOLERANCE

#: what the rank's program of the layer runs: its own routing, the dispatch, the routed products
ROUTED = ("token_rows", "route_locally", "dispatch_rows", "routed_grouped_mm")


def check_forced_dispatch_summed_whole(case: dict) -> dict:
    """On each rank: the case of ``tests/e2e/test_experts.py`` with the experts' output rows sent
    back by no reverse all-to-all (withdrawn for every program of the case, then restored)."""
    import autotp.passes.rules.experts as rules
    import autotp.passes.rules.routed as routed
    from tests.e2e.test_experts import _check_experts_case

    offered = rules.combine_back, routed._sent_back
    rules.combine_back = lambda info, inputs: []
    routed._sent_back = lambda info, placements, rule: []
    try:
        return _check_experts_case(case)
    finally:
        rules.combine_back, routed._sent_back = offered


def _case(tp: int, seq: int, seed: int) -> dict:
    return dict(family="mixtral", impl="eager", dtype="float64", tp=tp, experts=4, top_k=2, kv_heads=2, seq=seq,
                seed=seed, layers=1, plan_batch=64, plan_seq=4096, sp=True, dispatch=True)


def _assert_equals_serial(cluster_of, case: dict) -> None:
    results = cluster_of(case["tp"]).run(check_forced_dispatch_summed_whole, case)
    for rank, result in enumerate(results):
        assert set(ROUTED) <= set(result["routed"]), (case, rank, result["routed"])
        assert "combine_rows" not in result["routed"], (case, rank, result["routed"])
        # the experts' output rows made whole (each rank's put in place and summed by a g), each
        # rank's tokens' rows taken back from them by the inverse of its own sort
        assert ("g", "P(routed 0)", "R") in result["comms"], (case, rank, result["comms"])
        bound = result["bound"] or TOLERANCE[torch.float64]
        for key, error in result["errors"].items():
            assert error <= bound, (case, rank, key, error, bound)
        assert result["generate"], (case, rank, "greedy generate differs from serial")


# slow tier: 20 s on two cores; the fast tier runs the all-to-all dispatch against serial compiled
# (tests/e2e/test_compile.py) and builds a forced dispatch plan's programs (tests/runtime/test_plan_arguments.py)
@pytest.mark.slow
@pytest.mark.parametrize("tp, seq, seed", [(2, 7, 1), (3, 8, 2)])
def test_a_forced_dispatch_summed_whole_equals_serial(cluster_of, tp, seq, seed):
    _assert_equals_serial(cluster_of, _case(tp, seq, seed))


@pytest.mark.slow   # 30-60 s an example on two loaded cores
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(tp=st.sampled_from([2, 3]), seq=st.integers(3, 9), seed=st.integers(0, 2**16))
@example(tp=3, seq=5, seed=7)   # tp 3, a length it does not divide, in every run
def test_a_forced_dispatch_summed_whole_equals_serial_drawn(cluster_of, tp, seq, seed):
    _assert_equals_serial(cluster_of, _case(tp, seq, seed))
