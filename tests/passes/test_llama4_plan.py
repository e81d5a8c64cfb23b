"""Llama-4-Scout's text model planned at tp 8 on the meta device, as published (4 of its 48
layers: three chunked-attention layers with rotary, one full-attention layer without).

Its experts are stacks read whole by ``bmm`` ([16, 5120, 16384] gate|up, [16, 8192, 5120] down);
before, the rules did not see them as experts: gate|up was split on its hidden size and down kept
whole on every rank, 0.42 of the expert bytes per rank where every other MoE got 1/8."""
from functools import lru_cache

import pytest
import torch

import autotp
from autotp import zoo
from autotp.placements import Shard, local_size


@lru_cache(maxsize=1)
def _plan():
    model = zoo.build("llama4", zoo.published_config("llama-4-scout", layers=4), device="meta",
                      dtype=torch.bfloat16)
    return autotp.plan(model, tp=8)


@pytest.mark.slow   # 13 s; the fast tier runs Llama-4's experts split against serial on every call
# (tests/e2e/test_llama4.py) and plans Scout's shared expert and attention at real size (below)
def test_llama4_scout_plans_its_experts_at_an_eighth_per_rank():
    plan = _plan()
    stacks = {n: s for n, s in plan.shapes.items() if ".experts." in n}
    assert len(stacks) == 8 and all(len(s) == 3 and s[0] == 16 for s in stacks.values())
    rank = serial = 0
    for name, shape in stacks.items():
        whole = shape[0] * shape[1] * shape[2]
        p = plan.params[name]
        assert isinstance(p, Shard) and plan.roles[name] in ("expert", "expert_column", "expert_row"), (name, p)
        rank += whole // shape[p.dim] * max(local_size(shape[p.dim], p, 8, r) for r in range(8))
        serial += whole
    assert rank * 8 == serial
    # gate|up and down split alike in each layer: whole experts, or gate|up column and down row
    for layer in range(4):
        roles = {plan.roles[f"model.layers.{layer}.feed_forward.experts.{w}"] for w in ("gate_up_proj", "down_proj")}
        assert roles in ({"expert"}, {"expert_column", "expert_row"}), (layer, roles)
    assert any("experts model.layers" in note for note in plan.notes), plan.notes   # the layout said, and why


def test_llama4_scout_shared_expert_is_a_dense_mlp_and_attention_splits_by_head():
    plan = _plan()
    for layer in range(4):
        base = f"model.layers.{layer}"
        assert [plan.roles[f"{base}.feed_forward.shared_expert.{w}_proj.weight"] for w in ("gate", "up", "down")] \
            == ["column", "column", "row"]
        assert [plan.roles[f"{base}.self_attn.{w}_proj.weight"] for w in "qkv"] == ["column"] * 3
        assert plan.attention[f"{base}.self_attn"] == [5] * 8   # 40 heads, 5 a rank
        # the output projection: Megatron's row (a reduce-scatter into the sequence-parallel
        # residual), or column after its input's heads are gathered (an all-gather of the same
        # bytes); its output then split by features meets the residual stream, split along the
        # sequence, through one all-to-all each way (1/8 of a gather's bytes; issue 44's review:
        # layers 1-3 at this workload, 0.15 ms a step cheaper than o_proj pinned row)
        o_proj = plan.roles[f"{base}.self_attn.o_proj.weight"]
        assert o_proj in ("row", "column"), o_proj
        if o_proj == "column":
            into = [c for c in plan.comms if c.module == f"{base}.self_attn.o_proj"]
            assert [c.kind for c in into] == ["all_gather_f"], into
            moved = [(c.src, c.dst) for c in plan.comms if c.module == base and c.kind == "all_to_all"]
            # (layer 0's residual arrives split by features, from the embedding's table read by
            # columns: only the way into the sequence split; there the same predicted step as
            # o_proj row, a tie)
            assert ("S(2)", "S(1)") in moved and (("S(1)", "S(2)") in moved or layer == 0), moved
    # the rotary's complex products keep q and k split by head: no gather in attention
    assert not [c for c in plan.comms if c.module.endswith("self_attn") and c.kind in ("all_gather", "scatter")]
