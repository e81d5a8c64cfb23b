"""A plan carries the planning arguments its programs need: ``parallelize(model, tp, plan=p)`` builds
the programs ``parallelize(model, tp, <the arguments p was made with>)`` builds, from the plan
alone and after a JSON round trip, and an argument that contradicts the plan is a ConfigError.

Before, a plan held neither ``sequence_parallel`` nor ``expert_dispatch`` (nor its workload's
profile, batch and length for the replay): parallelize(plan=p) of a plan made with sequence
parallelism and the all-to-all dispatch forced built the experts gathered and a g in its place.

One rank of tp 2 on torch's ``fake`` backend (``fake_rank``): each program's structure (its plan's
collectives, its rewritten graph, by :func:`~autotp.distributed.agreement.fingerprint`) is what is
compared; no value is checked here (tests/e2e/test_forced_dispatch.py and
tests/e2e/test_sequence_parallel_families.py run such programs against serial)."""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.errors import ConfigError
from autotp.plan import Plan

#: where sequence parallelism and the dispatch pay (tests/passes/test_experts_dispatch_plan.py)
MIXTRAL = dict(layout={"*.experts.*": "expert"}, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True,
               expert_dispatch=True)
#: a workload at which the cost model, free to choose, splits nothing along the sequence (the
#: products pinned Megatron's way: at this workload they would otherwise run whole)
LLAMA = dict(batch=2, seq=16, profile="h100-dgx", sequence_parallel=True,
             layout={"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
                     "*.o_proj.weight": "row", "*.gate_proj.weight": "column", "*.up_proj.weight": "column",
                     "*.down_proj.weight": "row"})


def _mixtral():
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    return zoo.build("mixtral", config, dtype=torch.float32, seed=1), config


def _llama():
    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48)
    return zoo.build("llama", config, dtype=torch.float32, seed=1), config


def _programs(pm, batch, structure: bool = True) -> list:
    """Every program's structure, the training call's and the inference call's: its plan's
    parameter placements and collectives, its rewritten graph and its capture
    (:func:`~autotp.distributed.agreement.fingerprint`); ``structure=False``: its collectives
    only, each as (kind, source -> destination), counted."""
    from collections import Counter

    from autotp.distributed.agreement import fingerprint

    pm(**batch).loss.backward()
    with torch.no_grad():
        pm(input_ids=batch["input_ids"])
    if not structure:
        return [Counter((c.kind, c.src, c.dst) for c in p.plan.comms) for p in pm.programs]
    return [fingerprint(p.plan, p.graph_module, p.capture.graph).sections[1:] for p in pm.programs]


def test_a_forced_dispatch_plan_alone_builds_the_programs_of_its_arguments(fake_rank):
    # before: the plan alone built the experts gathered whole and a g in place of the all-to-alls.
    # Held to the plan given its arguments again (as the sequence test below): a fresh
    # parallelize prices this real CPU model otherwise than plan() does (5.34 against 4.16 ms
    # when o_proj was replicated under both), so once the product model made splitting o_proj
    # pay, the two no longer picked the same o_proj (row there, column here)
    model, config = _mixtral()
    batch = zoo.example_batch("mixtral", config, batch=2, seq=8, seed=2)
    plan = autotp.plan(model, 2, **MIXTRAL)
    assert [c.src for c in plan.comms if c.kind == "all_to_all" and c.src.startswith("P(")] == \
        ["P(tokens 0, reordered)", "P(sent 0)"], plan.comms   # the dispatch and the combine
    wanted = _programs(autotp.parallelize(model, 2, plan=plan, **MIXTRAL), batch)
    assert len(wanted) == 2
    assert _programs(autotp.parallelize(model, 2, plan=plan), batch) == wanted
    assert _programs(autotp.parallelize(model, 2, plan=Plan.from_json(plan.to_json())), batch) == wanted


def test_a_forced_sequence_plan_alone_builds_the_programs_of_its_arguments(fake_rank):
    # before: the plan alone built its inference program with no reduce-scatter along s (planned
    # by cost, on the default profile). A replayed plan's activations are the solver's under the
    # plan's placements: at an exact tie (an all-gather before or after a float32 -> float32 cast)
    # it may take the other one than the first solve did, so against parallelize without a plan
    # the collectives are compared, and the whole structure against the plan given its arguments
    model, config = _llama()
    batch = zoo.example_batch("llama", config, batch=2, seq=8, seed=2)
    wanted = _programs(autotp.parallelize(model, 2, **LLAMA), batch, structure=False)
    plan = autotp.plan(model, 2, **LLAMA)
    replayed = _programs(autotp.parallelize(model, 2, plan=plan, **LLAMA), batch)
    assert len(wanted) == 2 and all(w[("reduce_scatter", "P", "S(1)")] == 2 for w in wanted), wanted
    for again in (plan, Plan.from_json(plan.to_json())):
        assert _programs(autotp.parallelize(model, 2, plan=again), batch, structure=False) == wanted
        assert _programs(autotp.parallelize(model, 2, plan=again), batch) == replayed


def test_the_plan_records_its_arguments_and_says_so():
    model, _ = _mixtral()
    plan = autotp.plan(model, 2, **MIXTRAL)
    assert plan.sequence_parallel is True and plan.expert_dispatch is True
    assert plan.fuse_activations is True and plan.fuse_norms is True and plan.host_reads is True
    again = Plan.from_json(plan.to_json())
    assert (again.sequence_parallel, again.expert_dispatch) == (True, True)
    text = str(plan)
    assert "sequence parallelism: forced" in text and "expert dispatch: all-to-all, forced" in text
    by_cost = autotp.plan(_llama()[0], 2, batch=2, seq=16, profile="h100-dgx")
    assert by_cost.sequence_parallel is None and "sequence parallelism: by cost" in str(by_cost)


def test_an_argument_contradicting_the_plan_is_an_error(fake_rank):
    model, _ = _llama()
    plan = autotp.plan(model, 2, **LLAMA)
    with pytest.raises(ConfigError, match=r"sequence_parallel=False.*made with sequence_parallel=True.*re-plan"):
        autotp.parallelize(model, 2, plan=plan, sequence_parallel=False)
    with pytest.raises(ConfigError, match=r"fuse_norms=False.*made with fuse_norms=True"):
        autotp.parallelize(model, 2, plan=plan, fuse_norms=False)
    # the same value again is no contradiction
    pm = autotp.parallelize(model, 2, plan=plan, sequence_parallel=True, fuse_norms=True)
    assert pm.plan.sequence_parallel is True


def test_a_plan_file_without_the_arguments_loads_as_before():
    import json

    model, _ = _llama()
    text = autotp.plan(model, 2, batch=2, seq=16, profile="h100-dgx").to_json()
    doc = json.loads(text)
    assert doc["autotp_plan"] == 2 and doc["arguments"]["sequence_parallel"] is None
    doc["autotp_plan"] = 1   # as written before the arguments were recorded
    del doc["arguments"]
    old = Plan.from_json(json.dumps(doc))
    assert old.arguments is None and old.sequence_parallel is None and old.expert_dispatch is None
    assert "expert dispatch:" not in str(old)
    # a recorded argument of the wrong type is refused, named
    doc = json.loads(text)
    doc["arguments"]["sequence_parallel"] = "yes"
    with pytest.raises(ConfigError, match=r"malformed autotp plan: arguments.sequence_parallel is 'yes'"):
        Plan.from_json(json.dumps(doc))


def test_a_plan_made_unfused_builds_its_programs_unfused(fake_rank):
    # fuse_activations=False: GPT-2's tanh-GELU runs as the model writes it (mul, pow, add, tanh);
    # before, the plan alone built it fused (aten.gelu), parallelize's default
    config = zoo.tiny_config("gpt2", layers=1, heads=4, head_dim=8, vocab=61)
    model = zoo.build("gpt2", config, dtype=torch.float32, seed=1)
    plan = autotp.plan(model, 2, batch=2, seq=16, fuse_activations=False)
    ops = {str(n.target) for n in autotp.parallelize(model, 2, plan=plan).graph_module.graph.nodes}
    assert "aten.tanh.default" in ops and "aten.gelu.default" not in ops, sorted(ops)
