"""Every attention layout of the model zoo splits by head, with rotary embeddings kept local.

Tiny configurations of each family (random weights) are planned at a workload big enough that
splitting pays (batch 64, sequence 2048, h100-dgx): the attention op must run split by heads,
no all-gather may bring a tensor whole before it (rotary's cat/stack/flatten, NeoX's chunk,
Falcon's slices), and no scatter may split one before it except at the attention op itself (the
replicated k/v of grouped-query attention with fewer kv heads than ranks, sliced locally to
this rank's query heads). ``Plan.heads_per_rank`` and the printed line follow the real split.
Equivalence with the serial model (forward and every gradient) runs on gloo ranks at tp 2 and
3, uneven heads and fewer kv heads than ranks included.
"""
from __future__ import annotations

import logging

import pytest
import torch

import autotp
from autotp import zoo
from autotp.planner import build_plan
from autotp.capture import cache as capture_cache, capture, module_path
from autotp.testing import TOLERANCE, equivalence_errors, keep_loss_precision, tolerance

aten = torch.ops.aten
WORKLOAD = dict(batch=64, seq=2048, profile="h100-dgx")

# family, tp, heads, kv heads (None: the family has no separate count)
#: the fast tier leaves the families whose attention is another's (Mistral's and Qwen2's is
#: Llama's, OPT's and NeoX's GPT-J's plain heads, Falcon's kv 2 its kv 4) to the slow tier: a
#: capture each, 30 s on 2 cores; test_families_plan.py checks every family's split at real size
SLOW_SPLIT = {("mistral", 2), ("qwen2", 4), ("gpt-neox", 2), ("gpt-neox", 4), ("opt", 4), ("falcon-new", 2)}
SPLIT = [
    ("llama", 2, 8, 2), ("llama", 4, 8, 2), ("llama", 4, 8, 4), ("mistral", 2, 8, 2), ("qwen2", 4, 8, 2),
    ("gpt-neox", 2, 8, None), ("gpt-neox", 4, 8, None), ("gpt-j", 2, 8, None), ("gpt-j", 4, 8, None),
    ("falcon-new", 2, 8, 2), ("falcon-new", 4, 8, 4), ("gpt-bigcode", 2, 8, 8), ("gpt-bigcode", 4, 8, 8), ("opt", 4, 8, None),
    # a fused q|k|v of fewer kv heads read back with slices: blocks of unequal size, split by head
    ("phi3", 2, 8, 2), ("phi3", 4, 8, 4),
]


#: heads of a real model's width (hidden 512 for 8 heads): at zoo.tiny_config's 8 the products are
#: so small that the cost model keeps k/v projections whole on s/tp tokens or splits the hidden dim
HEAD_DIM = 64


def _model(family: str, heads: int, kv: int | None, dtype=torch.float32):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = zoo.tiny_config(family, heads=heads, kv_heads=kv, layers=2, head_dim=HEAD_DIM)
    return config, zoo.build(family, config, dtype=dtype)


def _attention_nodes(graph) -> list:
    out = []
    for n in graph.nodes:
        if n.target is aten.scaled_dot_product_attention.default:
            out.append(n)
        elif n.target in (aten._softmax.default, aten.softmax.int):
            shape = n.args[0].meta["val"].shape
            if len(shape) >= 3 and not any(isinstance(s, int) for s in shape[-2:]):
                out.append(n)   # eager attention's scores [b, heads, s, s]
    return out


def _captured(family: str, heads: int, kv: int | None):
    """One capture per structure, shared by the cases of its tps and the tests of one config
    (autotp.capture.cache: a capture is most of such a case's time, and autotp.plan reads the same
    entry)."""
    return capture_cache.capture(_model(family, heads, kv)[1])


@pytest.mark.parametrize("family, tp, heads, kv", [
    pytest.param(*c, marks=pytest.mark.slow) if c[:2] in SLOW_SPLIT else c for c in SPLIT],
    ids=[f"{f}-tp{t}-kv{k}" for f, t, _, k in SPLIT])
def test_attention_splits_by_head_with_no_gather_before_it(family, tp, heads, kv):
    cap = _captured(family, heads, kv)
    plan, _, prop = build_plan(cap, tp, **WORKLOAD)
    attention = _attention_nodes(cap.graph)
    assert len(attention) == 2
    pos = {n: i for i, n in enumerate(cap.graph.nodes)}
    nodes = {n.name: n for n in cap.graph.nodes}
    for node in attention:
        module = module_path(node)
        assert plan.attention.get(module) == [heads // tp] * tp, (module, plan.attention)
        # a free scatter (no bytes either way: rotary's cos and sin, which take no gradient, sliced
        # along s where k is computed on this rank's tokens and all-gathered into attention) is no
        # conversion of the attention's inputs
        before = [c for c in prop.comms if c.consumer in nodes and module_path(nodes[c.consumer]) == module
                  and (c.kind == "all_gather" and pos[nodes[c.consumer]] <= pos[node]
                       or c.kind == "scatter" and pos[nodes[c.consumer]] < pos[node]
                       and (c.fwd_bytes, c.bwd_bytes) != (0, 0))]
        assert before == [], f"{family}: {[(c.kind, c.tensor, c.consumer) for c in before]}"
    # every head-split projection counts the query heads each rank runs (Falcon's new layout at
    # 4 groups of 2 heads, tp 4, deals whole groups: one group, two query heads per rank)
    listed = plan.heads_per_rank()
    assert listed and all(v == [heads // tp] * tp for v in listed.values()), listed
    assert "attention heads per rank" in str(plan)


def test_rotary_cat_costs_no_collective_in_llama():
    # The plan: all_gather neg -> cat, all_gather slice -> cat, scatter mul -> add, per layer.
    _, model = _model("llama", 8, 2)
    plan = autotp.plan(model, 2, **WORKLOAD)
    # (the rotary's cat and add run in the attention; a decoder layer's residual add may cut its part
    # from the gather its norm shares, which is no rotary collective)
    attention = [c for c in plan.comms if ".self_attn" in c.module]
    assert attention, plan.comms   # the projections' f
    assert not [c for c in attention if c.kind in ("all_gather", "scatter") and c.consumer.startswith(("cat", "add"))]


@pytest.mark.parametrize("heads, kv, tp", [(8, 2, 2), (8, 4, 2), (8, 4, 4), (6, 3, 3)])
def test_kv_heads_dividing_tp_meet_the_query_heads_without_a_conversion(heads, kv, tp):
    # k split by kv heads, expanded by repeat_kv and reshaped: S(1/n_rep) on the query heads,
    # which same_placement finds equal to q's S(1).
    cap = _captured("llama", heads, kv)
    _, _, prop = build_plan(cap, tp, **WORKLOAD)
    for node in _attention_nodes(cap.graph):
        assert [c for c in prop.comms if c.consumer == node.name] == []


@pytest.mark.parametrize("heads, kv, tp", [(8, 2, 4), (8, 2, 8), (6, 2, 4), (8, 1, 2)])
def test_fewer_kv_heads_than_ranks_replicates_kv_and_slices_it_to_the_query_heads(heads, kv, tp):
    cap = _captured("llama", heads, kv)
    plan, _, prop = build_plan(cap, tp, **WORKLOAD)
    # q by heads; k and v whole on every rank, sdpa_localizer narrowing them to the heads each
    # rank's queries use: projected whole (an f each, summing their gradients), projected on this
    # rank's s/tp tokens and all-gathered along s (all_gather_f each: their gradients
    # reduce-scattered), projected whole and sliced (a scatter each), or row-parallel from an x
    # split along the hidden dim (k made whole by a g before rotary, v by a g at attention; an f each)
    assert repr(plan.params["model.layers.0.self_attn.q_proj.weight"]).startswith("S(0")
    sdpa = _attention_nodes(cap.graph)[0]
    assert sdpa.kwargs.get("enable_gqa") and sdpa.args[5] is True   # HF's own call: causal, no mask
    assert len(sdpa.args) < 4 or sdpa.args[3] is None
    at = [c for c in prop.comms if c.consumer == sdpa.name]
    assert len({c.tensor for c in at}) == 2, at   # k and v, nothing of q
    assert sorted(c.kind for c in at) in (["f", "f"], ["all_gather_f", "all_gather_f"], ["scatter", "scatter"],
                                          ["f", "f", "g"]), at
    share = [heads // tp + (r < heads % tp) for r in range(tp)]
    assert sorted(plan.attention["model.layers.0.self_attn"], reverse=True) == share


@pytest.mark.parametrize("heads, kv, tp, kinds", [
    (8, 2, 2, ()),                    # even: k and v split with q, nothing to pick
    (8, 2, 4, ("narrow",)),           # two ranks per group: each narrows to its group's head
    (6, 2, 4, ("narrow",)),           # runs 2, 2, 1, 1 of groups of 3: heads {0}, {0, 1}, {1}, {1}
    (8, 2, 3, ("cat", "narrow", "repeat_interleave")),   # runs 3, 3, 2: rank 1 holds 0, 1, 1
])
def test_grouped_query_heads_each_rank_picks(heads, kv, tp, kinds):
    """What each rank's attention is handed under the default plan: k and v split with q where
    the groups deal evenly; else whole, and narrowed to the heads the rank's queries use,
    repeated per query head (``enable_gqa`` off) where some rank's run straddles groups
    unevenly; the same ops on every rank (they check their graphs agree)."""
    from autotp.passes.rewrite import rewrite
    from autotp.distributed.agreement import _graph_entries

    cap = _captured("llama", heads, kv)
    plan, index, prop = build_plan(cap, tp, **WORKLOAD)
    entries = set()
    for rank in range(tp):
        gm = rewrite(index, prop, rank, None, None)
        entries.add(tuple(_graph_entries(gm)))
        sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
        k = sdpa.args[1]
        if k.target is aten.narrow.default:
            made = ("narrow",)
        elif k.target is aten.cat.default:   # each piece: a one-head narrow, repeated
            assert all(p.target is aten.repeat_interleave.self_int and p.args[0].target is aten.narrow.default
                       for p in k.args[0]), k.args[0]
            made = ("cat", "narrow", "repeat_interleave")
        else:
            made = ()
        assert made == kinds, (rank, made)
        assert sdpa.kwargs["enable_gqa"] == ("repeat_interleave" not in made), (rank, made)
    assert len(entries) == 1   # one graph on every rank, ints aside


def test_no_heads_line_when_attention_runs_whole():
    _, model = _model("gpt-neox", 8, None)
    layout = {"*.attention.query_key_value.*": "replicate", "*.attention.dense.*": "replicate"}
    plan = autotp.plan(model, 2, layout=layout, **WORKLOAD)
    assert plan.attention == {}
    assert plan.heads_per_rank() == {}
    assert "attention heads per rank" not in str(plan)
    again = autotp.Plan.from_json(plan.to_json())
    assert again.attention == {} and again.heads_per_rank() == {}


# ---------------------------------------------------------------- against the serial model

def check_family(family: str, tp: int, heads: int, kv: int | None, dtype: str) -> tuple[dict, dict, float]:
    """The errors of ``family`` parallelized at ``tp`` against serial, the plan's attention, and the
    bound of the least precise dtype the model computes in (``autotp.testing.tolerance``)."""
    logging.getLogger("autotp").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config, model = _model(family, heads, kv, getattr(torch, dtype))
    model = keep_loss_precision(model)
    inputs = zoo.example_batch(family, config, batch=2, seq=8, seed=0)
    pm = autotp.parallelize(model, tp, **WORKLOAD)
    errors = equivalence_errors(model, pm, inputs)
    # k's bias has a zero gradient in exact arithmetic (softmax ignores a constant per query):
    # its relative error compares rounding noise with rounding noise, so measure it absolutely
    scale = max(p.grad.norm().item() for p in model.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        if f"grad:{name}" in errors and p.grad is not None and p.grad.norm().item() < 1e-12 * scale:
            errors[f"grad:{name}"] *= p.grad.norm().item() / scale
    return errors, pm.plan.attention, tolerance(model, inputs)


# GPT-J computes attention in float32 whatever the model's dtype (its q and k are cast), so it is
# held to float32's tolerance; the rest run in float64. tp=3 leaves heads uneven (6 heads: 2 each,
# 8 heads: 3, 3, 2); kv=1 is multi-query.
EQUIVALENCE = [
    ("opt", 2, 8, None, "float64"), ("opt", 3, 8, None, "float64"),
    ("gpt-bigcode", 2, 8, 8, "float64"), ("gpt-bigcode", 3, 6, 6, "float64"), ("gpt-bigcode", 3, 6, 1, "float64"),
    ("gpt-j", 2, 8, None, "float32"), ("gpt-j", 3, 6, None, "float32"),
    # rotary families; tp=3 with 2 kv heads: k and v replicated, sliced to each rank's query heads
    ("llama", 2, 8, 2, "float64"), ("mistral", 2, 8, 4, "float64"), ("gpt-neox", 2, 8, None, "float64"),
    ("falcon-new", 2, 8, 2, "float64"), ("llama", 3, 8, 2, "float64"), ("qwen2", 3, 6, 2, "float64"),
    ("llama", 3, 6, 1, "float64"), ("gpt-neox", 3, 8, None, "float64"), ("falcon", 3, 8, 2, "float64"),
]


@pytest.mark.slow   # the fast tier checks every family against serial in tests/e2e/test_families.py
@pytest.mark.parametrize("family, tp, heads, kv, dtype", sorted(EQUIVALENCE, key=lambda c: c[1]),
                         ids=[f"{f}-tp{t}-h{h}-kv{k}-{d}" for f, t, h, k, d in sorted(EQUIVALENCE, key=lambda c: c[1])])
def test_head_split_attention_matches_serial(cluster_of, family, tp, heads, kv, dtype):
    # Llama's, Mistral's and Qwen2's RMSNorm computes its variance in float32 whatever the model's
    # dtype (GPT-J its q and k): where the plan splits the hidden dim the ranks sum in another
    # order than serial (embed_tokens' gradient 5e-9 to 2e-8 relative, head dims 8 and 64 alike):
    # each case is held to the bound of the least precise dtype its model computes in
    for errors, attention, bound in cluster_of(tp).run(check_family, family, tp, heads, kv, dtype):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= bound, (worst, errors[worst])
        if kv != 1:
            assert attention, "attention ran whole"


# ---------------------------------------------------------------- fused multi-query projections

#: family, tp, heads, kv heads, the fused projection, the attention output projection (Falcon's
#: new layout with fewer kv groups than ranks: 4 or 6 query heads per group dealt over the ranks)
FUSED_MQA = [("gpt-bigcode", 2, 6, 1, "attn.c_attn", "attn.c_proj"),
             ("gpt-bigcode", 3, 4, 1, "attn.c_attn", "attn.c_proj"),
             ("falcon", 2, 6, 1, "self_attention.query_key_value", "self_attention.dense"),
             ("falcon", 3, 4, 1, "self_attention.query_key_value", "self_attention.dense"),
             ("falcon-new", 3, 12, 2, "self_attention.query_key_value", "self_attention.dense"),
             ("falcon-new", 4, 8, 2, "self_attention.query_key_value", "self_attention.dense")]
_FUSED_IDS = [f"{f}-tp{t}-h{h}-kv{k}" for f, t, h, k, _, _ in FUSED_MQA]


def _fused_layout(fused: str, out: str) -> dict:
    return {f"*.{fused}.*": "column", f"*.{out}.weight": "row"}


@pytest.mark.parametrize("family, tp, heads, kv, fused, out", FUSED_MQA, ids=_FUSED_IDS)
def test_a_fused_projection_with_fewer_kv_heads_than_ranks_splits_query_heads_and_keeps_kv_whole(
        family, tp, heads, kv, fused, out):
    # GPT-BigCode's [q | k | v] and Falcon's groups [q.. | k | v]: each rank holds its run of
    # query heads of every group followed by the group's k and v whole (a tail), attention splits
    # by query head, and the output projection is row-parallel on the same heads.
    _, model = _model(family, heads, kv)
    cap = capture(model)
    plan, _, prop = build_plan(cap, tp, layout=_fused_layout(fused, out), **WORKLOAD)
    weight = plan.params[f"transformer.h.0.{fused}.weight"]
    assert isinstance(weight, autotp.Shard) and weight.tail == 2 and weight.chunks == kv, weight
    assert plan.roles[f"transformer.h.0.{out}.weight"] == "row"
    module = f"transformer.h.0.{fused.split('.')[0]}"
    assert sum(plan.attention[module]) == heads and max(plan.attention[module]) - min(plan.attention[module]) <= kv
    assert sum(plan.heads_per_rank()[f"transformer.h.0.{fused}.weight"]) == heads
    # (the sequence-parallel region's all-gather along s into the fused projection is not one)
    gathers = [c for c in plan.comms if c.module.startswith(module) and c.kind in ("all_gather", "reshard")
               and not (c.src == "S(1)" and c.module == f"transformer.h.0.{fused}")]
    assert gathers == [], [(c.kind, c.tensor) for c in gathers]


def check_fused(family: str, tp: int, heads: int, kv: int, fused: str, out: str) -> dict:
    logging.getLogger("autotp").setLevel(logging.ERROR)
    config, model = _model(family, heads, kv, torch.float64)
    model = keep_loss_precision(model)
    inputs = zoo.example_batch(family, config, batch=2, seq=7, seed=0)
    pm = autotp.parallelize(model, tp, layout=_fused_layout(fused, out), **WORKLOAD)
    assert pm.plan.params[f"transformer.h.1.{fused}.weight"].tail == 2
    return equivalence_errors(model, pm, inputs)


#: the fast tier's share: uneven query heads (GPT-BigCode, 4 over 3 ranks) and Falcon's groups
#: (Falcon-7B's multi-query split runs in tests/e2e/test_families.py at tp 3); the slow tier runs
#: every case
_FAST_FUSED = {("gpt-bigcode", 3), ("falcon-new", 4)}   # Falcon's multi-query split: test_families, tp 3


@pytest.mark.parametrize("family, tp, heads, kv, fused, out", [
    case if case[:2] in _FAST_FUSED else pytest.param(*case, marks=pytest.mark.slow) for case in FUSED_MQA],
    ids=_FUSED_IDS)
def test_a_fused_multi_query_split_matches_serial(cluster_of, family, tp, heads, kv, fused, out):
    # float64: loss, logits and every gradient, the k and v rows' held whole on every rank included
    for errors in cluster_of(tp).run(check_fused, family, tp, heads, kv, fused, out):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE[torch.float64], (worst, errors[worst])


# ---------------------------------------------------------------- a fused q|k|v split by sizes, grouped kv heads

class FusedGroupedAttention(torch.nn.Module):
    """One causal attention block whose q | k | v come out of one projection and are cut apart by
    ``split([q, kv, kv])`` (ChatGLM's ``query_key_value``), the kv heads repeated for their query
    heads by ``repeat_interleave``."""

    def __init__(self, heads: int, kv: int, head_dim: int = 4, hidden: int = 16):
        super().__init__()
        self.heads, self.kv, self.head_dim = heads, kv, head_dim
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv) * head_dim)
        self.out = torch.nn.Linear(heads * head_dim, hidden)

    def forward(self, x):                                               # (b, s, hidden)
        b, s, _ = x.shape
        h, kv, d = self.heads, self.kv, self.head_dim
        q, k, v = self.qkv(x).split([h * d, kv * d, kv * d], dim=-1)
        q = q.view(b, s, h, d).transpose(1, 2)                          # (b, h, s, d)
        k = k.view(b, s, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        v = v.view(b, s, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h * d))         # (b, s, hidden)


_SPLIT_LAYOUT = {"qkv.*": "column", "out.weight": "row"}
#: tp, heads, kv heads, the fused projection's placement: kv groups (a kv head with its query
#: heads) dealt by head where there are at least tp of them (3 over 2 ranks: 2 and 1), k and v
#: whole on every rank (a tail) where there are fewer (the multi-query layout: 1 kv head)
SPLIT_BY_SIZES = [(2, 4, 2, autotp.Shard(0, 3, 4, sizes=(2, 1, 1))),
                  (2, 6, 3, autotp.Shard(0, 3, 4, sizes=(2, 1, 1))),
                  (4, 8, 4, autotp.Shard(0, 3, 4, sizes=(2, 1, 1))),
                  (4, 8, 1, autotp.Shard(0, 1, 4, tail=2))]


@pytest.mark.parametrize("tp, heads, kv, want", SPLIT_BY_SIZES, ids=[f"tp{t}-h{h}-kv{k}" for t, h, k, _ in SPLIT_BY_SIZES])
def test_a_fused_qkv_split_by_sizes_deals_kv_groups_by_head_and_keeps_one_kv_head_whole(tp, heads, kv, want):
    # Before, an unequal split was always read as the multi-query layout (k and v whole on every
    # rank) even where tp could deal the kv heads with their query heads
    model = FusedGroupedAttention(heads, kv)
    plan = autotp.plan(model, tp, example_inputs=(torch.randn(2, 5, 16),), layout=_SPLIT_LAYOUT, **WORKLOAD)
    assert plan.params["qkv.weight"] == want, plan.params["qkv.weight"]
    assert plan.roles["out.weight"] == "row"
    if kv >= tp:   # each rank its groups' query heads
        assert plan.attention[""] == [g * (heads // kv) for g in _groups(kv, tp)], plan.attention
    else:
        assert sum(plan.attention[""]) == heads, plan.attention
    gathers = [c.kind for c in plan.comms if c.kind in ("all_gather", "reshard", "scatter")]
    assert gathers == ([] if kv >= tp else ["scatter", "scatter"]), gathers   # the tail's k, v sliced locally


def _groups(n: int, tp: int) -> list[int]:
    return [n // tp + (r < n % tp) for r in range(tp)]


def check_split_by_sizes(tp: int, heads: int, kv: int) -> dict:
    torch.manual_seed(0)
    model = FusedGroupedAttention(heads, kv).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    pm = autotp.parallelize(model, tp, example_inputs=(x,), layout=_SPLIT_LAYOUT, **WORKLOAD)
    return equivalence_errors(model, pm, {"x": torch.randn(3, 6, 16, dtype=torch.float64)})


@pytest.mark.slow
@pytest.mark.parametrize("tp, heads, kv", [(2, 6, 3), (2, 4, 1)], ids=["tp2-h6-kv3", "tp2-h4-kv1"])
def test_a_fused_qkv_split_by_sizes_matches_serial(cluster_of, tp, heads, kv):
    # float64, forward and every gradient: uneven kv groups (2 and 1 of 3), and one kv head whole
    for errors in cluster_of(tp).run(check_split_by_sizes, tp, heads, kv):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE[torch.float64], (worst, errors[worst])
