"""A layout pin that no plan can hold is refused with a PlanError naming the parameter, the heads
its split dim holds (read off the graph), the ranks left without one, and what to pin instead."""
import pytest

import autotp
from autotp import zoo
from autotp.errors import PlanError

MEGATRON = {"*.q_proj.weight": "column", "*.k_proj.weight": "column", "*.v_proj.weight": "column",
            "*.o_proj.weight": "row"}


def test_a_column_pin_on_fewer_kv_heads_than_ranks_names_the_parameter_and_heads():
    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=40)
    model = zoo.build("llama", config, device="meta")
    with pytest.raises(PlanError) as err:
        autotp.plan(model, tp=4, layout=MEGATRON)
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
