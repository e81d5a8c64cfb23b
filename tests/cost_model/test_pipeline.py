"""autotp.cost_model.pipeline: PTD-P step time, bubble and the (t, p, d) search, on synthetic
layer costs (no capture)."""
import dataclasses

from hypothesis import example, given, settings
from hypothesis import strategies as st

from autotp.cost_model import PROFILES
from autotp.cost_model.pipeline import (Cluster, LayerCost, choose, in_flight_layers, memory, model_flops, stage_layers,
                                        step_time)

A100 = Cluster(PROFILES["a100-dgx"])


def _cost(t: int, mb: int, layer_s: float = 0.01) -> LayerCost:
    # compute splits over t; a tp > 1 pays a fixed all-reduce share
    return LayerCost(layer_s * mb / t + (0.001 if t > 1 else 0.0), 0.002 * mb, 1e8 / t, 5e7 / t, 1e9 * mb / t,
                     mb * 2048 * 4096 * 2)


@settings(max_examples=50, deadline=None)
@given(p=st.sampled_from([1, 2, 4, 8]), m=st.integers(1, 64), v=st.sampled_from([1, 2]))
def test_the_bubble_is_p_minus_1_slots_over_v(p, m, v):
    cluster = dataclasses.replace(A100, node_link_bw=float("inf"), node_link_latency=0.0)
    cost = _cost(1, 1)
    step, bubble, parts = step_time(cost, cluster, layers=16, t=1, p=p, d=1, batch=m, micro_batch=1, virtual=v)
    stage = 16 / p * cost.layer_s * 4 / 3 + cost.outside_s
    assert abs(parts["pipeline_s"] - (m + (p - 1) / v) * stage) < 1e-12
    assert abs(bubble * step - (p - 1) / v * stage) < 1e-12
    assert step == parts["pipeline_s"] + parts["optimizer_s"]       # d = 1: no data-parallel traffic


@settings(max_examples=25, deadline=None)
@given(gpus=st.sampled_from([8, 16, 32, 64]), layers=st.sampled_from([8, 12, 16]),
       batch=st.sampled_from([32, 64, 128]), limit_gib=st.sampled_from([2, 8, 80]),
       virtual=st.sampled_from([(1,), (1, 2, 4)]))
def test_every_choice_uses_every_gpu_keeps_tp_in_a_node_and_fits(gpus, layers, batch, limit_gib, virtual):
    cluster = dataclasses.replace(A100, profile=dataclasses.replace(A100.profile, memory=limit_gib * 2**30))
    found = choose(_cost, cluster, gpus=gpus, layers=layers, batch=batch, seq=2048, hidden=4096, vocab=51200,
                   virtual=virtual)
    for c in found:
        assert c.t * c.p * c.d == gpus and c.t <= cluster.gpus_per_node and layers % c.p == 0
        assert c.d * c.micro_batch * c.micro_batches == batch
        assert c.memory_bytes <= cluster.profile.memory
        assert c.virtual in virtual and (c.virtual == 1 or (c.p > 1 and (layers // c.p) % c.virtual == 0))
        assert c.memory_bytes == memory(_cost(c.t, c.micro_batch), cluster, layers=layers, p=c.p,
                                        micro_batch=c.micro_batch, virtual=c.virtual,
                                        micro_batches=c.micro_batches)
    assert [c.step_s for c in found] == sorted(c.step_s for c in found)
    if found:
        flops = model_flops(batch=batch, seq=2048, layers=layers, hidden=4096, vocab=51200)
        assert abs(found[0].flops_per_gpu - flops / found[0].step_s / gpus) < 1e-6 * found[0].flops_per_gpu


@settings(max_examples=50, deadline=None)
@given(p=st.sampled_from([2, 4, 8, 16]), per_gpu=st.sampled_from([1, 2, 4, 6]), m=st.integers(1, 64))
def test_the_interleaved_schedule_holds_more_layers_in_flight_than_1f1b(p, per_gpu, m):
    layers = p * per_gpu
    plain = in_flight_layers(layers=layers, p=p, micro_batches=m)
    assert plain == min(p, m) * per_gpu                   # p micro-batches of the first GPU's layers
    for v in (v for v in range(2, per_gpu + 1) if per_gpu % v == 0):
        got = in_flight_layers(layers=layers, p=p, virtual=v, micro_batches=m)
        # torch's Interleaved1F1B on rank 0: (v-1) p + 2 (p-1) chunk forwards, then the first backward
        whole = ((v - 1) * p + 2 * (p - 1) + 1) * per_gpu / v
        assert got == min(whole, m * per_gpu)
        assert got <= (1 + 1 / v) * layers                  # the paper's "comparable footprint"
        if m >= 2 * p:
            assert got > plain
    # the 1T row of the paper: 64 stages of 2 layers, 2 chunks each -> 191 layer inputs, not 128
    assert in_flight_layers(layers=128, p=64, virtual=2) == 191
    assert in_flight_layers(layers=128, p=64) == 128


@settings(max_examples=60, deadline=None)
@given(p=st.sampled_from([2, 3, 4]), v=st.sampled_from([1, 2]), per_chunk=st.integers(1, 4),
       first=st.floats(0.0, 0.05), last=st.floats(0.0, 0.08))
@example(p=2, v=2, per_chunk=2, first=0.015625, last=0.0078125)   # the leftovers of two chunks on one GPU
def test_the_slowest_gpu_sets_the_pace_with_the_head_on_the_last(p, v, per_chunk, first, last):
    layers = p * v * per_chunk
    cost = dataclasses.replace(_cost(1, 1), outside_s=first + last, first_s=first)
    per = cost.layer_s * 4 / 3
    even, slowest_even = stage_layers(cost, layers=layers, p=p, virtual=v, balanced=False)
    assert even == [layers // p] * p
    assert abs(slowest_even - (layers // p * per + max(first, last))) < 1e-12   # embedding and head apart
    held, slowest = stage_layers(cost, layers=layers, p=p, virtual=v)
    assert sum(held) == layers and all(n >= v for n in held)      # every chunk keeps a layer
    assert slowest <= slowest_even + 1e-12                         # the runtime's cut is never slower
    assert slowest >= (layers * per + first + last) / p - 1e-12   # nor faster than a perfect share
    if v == 1 and last - first >= 2 * per and per_chunk > 1:        # a head two layers dearer moves one off
        assert held[-1] < layers // p
    # without the split known, all of what lies outside lands on the slowest stage (as before)
    unknown = dataclasses.replace(cost, first_s=None)
    assert abs(stage_layers(unknown, layers=layers, p=p, virtual=v)[1] - (layers / p * per + first + last)) < 1e-12


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 40), data=st.data(), per=st.sampled_from([0.01, 0.013, 1.0]),
       first=st.floats(0.0, 5.0), last=st.floats(0.0, 8.0))
def test_the_uniform_cut_is_as_fast_as_the_runtimes_balance(n, data, per, first, last):
    from autotp.cost_model.pipeline import _uniform_balance, balance

    chunks = data.draw(st.integers(1, n))
    first, last = first * per, last * per

    def slowest(sizes):
        return max(x * per + (first if k == 0 else 0.0) + (last if k == chunks - 1 else 0.0)
                   for k, x in enumerate(sizes))

    fast = _uniform_balance(n, per, first, last, chunks)
    assert sum(fast) == n and min(fast) >= 1 and len(fast) == chunks
    exact = balance([per] * n, first, last, chunks)
    assert abs(slowest(fast) - slowest(exact)) <= 1e-9 * slowest(exact)


def test_the_papers_flop_count_of_the_1t_row():
    # eq. 3, 96 B s l h^2 (1 + s/6h + V/16lh): 5.14e19 FLOPs a step, so the published 163 TF/s on
    # each of 3072 GPUs is a step of about 103 s
    f = model_flops(batch=3072, seq=2048, layers=128, hidden=25600, vocab=51200)
    by_hand = 96 * 3072 * 2048 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert f == by_hand and 102 < f / (163e12 * 3072) < 103


# ---- autotp.plan(model, world=N): the choice for a captured model ------------------------------

def _meta_gpt2(layers: int = 8):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(n_embd=256, n_head=8, n_layer=layers, vocab_size=1000, n_positions=128))


def test_plan_with_world_chooses_t_p_d_within_a_node_and_says_why():
    import autotp
    from autotp.ptd import PipelinePlan

    got = autotp.plan(_meta_gpt2(), world=16, gpus_per_node=4, batch=32, seq=128, profile="a100-dgx")
    assert isinstance(got, PipelinePlan) and got.layers == 8
    for c in got.choices:
        assert c.t * c.p * c.d == 16 and c.t <= 4 and 8 % c.p == 0 and 32 % (c.d * c.micro_batch) == 0
        assert c.micro_batches == 32 // (c.d * c.micro_batch)
    assert [c.step_s for c in got.choices] == sorted(c.step_s for c in got.choices)
    assert len({(c.t, c.p) for c in got.choices}) > 1     # the search saw several (t, p)
    text = str(got)
    best = got.best
    assert f"chosen: t={best.t} x p={best.p} x d={best.d}" in text and "pipeline bubble" in text
    assert "tensor parallelism stays inside a node (4 GPUs)" in text
    assert "t in [8, 16] would put tensor parallelism's all-reduces on the inter-node link" in text
    run = got.parallelize_kwargs()
    assert run["tp"] == best.t and run["batch"] * best.d == 32 and run["seq"] == 128
    if best.p > 1:
        assert run["pp"] == best.p and run["microbatches"] == best.micro_batches and run["virtual"] == best.virtual
    piped = next(c for c in got.choices if c.p > 1)
    assert got.parallelize_kwargs(piped)["pp"] == piped.p
    fixed = autotp.plan(_meta_gpt2(), 2, world=16, gpus_per_node=4, batch=32, seq=128, profile="a100-dgx")
    assert {c.t for c in fixed.choices} == {2}


def test_model_flops_are_counted_off_the_graph_eq_3_for_a_gpt_and_what_swiglu_and_gqa_compute():
    """A step's model FLOPs from the captured products: the paper's eq. (3) exactly for GPT-2,
    and for a Llama (SwiGLU MLP of 3 matrices, 2 kv heads of 4, untied head) the hand count."""
    import torch

    import autotp
    from autotp import zoo
    from autotp.capture.expand import find_stacks
    from autotp.cost_model.pipeline import counted_flops, model_flops
    from autotp.ptd import layer_cost

    gpt2 = _meta_gpt2()   # the structure the planner tests below capture too (the captures are cached)
    cost = layer_cost(gpt2, find_stacks(gpt2)[0], 2, 2, 128, "a100-dgx")
    eq3 = model_flops(batch=8, seq=128, layers=8, hidden=256, vocab=1000)
    assert abs(counted_flops(cost, batch=8, micro_batch=2, layers=8) / eq3 - 1) < 1e-9
    config = zoo.tiny_config("llama", layers=4, heads=4, kv_heads=2, head_dim=8, vocab=100, positions=128)
    llama = zoo.build("llama", config, device="meta", dtype=torch.bfloat16)
    cost = layer_cost(llama, find_stacks(llama)[0], 1, 1, 64, "a100-dgx")
    h, kv, ffn, s, v = 32, 2 * 8, config.intermediate_size, 64, 100
    layer = 2 * s * (h * h + 2 * h * kv + h * h + 3 * h * ffn) + 4 * s * s * h   # q, k, v, o, MLP; attention
    assert (cost.layer_flops, cost.outside_flops) == (layer, 2 * s * h * v)
    assert counted_flops(cost, batch=3, micro_batch=1, layers=4) == 3 * (4 * 4 * layer + 3 * 2 * s * h * v)
    plan = autotp.plan(llama, 1, world=8, gpus_per_node=8, batch=8, seq=64, profile="a100-dgx")   # t fixed: quick
    best = plan.best
    assert abs(best.flops_per_gpu * best.step_s * 8 - counted_flops(cost, batch=8, micro_batch=1, layers=4)) < 1e-3 * \
        counted_flops(cost, batch=8, micro_batch=1, layers=4)


def test_plan_with_world_refuses_what_cannot_be_split_clearly():
    import pytest
    import torch

    import autotp
    from autotp.errors import ConfigError

    with pytest.raises(ConfigError, match="world=0: give the number of GPUs"):
        autotp.plan(_meta_gpt2(), world=0, seq=128)
    with pytest.raises(ConfigError, match=r"one stack of more than 3 identical blocks .* found 0 \(none\)"):
        autotp.plan(torch.nn.Linear(4, 4), world=4, seq=8)
    # 3 GPUs, 2 per node: t = 1, p divides 8 layers and 3 GPUs -> 1, d = 3 does not divide batch 32
    with pytest.raises(ConfigError, match=r"no \(t, p, d\) fits 3 GPUs .* Change world, batch or gpus_per_node"):
        autotp.plan(_meta_gpt2(), world=3, gpus_per_node=2, batch=32, seq=128)
    with pytest.raises(ConfigError, match="needs tp"):
        autotp.plan(_meta_gpt2())
    # layers that alternate (sliding and full attention): a stack of period 2 (which capture cuts and
    # expands), whose one layer's price is not every layer's; at 6 layers too few to cut
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for layers, refused in ((6, r"one stack of more than 3 identical blocks .* found 0"),
                            (8, r"its layers differ, repeating every 2 .* autotp.plan\(model, tp\)")):
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=layers, vocab_size=100, use_sliding_window=True, sliding_window=16,
                             layer_types=["full_attention", "sliding_attention"] * (layers // 2))
        with torch.device("meta"):
            alternating = Qwen2ForCausalLM(config)
        with pytest.raises(ConfigError, match=refused):
            autotp.plan(alternating, world=8, gpus_per_node=4, batch=8, seq=32)
