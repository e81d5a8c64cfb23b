"""A later program of ``parallelize`` (an inference call, a padded one, a generation prefill or
decode step) runs the parameter layout the first plan pinned: no weight is converted at run time,
not even through a view of it (``x @ w.T``'s transpose), so a pin never holds in name only.

One rank of tp 4 on torch's ``fake`` backend: each program is planned and rewritten as a real
rank's, and its plan's collectives read; values are the gloo tiers' (tests/e2e)."""
import pytest
import torch
import torch.distributed as dist

from autotp import zoo
from autotp.passes.propagate import _param_views

TP = 4
#: Falcon's row-parallel products pinned; its products read the weights through their transposes
ROWS = {"*.self_attention.dense.weight": "row", "*.mlp.dense_4h_to_h.weight": "row"}


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=TP - 1, world_size=TP, store=FakeStore())
    yield
    dist.destroy_process_group()


def moved_weights(program) -> list[tuple]:
    """The collectives of a program's plan that convert a sharded parameter or a view of one."""
    views = {n.name for n in _param_views(program.capture)}
    return [(c.kind, c.tensor, c.src, c.dst) for c in program.plan.comms if c.tensor in views and c.src != "R"]


# falcon in the slow tier (13 s): falcon-new's fused projection holds what it checks
@pytest.mark.parametrize("family", [pytest.param("falcon", marks=pytest.mark.slow), "falcon-new"])
def test_later_programs_never_move_a_pinned_weight(fake_world, family):
    # before, the op-by-op walk of a later program, kept where the cost model found it cheaper than
    # the solver's plan, moved the row-pinned weights through their transposes: the inference and
    # padded calls all-gathered them (S(0) -> R, the products then run whole), the prefill and decode
    # steps turned them into column splits (an all-to-all S(0) -> S(1)) every step
    import autotp

    config = zoo.tiny_config(family, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=61)
    model = zoo.build(family, config, dtype=torch.float32, seed=1)
    pm = autotp.parallelize(model, TP, layout=ROWS, batch=2, seq=16, profile="h100-dgx")
    pm.eval()
    ids = torch.randint(3, 61, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        pm(input_ids=ids)
        pm(input_ids=ids, attention_mask=mask)
        pm.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    kinds = sorted(p.step or "call" for p in pm.programs[1:])
    assert kinds == ["call", "call", "decode", "prefill"], kinds
    rows = {name for name, role in pm.plan.roles.items() if role == "row"}
    assert {n for n in rows if "dense" in n} and all(pm.programs[0].plan.params[n] == p.plan.params[n]
                                                     for p in pm.programs[1:] for n in rows)
    for program in pm.programs:
        assert not moved_weights(program), (program.step or "call", moved_weights(program))


def test_a_later_program_that_only_moving_a_pinned_weight_can_run_is_a_plan_error(monkeypatch):
    # planning only (the meta device). The solver never moves a sharded weight; where it finds no
    # plan (its search cut at MAX_STATES, simulated here), the op-by-op walk was kept whatever it
    # did: Falcon's inference call all-gathered its row-pinned weights and ran the products whole
    from autotp.capture import capture
    from autotp.errors import PlanError
    from autotp.planner import build_plan, replay

    config = zoo.tiny_config("falcon", layers=2, heads=4, kv_heads=2, head_dim=8, vocab=61)
    model = zoo.build("falcon", config, device="meta", dtype=torch.float32)
    workload = dict(batch=2, seq=16, profile="h100-dgx", align=None)
    first, *_ = build_plan(capture(model), TP, layout=ROWS, **workload)
    ids = torch.ones(2, 7, dtype=torch.long, device="meta")
    inference = capture(model.eval(), example_kwargs={"input_ids": ids})

    def no_plan(*args, **kwargs):
        raise PlanError("no plan within the search's bound (MAX_STATES)")

    monkeypatch.setattr(replay, "solve", no_plan)
    # the first weight the walk would move is named (the dense one, or, as products are priced
    # since a product's time stopped falling with its contraction, the fused q|k|v before it)
    with pytest.raises(PlanError, match=r"runs only by moving transformer\.h\.0\.self_attention\."
                                        r"(dense\.weight, placed S\(1\): numpy_t\S* would be converted S\(0\)|"
                                        r"query_key_value\.weight, placed S\(0/24\): numpy_t\S* would be converted "
                                        r"S\(1/24\)) -> R at run time, so the placement would hold in name only"):
        build_plan(inference, TP, plan=first, gather_logits=True, **workload)
