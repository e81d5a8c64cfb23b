"""A generation step's plan: generate runs every step under ``torch.no_grad()``, so the step is
planned as it runs, forward only (one process, a tiny model on the meta device)."""
import functools

import pytest
import torch

import autotp
from autotp import zoo
from autotp.generation import CacheLayout, StepSpec, capture_step
from autotp.placements import REPLICATE, Routed, Shard
from autotp.passes.propagate import grad_nodes
from autotp.planner.planner import build_plan


def test_a_generation_step_is_priced_forward_only_and_places_no_f():
    # Before, a step was priced as if trained: an f's backward all-reduce (of a gradient never
    # computed) made a decode step of Mamba with Megatron's layout all-gather its split SSM state
    # for ``ssm_state @ C`` rather than keep it split (docs/architecture.md, "Recurrent states")
    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=4, head_dim=8, vocab=64)
    model = zoo.build("llama", config, device="meta").eval()
    plan = autotp.plan(model, tp=2, layout={"*q_proj.weight": "column", "*k_proj.weight": "column",
                                            "*v_proj.weight": "column", "*o_proj.weight": "row"})
    ids = torch.ones(2, 5, dtype=torch.long)
    spec = StepSpec({"input_ids": ids})
    cap = capture_step(model, spec)
    assert not cap.differentiable and grad_nodes(cap) == frozenset()
    step, *_ = build_plan(cap, 2, batch=8, seq=64, plan=plan, gather_logits=True, keep_split=spec.keep_split(cap))
    assert step.comms and all(c.kind not in ("f", "all_gather_f") and c.bwd_bytes == 0 for c in step.comms), step.comms


@functools.lru_cache(maxsize=None)
def _bamba_decode_step(groups: int) -> tuple:
    """A tiny Bamba's decode step (config, spec, capture), one capture for the cases of a group count."""
    config = zoo.tiny_config("bamba", layers=2, heads=2, kv_heads=2, head_dim=8, vocab=64, mamba_n_groups=groups)
    model = zoo.build("bamba", config, device="meta").eval()
    heads, d, n = config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state
    conv = config.mamba_expand * config.hidden_size + 2 * groups * n
    names = ("conv_0", "ssm_0", "key_1", "value_1")
    # the states a prefill split by head leaves (the conv state's layout is not this test's)
    layout = CacheLayout(shapes=(("conv_0", (conv, config.mamba_d_conv)), ("ssm_0", (heads, d, n)),
                                 ("key_1", (2, 0, 8)), ("value_1", (2, 0, 8))),
                         dtypes=tuple((name, torch.float32) for name in names),
                         placements=(("conv_0", REPLICATE), ("ssm_0", Shard(1)), ("key_1", Shard(1)),
                                     ("value_1", Shard(1))))
    spec = StepSpec({"input_ids": torch.ones(2, 1, dtype=torch.long)}, layout, 5)
    return config, spec, capture_step(model, spec)


@pytest.mark.parametrize("groups, host_reads", [(1, True), (2, True), (2, False)])
def test_a_mamba2_decode_step_reads_its_split_state_for_one_bmm_without_gathering_it(groups, host_reads):
    # Mamba2's torch path reads its SSM state as view(batch * heads, head_dim, d_state) for one
    # bmm with C: a merge of the dynamic batch with the split heads, which no Shard can say. The
    # state and C were all-gathered for that product every decode step (b*h*d*n float32 bytes a
    # layer) and y sliced back. Now the merge makes each rank's rows (P(tokens 0)), the bmm
    # keeps them, and the view back to [b, h, d] is the heads' split again. Their row map is
    # computed from the shapes, no host read: host_reads=False keeps them (it dropped every
    # strategy of rows, the experts' with these, and gathered the state again)
    config, spec, cap = _bamba_decode_step(groups)
    heads, d, n = config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state
    step, index, prop = build_plan(cap, 2, batch=64, seq=4096, profile="h100-dgx", gather_logits=True,
                               layout={"*in_proj.weight": "column", "*out_proj.weight": "row"},
                               input_placements=spec.input_placements, keep_split=spec.keep_split(cap),
                               host_reads=host_reads)
    shapes = {n.name: tuple(n.meta["val"].shape[1:]) for n in cap.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)}
    gathered = [c.tensor for c in step.comms if c.kind.startswith("all_gather")
                and shapes[c.tensor] in ((heads, d, n), (heads, n))]   # the state, C
    assert gathered == [], gathered
    # the graph as planned (its RMSNorms fused: a copy of the capture)
    (bmm,) = [node for node in index.capture.graph.nodes if node.target is torch.ops.aten.bmm.default]
    assert prop.chosen[bmm].output == Routed(0, tokens=True, heads=heads), prop.chosen[bmm]
    (back,) = bmm.users
    assert isinstance(prop.chosen[back].output, Shard) and prop.chosen[back].output.dim == 1, prop.chosen[back]


def test_a_mamba2_decode_step_reads_a_state_split_by_group_where_tp_divides_neither():
    # 8 heads in 4 groups of 2 at tp 3: the prompt leaves the state split by group (S(1/2): 2, 1
    # and 1 groups, 4, 2 and 2 heads a rank, not a plain split's 3, 3 and 2). Its merge with the
    # batch was refused (only runs laid out as a plain shard's had a row map) and the state and
    # C all-gathered every step; now the row map is the runs of whole groups of each rank
    config = zoo.tiny_config("bamba", layers=2, heads=2, kv_heads=2, head_dim=8, vocab=64, mamba_n_groups=4,
                             mamba_n_heads=8, mamba_d_head=4)
    model = zoo.build("bamba", config, device="meta").eval()
    heads, d, n = 8, 4, config.mamba_d_state
    conv = heads * d + 2 * 4 * n
    names = ("conv_0", "ssm_0", "key_1", "value_1")
    layout = CacheLayout(shapes=(("conv_0", (conv, config.mamba_d_conv)), ("ssm_0", (heads, d, n)),
                                 ("key_1", (2, 0, 8)), ("value_1", (2, 0, 8))),
                         dtypes=tuple((name, torch.float32) for name in names),
                         placements=(("conv_0", REPLICATE), ("ssm_0", Shard(1, unit=2)), ("key_1", Shard(1)),
                                     ("value_1", Shard(1))))
    spec = StepSpec({"input_ids": torch.ones(2, 1, dtype=torch.long)}, layout, 5)
    cap = capture_step(model, spec)
    step, index, prop = build_plan(cap, 3, batch=64, seq=4096, profile="h100-dgx", gather_logits=True,
                               layout={"*in_proj.weight": "column", "*out_proj.weight": "row"},
                               input_placements=spec.input_placements, keep_split=spec.keep_split(cap))
    shapes = {n.name: tuple(n.meta["val"].shape[1:]) for n in cap.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)}
    gathered = [c.tensor for c in step.comms if c.kind.startswith("all_gather") and shapes[c.tensor] == (heads, d, n)]
    assert gathered == [], gathered
    # the graph as planned (its RMSNorms fused: a copy of the capture)
    (bmm,) = [node for node in index.capture.graph.nodes if node.target is torch.ops.aten.bmm.default]
    assert prop.chosen[bmm].output == Routed(0, tokens=True, unit=2, heads=heads), prop.chosen[bmm]
    (back,) = bmm.users
    assert prop.chosen[back].output == Shard(1, unit=2), prop.chosen[back]
