"""A layout pin that no plan can hold is refused with a PlanError naming the parameter, the heads
its split dim holds (read off the graph), the ranks left without one, and what to pin instead."""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.errors import PlanError

MEGATRON = {"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
            "*.o_proj.weight": "row"}


def test_a_column_pin_on_fewer_kv_heads_than_ranks_names_the_parameter_and_heads():
    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=40)
    model = zoo.build("llama", config, device="meta")
    with pytest.raises(PlanError) as err:
        # the written k_proj's pin (its heads' blocks): joined with q and v for one product, the pins
        # hold with its rows split plain and q|k|v gathered whole before attention (exact), no error
        autotp.plan(model, tp=4, layout=MEGATRON, fuse_products=False)
    message = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message, message
    assert "'*.k_proj.weight'" in message and "2 heads of 8" in message, message
    assert "ranks 2-3 of 4 would hold no head" in message, message
    assert "'replicate'" in message and "tp in {1, 2}" in message, message


def test_the_same_pins_hold_where_each_rank_gets_a_kv_head():
    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=40)
    plan = autotp.plan(zoo.build("llama", config, device="meta"), tp=2, layout=MEGATRON)
    assert repr(plan.params["model.layers.0.self_attn.k_proj.weight"]).startswith("S(0")


def test_a_column_pin_on_a_fused_qkv_with_fewer_kv_heads_than_ranks_keeps_them_whole():
    # Phi-3's q | k | v of 4 | 2 | 2 heads: split by group (a kv head with its query heads) where
    # every rank gets one; with fewer kv heads than ranks the query heads split and k and v stay
    # whole on every rank (a tail of 2 + 2 heads). Before, that pin was a PlanError.
    config = zoo.tiny_config("phi3", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=40)
    model = zoo.build("phi3", config, device="meta")
    layout = {"*.qkv_proj.weight": "column", "*.o_proj.weight": "row"}
    plan = autotp.plan(model, tp=4, layout=layout, batch=64, seq=4096, profile="h100-dgx")
    assert plan.params["model.layers.0.self_attn.qkv_proj.weight"] == autotp.Shard(0, 1, 8, tail=4)
    assert plan.attention == {"model.layers.0.self_attn": [1, 1, 1, 1]}
    plan = autotp.plan(model, tp=2, layout=layout)
    assert plan.params["model.layers.0.self_attn.qkv_proj.weight"].sizes == (2, 1, 1)


@pytest.mark.parametrize("impl", ["batched_mm", "eager"])
def test_an_experts_pin_at_tp_1_plans_like_any_other_pin(impl):
    """At tp 1 a stack pinned 'expert' (whole experts per rank) is the whole stack: the op that reads
    it (the batched path's pick ``w[expert_ids]``, the grouped product) reads it as it is. Before,
    only the routed strategies (tp > 1) took a stack by experts: a PlanError on the batched path
    (drawn by tests/e2e/test_experts.py's slow test at tp 1). The plan names the pinned role, and
    the rank's program is the captured graph's own ops, computing what the model does."""
    from autotp.capture import capture
    from autotp.passes.rewrite import rewrite
    from autotp.planner import build_plan
    from tests.test_capture_expand import run

    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=3, top_k=2)
    config._experts_implementation = impl
    model = zoo.build("mixtral", config, dtype=torch.float64, seed=1)
    cap = capture(model)
    plan, index, prop = build_plan(cap, 1, batch=2, seq=8, layout={"*.experts.*": "expert"})
    assert {r for n, r in plan.roles.items() if ".experts." in n} == {"expert"}, plan.roles
    gm = rewrite(index, prop, 0, None, None)
    # the capture as planned (norms fused), less its ops nothing reads (rewrite.remove_dead: HF's
    # position ids' expand)
    unread = [n for n in index.capture.graph.nodes if n.op == "call_function" and not n.users]
    assert len(gm.graph.nodes) == len(index.capture.graph.nodes) - len(unread), [n.name for n in unread]
    data = zoo.example_batch("mixtral", config, batch=2, seq=8, seed=2)
    want = run(cap, model, data)
    captured, cap.graph_module = cap.graph_module, gm   # the rank's program, fed as the capture is
    try:
        got = run(cap, model, data)
    finally:
        cap.graph_module = captured   # (the capture is cached per structure)
    torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=0)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=0)
