"""The planner: Megatron's layout emerges where the cost model says it is best; plans print,
round-trip through JSON and refuse what they cannot read."""
import json

import pytest

import autotp
from autotp.errors import ConfigError
from autotp.testing import MEGATRON_GPT2
from tests.helpers import tiny_gpt2

MEGATRON_ROLES = {
    "attn.c_attn.weight": "column", "attn.c_attn.bias": "column",
    "attn.c_proj.weight": "row", "attn.c_proj.bias": "replicate",
    "mlp.c_fc.weight": "column", "mlp.c_fc.bias": "column",
    "mlp.c_proj.weight": "row", "mlp.c_proj.bias": "replicate",
    "ln_1.weight": "replicate", "ln_2.weight": "replicate",
}


def gpt2_meta(n_embd: int, n_head: int, n_layer: int = 2):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head))


def assert_megatron(plan, n_layer: int = 2):
    for layer in range(n_layer):
        for suffix, role in MEGATRON_ROLES.items():
            assert plan.roles[f"transformer.h.{layer}.{suffix}"] == role, suffix
    assert plan.roles["lm_head.weight"] == "vocab"
    assert plan.roles["transformer.ln_f.weight"] == "replicate"
    layer_comms = [c for c in plan.comms if c.module.startswith("transformer.h.")]
    per_layer = {}
    for c in layer_comms:
        per_layer.setdefault(c.module.split(".")[2], []).append(c.kind)
    for layer in range(n_layer):
        kinds = sorted(per_layer[str(layer)])
        assert kinds == ["f", "f", "g", "g"], kinds   # 2 all-reduces forward (g), 2 backward (f)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("size", [(768, 12), (1024, 16), (1280, 20)], ids=["gpt2", "medium", "large"])
def test_megatron_layout_emerges_on_the_papers_v100_machine(size, tp):
    plan = autotp.plan(gpt2_meta(*size), tp=tp, profile="v100-dgx2h", batch=8, seq=1024)
    assert_megatron(plan)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_layout_emerges_on_h100_for_gpt2_large(tp):
    plan = autotp.plan(gpt2_meta(1280, 20), tp=tp, profile="h100-dgx", batch=8, seq=1024)
    assert_megatron(plan)


def test_tiny_model_over_slow_link_stays_replicated_and_the_plan_says_so():
    plan = autotp.plan(tiny_gpt2(n_head=4, head_dim=8), tp=4, profile="cpu-gloo", batch=1, seq=8)
    assert set(plan.roles.values()) == {"replicate"}
    assert plan.comms == []
    assert "collectives: none" in str(plan)


def test_plan_prints_every_parameter_layout_and_collective():
    plan = autotp.plan(tiny_gpt2(), tp=2, layout=MEGATRON_GPT2)
    text = str(plan)
    for name in plan.params:
        assert name in text
    assert "column" in text and "row" in text and "P->R" in text
    assert "predicted step" in text and "parameter MB per rank" in text


def test_plan_json_round_trips():
    plan = autotp.plan(tiny_gpt2(), tp=2, layout=MEGATRON_GPT2)
    again = autotp.Plan.from_json(plan.to_json())
    assert again.params == plan.params and again.roles == plan.roles and again.comms == plan.comms
    assert again.to_json() == plan.to_json()


def test_plan_with_unknown_schema_version_is_refused():
    doc = json.loads(autotp.plan(tiny_gpt2(), tp=2).to_json())
    doc["autotp_plan"] = 99
    with pytest.raises(ConfigError, match="schema version 99 is not supported"):
        autotp.Plan.from_json(json.dumps(doc))


def test_plan_that_is_not_json_is_refused():
    with pytest.raises(ConfigError, match="not an autotp plan"):
        autotp.Plan.from_json("{not json")


def test_planning_a_meta_model_allocates_no_weights():
    model = tiny_gpt2(device="meta")
    plan = autotp.plan(model, tp=2, layout=MEGATRON_GPT2)
    assert all(p.is_meta for p in model.parameters())
    assert plan.roles["transformer.h.0.attn.c_attn.weight"] == "column"


def test_fused_qkv_is_split_by_heads_not_contiguously():
    plan = autotp.plan(tiny_gpt2(n_head=4, head_dim=8), tp=2, layout=MEGATRON_GPT2)
    placement = plan.params["transformer.h.0.attn.c_attn.weight"]
    assert (placement.dim, placement.chunks, placement.unit) == (1, 3, 8)   # q|k|v blocks of 8-wide heads


def test_same_inputs_give_the_same_plan_byte_for_byte():
    a = autotp.plan(gpt2_meta(768, 12), tp=4, profile="v100-dgx2h")
    b = autotp.plan(gpt2_meta(768, 12), tp=4, profile="v100-dgx2h")
    assert a.to_json() == b.to_json()
