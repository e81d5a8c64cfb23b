"""Sequence parallelism where a model flattens the batch and the sequence into one dim (OPT's
decoder layer: ``hidden_states.reshape(-1, h)`` before ``final_layer_norm``/fc1, ``.view(shape)``
after fc2, dropout and the residual add), on real gloo ranks, float64, against serial.

A rank's part of ``[b, s/tp, h]`` flattened is ``b`` runs of its share of the sequence (the
tokens' rows, ``P(tokens 0)``): the layer norm, fc2's bias add, dropout and the residual add run on
those rows, fc2's partial sum is reduce-scattered into them and fc1 reads them all-gathered with
its f fused in. Each example draws tp, the batch (one or more sequences) and lengths tp does not
divide (and one shorter than tp: a rank with no tokens); every call is a training call (loss,
logits, every gradient) and the plan must hold both collectives of the merged rows."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotp import zoo
from autotp.testing import TOLERANCE, equivalence_errors, keep_loss_precision

#: OPT's Megatron layout: q, k, v and fc1 column-parallel, out_proj and fc2 row-parallel (at these
#: widths the cost model keeps the tiny layers whole unpinned)
MEGATRON_OPT = {"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
                "*.out_proj.weight": "row", "*.fc1.weight": "column", "*.fc2.weight": "row"}
#: the merged rows' placement as the plan prints it
ROWS = "P(tokens 0)"


def merged_rows_case(case: dict) -> dict:
    """On each rank: the tiny OPT parallelized with sequence parallelism forced, its errors
    against serial at each length and the plan's collectives into and out of the merged rows."""
    import autotp

    config = zoo.tiny_config("opt", layers=case["layers"], heads=4, kv_heads=None, head_dim=4, vocab=37)
    model = keep_loss_precision(zoo.build("opt", config, dtype=torch.float64, seed=case["seed"]))
    pm = autotp.parallelize(model, case["tp"], batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True,
                            layout=MEGATRON_OPT)
    errors = {}
    for seq in case["lengths"]:
        gen = torch.Generator().manual_seed(case["seed"] + seq)
        ids = torch.randint(3, 37, (case["batch"], seq), generator=gen)
        for name, err in equivalence_errors(model, pm, {"input_ids": ids, "labels": ids}).items():
            errors[f"s={seq} {name}"] = err
    comms = [(c.kind, c.src, c.dst) for c in pm.plan.comms]
    return {"errors": errors, "comms": comms}


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([2, 3]))
    lengths = draw(st.lists(st.integers(tp + 1, 11).filter(lambda s: s % tp), min_size=1, max_size=2, unique=True))
    return {"tp": tp, "layers": draw(st.integers(1, 2)), "batch": draw(st.integers(1, 3)),
            "lengths": lengths + [tp - 1], "seed": draw(st.integers(0, 2**16))}


def _check(cluster_of, case: dict) -> None:
    for rank, r in enumerate(cluster_of(case["tp"]).run(merged_rows_case, case)):
        comms = r["comms"]
        assert ("reduce_scatter", "P", ROWS) in comms, (case, comms)   # fc2's sum into the rows
        assert ("all_gather_f", ROWS, "R") in comms, (case, comms)     # the rows into fc1, f fused
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOLERANCE[torch.float64], (case, rank, worst, r["errors"][worst])


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_opt_mlp_on_merged_rows_equals_serial(cluster_of, case):
    _check(cluster_of, case)


def test_opt_mlp_on_merged_rows_two_sequences_at_tp_2(cluster_of):
    # a batch of two: each rank's rows are two runs, not one contiguous block of [b*s, h]
    _check(cluster_of, {"tp": 2, "layers": 2, "batch": 2, "lengths": [7, 1], "seed": 11})
