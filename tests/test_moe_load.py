"""The rank benchmark's routing load (``benchmarks/moe_load.py``): the rows each expert and each
rank's experts get from the serial model's top-k, and the rank the fake world runs as
(``benchmarks/fake_peers.fake_rank``) computing exactly its experts' rows."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp import zoo
from autotp.testing.work import WorkCounter
from benchmarks.fake_peers import fake_rank, mirrored_peers
from benchmarks.moe_load import at_load, expert_ranges, expert_rows_share, routing_load
from benchmarks.op_timer import module_step
from tests.helpers import EXPERTS_ALONE_SPLIT


def _tiny_moe(layers: int, experts: int):
    torch.manual_seed(0)
    config = zoo.tiny_config("mixtral", layers=layers, heads=4, head_dim=8, vocab=64, positions=64, experts=experts,
                             top_k=2)
    return zoo.build("mixtral", config, device="cpu", dtype=torch.float32)


def test_rows_per_rank_sum_to_tokens_times_top_k_with_uneven_experts():
    model = _tiny_moe(layers=2, experts=6)   # 6 experts over 4 ranks: 2, 2, 1, 1
    batch = zoo.example_batch("mixtral", model.config, batch=2, seq=16, seed=0)
    load = routing_load(model, batch, tp=4)
    assert (load.tokens, load.top_k, len(load.layers)) == (32, 2, 2)
    for layer in load.layers:
        assert sum(layer.experts) == sum(layer.ranks) == 32 * 2
        assert list(layer.ranks) == [sum(sum(layer.experts[lo:hi]) for lo, hi in expert_ranges(6, 4, r))
                                     for r in range(4)]
        assert [len(range(*expert_ranges(6, 4, r)[0])) for r in range(4)] == [2, 2, 1, 1]
    assert sum(load.ranks) == 2 * 32 * 2
    assert load.ranks[load.busiest_rank] == max(load.ranks)
    assert all(abs(load.ranks[load.balanced_rank] - load.mean) <= abs(c - load.mean) for c in load.ranks)


def test_the_rank_run_computes_exactly_its_experts_rows():
    """One MoE layer with everything before its router replicated (no g whose fake all-reduce would
    leave the rank's part alone), so the rank routes as serial does: its grouped products' FLOPs
    are its experts' rows, on the balanced and the busiest rank, and the expert-TP rank's are its share."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = _tiny_moe(layers=1, experts=8)
    batch = zoo.example_batch("mixtral", model.config, batch=2, seq=16, seed=0)
    load = routing_load(model, batch, tp=4)
    assert load.busiest_rank != load.balanced_rank
    with WorkCounter() as serial:
        module_step(model, batch)()
    model.zero_grad(set_to_none=True)
    pins = EXPERTS_ALONE_SPLIT
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        for rank in (load.balanced_rank, load.busiest_rank):
            with fake_rank(rank, 4), mirrored_peers():
                assert dist.get_rank() == rank
                pm = autotp.parallelize(model, 4, batch=2, seq=16, device="cpu", layout=pins)
                with WorkCounter() as work:
                    module_step(pm, batch)()
                del pm
            assert expert_rows_share(work, serial, 4) * load.mean == pytest.approx(load.ranks[rank], rel=1e-12)
        assert dist.get_rank() == 0   # the world before is put back
    finally:
        dist.destroy_process_group()


def test_the_prediction_at_a_load_scales_the_experts_part_alone():
    assert at_load(10.0, 4.0, 1.5) == pytest.approx(12.0)
    assert at_load(10.0, 4.0, 0.5) == pytest.approx(8.0)
    assert at_load(10.0, 4.0, float("nan")) == 10.0   # no grouped product counted: as predicted


def _fake_world(tp: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())


def test_the_probe_reads_each_ranks_rows_and_a_program_from_rank_0s_plan_is_the_planned_one():
    """``rank_efficiency._probe`` writes ranks 1.. from rank 0's plan: where the rank routes as serial
    does (one layer, everything before the router replicated) its shares are the serial count's;
    and a dispatching plan's program written from the plan with the planning's other arguments is
    the one planned afresh (without them it gathers)."""
    import argparse

    from benchmarks import rank_efficiency as R

    model = _tiny_moe(layers=1, experts=8)
    batch = zoo.example_batch("mixtral", model.config, batch=2, seq=16, seed=0)
    load = routing_load(model, batch, tp=4)
    with WorkCounter() as serial:
        module_step(model, batch)()
    model.zero_grad(set_to_none=True)
    args = argparse.Namespace(tp=4, profile="h200", plan_batch=2, plan_seq=16, device="cpu")
    pins = EXPERTS_ALONE_SPLIT
    _fake_world(4)
    try:
        shares = R._probe(model, batch, args, dict(layout=pins), serial)
        assert shares == pytest.approx([c / load.mean for c in load.ranks], rel=1e-12)
        dispatch = R.EXPERTS["expert-parallel, all-to-all dispatch"]
        with fake_rank(0, 4), mirrored_peers():
            plan = R._parallelize(model, args, dispatch).plan
        with fake_rank(2, 4), mirrored_peers():
            fresh, written = R._parallelize(model, args, dispatch), R._parallelize(model, args, dispatch, plan)
            counts = []
            for pm in (fresh, written):
                module_step(pm, batch)()   # the program is written at the first call
                with WorkCounter() as work:
                    module_step(pm, batch)()
                counts.append((work.flops, work.moved))
            assert R._collectives(written.plan) == R._collectives(fresh.plan)
            assert any(c.kind == "all_to_all" for c in written.plan.comms) and counts[0] == counts[1]
            del fresh, written, pm
    finally:
        dist.destroy_process_group()


def test_the_default_plan_is_made_at_the_batchs_measured_load_beside_the_balanced_one():
    """``rank_efficiency --plan-load``: the default version planned with the load measured on the
    benchmark batch, beside (both) or instead of (measured) the balanced router's; its table names
    the layout each default plan picked."""
    from benchmarks import rank_efficiency as R

    model = _tiny_moe(layers=2, experts=8)
    batch = zoo.example_batch("mixtral", model.config, batch=2, seq=16, seed=0)
    layouts = {"default": {}, "expert-TP": R.EXPERTS["expert-TP"]}
    both = R._with_measured_load(layouts, model, batch, "both", True)
    assert list(both) == ["default", R.AT_LOAD, "expert-TP"] and both["default"] == {}
    assert both[R.AT_LOAD]["expert_load"] == autotp.measure_expert_load(model, batch)
    assert list(R._with_measured_load(layouts, model, batch, "measured", True)) == ["default", "expert-TP"]
    assert R._with_measured_load(layouts, model, batch, "both", False) is layouts
    plans = [autotp.plan(model, tp=4, batch=2, seq=16, **both[k]) for k in ("default", R.AT_LOAD)]
    table = R._picks([dict(label=k, plan=p, time=dict(thread=0.01)) for k, p in zip(("default", R.AT_LOAD), plans)])
    assert table[-2].startswith("| default | ") and table[-1].startswith(f"| {R.AT_LOAD} | ")
    assert f"| {(plans[1].compute_s + plans[1].comm_s) * 1e3:.3f} | 10.0 |" in table[-1]
    assert R._picks([dict(label="default", plan=plans[0], time=dict(thread=0.01))]) == []   # no load: no table
