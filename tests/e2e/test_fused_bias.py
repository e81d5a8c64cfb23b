"""A product's bias added inside the product on a rank (``autotp/passes/fused_bias.py``), as the
serial model adds it, trains as serial does.

GPT-2's Conv1D runs ``addmm(bias, x, W)``; capture splits it into the product and an add, and a
rank's program ran both: one kernel and one pass over the output more than serial, a product. Now
the column-parallel products (c_attn, c_fc: the bias split like the columns, nothing between)
run ``linear(x, W.T, b)`` again; the row-parallel ones keep their add after the g (their bias is
added once, to the sum). Heads that tp does not divide (uneven splits of c_attn's columns), with
and without sequence parallelism, float64 on gloo ranks: loss, logits and every gradient.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotp.testing import TOLERANCE


@st.composite
def cases(draw):
    tp = draw(st.integers(2, 4))
    heads = draw(st.sampled_from([h for h in range(tp + 1, 3 * tp) if h % tp]))
    return {"tp": tp, "heads": heads, "head_dim": draw(st.sampled_from([4, 6])),
            "sequence_parallel": draw(st.booleans()), "seed": draw(st.integers(0, 1000))}


def fused_products(pm) -> tuple[int, int]:
    """(products with their bias inside, bare products) in the rank's program."""
    aten = torch.ops.aten
    graphs = [m for m in pm.modules() if type(m).__name__ == "ParallelGraph"]
    assert graphs, "no rank program"
    fused = bare = 0
    for node in graphs[0].graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.addmm.default or (node.target is aten.linear.default and len(node.args) == 3
                                                 and node.args[2] is not None):
            fused += 1
        elif node.target in (aten.mm.default, aten.matmul.default, aten.linear.default):
            bare += 1
    return fused, bare


def check_fused_bias(case: dict) -> dict:
    import autotp
    from autotp import zoo
    from autotp.testing import equivalence_errors, keep_loss_precision
    from autotp.testing.host import MEGATRON

    config = zoo.tiny_config("gpt2", layers=2, heads=case["heads"], head_dim=case["head_dim"], vocab=64,
                             positions=32)
    model = keep_loss_precision(zoo.build("gpt2", config, dtype=torch.float64, seed=case["seed"]))
    batch = zoo.example_batch("gpt2", config, batch=2, seq=7, seed=case["seed"] + 1)
    pm = autotp.parallelize(model, case["tp"], profile="h100-dgx", batch=8, seq=32, layout=MEGATRON["gpt2"],
                            sequence_parallel=case["sequence_parallel"])
    return {"products": fused_products(pm), "errors": equivalence_errors(model, pm, batch)}


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(case=cases())
def test_column_parallel_biases_run_inside_their_products_and_train_as_serial(cluster_of, case):
    for rank, r in enumerate(cluster_of(case["tp"]).run(check_fused_bias, case)):
        # two layers: c_attn and c_fc with their bias inside; c_proj (row) twice bare, and the head
        assert r["products"] == (4, 5), (rank, r["products"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOLERANCE[torch.float64], (rank, worst, r["errors"][worst])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(case=cases())
def test_column_parallel_biases_inside_their_products_30_cases(cluster_of, case):
    test_column_parallel_biases_run_inside_their_products_and_train_as_serial.hypothesis.inner_test(cluster_of, case)
