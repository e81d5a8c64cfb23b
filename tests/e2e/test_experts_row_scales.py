"""Routing weights on the narrower side: where a rank holds the down product's input rows
narrower than its output rows (expert-TP: ``inter / tp`` columns against ``hidden``; expert
parallelism or tp 1: ``inter`` against ``hidden``), the plan may multiply each (token, expert)
row by its routing weight before the product instead of after it (autotp/passes/row_scales.py),
and takes it where the cost model finds it cheaper. Either way the model computes what the
serial one does: loss, logits, the router loss and every gradient (the router's included),
inference, a padded call and greedy generate, float64 (``eager``: captured as the grouped
product's fallback; ``batched_mm``: a ``bmm`` of the picked matrices). The logits within
float64's bound; at tp > 1 the gradients, the router loss and the loss it is added to within
float32's (``router_grads``): the routers compute their softmax in float32 whatever the model's
dtype, so where a plan sums the routing weights' gradient or the router's statistics over the
ranks it adds float32 parts. That holds moved or not: the weights left on Mixtral's wider output
rows at tp 2 below differ from serial alike, and a Mixtral expert-parallel plan at 64 x 4096
(not moved: 72 columns against 32) measures a loss 6.0e-8 from serial on the tree before the move
existed, as on this one. The drawn cases at tp > 1 hold every output to float32's bound
(``router_bound``): an OLMoE expert-parallel plan at tp 3 and 64 x 4096, not moved, has its logits
9.8e-9 from serial on both trees too.

Families: Mixtral, Qwen3-MoE, Qwen2-MoE (a shared expert: its sigmoid gate scales a dense
product's output, which is not moved), OLMoE and DeepSeek-V3 have the shape (a per-row weight of
the down product's output). gpt-oss does not (its experts add a bias after the down product: the
weight scales product + bias, and moving it would need the bias scaled per row too); Llama-4 does
not (its router's scores scale the rows before the gate|up product already).
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.test_experts import assert_experts_case

#: the families whose routing weights scale the down product's output rows
FAMILIES = ["mixtral", "qwen3-moe", "qwen2-moe", "olmoe", "deepseek-v3"]


@pytest.mark.parametrize("case", [
    # expert-TP at tp 2: Qwen3-MoE's experts are 12 wide against a hidden size of 32, so each
    # rank's 6 columns take the weights (its gradient summed over the ranks by the weights' f)
    dict(family="qwen3-moe", impl="eager", tp=2, experts=4, top_k=2, kv_heads=2, seq=6, seed=1, layers=1,
         layout="etp", profile="h100-dgx", plan_batch=64, plan_seq=4096, sp=False,
         router_grads=True, scaled=True),
    # Mixtral's experts are 72 wide: at tp 3 a rank's 24 columns are narrower than the hidden
    # 32, on the batched path (bmm of the picked matrices, x's rows as columns)
    # (slow tier: 25 s each on two loaded cores, over the fast tier's share)
    pytest.param(dict(family="mixtral", impl="batched_mm", tp=3, experts=3, top_k=2, kv_heads=2, seq=5, seed=2,
                      layers=1, layout="etp", profile="h100-dgx", plan_batch=64, plan_seq=4096, sp=False,
                      router_grads=True, scaled=True), marks=pytest.mark.slow),
    # ... and at tp 2 its 36 are not: the weights stay on the product's output rows
    pytest.param(dict(family="mixtral", impl="batched_mm", tp=2, experts=3, top_k=2, kv_heads=2, seq=5, seed=2,
                      layers=1, layout="etp", profile="h100-dgx", plan_batch=64, plan_seq=4096, sp=False,
                      router_grads=True, scaled=False), marks=pytest.mark.slow),
    # tp 1: the whole experts, 12 columns against 32 (slow tier: 10 s on two cores; the tp-2 case
    # above holds the narrower side in the fast tier)
    pytest.param(dict(family="qwen3-moe", impl="eager", tp=1, experts=4, top_k=2, kv_heads=2, seq=5, seed=3,
                      layers=1, layout="ep", plan_batch=64, plan_seq=4096, sp=False, scaled=True),
                 marks=pytest.mark.slow),
    # expert parallelism with the all-to-all dispatch (the tokens split along the sequence, forced):
    # the weights multiply the rows the dispatch brought, before the down product, and the rows go
    # back by the reverse all-to-all (the weights' gradient summed over the ranks' rows: float32)
    # (forced: by cost, the gathers around the all-to-all priced since a9ea17a, this tiny layer
    # gathers its tokens whole; its rows are sent as they lie, no token_rows, since f062c02)
    pytest.param(dict(family="qwen3-moe", impl="eager", tp=2, experts=4, top_k=2, kv_heads=2, seq=7, seed=1,
                      layers=1, plan_batch=64, plan_seq=4096, sp=True, router_grads=True, dispatch=True,
                      routed=("dispatch_rows", "combine_rows", "token_sums_in_order"), scaled=True),
                 marks=pytest.mark.slow),
], ids=["qwen3-eager-etp-tp2", "mixtral-batched-etp-tp3", "mixtral-batched-etp-tp2-wider", "qwen3-eager-tp1",
        "qwen3-eager-tokens-a2a"])
def test_routing_weights_on_the_narrower_side_equal_serial(cluster_of, case):
    assert_experts_case(cluster_of, {**case, "dtype": "float64"})


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.fixed_dictionaries({
    "family": st.sampled_from(FAMILIES),
    "impl": st.sampled_from(["eager", "batched_mm"]),
    "tp": st.sampled_from([1, 2, 3]),
    "experts": st.sampled_from([3, 4]),
    "top_k": st.sampled_from([1, 2]),
    "kv_heads": st.just(2),
    "seq": st.integers(3, 9),
    "seed": st.integers(0, 2**16),
    "layout": st.sampled_from(["ep", "etp"]),
    "layers": st.just(1),
    "profile": st.sampled_from(["h100-dgx", None]),
    # the planning workload: at the larger one the scales' bytes outweigh the collectives' latency
    "plan_batch": st.sampled_from([8, 64]),
}).map(lambda c: {**c, "plan_seq": 4096 if c["plan_batch"] == 64 else None, "sp": False, "router_bound": c["tp"] > 1}))
def test_routing_weights_on_the_narrower_side_equal_serial_drawn(cluster_of, case):
    assert_experts_case(cluster_of, {**case, "dtype": "float64"})
