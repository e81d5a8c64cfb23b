"""Activation checkpointing priced: ``activation_checkpointing=True`` plans the run that recomputes
each repeated layer in backward (autotp/passes/checkpoint.py's ``price_recomputation``).

What checkpoint keeps grows by one layer input a layer (the hidden state entering it, at the
profile's bytes), where the plain run keeps every layer's activations: the difference between a
4-layer and a 2-layer model of one family, per layer, is one ``batch x seq x hidden`` tensor
under checkpointing. Each layer's forward runs twice, so the step costs more; a memory limit the
plain run's activations exceed is met by the checkpointed one; and the plan says it was priced so.
``benchmarks/activation_memory.md`` holds the figure against what autograd keeps at GPT-2 124M's size.
"""
from __future__ import annotations

import pytest
import sympy
import torch

import autotp
from autotp import zoo
from autotp.cost_model.devices import get_profile
from autotp.errors import MemoryLimitError
from autotp.plan import Plan

BATCH, SEQ, HIDDEN = 8, 32, 32


def _plans(family: str, layers: int) -> dict[bool, Plan]:
    config = zoo.tiny_config(family, layers=layers, heads=4, kv_heads=4, head_dim=8, vocab=64, positions=SEQ)
    model = zoo.build(family, config, device="meta", dtype=torch.float32)
    return {ck: autotp.plan(model, 1, batch=BATCH, seq=SEQ, activation_checkpointing=ck) for ck in (False, True)}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_checkpointing_keeps_one_layer_input_a_layer_and_runs_each_forward_twice(family):
    two, four = _plans(family, 2), _plans(family, 4)
    hidden_state = BATCH * SEQ * HIDDEN * get_profile(four[True].profile).dtype_bytes
    per_layer = {ck: (four[ck].activation_bytes - two[ck].activation_bytes) / 2 for ck in (False, True)}
    # a few bytes a layer besides (a per-position vector some layers read): within 1%
    assert per_layer[True] == pytest.approx(hidden_state, rel=0.01), per_layer
    assert per_layer[False] > 4 * hidden_state, per_layer   # every activation of a layer, without
    assert four[True].activation_bytes < four[False].activation_bytes
    assert four[True].memory_bytes - four[True].activation_bytes == \
        pytest.approx(four[False].memory_bytes - four[False].activation_bytes)   # training state unchanged
    # the layers' forwards again: more than nothing, less than a second forward and backward
    assert four[False].compute_s < four[True].compute_s < 2 * four[False].compute_s
    # the compute expression in b and s holds the recomputation too (as near as the plain plan's
    # own is at this tiny workload, 2e-4; without the recomputation it read 24% under)
    b, s = sympy.symbols("b s", integer=True, positive=True)
    expr = sympy.sympify(four[True].expressions["compute_s"], locals={"b": b, "s": s})
    assert float(expr.subs({b: BATCH, s: SEQ})) == pytest.approx(four[True].compute_s, rel=1e-3)
    assert (four[True].recomputed, four[False].recomputed) == (True, False)
    assert "layers recomputed in backward" in "\n".join(four[True].summary_lines())
    assert Plan.from_json(four[True].to_json()).recomputed
    # of its activations, the layers' inputs: one hidden state a layer, the rest one layer's
    # recomputation and what lies outside the layers
    kept = {n: plan.layer_input_bytes for n, plan in ((2, two[True]), (4, four[True]))}
    assert kept[4] - kept[2] == pytest.approx(2 * hidden_state, rel=0.01), kept
    assert 4 * hidden_state <= kept[4] < four[True].activation_bytes   # (rotary's cos and sin kept once)
    assert four[False].layer_input_bytes == two[False].layer_input_bytes == 0
    assert Plan.from_json(four[True].to_json()).layer_input_bytes == kept[4]


def test_a_pipeline_stage_holds_each_layer_input_in_flight_and_one_recomputation():
    from autotp.runtime.pipeline.stage import stage_activation_bytes

    # 8 layers: 80 bytes of their inputs, 120 of one layer's recomputation and the rest; a stage
    # of 2 layers with 4 micro-batches in flight holds 8 layer-micro-batches of 4 micro-batches
    plan = Plan(tp=2, profile="cpu-gloo", batch=4, seq=8, params={}, shapes={}, roles={}, activation_bytes=200.0, layer_input_bytes=80.0,
                recomputed=True)
    assert stage_activation_bytes(plan, 8, 8, 4) == pytest.approx((8 * 80 / 8 + 120) / 4)
    # GPipe's 2 layers for 16 micro-batches: 32 inputs, still one recomputation (the plain
    # spread priced 32 layers' shares, 800 / 16)
    assert stage_activation_bytes(plan, 8, 32, 16) == pytest.approx((32 * 80 / 8 + 120) / 16)
    # a plain plan's layer share per layer-micro-batch, and a checkpointed plan saved before
    # its layers' inputs were recorded read as one
    plain = Plan(tp=2, profile="cpu-gloo", batch=4, seq=8, params={}, shapes={}, roles={}, activation_bytes=200.0)
    assert stage_activation_bytes(plain, 8, 8, 4) == pytest.approx(200 / 8 / 4 * 8)
    old = Plan(tp=2, profile="cpu-gloo", batch=4, seq=8, params={}, shapes={}, roles={}, activation_bytes=200.0, recomputed=True)
    assert stage_activation_bytes(old, 8, 8, 4) == stage_activation_bytes(plain, 8, 8, 4)


def test_a_limit_the_plain_activations_exceed_is_met_by_recomputation():
    plans = _plans("llama", 4)
    limit = (plans[False].memory_bytes + plans[True].memory_bytes) / 2
    config = zoo.tiny_config("llama", layers=4, heads=4, kv_heads=4, head_dim=8, vocab=64, positions=SEQ)
    model = zoo.build("llama", config, device="meta", dtype=torch.float32)
    with pytest.raises(MemoryLimitError, match="or activation_checkpointing=True"):
        autotp.plan(model, 1, batch=BATCH, seq=SEQ, memory_limit=limit)
    fits = autotp.plan(model, 1, batch=BATCH, seq=SEQ, memory_limit=limit, activation_checkpointing=True)
    assert fits.memory_bytes <= limit
    with pytest.raises(MemoryLimitError, match=r"recomputed already") as caught:
        autotp.plan(model, 1, batch=BATCH, seq=SEQ, memory_limit=plans[True].memory_bytes / 2,
                    activation_checkpointing=True)
    assert "or activation_checkpointing=True" not in str(caught.value)


def test_activation_checkpointing_is_true_or_false():
    config = zoo.tiny_config("gpt2", layers=1, heads=2, head_dim=8, vocab=64, positions=SEQ)
    model = zoo.build("gpt2", config, device="meta", dtype=torch.float32)
    with pytest.raises(autotp.ConfigError, match="activation_checkpointing='yes'"):
        autotp.plan(model, 1, activation_checkpointing="yes")


def test_a_recomputed_layers_collectives_run_their_forward_again():
    # checkpoint_layers puts each communication node in the layer of the op it feeds, so the
    # recomputation runs a layer's g all-reduce and all-gathers again (an f's forward is nothing):
    # priced once more forward, and only there (the embedding's and the head's collectives run once)
    from autotp.testing.host import MEGATRON

    config = zoo.tiny_config("gpt2", layers=2, heads=4, head_dim=8, vocab=64, positions=SEQ)
    model = zoo.build("gpt2", config, device="meta", dtype=torch.float32)
    plans = {ck: autotp.plan(model, 2, batch=BATCH, seq=SEQ, layout=MEGATRON["gpt2"], sequence_parallel=False,
                             activation_checkpointing=ck) for ck in (False, True)}
    key = lambda c: (c.kind, c.tensor, c.consumer, c.src, c.dst)  # noqa: E731
    plain = {key(c): c for c in plans[False].comms}
    assert sorted(plain) == sorted(key(c) for c in plans[True].comms)   # the same plan, priced twice
    profile = get_profile(plans[True].profile)
    extra = 0.0
    for c in plans[True].comms:
        more = c.seconds - plain[key(c)].seconds
        in_layer = c.module.startswith("transformer.h.")
        if c.kind == "g" and in_layer:   # its all-reduce forward again
            assert more == pytest.approx(profile.all_reduce_time(c.fwd_bytes * 2 / (2 * (2 - 1)), 2)), c
        elif c.kind == "f" or not in_layer:
            assert more == 0.0, c
        extra += more
    assert sum(c.kind == "g" and c.module.startswith("transformer.h.") for c in plans[True].comms) == 4
    assert plans[True].comm_s - plans[False].comm_s == pytest.approx(extra) and extra > 0
    b, s = sympy.symbols("b s", integer=True, positive=True)
    for ck, plan in plans.items():   # the comm expression in b and s holds it too
        expr = sympy.sympify(plan.expressions["comm_s"], locals={"b": b, "s": s})
        assert float(expr.subs({b: BATCH, s: SEQ})) == pytest.approx(plan.comm_s, rel=1e-3), ck
