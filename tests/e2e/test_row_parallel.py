"""Row-parallel with a free weight (autotp/passes/rules/matrix.py), chosen by the solver, computes
what the serial model computes: loss, logits and every gradient, float64; then, on the same
ParallelModule, an inference call and greedy ``generate``.

Two cases at tp 4 (2 kv heads, fewer than the ranks; 6 heads, dealt unevenly):

* ``kv-row``: Qwen2-7B's plan at tp 8 made tiny (tests/passes/test_row_plan.py plans it at the
  real shape): layer 0's k and v row-parallel on x split by its features, their partial sums
  summed (a g, or a reduce-scatter along the sequence) before attention; layer 1's k and v
  weights whole on the rank's tokens (the residual stream runs sequence-parallel there; each
  weight's gradient summed by an f) and k/v gathered along the sequence into attention;
* ``tight``: q/k/v pinned whole (attention computed whole on every rank) and o_proj pinned
  ``row``: its x (whole) converted to a fresh split in whole heads (uneven, the extra head rotated
  by layer), which keeps 1/4 of x for backward where the fastest plan's column keeps it all. (A
  memory limit of 85% of the fastest plan's chose it once; priced today, with sequence parallelism
  and the activations each layout keeps, the row plan needs 92.5% of the fastest's and a column
  plan of another layout fits under 85%, so the case pins what it is here to run.)

A tiny model prices as a large one under a profile whose FLOP rate is scaled down with its width
(an H100's / 100 for hidden 24 against Qwen2-7B's 3584) and whose products run at that rate
whatever their shape, as Qwen2-7B's nearly do (contracting 3584, or 448 split 8 ways: 0.97 or
0.82 of the rate by the profile's depth term; 24 or 6 here would be priced at 0.19 or 0.06 of it,
so the tiny model's row splits, which shorten the contraction, would cost what the large model's
do not), with the e2e families' batch 64 x seq 4096 workload.
"""
from dataclasses import replace

import pytest
import torch

STRUCTURE = dict(heads=6, kv_heads=2, head_dim=4, tp=4, batch=2, seq=7)
WHOLE_QKV = {"*.q_proj.*": "replicate", "*.k_proj.*": "replicate", "*.v_proj.*": "replicate"}


def check_row_case(case: dict) -> dict:
    import autotp
    from autotp import zoo
    from autotp.cost_model.devices import PROFILES
    from autotp.testing import equivalence_errors, keep_loss_precision, relative_error, tolerance
    from tests.e2e.test_families import rescale_zero_gradients

    h100 = PROFILES["h100-dgx"]
    # products at the scaled FLOP rate whatever their shape (no size or depth term): see the module docstring
    profile = replace(h100, name="h100-flops/100", flops=h100.flops / 100, product_half_work=0.0, product_half_k=0.0)
    config = zoo.tiny_config("qwen2", layers=2, heads=case["heads"], kv_heads=case["kv_heads"],
                             head_dim=case["head_dim"], vocab=48)
    model = keep_loss_precision(zoo.build("qwen2", config, dtype=torch.float64, seed=case["seed"]))
    batch = zoo.example_batch("qwen2", config, batch=case["batch"], seq=case["seq"], seed=case["seed"] + 1)
    workload = dict(batch=64, seq=4096, profile=profile)
    if case["name"] == "tight":
        # this plan runs sequence parallelism: its logits, split along the sequence, come back gathered
        # (returned split, their DTensor stated the capture's length: 11 tokens for 7)
        workload.update(layout={**WHOLE_QKV, "*.o_proj.weight": "row"})
    pm = autotp.parallelize(model, case["tp"], **workload)
    plan = pm.plan
    names = [n for n in plan.roles if ".layers." in n and n.endswith("proj.weight")]
    roles = {n.split("layers.")[1]: plan.roles[n] for n in names}
    placements = {n.split("layers.")[1]: str(plan.params[n]) for n in names}
    sliced = [(c.module, c.src, c.dst) for c in plan.comms if c.kind == "scatter"]
    comms = [(c.kind, c.module, c.tensor, c.src, c.dst) for c in plan.comms]
    errors = rescale_zero_gradients(model, pm, equivalence_errors(model, pm, batch))
    # after the training call, on the same ParallelModule: an inference call and greedy generate
    # (their programs captured from the weightless twin, run with the plan's slices)
    ids = batch["input_ids"]
    with torch.no_grad():
        errors["inference logits"] = relative_error(pm(input_ids=ids).logits, model(input_ids=ids).logits)
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    got = pm.generate(ids, max_new_tokens=3, do_sample=False)
    # the dtype's bound, or float32's where the model casts down: Qwen2's RMSNorm computes its
    # variance in float32, which a plan summing it in another order (the kv-row plan's residual
    # split by features: the mean of squares summed from 4 parts) moves by float32's rounding
    # (the embedding's gradient, which only the first norm's backward reaches: 2.8e-9 to 5.8e-9
    # relative on the 4 ranks, every other gradient within 4e-16)
    return {"roles": roles, "placements": placements, "sliced": sliced, "comms": comms, "errors": errors,
            "tolerance": tolerance(model, batch), "generate": bool(torch.equal(want, got))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kv-row", "tight"])
def test_row_parallel_with_a_free_weight_equals_serial(cluster_of, name):
    case = dict(STRUCTURE, name=name, seed=5)
    for rank, result in enumerate(cluster_of(case["tp"]).run(check_row_case, case)):
        roles, placements = result["roles"], result["placements"]
        for layer in (0, 1):
            got = [roles[f"{layer}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            if name == "kv-row":
                want = ["column", "row", "row", "row"] if layer == 0 else ["column", "replicate", "replicate", "row"]
                assert got == want, (rank, layer, roles)
            else:
                assert got == ["replicate", "replicate", "replicate", "row"], (rank, roles)
                # pinned "row": split along its input features as the pin reads them (the solver's own
                # choice was whole heads, the extra one rotated by layer: S(1/4), S(1/4@1))
                assert placements[f"{layer}.self_attn.o_proj.weight"].startswith("S(1"), placements
        if name == "kv-row":
            # layer 0: k and v row-parallel on x as it arrives (split by features), their partial sums
            # summed by a g each (or reduce-scattered along the sequence, gathered before attention;
            # the bias then added on the rank's tokens, its gradient summed by an f)
            for proj in ("k_proj", "v_proj"):
                into = [c[0] for c in result["comms"]
                        if c[1] == f"model.layers.0.self_attn.{proj}" and not c[2].startswith("p_")]
                assert into in (["g"], ["reduce_scatter"]), (proj, into)
            # layer 1: k and v weights whole on the rank's tokens (an f each), k/v gathered along the sequence
            attention = "model.layers.1.self_attn"
            for proj in ("k_proj", "v_proj"):
                weight = f"p_{attention.replace('.', '_')}_{proj}_weight"
                assert [c[0] for c in result["comms"] if c[2] == weight] == ["f"], (proj, result["comms"])
            gathered = [(c[0], c[3]) for c in result["comms"] if c[1] == attention]
            assert gathered.count(("all_gather_f", "S(2)")) == 2, gathered
        else:   # attention's output, whole, sliced for o_proj in every layer (as the pin splits its rows)
            for layer in (0, 1):
                assert [c for c in result["sliced"] if c[0] == f"model.layers.{layer}.self_attn.o_proj"
                        and c[1] == "R" and c[2].startswith("S(2")], result["sliced"]
        assert result["generate"], (rank, name, "greedy generate after training differs from serial")
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= result["tolerance"], (rank, worst, result["errors"][worst])
