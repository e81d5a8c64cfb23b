"""GPT-2's tanh-GELU, written by HF as ``mul``/``pow``/``add``/``tanh``, runs on a rank as one
``aten.gelu(x, approximate="tanh")`` (``autotp/passes/activations.py``) and trains as serial does.

The serial model runs HF's module as it is (the chain of pointwise ops); the rank the fused op. On
gloo ranks, tp 1 to 4 (tp 1: the fusion runs in a program of one rank too), heads tp may not
divide, with and without sequence parallelism, float64: loss, logits and every gradient.
"""
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from autotp.testing import TOLERANCE

LAYERS = 2


@st.composite
def cases(draw):
    tp = draw(st.integers(1, 4))
    return {"tp": tp, "heads": draw(st.integers(max(tp, 2), 2 * tp + 1)), "head_dim": draw(st.sampled_from([4, 6])),
            "sequence_parallel": draw(st.booleans()) if tp > 1 else None, "seed": draw(st.integers(0, 1000))}


def activation_ops(pm) -> dict[str, int]:
    """How many tanh-GELUs the rank's program runs as ``gelu``, and how many ``tanh`` it runs."""
    aten = torch.ops.aten
    graphs = [m for m in pm.modules() if type(m).__name__ == "ParallelGraph"]
    assert graphs, "no rank program"
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    return {"gelu": sum(n.target is aten.gelu.default and n.kwargs.get("approximate") == "tanh" for n in nodes),
            "tanh": sum(n.target is aten.tanh.default for n in nodes)}


def check_fused_gelu(case: dict) -> dict:
    import autotp
    from autotp.testing import equivalence_errors, keep_loss_precision
    from autotp.testing.host import MEGATRON
    from tests.helpers import batch, tiny_gpt2

    model = keep_loss_precision(tiny_gpt2(n_layer=LAYERS, n_head=case["heads"], head_dim=case["head_dim"], vocab=64,
                                          seed=case["seed"]))
    pm = autotp.parallelize(model, case["tp"], profile="h100-dgx", batch=8, seq=32,
                            layout=MEGATRON["gpt2"] if case["tp"] > 1 else None,
                            sequence_parallel=case["sequence_parallel"])
    return {"ops": activation_ops(pm), "notes": pm.plan.notes,
            "errors": equivalence_errors(model, pm, batch(64, b=2, s=7, seed=case["seed"] + 1))}


# the fast tier runs one case (the shared four ranks, heads tp does not divide, sequence parallel);
# the slow tier draws tp 1-4
@settings(phases=[Phase.explicit], deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(case={"tp": 4, "heads": 6, "head_dim": 4, "sequence_parallel": True, "seed": 3})
@given(case=cases())
def test_gpt2_tanh_gelu_runs_as_one_gelu_and_trains_as_serial(cluster_of, case):
    check_gpt2_fused_gelu(cluster_of, case)


def check_gpt2_fused_gelu(cluster_of, case: dict) -> None:
    for rank, r in enumerate(cluster_of(case["tp"]).run(check_fused_gelu, case)):
        assert r["ops"] == {"gelu": LAYERS, "tanh": 0}, (rank, r["ops"])
        said = f"activations fused: {LAYERS} tanh-GELU regions of 8 pointwise ops"
        assert any(n.startswith(said) for n in r["notes"]), r["notes"]
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOLERANCE[torch.float64], (rank, worst, r["errors"][worst])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(case=cases())
def test_gpt2_tanh_gelu_fused_24_cases(cluster_of, case):
    check_gpt2_fused_gelu(cluster_of, case)
