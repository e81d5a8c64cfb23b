"""A model that is not a transformer, at real size: Mamba-130m (two of its layers) planned at
tp=8 on the meta device. Its slow path loops over the sequence, so the capture's sequence dim
comes out fixed to the example's length (Capture.fixed_dims) and the unrolled scan keeps many
tensors live at once (the solver's state cap, autotp/passes/solve.py): the plan must still
come back, its 50280-word output layer split."""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.capture import EXAMPLE_SEQ
from autotp.capture import cache as capture_cache
from autotp.placements import Shard


def test_mamba_130m_plans_at_tp8_with_its_sequence_fixed():
    model = zoo.build("mamba", zoo.published_config("mamba-130m", layers=1), device="meta", dtype=torch.bfloat16)
    cap = capture_cache.capture(model)
    assert cap.fixed_dims == {"input_ids.1": EXAMPLE_SEQ, "labels.1": EXAMPLE_SEQ}
    plan = autotp.plan(model, tp=8)
    head = plan.params["lm_head.weight"]
    # by vocabulary rows or by hidden columns, whichever the cost model prices cheaper: at the
    # fixed sequence's 8 x 11 tokens (under the ridge, so not padded), 6285 words a rank is an
    # unaligned product (h100-dgx: 209 us forward and backward, against 40 us for 96 aligned
    # hidden columns, whose logits then take a g)
    assert isinstance(head, Shard) and plan.shapes["lm_head.weight"][head.dim] in (50280, 768), head
    if plan.shapes["lm_head.weight"][head.dim] == 768:
        assert [c.kind for c in plan.comms if c.consumer.startswith("to_dtype") and c.src == "P"] == ["g"]


def test_mamba_130m_takes_the_channel_layout_pinned_at_tp8():
    # Megatron's and vLLM's Mamba layout: in_proj column, x_proj row (its dt|B|C a Partial, one
    # all-reduce), dt_proj column, out_proj row. dt_proj is read as ``dt_proj.weight @ x`` (a 2-D
    # weight on the left of a batched product), which had no rule: pinning it was a PlanError.
    model = zoo.build("mamba", zoo.published_config("mamba-130m", layers=1), device="meta", dtype=torch.bfloat16)
    layout = {"*in_proj.weight": "column", "*x_proj.weight": "row", "*dt_proj.weight": "column",
              "*out_proj.weight": "row"}
    plan = autotp.plan(model, tp=8, layout=layout)
    mixer = "backbone.layers.0.mixer."
    assert plan.params[mixer + "dt_proj.weight"] == Shard(0)
    assert plan.params[mixer + "x_proj.weight"] == Shard(1)
    assert plan.local_shape(mixer + "dt_proj.weight", 0) == (1536 // 8, 48)
    # x_proj's Partial output is made whole once, before dt|B|C are split apart
    assert [c.kind for c in plan.comms if c.module == mixer.rstrip(".") and c.src == "P"] == ["g"]


def _mamba2_plan(groups: int, tp: int):
    """A tiny Bamba whose Mamba2 mixer has 2 * tp heads of 8 in ``groups`` groups (d_state 4),
    planned at a large workload so that the cost model splits it. One layer, the mixer alone:
    these tests read layer 0's mixer, and a second layer (Bamba's attention) only doubled the
    solve (tests/passes/test_attention.py plans the attention)."""
    config = zoo.tiny_config("bamba", layers=1, heads=tp, kv_heads=tp, head_dim=8, vocab=64,
                             mamba_n_groups=groups)
    model = zoo.build("bamba", config, device="meta")
    return autotp.plan(model, tp=tp, batch=64, seq=4096, profile="h100-dgx")


@pytest.mark.parametrize("groups, tp", [(2, 2), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_mamba2_with_groups_dealt_to_the_ranks_splits_by_head_group(groups, tp):
    # in_proj's [z | x | B | C | dt] cut per group (its heads' z, x and dt; its own B and C): the
    # conv, the chunked scan and the gated norm run on each rank's groups, nothing gathered
    # between in_proj and out_proj (before: in_proj in three plain blocks, B and C cut across
    # groups, the conv's output all-gathered and the scan run whole on every rank). Per group:
    # z 16, x 16, B 4, C 4, dt 2 elements, blocks in units of 2.
    plan = _mamba2_plan(groups, tp)
    mixer = "model.layers.0.mamba"
    in_proj, out_proj = plan.params[mixer + ".in_proj.weight"], plan.params[mixer + ".out_proj.weight"]
    assert isinstance(in_proj, Shard) and in_proj.dim == 0 and in_proj.sizes == (8, 8, 2, 2, 1), in_proj
    assert isinstance(out_proj, Shard) and out_proj.dim == 1, out_proj
    inside = [c for c in plan.comms if c.module.startswith(mixer) and c.module != mixer + ".in_proj"
              and c.kind != "scatter"]   # (scatters: A_log, D, dt_bias and the conv weight sliced)
    assert inside == [], inside


def test_mamba2_with_one_group_splits_by_head_with_b_and_c_whole():
    # every published Bamba, Falcon-H1 and Granite-4.0-H has one group of B and C, read by every
    # head: in_proj [z | x | B | C | dt] dealt by head (its z, x, dt) with B and C whole on every
    # rank (before: in_proj in three plain blocks, the conv's output all-gathered, the conv, scan and
    # gated norm run whole on every rank). Per head: z 8, x 8, dt 1; B and C 4 each (one part per
    # head of 4). Nothing is gathered between in_proj and out_proj: B and C repeated for the rank's
    # heads behind an f each (their gradients summed over the ranks' heads), then either out_proj
    # row-parallel (the gated norm's statistic over all heads a g), or (issue 44: 9 us a step
    # cheaper at this workload, the split by heads reaching a split along the sequence by one
    # all-to-all) the scan's output moved to the rank's tokens, where the gated norm and a whole
    # out_proj run (their weights' gradients summed by an f each)
    plan = _mamba2_plan(1, 2)
    mixer = "model.layers.0.mamba"
    in_proj, out_proj = plan.params[mixer + ".in_proj.weight"], plan.params[mixer + ".out_proj.weight"]
    assert in_proj == Shard(0, 5, 1, sizes=(8, 8, 1, 1, 1), whole=(2, 3)), in_proj
    assert plan.local_shape(mixer + ".in_proj.weight", 1) == (16 + 16 + 4 + 4 + 2, 16)
    inside = [c for c in plan.comms if c.module.startswith(mixer) and c.module != mixer + ".in_proj"
              and c.kind != "scatter"]
    assert not [c for c in inside if c.kind in ("all_gather", "all_gather_f", "reshard")], inside
    assert [c.consumer.split("_self")[0] for c in inside if c.module == mixer] == ["repeat_interleave"] * 2
    if isinstance(out_proj, Shard):
        # out_proj row-parallel (the plan at this workload since a product's price stopped falling
        # as its contraction grows): the gated norm's statistic over all heads all-reduced inside
        # the fused norm, forward and backward (SplitRmsNorm), B's and C's f
        assert out_proj.dim == 1, out_proj
        assert sorted(c.kind for c in inside) == ["all_reduce", "all_reduce", "f", "f"], inside
    else:
        moved = [(c.src, c.dst) for c in inside if c.kind == "all_to_all"]
        assert moved == [("S(3/8)", "S(1)")], moved
        weights = [c.module for c in inside if c.kind == "f" and c.tensor.startswith("p_")]
        assert weights == [mixer + ".norm", mixer + ".out_proj"], weights


def test_mamba2_with_fewer_groups_than_ranks_splits_by_head_with_every_group_of_b_and_c_whole():
    # 2 groups at tp 4 (4 heads of 8, d_state 4): tp cannot deal the groups, so each rank holds
    # its head's z, x and dt and B's and C's two groups whole, as for one group; vLLM would hold
    # only its own group's B and C (docs/architecture.md)
    config = zoo.tiny_config("bamba", layers=1, heads=2, kv_heads=2, head_dim=8, vocab=64, mamba_n_groups=2)
    plan = autotp.plan(zoo.build("bamba", config, device="meta"), tp=4, batch=64, seq=4096, profile="h100-dgx")
    in_proj = "model.layers.0.mamba.in_proj.weight"
    assert plan.params[in_proj] == Shard(0, 5, 1, sizes=(8, 8, 2, 2, 1), whole=(2, 3)), plan.params[in_proj]
    assert plan.local_shape(in_proj, 3) == (8 + 8 + 8 + 8 + 1, 16)   # of [84, hidden 16]
    assert not any("Mamba2 in-projection" in note for note in plan.notes)
    # B and C repeated for each rank's own head from their whole groups, behind an f (before: the
    # repeat run whole and its output sliced, the gradient all-gathered)
    mixer = "model.layers.0.mamba"
    repeats = [c for c in plan.comms if c.module == mixer and c.consumer.startswith("repeat_interleave")]
    assert [c.kind for c in repeats] == ["f", "f"], repeats


def test_a_mamba2_mixer_tp_cannot_split_by_head_runs_whole_and_the_plan_says_why():
    # 6 heads beside B's and C's 4 rows (one group, d_state 4) divide into 2 head groups only:
    # at tp 3 the in-projection is not split by head (on meta in float32 its z rows dealt and the
    # rest whole, a tail), and a note names it, the count and the tp that fits
    config = zoo.tiny_config("bamba", layers=1, heads=3, kv_heads=3, head_dim=8, vocab=64)
    plan = autotp.plan(zoo.build("bamba", config, device="meta"), tp=3, batch=64, seq=4096, profile="h100-dgx")
    in_proj = plan.params["model.layers.0.mamba.in_proj.weight"]
    assert not (isinstance(in_proj, Shard) and in_proj.sizes), in_proj
    notes = [note for note in plan.notes if "Mamba2 in-projection" in note]
    assert len(notes) == 1 and "model.layers.0.mamba.in_proj.weight" in notes[0], plan.notes
    assert "6 heads" in notes[0] and "2 head groups" in notes[0] and "tp=3" in notes[0] and "[2]" in notes[0], notes


def test_gated_deltanet_pinned_by_head_runs_its_chunked_recurrence_split():
    # Qwen3-Next's chunked rule views the padded [b, heads, s + pad, d] as [b, heads, chunks, 64,
    # d]; export writes the padded length with Mod terms the reshape's dim grouping cannot divide,
    # so the heads shard was lost there and q, k, v were all-gathered into a whole recurrence on
    # every rank (5 all-gathers, 12% more predicted step). The heads dim leads the view
    # unchanged: the shard stays. (The SP all-gather before in_proj and the gated norm's own
    # conversions belong to submodules, not to the mixer's ops.)
    from tests.e2e.test_recurrent_states import DELTANET_LAYOUT

    config = zoo.tiny_config("qwen3-next", layers=1, heads=2, kv_heads=2, head_dim=8, vocab=64)
    config.layer_types = ["linear_attention"]
    config.mlp_only_layers = [0]   # a dense MLP: the experts' notes would solve the layer twice more
    plan = autotp.plan(zoo.build("qwen3-next", config, device="meta"), tp=2, batch=64, seq=4096,
                       profile="h100-dgx", layout=DELTANET_LAYOUT)
    mixer = [c for c in plan.comms if c.module == "model.layers.0.linear_attn"]
    assert mixer and not [c for c in mixer if c.kind.startswith("all_gather")], mixer
