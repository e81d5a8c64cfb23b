"""Expert parallelism at real size: MoE models planned at tp=8 on the meta device (no ranks, no weights)."""
import pytest
import torch

import autotp
from autotp import zoo
from autotp.errors import ConfigError


def _plan(size: str, layers: int, **kw):
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=layers), device="meta")
    return autotp.plan(model, tp=8, **kw), model


def _expert_bytes(plan, rank_share: bool, biases: bool = True) -> int:
    from autotp.placements import Shard, local_size

    total = 0
    for name, shape in plan.shapes.items():
        if ".experts." not in name or (not biases and name.endswith("_bias")):
            continue
        n = 1
        for s in shape:
            n *= s
        p = plan.params[name]
        if rank_share and isinstance(p, Shard):
            n = n // shape[p.dim] * max(local_size(shape[p.dim], p, plan.tp, r) for r in range(plan.tp))
        total += n
    return total


# Mixtral and Qwen3 (the rank benchmark's) in the fast tier; the shared-expert and OLMoE widths, 9 s each
# on two cores, in the slow one (their layers' exactness: tests/e2e/test_experts.py, fast)
@pytest.mark.parametrize("size", ["mixtral-8x7b", "qwen3-30b-a3b",
                                  *(pytest.param(s, marks=pytest.mark.slow)
                                    for s in ("qwen1.5-moe-a2.7b", "olmoe-1b-7b"))])
def test_experts_split_eight_ways_at_tp8(size):
    # whole experts per rank or every expert split along its features (the solver's choice, said in
    # a note): 1/8 either way where tp divides the experts (8, 128, 64); Qwen1.5-MoE's 60 whole
    # experts would put 8 on the busiest rank, its 1408 features per expert split evenly. Split,
    # gate|up is column-parallel and down row (Megatron's) or column too (its input gathered: the
    # routing weights then multiply 1/8 of each routed token's output, not a partial sum whole)
    plan, _ = _plan(size, layers=2)
    experts = {n: r for n, r in plan.roles.items() if ".experts." in n and ".shared_expert" not in n}
    assert experts and set(experts.values()) in ({"expert"}, {"expert_column", "expert_row"},
                                                 {"expert_column"}), experts
    count = next(shape[0] for name, shape in plan.shapes.items() if name in experts and len(shape) == 3)
    busiest = -(-count // 8) if set(experts.values()) == {"expert"} else count / 8
    assert _expert_bytes(plan, True) * count == _expert_bytes(plan, False) * busiest
    assert any(n.startswith("experts model.layers.{0..1}.mlp.experts: expert") for n in plan.notes), plan.notes


def test_expert_pin_on_a_matrix_names_the_fix():
    model = zoo.build("mixtral", zoo.tiny_config("mixtral", layers=1), device="meta")
    with pytest.raises(ConfigError, match="role 'expert'"):
        autotp.plan(model, tp=2, layout={"*.q_proj.weight": "expert"})
    with pytest.raises(ConfigError, match="stack of experts.*pin 'expert_row'"):
        autotp.plan(model, tp=2, layout={"*.experts.down_proj": "row"})


def _roles(plan, suffix: str) -> set[str]:
    return {role for name, role in plan.roles.items() if name.endswith(suffix)}


def test_deepseek_v3_at_tp8_experts_and_mla_split_by_head():
    """DeepSeek-V3 at its published width, its first three (dense) layers and one MoE layer (256
    routed experts of 8, one shared expert): experts split 8 ways, MLA split by head as
    torchtitan splits it (the up-projections q_b_proj/kv_b_proj column, o_proj row; the
    down-projections to the latents and their norms replicated: the latents are shared by every
    head), and the plan fits 80 GiB per rank (serial, the layers' training state alone is ~900 GiB)."""
    plan, _ = _plan("deepseek-v3", layers=4)
    experts = {n: r for n, r in plan.roles.items() if ".experts." in n and ".shared_experts." not in n}
    # whole experts per rank or every expert split (the solver's choice, said in the plan's note;
    # split, down may be column-parallel too, as in test_experts_split_eight_ways_at_tp8)
    assert experts and set(experts.values()) in ({"expert"}, {"expert_column", "expert_row"},
                                                 {"expert_column"}), experts
    assert _expert_bytes(plan, True) * 8 == _expert_bytes(plan, False)   # 256 experts: 1/8 each
    for suffix in ("q_b_proj.weight", "kv_b_proj.weight"):
        assert _roles(plan, suffix) == {"column"}, (suffix, _roles(plan, suffix))
    assert _roles(plan, "self_attn.o_proj.weight") == {"row"}
    for suffix in ("q_a_layernorm.weight", "kv_a_layernorm.weight"):
        assert _roles(plan, suffix) == {"replicate"}, (suffix, _roles(plan, suffix))
    # the down-projections to the latents: replicated (torchtitan) or, where their input arrives
    # split along the hidden dim, row-parallel (the cost model's pick at this workload: a g of the
    # 2112-wide latents instead of gathering the 7168-wide hidden state); the latents are whole
    # on every rank either way
    for suffix in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight"):
        assert _roles(plan, suffix) <= {"replicate", "row"}, (suffix, _roles(plan, suffix))
    assert plan.attention and all(heads == [16] * 8 for heads in plan.attention.values()), plan.attention
    assert plan.memory_bytes < 80 * 2**30 and plan.memory_limit == 80 * 2**30


def test_gpt_oss_20b_at_tp8_experts_and_sinks_split_by_head():
    """gpt-oss-20b (32 experts of 4 per token, biased experts, attention sinks, 64 q / 8 kv heads):
    whole experts per rank, 4 each, the biases with them (a rank computes its experts' rows alone; its
    gate and up, read interleaved, [..., ::2] and [..., 1::2], and its clamp and ``up + 1`` run on
    those rows); attention split by head (the 64 sinks may stay replicated: each rank slices its
    heads' for free, their gradient summed)."""
    plan, _ = _plan("gpt-oss-20b", layers=2)
    experts = {n: r for n, r in plan.roles.items() if ".experts." in n}
    assert {n.rpartition(".")[2] for n in experts} == {"gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                      "down_proj_bias"}
    assert set(experts.values()) == {"expert"}, experts
    assert _expert_bytes(plan, True) * 8 == _expert_bytes(plan, False)   # 1/8 of each stack, 4 experts' biases
    for suffix in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        assert _roles(plan, suffix) == {"column"}, (suffix, _roles(plan, suffix))
    assert _roles(plan, "o_proj.weight") == {"row"}
    assert plan.attention and all(heads == [8] * 8 for heads in plan.attention.values()), plan.attention
    assert _roles(plan, "router.weight") == {"replicate"}


class _Reorders(torch.nn.Module):
    """Rows sorted by id and put back, as transformers' experts do (``inv[perm] = arange``), beside
    indices that are not permutations."""

    def forward(self, x, ids):
        _, perm = torch.sort(ids)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0))
        shorter = torch.empty_like(perm)
        shorter[perm[:-1]] = torch.arange(perm.size(0) - 1)   # one entry never written
        summed = torch.zeros_like(perm).index_put((perm,), torch.arange(perm.size(0)), accumulate=True)
        written = torch.empty_like(perm)
        written[perm] = torch.arange(perm.size(0))
        written.clamp_(max=1)                                  # written after it is made
        return x[inverse], x[shorter], x[summed], x[written], x[ids], x[torch.argsort(ids)]


def test_the_inverse_of_a_sort_is_known_a_permutation_and_nothing_else_is():
    """A reorder by a permutation keeps a rank's rows and their count: the rewrite renumbers them
    instead of reading how many land on the rank (autotp/passes/rules/routed_localizer.py)."""
    from autotp.passes.rules.routing import is_permutation

    ep = torch.export.export(_Reorders(), (torch.randn(5, 2), torch.randint(0, 3, (5,))))
    gathers = [n for n in ep.graph.nodes if n.target is torch.ops.aten.index.Tensor]
    assert [is_permutation(n.args[1][0]) for n in gathers] == [True, False, False, False, False, True]


class _Routes(torch.nn.Module):
    """A router's top-k ids sorted and counted per expert (transformers' grouped experts), beside
    counts that do not match the sorted ids."""

    def forward(self, scores):
        ids = torch.topk(scores, 2, dim=-1)[1].reshape(-1)          # (tokens * 2,) ids in 0..3
        ascending, _ = torch.sort(ids)
        descending, _ = torch.sort(ids, descending=True)
        offs = torch.cumsum(torch.histc(ascending.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        fewer = torch.cumsum(torch.histc(descending.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        shifted, _ = torch.sort(ids + 1)                             # not a router's ids any more
        off_by_one = torch.cumsum(torch.histc(shifted.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        return ascending, descending, shifted, offs, fewer, off_by_one


def test_sorted_router_ids_are_counted_by_the_offsets_made_from_them():
    """A pick by sorted router ids takes the rows its experts' grouped products take (the offsets
    count exactly those ids): the rewrite reuses the products' bounds instead of reading its own."""
    from autotp.passes.rules.routing import counted_by

    ep = torch.export.export(_Routes(), (torch.randn(5, 4),))
    ascending, descending, shifted, offs = (ep.graph.output_node().args[0][i] for i in range(4))
    assert counted_by(ascending, 4) is offs
    assert counted_by(ascending, 5) is None                          # another number of experts
    assert counted_by(descending, 4) is None and counted_by(shifted, 4) is None


def test_a_host_read_is_priced_once_per_expert_layer_where_a_rank_counts_its_rows():
    """Expert parallelism reads how many rows each rank's experts got, once per layer: the cost
    model prices each read at the profile's host_read_time (the queue drained, the round trip, a
    launch the device waits for); expert-TP reads nothing; on a CPU profile nothing waits."""
    from autotp.capture.cache import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.symbolic import step_breakdown
    from autotp.planner.planner import build_plan

    model = zoo.build("mixtral", zoo.tiny_config("mixtral", layers=1), device="meta")
    cap = capture(model, (), None)
    h200 = get_profile("h200")
    assert h200.host_read_time() == pytest.approx(h200.sync_s + h200.launch_s) and h200.sync_s > 0
    assert get_profile("cpu-gloo").host_read_time() == 0
    etp = {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}
    for layout, reads in (({"*.experts.*": "expert"}, 1), (etp, 0)):
        _, index, prop = build_plan(cap, 2, batch=8, seq=64, profile=h200, layout=layout)
        assert step_breakdown(index, prop, h200)["host_reads"] == pytest.approx(reads * h200.host_read_time())


def test_rows_gathered_for_an_expert_tp_product_stay_whole():
    """Under expert-TP pins a rank has no experts of its own: the gather in front of the grouped
    product must not take routed rows (at Qwen3-30B-A3B's size the solver once took them and
    summed them back, a plan whose rewrite raised: the rows of no rank's experts). Rows held by
    their tokens' ranks (a sequence split: the router and the tokens' reorder on a rank's own)
    are every row, each once, and may be made whole for the product."""
    from autotp.capture.cache import capture
    from autotp.passes.rules.registry import is_routed
    from autotp.planner.planner import build_plan

    size = "qwen3-30b-a3b"
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=1), device="meta")
    etp = {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}
    _, _, prop = build_plan(capture(model, (), None), 8, batch=2, seq=4096, profile="h200", layout=etp)
    from autotp.placements import Routed

    def experts_rows(s):
        outs = s.output if isinstance(s.output, tuple) else (s.output,)
        return any(isinstance(p, Routed) and not p.tokens for p in (*s.inputs, *outs))

    assert [node.name for node, s in prop.chosen.items() if is_routed(s) and experts_rows(s)] == []


@pytest.mark.parametrize("family, tp", [("mixtral", 8), ("qwen3-moe", 3)])
def test_the_gathered_experts_combine_is_reduce_scattered_along_the_sequence(family, tp):
    # sequence parallelism forced, the tokens gathered whole for the experts (no dispatch): the
    # combine's partial sum, cast to the dtype it has (the identity) and viewed [b, s, h], meets
    # the residual add as one reduce-scatter along the sequence, like attention's row-parallel
    # output. The cast once took no Partial: the combine was all-reduced whole (a g) and cut to
    # the rank's run (a scatter, whose backward all-gathers): 1.5x the bytes, and the whole
    # [b*s, h] summed on every rank (benchmarks/moe_rank.md, Mixtral's and Qwen3's gathering plans).
    # Planned at 2 x 4096, where the choice is about bytes: at 2 x 256 (width 256) Mixtral's plan
    # makes the experts' [T*k, h] rows whole by a g before the routing weights' product (no f on
    # the weights: one collective fewer, a latency-bound workload), 0.8% cheaper since the
    # reorder back to token order, run whole there, has its backward priced as the gather it is
    # (rules/row_reads.permutes_rows)
    config = zoo.tiny_config(family, layers=2, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2, vocab=64)
    model = zoo.build(family, config, device="meta")
    layout = {"*.experts.*": "expert", "*.q_proj.weight": "column", "*.o_proj.weight": "row"}
    plan = autotp.plan(model, tp=tp, layout=layout, batch=2, seq=4096, sequence_parallel=True, expert_dispatch=False)
    layer = [(c.kind, c.src, c.dst) for c in plan.comms if c.module.startswith("model.layers.0")]
    assert ("g", "P", "R") not in layer, layer
    # attention's output and the experts' combine (the vocabulary-split embedding's partial output,
    # reduce-scattered into the first norm's tokens where the sequence's collectives at a batch of
    # two copy nothing, is listed under that norm: not the layer's own)
    own = [(c.kind, c.src, c.dst) for c in plan.comms if c.module.startswith("model.layers.0")
           and not c.tensor.startswith("embedding")]
    assert own.count(("reduce_scatter", "P", "S(1)")) == 2, layer
