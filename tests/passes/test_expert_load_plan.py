"""Expert parallelism priced at the router's load (autotp/planner/expert_load.py): the rows each
rank's experts get, measured from the serial model's top-k or given, priced at the busiest rank."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import autotp
from autotp import zoo
from autotp.errors import ConfigError
from autotp.plan.expert_load import ExpertLoad
from autotp.planner.expert_load import shares
from tests.helpers import EXPERTS_ALONE_SPLIT

LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def _skewed_moe(layers: int, head_dim: int = 8, intermediate: int | None = None, device: str = "cpu"):
    """A tiny Mixtral whose routers favour experts 0 and 1 (their rows of the router's weight 8x the
    others': they win the top-k wherever their logit is positive), both held by rank 0 at tp=4."""
    extra = {} if intermediate is None else {"intermediate_size": intermediate}
    config = zoo.tiny_config("mixtral", layers=layers, heads=4, head_dim=head_dim, vocab=64, positions=1024,
                             experts=8, top_k=2, **extra)
    model = zoo.build("mixtral", config, device=device, dtype=torch.float32)
    if device != "meta":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight[:2] *= 8.0
    return model


def _layouts(plan) -> set[str]:
    return {role for name, role in plan.roles.items() if ".experts." in name}


def _experts_note(plan) -> str:
    return "\n".join(n for n in plan.notes if n.startswith(("experts ", "expert load")))


# ---- the measured load --------------------------------------------------------------------------
def test_measured_load_is_the_rows_the_busiest_ranks_experts_compute():
    """The measured rows per rank sum to T*k; the busiest rank (fake backend, everything before the
    router replicated so that the rank routes as serial does) computes exactly its share of the
    grouped products' FLOPs, and the cost model prices that rank's grouped products at those FLOPs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotp.api import capture_model
    from autotp.cost_model.symbolic import op_work, evaluate
    from autotp.placements import Shard
    from autotp.planner.planner import build_plan
    from autotp.testing.work import WorkCounter
    from benchmarks.fake_peers import fake_rank, mirrored_peers
    from benchmarks.moe_load import expert_rows_share
    from benchmarks.op_timer import module_step

    model = _skewed_moe(layers=1)
    batch = zoo.example_batch("mixtral", model.config, batch=2, seq=16, seed=0)
    load = autotp.measure_expert_load(model, batch)
    assert load.modules == LAYERS[:1] and load.source.startswith("measured")
    rows = load[LAYERS[0]]
    share = shares(rows, 4)
    assert sum(rows) == 2 * 16 * 2 and sum(share) == pytest.approx(1.0, rel=1e-12)
    busiest = max(range(4), key=lambda r: share[r])
    assert share[busiest] >= 0.4, share   # a strong skew: a balanced router's is 0.25
    with WorkCounter() as serial:
        module_step(model, batch)()
    model.zero_grad(set_to_none=True)
    pins = EXPERTS_ALONE_SPLIT
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        with fake_rank(busiest, 4), mirrored_peers():
            pm = autotp.parallelize(model, 4, batch=2, seq=16, device="cpu", layout=pins)
            with WorkCounter() as work:
                module_step(pm, batch)()
            del pm
    finally:
        dist.destroy_process_group()
    counted = expert_rows_share(work, serial, 4) / 4
    assert counted == pytest.approx(share[busiest], rel=1e-12)
    # the cost model's grouped products on that rank, at the measured load: the FLOPs counted
    cap = capture_model(model, (), dict(batch))
    _, index, prop = build_plan(cap, 4, batch=2, seq=16, layout=pins, expert_load=load)
    grouped = [(index.infos[n], s) for n, s in prop.chosen.items() if "grouped_mm" in str(index.infos[n].target)
               and isinstance(s.inputs[1], Shard) and s.inputs[1].dim == 0]
    assert len(grouped) == 2   # gate|up and down, whole experts per rank
    predicted = sum(evaluate(p.flops, index.env) for info, s in grouped
                    for p in op_work(info, s, autotp.cost_model.get_profile(None), 4, busiest).products)
    by_op = sum(f for op, f in work.by_op.items() if "grouped_mm" in op)
    assert predicted == pytest.approx(by_op, rel=1e-9), (predicted, by_op)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, 50), min_size=6, max_size=6).filter(lambda r: sum(r) > 0),
       tp=st.sampled_from([2, 4]))
def test_shares_are_each_ranks_contiguous_experts_rows(rows, tp):
    # 6 experts over 4 ranks: 2, 2, 1, 1 (the stack's Shard(0), uneven)
    held = {2: [(0, 3), (3, 6)], 4: [(0, 2), (2, 4), (4, 5), (5, 6)]}[tp]
    assert shares(rows, tp) == pytest.approx([sum(rows[lo:hi]) / sum(rows) for lo, hi in held], rel=1e-12)


# ---- the choice ------------------------------------------------------------------------------------
def test_a_skewed_load_picks_expert_tp_where_a_balanced_one_picks_expert_parallel():
    """At the same shapes (hidden 128, 8 experts of 1024, top-2, tp 4, 8 x 512 tokens): whole
    experts per rank at a balanced router (None, or a uniform load given: the same plan, to the
    bit), every expert split at the skewed router's measured load, each plan's note giving the
    other layout's predicted step and the load's."""
    model = _skewed_moe(layers=2, head_dim=32, intermediate=1024)
    load = autotp.measure_expert_load(model, zoo.example_batch("mixtral", model.config, batch=2, seq=64, seed=0))
    skew = [max(shares(load[m], 4)) * 4 for m in LAYERS]
    assert min(skew) > 1.5, skew
    kw = dict(tp=4, batch=8, seq=512)
    balanced = autotp.plan(model, **kw)
    uniform = autotp.plan(model, **kw, expert_load={m: [1] * 8 for m in LAYERS})
    skewed = autotp.plan(model, **kw, expert_load=load)
    said = (f"balanced {balanced.compute_s + balanced.comm_s:.6e} s:\n{_experts_note(balanced)}\n"
            f"skewed {skewed.compute_s + skewed.comm_s:.6e} s:\n{_experts_note(skewed)}")
    assert _layouts(balanced) == {"expert"}, said
    assert _layouts(skewed) == {"expert_column", "expert_row"}, said
    assert (uniform.compute_s, uniform.comm_s, uniform.roles) == (balanced.compute_s, balanced.comm_s,
                                                                  balanced.roles), said
    note = next(n for n in skewed.notes if n.startswith("expert load (measured"))
    assert "it changed the choice: model.layers.{0..1}.mlp.experts expert-TP, not expert-parallel" in note, note
    assert f"model.layers.0.mlp.experts {skew[0]:.2f}x" in note, note
    assert "the choice is the one a balanced router gets (expert-parallel)" in _experts_note(uniform)


# ---- recorded and replayed ---------------------------------------------------------------------------
def test_the_load_is_recorded_in_the_plan_file_and_replayed():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.fake_peers import fake_rank, mirrored_peers

    model = _skewed_moe(layers=2)
    load = ExpertLoad({m: [8, 7, 1, 0, 2, 2, 1, 3] for m in LAYERS})
    plan = autotp.plan(model, tp=2, batch=2, seq=16, expert_load=load)
    doc = json.loads(plan.to_json())
    assert doc["autotp_plan"] == 3 and doc["arguments"]["expert_load"]["layers"][LAYERS[1]] == [8, 7, 1, 0, 2, 2, 1, 3]
    again = autotp.Plan.from_json(plan.to_json())
    assert again.expert_load == load and "expert load: given (2 MoE layers)" in str(again)
    assert json.loads(autotp.plan(model, tp=2, batch=2, seq=16).to_json())["autotp_plan"] == 2   # none: as before
    other = {m: [1] * 8 for m in LAYERS}
    with pytest.raises(ConfigError, match=r"expert_load=ExpertLoad\(2 MoE layers, given; busiest expert 1.00x the "
                                          r"mean\) differs from the load the plan was priced at \(ExpertLoad\(2 MoE "
                                          r"layers, given; busiest expert 2.67x"):
        autotp.parallelize(model, 2, plan=again, expert_load=other, device="cpu")
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with fake_rank(1, 2), mirrored_peers():
            pm = autotp.parallelize(model, 2, plan=again, device="cpu")
            assert pm.plan.expert_load == load and pm.plan.roles == plan.roles
            pm = autotp.parallelize(model, 2, plan=again, expert_load=dict(load.layers), device="cpu")   # the same
            assert pm.plan.expert_load == load
            del pm
    finally:
        dist.destroy_process_group()


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("load, match", [
    ({"model.layers.0.mlp.experts": [1] * 8, "model.layers.9.mlp.experts": [1] * 8},
     r"names 'model.layers.9.mlp.experts', which is not an MoE layer of this model; its experts modules are "
     r"'model.layers.0.mlp.experts', 'model.layers.1.mlp.experts'"),
    ({"model.layers.0.mlp.experts": [1] * 8}, r"leaves out the MoE layer\(s\) 'model.layers.1.mlp.experts'"),
    ({m: [1] * 6 for m in LAYERS}, r"has 6 counts, but that layer has 8 experts"),
    ({m: [1, -1] + [1] * 6 for m in LAYERS}, r"finite, non-negative and not all zero"),
    ({m: [0] * 8 for m in LAYERS}, r"finite, non-negative and not all zero"),
    ([1, 2, 3], r"expert_load=\[1, 2, 3\]: pass autotp.measure_expert_load"),
    ({}, r"names no MoE layer"),
])
def test_a_load_that_does_not_fit_the_model_is_a_config_error(load, match):
    model = _skewed_moe(layers=2, device="meta")
    with pytest.raises(ConfigError, match=match):
        autotp.plan(model, tp=2, batch=2, seq=16, expert_load=load)


def test_measuring_needs_weights_and_a_load_needs_experts():
    with pytest.raises(ConfigError, match="meta device"):
        autotp.measure_expert_load(_skewed_moe(layers=1, device="meta"), {"input_ids": torch.zeros(1, 4).long()})
    dense = zoo.build("llama", zoo.tiny_config("llama", layers=1), device="meta")
    with pytest.raises(ConfigError, match="the model has no MoE layer"):
        autotp.plan(dense, tp=2, batch=2, seq=16, expert_load={"model.layers.0.mlp": [1, 1]})


@pytest.fixture(scope="module")
def _ep_rank_program():
    """A tiny Qwen3-MoE (hidden 64, 8 experts of 1 per rank at tp 8, 128 tokens: an expert's
    products over a few dozen rows) planned whole experts per rank: its index and propagation."""
    from autotp.api import capture_model
    from autotp.planner.planner import build_plan

    model = zoo.build("qwen3-moe", zoo.tiny_config("qwen3-moe", layers=2, heads=8, head_dim=8, vocab=128,
                                                   positions=1024, experts=8, top_k=2), device="meta")
    cap = capture_model(model, (), None)
    layout = {"*.experts.gate_up_proj": "expert", "*.experts.down_proj": "expert"}
    _, index, prop = build_plan(cap, 8, batch=2, seq=64, profile="h200", layout=layout)
    return index, prop


@settings(max_examples=20, deadline=None)
@given(rows=st.lists(st.integers(0, 60), min_size=8, max_size=8).filter(lambda r: sum(r) > 0))
def test_a_busier_rank_never_prices_expert_parallelism_cheaper(_ep_rank_program, rows):
    """The experts' ops on the busiest rank cost at least a balanced router's, and more the
    busier it is: never less for more rows (the product model's weight-gradient product contracts
    over the rows, and priced at more rows per expert a tiny one would get cheaper)."""
    from autotp.cost_model import get_profile
    from autotp.cost_model.symbolic import split_seconds
    from autotp.planner.expert_load import apply_load

    index, prop = _ep_rank_program
    prof = get_profile("h200")
    experts = {m: 8 for m in LAYERS}

    def step(load) -> float:
        apply_load(index, load, experts)
        return sum(sum(split_seconds(index.infos[n], s, index.env, prof, 8, index.align).values())
                   for n, s in prop.chosen.items())

    balanced = step(None)
    skewed = ExpertLoad({m: rows for m in LAYERS})
    busier = ExpertLoad({m: [r + (40 if e == max(range(8), key=rows.__getitem__) else 0) for e, r in enumerate(rows)]
                         for m in LAYERS})
    at, more = step(skewed), step(busier)
    step(None)
    assert at >= balanced * (1 - 1e-12) and more >= at * (1 - 1e-12), (balanced, at, more, rows)


def test_a_plan_file_with_a_malformed_load_is_refused_and_a_diff_names_the_loads():
    model = _skewed_moe(layers=2, device="meta")
    load = {m: [8, 7, 1, 0, 2, 2, 1, 3] for m in LAYERS}
    plan = autotp.plan(model, tp=2, batch=2, seq=16, expert_load=load)
    doc = json.loads(plan.to_json())
    for bad in ({"layers": {LAYERS[0]: [-1] * 8}}, {"layers": [1, 2]}, [3]):
        doc["arguments"]["expert_load"] = bad
        with pytest.raises(ConfigError, match=r"malformed autotp plan: arguments\.expert_load"):
            autotp.Plan.from_json(json.dumps(doc))
    diff = str(plan.diff(autotp.plan(model, tp=2, batch=2, seq=16)))
    assert "planned with: expert_load ExpertLoad(2 MoE layers, given; busiest expert 2.67x the mean) -> None" in diff
