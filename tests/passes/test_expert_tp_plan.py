"""Expert tensor parallelism against expert parallelism, chosen per MoE layer by the cost model
(tiny MoE models planned at tp=8 on the meta device: no ranks, no weights).

Where fewer experts than ranks leave expert parallelism's ranks idle, each expert's matrices are
split instead along their features (Megatron's gate|up column in two matching blocks and down row,
or, where the cost model prices it cheaper, gate|up row and down column); the plan's note says by
how much the other layout loses, or that it cannot split. Where every rank gets whole experts
(gpt-oss's 16 at tp 4), expert parallelism can be the cheaper (see autotp/planner/experts.py).
Either can be pinned; a pin that cannot hold names the stack, its experts' features and what to
pin instead.
"""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.errors import ConfigError, PlanError
from autotp.placements import Shard

ETP = {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}
EP = {"*.experts.*": "expert"}


def _model(family: str, experts: int, kv_heads: int = 2, head_dim: int = 8, **extra):
    config = zoo.tiny_config(family, layers=1, heads=8, kv_heads=kv_heads, head_dim=head_dim, vocab=48,
                             experts=experts, top_k=2, **extra)
    config._experts_implementation = "grouped_mm"
    return zoo.build(family, config, device="meta")


def _experts(plan) -> dict:
    return {name.rsplit(".", 1)[-1]: (plan.roles[name], plan.params[name]) for name in plan.params
            if ".experts." in name}


def test_fewer_experts_than_ranks_split_inside_each_expert():
    # hidden 2048, default profile. (At hidden 512 the cost model keeps the experts' weights split
    # but all-gathers them into whole products: cheaper there than an f on the routed tokens.)
    model = _model("mixtral", experts=4, head_dim=256)
    plan = autotp.plan(model, tp=8)
    got = _experts(plan)
    # each expert split along its features, 1/8 per rank: the solver's pick is gate|up row, down
    # column (the routing weights then multiply 1/8 of each routed token's output, where after a
    # row-parallel down they multiply its whole partial sum on every rank)
    assert {role for role, _ in got.values()} <= {"expert_column", "expert_row"}, got
    assert all(isinstance(p, Shard) and p.dim in (1, 2) for _, p in got.values()), got
    assert not [c for c in plan.comms if c.kind == "all_gather" and "experts" in c.module
                and c.consumer.startswith("grouped_mm")], "an expert's weights gathered: its products run whole"
    note = next(n for n in plan.notes if n.startswith("experts "))
    assert "expert-TP" in note, note
    assert "cheaper than expert-parallel (4 experts, 1 on the busiest rank, 4 idle)" in note, note
    assert "note: experts model.layers.0.mlp.experts: expert-TP" in str(plan)   # the folded view says it too
    # Megatron's expert-TP pinned: matching gate and up halves, down row; no cheaper than the solver's
    pinned = autotp.plan(model, tp=8, layout=ETP)
    assert _experts(pinned) == {"gate_up_proj": ("expert_column", Shard(1, chunks=2)),
                                "down_proj": ("expert_row", Shard(2))}, _experts(pinned)
    assert plan.compute_s + plan.comm_s <= (pinned.compute_s + pinned.comm_s) * (1 + 1e-12)


def test_where_expert_tp_cannot_split_the_note_says_so():
    # each expert's 12 features cannot be dealt evenly to 8 ranks (uneven=False): expert-TP is not
    # offered, and the layer is priced against whole experts per rank (8 experts, 1 each). Experts this
    # small stay whole on every rank: the split saves less than its collectives cost.
    plan = autotp.plan(_model("qwen3-moe", experts=8, head_dim=128, moe_intermediate_size=12), tp=8, uneven=False)
    assert {role for role, _ in _experts(plan).values()} == {"replicate"}, _experts(plan)
    note = next(n for n in plan.notes if n.startswith("experts "))
    assert "replicated — cheaper than expert-parallel (8 experts, 1 per rank) by" in note, note
    assert "expert-TP (every expert's gate|up column, down row: 1/8 of each expert per rank) not possible" in note


def test_either_layout_can_be_pinned():
    pinned = autotp.plan(_model("mixtral", experts=4, head_dim=64), tp=8, layout=EP)
    assert {role for role, _ in _experts(pinned).values()} == {"expert"}
    assert not [n for n in pinned.notes if n.startswith("experts ")]   # a pin decided it: nothing compared
    pinned = autotp.plan(_model("qwen3-moe", experts=8, head_dim=128, moe_intermediate_size=16), tp=8, layout=ETP)
    assert {role for role, _ in _experts(pinned).values()} == {"expert_column", "expert_row"}, _experts(pinned)


def test_expert_tp_pin_that_cannot_hold_names_the_experts():
    # 2 features per expert in the down stack: 4 ranks cannot each hold an equal slice of every expert
    model = _model("qwen3-moe", experts=4, kv_heads=8, moe_intermediate_size=2)
    with pytest.raises(PlanError, match=r"down_proj.*cannot be split 4 ways.*2 features.*Pin it 'expert'"):
        autotp.plan(model, tp=4, profile="cpu-gloo", layout=ETP, uneven=False)
    with pytest.raises(ConfigError, match="role 'expert_column'.*applies to a stack of experts"):
        autotp.plan(model, tp=2, layout={"*.q_proj.weight": "expert_column"})
    with pytest.raises(ConfigError, match="pin 'expert_row'"):
        autotp.plan(model, tp=2, layout={"*.experts.down_proj": "row"})


def test_no_pinned_experts_layout_beats_the_solvers_choice():
    # A pin narrows the search, so a plan under it never costs less than the solver's. gpt-oss reads
    # its gate and up interleaved ([..., ::2], [..., 1::2]): the gate|up product's split columns are
    # gathered and the down product's x arrives whole. Row with x converted to the stack's split
    # was offered only to a stack already split (pinned), so expert-TP pinned came out cheaper than
    # the solver's choice (gpt-oss-20b at tp 8: by 6.1 ms/step) and the note said "dearer than".
    model = _model("gpt-oss", experts=16, head_dim=32)
    plan = autotp.plan(model, tp=4)
    rows = {"*.experts.gate_up_proj": "expert_row", "*.experts.down_proj": "expert_row"}
    for layout in (EP, ETP, rows):
        pinned = autotp.plan(model, tp=4, layout=layout)
        assert plan.compute_s + plan.comm_s <= (pinned.compute_s + pinned.comm_s) * (1 + 1e-12), layout
    note = next(n for n in plan.notes if n.startswith("experts "))
    assert "dearer than" not in note, note
    # A rank now computes its own experts' rows alone (the activation, the routing weights' product
    # and the reorder too, where every rank once ran them on every row): whole experts per rank are
    # the cheapest here (both products were row-parallel before), and the note says so
    assert {role for role, _ in _experts(plan).values()} == {"expert"}, _experts(plan)
    assert "expert-parallel (16 experts, 4 per rank) — cheaper than expert-TP" in note, note


def test_token_rows_made_whole_under_expert_tp_are_all_gathered_along_the_sequence(monkeypatch):
    # the tokens split along the sequence, the router on a rank's own: the expert ids and routing
    # weights every rank needs whole under expert-TP are its tokens in sequence order, gathered
    # along it ((tp-1)/tp of their bytes), not scattered into zeros and all-reduced (twice that).
    # (Each rank routing its own rows, not offered here, costs more at this size, priced as it
    # runs: test_an_expert_tp_layer_is_priced_no_dispatch_kernels_it_does_not_run below)
    import autotp.passes.rules.routed as rules

    monkeypatch.setattr(rules, "own_merge", lambda info, p: None)
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    model = zoo.build("mixtral", config, device="meta")
    plan = autotp.plan(model, tp=2, layout=ETP, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True)
    # (the rows h[perm // k] of the rank's tokens, all-gathered inside the gather, are the test below)
    whole = [c for c in plan.comms if c.src == "P(tokens 0)" and c.kind != "all_gather_rows"]
    assert [c.kind for c in whole] == ["all_gather", "all_gather"], plan.comms
    rows = 64 * 4096
    # the weights (priced in the profile's 2-byte dtype) and ids (int64): [tokens, top_k] each,
    # half of each sent at tp 2
    assert sorted(c.fwd_bytes for c in whole) == [rows * 2 * 2 / 2, rows * 2 * 8 / 2]
    assert all(c.bwd_bytes == 0 for c in whole)


def test_an_expert_tp_layer_is_priced_no_dispatch_kernels_it_does_not_run():
    # The tiny Mixtral above at tp 2, each rank's own routing offered. An expert-TP layer whose
    # ranks route their own rows sums them whole by a g: its rank runs route_locally around its
    # sort and no dispatch (no split sizes, no dispatch plan); the whole sort's reorder of a rank's
    # tokens' rows made whole by a g runs no dispatch either. The dispatch's kernels are the
    # dispatching product's (cost_model/routing.dispatch_work). Before, the own sort was priced
    # with the dispatch's split sizes and plan, and the reorder with the whole sort's: each
    # layer charged kernels its rank never runs, which tipped this plan to the rows all-gathered
    # (5.233 ms/step; the whole sort and the rows made whole by a g are 5.173 priced as run,
    # each rank's own routing 5.211)
    import dataclasses

    from autotp.capture.cache import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.kernels import op_work as kernels_work
    from autotp.cost_model.routing import route_locally_work
    from autotp.cost_model.symbolic import op_work
    from autotp.cost_model.work import RankOp
    from autotp.passes.rules.local_routing import ALONE, OWN
    from autotp.placements import REPLICATE, Routed
    from autotp.planner.planner import build_plan

    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2)
    profile = get_profile("h100-dgx")
    plan, index, prop = build_plan(capture(zoo.build("mixtral", config, device="meta"), (), None), 2, batch=64,
                                   seq=4096, profile=profile, layout=ETP, sequence_parallel=True)
    (sort,) = [n for n in index.infos if n.target in (torch.ops.aten.sort.default, torch.ops.aten.sort.stable)]
    info = index.infos[sort]
    (own,) = [s for s in index.strategies(sort, (OWN,))]
    bare = kernels_work(dataclasses.replace(info, routing_experts=0), own, 2, profile.dtype_bytes, info.train_dtype)
    around = route_locally_work(RankOp(info, own, 2, profile.dtype_bytes, info.train_dtype).n_in[0], 4, 2)
    planned = op_work(info, own, profile, 2)
    assert (planned.launches, planned.moved) == (bare.launches + around.launches, bare.moved + around.moved)
    # h[perm // k]: by the rank's own positions, the rows a dispatch would be priced from its
    # routing (ALONE); by the whole sort's, priced as the reorder alone
    (gather,) = [n for n in index.infos if index.infos[n].gathers_expert_rows and index.infos[n].row_copies]
    info = index.infos[gather]
    tokens = Routed(0, tokens=True)
    assert [s.output for s in index.strategies(gather, (tokens, OWN))] == [ALONE]
    (whole,) = [s for s in index.strategies(gather, (tokens, REPLICATE)) if s.output == Routed(0, tokens=True,
                                                                                               reordered=True)]
    assert op_work(info, whole, profile, 2) == kernels_work(dataclasses.replace(info, routing_experts=0), whole, 2,
                                                            profile.dtype_bytes, info.train_dtype)
    # priced so, the solver takes the whole sort, each rank reordering its own tokens' rows, made
    # whole by a g for the column-parallel gate|up product
    assert not [c for c in plan.comms if c.src.endswith(", own)") or c.kind == "all_gather_rows"], plan.comms
    assert [c.consumer.startswith("grouped_mm") for c in plan.comms if c.kind == "g"] == [True], plan.comms


@pytest.mark.parametrize("family, tp", [("mixtral", 2), ("qwen3-moe", 3)])
def test_expert_tp_combine_is_reduce_scattered_into_the_sequence_split(family, tp):
    # the tokens split along the sequence (forced), 3 experts (uneven at tp 2): the down product's
    # partial rows go through the routing weights' product, the reorder back to token order and
    # the top-k sum as a Partial (each linear in it), then the combine's cast to the hidden dtype
    # (the same dtype: the identity) and the view back to [b, s, h], to the residual add, where
    # they are reduce-scattered along the sequence: no g of the combine, whole on every rank and
    # then sliced (before: a g at that cast, k-fold fewer bytes than one before the top-k sum,
    # twice a reduce-scatter's)
    config = zoo.tiny_config(family, layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=3, top_k=2)
    config._experts_implementation = "eager"
    plan = autotp.plan(zoo.build(family, config, device="meta"), tp=tp, layout=ETP, sequence_parallel=True,
                       batch=64, seq=4096, profile="cpu-gloo")
    experts = [c for c in plan.comms if ".mlp" in c.module]
    assert not [c for c in experts if c.kind == "g"], experts
    after = plan.comms[plan.comms.index(experts[-1]) + 1]   # the experts' output into the residual add
    assert (after.kind, str(after.src), str(after.dst)) == ("reduce_scatter", "P", "S(1)"), plan.comms
    assert after.consumer.startswith("add_tensor") and after.module == "model.layers.0", after


def _full_bytes(comm, tp: int) -> float:
    """The bytes of the whole tensor a collective of the plan moves (in the profile's dtype): an
    all-reduce (f, g) moves 2(n-1)/n of them, the others (n-1)/n."""
    moved = max(comm.fwd_bytes, comm.bwd_bytes)
    return moved / ((2 if comm.kind in ("f", "g") else 1) * (tp - 1) / tp)


@pytest.mark.parametrize("size, hidden, k, sequence_parallel, gathered", [
    ("mixtral-8x7b", 4096, 2, False, "tokens"),
    ("qwen3-30b-a3b", 2048, 8, True, "rows"),
])
def test_expert_tp_sums_the_gathered_rows_gradient_on_the_tokens_not_on_the_rows(size, hidden, k, sequence_parallel,
                                                                                 gathered):
    # expert-TP at h200, 2 x 4096, tp 8: the (token, expert) rows h[perm // k] the
    # column-parallel gate|up product reads are gathered whole on every rank, and their gradient,
    # a summand on each rank, passes back through the gather (a scatter-add, linear) to the
    # tokens, where one f sums it, fused with their all-gather: [T, h], not [T*k, h]. Before, the
    # f sat at the product, on the rows (Mixtral-8x7B, the tokens whole at the experts: 234.9 MB
    # a layer backward); and with the tokens split along the sequence the rank reordered its own
    # tokens' rows and all-reduced them whole (Qwen3-30B-A3B, k = 8: a g of 469.8 MB forward and
    # the f's 469.8 MB backward a layer, 25.25 ms/step for 2 layers; 18.98 with the tokens'
    # all-gather). With the tokens split, each rank's tokens' k rows may now be all-gathered
    # inside the gather instead (its backward a reduce-scatter, the f fused in, and the rank's
    # scatter-add of its own rows alone, where the whole gather's is [T*k, h] on every rank):
    # Qwen3-30B-A3B takes it by cost, 18.98 -> 17.94 ms/step, half the bytes of a g and an f of
    # the rows, none all-reduced
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=1), device="meta",
                      dtype=torch.bfloat16)
    tp, tokens = 8, 2 * 4096
    plan = autotp.plan(model, tp, batch=2, seq=4096, profile="h200", layout=ETP, sequence_parallel=sequence_parallel)
    experts = [c for c in plan.comms if c.module.endswith(".mlp.experts")]
    assert experts, plan.comms
    rows = tokens * k * hidden * 2   # [T*k, h] in bf16
    # nothing of the rows the products read all-reduced. (The down product's partial sum, "P", may
    # be: Mixtral's combine is float32, so its g after the top-k sum moves the bytes of a g of the
    # bf16 [T*k, h] rows before the routing weights' product, which spares the f of those weights)
    assert not [c for c in experts if c.kind in ("g", "f") and _full_bytes(c, tp) >= rows and c.src != "P"], \
        [(c.kind, c.tensor, c.consumer) for c in experts]
    into_gather = [c for c in experts if c.consumer.startswith("index") and c.bwd_bytes]
    kind, moved = {"tokens": ("all_gather_f", tokens * hidden * 2), "rows": ("all_gather_rows", rows)}[gathered]
    assert [c.kind for c in into_gather] == [kind], experts   # the f fused with the gather
    assert _full_bytes(into_gather[0], tp) == moved
    assert not [c for c in experts if c.kind == "f" and "grouped_mm" in c.consumer], experts


# Mixtral-8x7B expert-TP with the tokens split along the sequence (its rows all-gathered once inside
# the gather, its float32 combine reduce-scattered into the rank's tokens, or the rows and the down
# product's partial rows all-reduced in bf16, whichever is cheaper): tests/passes/test_conversion_dtype_plan.py
