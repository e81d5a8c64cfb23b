"""A plan rebuilt from what another rank's search chose is that plan: the same plan, placements,
collectives and costs, from one walk of the graph (autotp/planner/planner.py's Decided; the TP
ranks rebuild TP rank 0's plan, autotp/distributed/plans.py). What does not rebuild is a PlanError,
so that the rank searches itself."""
import json

import pytest
import torch

from autotp import zoo
from autotp.capture import cache as capture_cache
from autotp.errors import PlanError
from autotp.planner.planner import Decided, build_plan, decided, digest

ETP = {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}


def _sent(plan, index, prop):
    return Decided.from_json(json.loads(json.dumps(decided(plan, index, prop).to_json())))   # as it travels


def _same(made, rebuilt) -> None:
    (plan, index, prop), (plan2, index2, prop2) = made, rebuilt
    assert plan2.to_json() == plan.to_json()
    assert plan2.notes == plan.notes and plan2.arguments == plan.arguments
    assert digest(index2, prop2) == digest(index, prop)
    assert [n.name for n in index2.capture.graph.nodes] == [n.name for n in index.capture.graph.nodes]


@pytest.mark.parametrize("family, extra, kwargs", [
    # sibling products fused (q|k|v, gate|up) at tp 2, the later (inference) program replayed
    ("llama", dict(kv_heads=2), dict(batch=8, seq=64)),
    # routing weights moved to the down product's input (expert-TP at tp 2: 6 columns against 32)
    ("qwen3-moe", dict(kv_heads=2, experts=4, top_k=2, head_dim=8, vocab=48, layers=1),
     dict(batch=64, seq=4096, profile="h100-dgx", layout=ETP, sequence_parallel=False)),
])
def test_a_plan_rebuilt_from_what_was_decided_is_the_plan(family, extra, kwargs):
    config = zoo.tiny_config(family, output_router_logits=True, **extra) if "experts" in extra \
        else zoo.tiny_config(family, **extra)
    if "experts" in extra:
        config._experts_implementation = "eager"
    model = zoo.build(family, config, dtype=torch.float64, seed=1)
    cap = capture_cache.capture(model)
    made = build_plan(cap, 2, **kwargs)
    if "experts" in extra:   # the case is there for the moved scales
        assert made[1].moved_scales and any(n.startswith("per-row scales") for n in made[0].notes)
    else:
        assert made[1].apart == frozenset() and any(n.startswith("sibling products fused") for n in made[0].notes)
    _same(made, build_plan(cap, 2, decided=_sent(*made), **kwargs))

    later_cap = capture_cache.capture(model.eval())   # a later program: replayed under the first plan's pins
    kwargs = {k: v for k, v in kwargs.items() if k != "layout"}
    later = build_plan(later_cap, 2, plan=made[0], **kwargs)
    rebuilt = build_plan(later_cap, 2, plan=made[0], decided=_sent(*later), **kwargs)
    _same(later, rebuilt)
    assert dict(rebuilt[0].expressions) == dict(later[0].expressions)   # computed where first read


def test_what_does_not_rebuild_is_a_plan_error():
    model = zoo.build("llama", zoo.tiny_config("llama", kv_heads=2), dtype=torch.float64)
    cap = capture_cache.capture(model)
    made = build_plan(cap, 2, batch=8, seq=64)
    sent = _sent(*made)
    sent.digest = "another"            # the walk does not reach the same placements
    with pytest.raises(PlanError, match="other placements"):
        build_plan(cap, 2, batch=8, seq=64, decided=sent)
    other = capture_cache.capture(zoo.build("llama", zoo.tiny_config("llama", layers=1), dtype=torch.float64))
    with pytest.raises(PlanError, match="no op of this capture"):   # a capture of another model
        build_plan(other, 2, batch=8, seq=64, decided=_sent(*made))
    # another workload prices it otherwise: the same strategies, other costs
    with pytest.raises(PlanError, match="other placements"):
        build_plan(cap, 2, batch=16, seq=64, decided=_sent(*made))


def test_a_fused_multi_query_projection_rebuilds():
    """Falcon's fused q|k|v with fewer kv heads than query heads: its conversions' keys hold f
    flags of two types (a bool, a kind's name), which the digest once sorted together and failed
    on: the plan was then never sent, and every rank searched it (autotp/distributed/plans.py)."""
    config = zoo.tiny_config("falcon-new", heads=8, kv_heads=2, layers=2, head_dim=4)
    cap = capture_cache.capture(zoo.build("falcon-new", config, dtype=torch.float32))
    kwargs = dict(batch=64, seq=2048, profile="h100-dgx")
    for tp in (2, 4):
        made = build_plan(cap, tp, **kwargs)
        _same(made, build_plan(cap, tp, decided=_sent(*made), **kwargs))
