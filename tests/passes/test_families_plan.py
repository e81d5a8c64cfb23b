"""Megatron's layout emerges from the planner at real size (meta device, default profile, tp=8).

Each published configuration is planned with 2 of its layers. The roles are checked by where a
weight sits in the captured graph, never by its name: a matrix is column-parallel when it is
split along the output dim of the product that reads it, row-parallel when split along the
contracted dim. Within layer 1 (the second), the matrices in the order the graph first reads
them must read as Megatron's two blocks, column-parallel matrices entering each block and one
row-parallel matrix leaving it (q/k/v then the attention output, up/gate then down); k/v may be
replicate or row-parallel (x sliced on each rank, k and v made whole by a g each) where there are
fewer kv heads than ranks (the solver prices both), and attention runs
split by head, every rank holding at least one (fused multi-query projections too: StarCoder,
Falcon-7B). A block may also end in a column-parallel matrix whose split output is gathered
whole before the residual add (OPT's out_proj: the same bytes as a row-parallel one's
reduce-scatter and gather, its MLP running on flattened tokens that no sequence shard reaches),
and at widths up to 1024 a block's matrices may stay whole, run on each rank's s/tp tokens
(their gradients summed by an f each: ModernBERT-large's MLP, as GPT-2 small's in
tests/test_plan.py). One forward reduction per block, an all-reduce (g) or, sequence-parallel,
a reduce-scatter along the sequence (Megatron-SP), or one for both where attention and MLP run
side by side into one residual add (GPT-J, Falcon); a norm statistic's reduction over split
heads (OLMo2's q/k norms, one number per token) is not one of them. Outside the layers no rank
holds a vocabulary-sized matrix whole:
the output layer is split along the vocabulary (vocab-parallel, so the loss runs vocab-parallel),
and an untied token embedding is split by vocabulary rows or by hidden columns, whichever the
cost model prices cheaper (a hidden split's all-gather of b*s*h moves half the bytes of the
all-reduce a vocabulary split needs, for the same memory: docs/architecture.md). Other
collectives in the layer are shown in the failure message.
"""
import re
import xml.etree.ElementTree as ET

import pytest
import torch

import autotp
from autotp.placements import Shard, is_even
from autotp import zoo
from autotp.capture import cache as capture_cache

SIZES = ["llama-3-8b", "mistral-7b", "qwen2-7b", "gpt-neox-20b", "gpt-j-6b", "falcon-7b", "falcon-40b", "starcoder-15b",
         "opt-6.7b", "bert-large",
         # whole-width q/k norms (an all-reduce of the sum of squares), a fused q|k|v read back with
         # slices, a fused Wqkv unbound and a fused GLU Wi chunked in two
         "olmo-2-7b", "phi-3-mini", "modernbert-large"]
#: size -> why its plan does not show Megatron's layout yet (measured when this file was last changed)
KNOWN_BROKEN = {}
TP = 8
aten = torch.ops.aten


def _layer_of(fqn: str) -> int | None:
    m = re.search(r"\.(\d+)\.", fqn)
    return int(m.group(1)) if m else None


def first_use_order(cap) -> dict[str, int]:
    """Parameter FQN -> position in the graph of the first op that reads it."""
    position = {node: i for i, node in enumerate(cap.graph.nodes)}
    order = {}
    for node in cap.graph.nodes:
        if node.op == "placeholder" and node.name in cap.param_names and node.users:
            order[cap.param_names[node.name]] = min(position[u] for u in node.users)
    return order


_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default}
_PRODUCTS = {aten.mm.default, aten.matmul.default, aten.linear.default}


def matrix_role(cap, plan, fqn: str) -> str:
    """column / row / replicate for a weight matrix, from its placement and the product that uses it:
    split along the product's output dim is column-parallel, along the contracted dim row-parallel."""
    placement = plan.params[fqn]
    if not isinstance(placement, Shard):
        return "replicate"
    node = next(n for n in cap.graph.nodes if n.op == "placeholder" and cap.param_names.get(n.name) == fqn)
    dim = placement.dim
    while True:
        users = list(node.users)
        if len(users) != 1:
            return f"shard({dim}) read by {len(users)} ops"
        user = users[0]
        if user.target in _TRANSPOSES:
            dim, node = 1 - dim, user      # 2-D: every transpose swaps the two dims
            continue
        if user.target not in _PRODUCTS:
            return f"shard({dim}) read by {user.target}"
        if user.target is aten.linear.default:
            out_dim = 0                    # linear(x, W): x @ W.T, W's rows are the outputs
        else:
            out_dim = 1 if user.args[1] is node else 0
        return "column" if dim == out_dim else "row"


def _product_of(cap, fqn: str):
    """The matrix product that reads the parameter (through transposes)."""
    node = next(n for n in cap.graph.nodes if n.op == "placeholder" and cap.param_names.get(n.name) == fqn)
    while node.target not in _PRODUCTS:
        node = next(iter(node.users))
    return node


def feeds_attention(cap, fqn: str) -> bool:
    """Is the product reading the parameter an input of attention, through ops other than products
    (a bias, the views into heads, rotary, the repeat of kv heads)?"""
    todo, seen = list(_product_of(cap, fqn).users), set()
    while todo:
        user = todo.pop()
        if user in seen or user.target in _PRODUCTS:
            continue
        seen.add(user)
        if user.target is aten.scaled_dot_product_attention.default:
            return True
        todo.extend(user.users)
    return False


def read_by_product(cap, fqn: str) -> bool:
    """Is the parameter (through transposes) an operand of a matrix product?"""
    node = next(n for n in cap.graph.nodes if n.op == "placeholder" and cap.param_names.get(n.name) == fqn)
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user.target in _PRODUCTS:
            return True
        if user.target in _TRANSPOSES:
            todo.extend(user.users)
    return False


def _placeholder(cap, fqn: str) -> str:
    return next(n.name for n in cap.graph.nodes if n.op == "placeholder" and cap.param_names.get(n.name) == fqn)


def gathered_whole(cap, plan, fqn: str) -> bool:
    """Is the output of the product reading the parameter all-gathered whole (no sharded compute
    after it) before it meets another product or attention (through its bias, dropout, casts)?"""
    made, todo = set(), [_product_of(cap, fqn)]
    while todo:
        node = todo.pop()
        if node.name in made:
            continue
        made.add(node.name)
        todo.extend(u for u in node.users if u.target not in _PRODUCTS
                    and u.target is not aten.scaled_dot_product_attention.default)
    return any(c.kind == "all_gather" and c.tensor in made for c in plan.comms)


def plan_at_size(size: str):
    family = zoo.family_of(size).name
    model = zoo.build(family, zoo.published_config(size, layers=2), device="meta", dtype=torch.bfloat16)
    cap = capture_cache.capture(model)      # the plan below reuses this capture
    return model, cap, autotp.plan(model, TP)


def _sizes():
    return [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[s])) if s in KNOWN_BROKEN
            else s for s in SIZES]


@pytest.mark.parametrize("size", _sizes())
def test_megatron_layout_emerges_at_real_size(size):
    model, cap, plan = plan_at_size(size)
    order = first_use_order(cap)
    layer = sorted((order[n], n) for n in order if _layer_of(n) == 1 and len(plan.shapes[n]) == 2)
    roles = {n: matrix_role(cap, plan, n) for _, n in layer}
    # k/v projections with fewer kv heads than ranks: replicate, or row-parallel (x sliced on each
    # rank, k and v made whole by a g each before attention: 7/8 of their products saved for two
    # small all-reduces, Qwen2-7B's 4 kv heads at tp 8), whichever the solver prices cheaper
    kv_heads = getattr(model.config, "num_key_value_heads", None) or getattr(model.config, "num_attention_heads", TP)
    kv_rows = {n for n in roles if roles[n] == "row" and kv_heads < TP and feeds_attention(cap, n)}
    roles.update({n: "kv-row" for n in kv_rows})
    # a column-parallel matrix whose output is gathered whole ends a block as a row-parallel one does
    roles.update({n: "column-gathered" for n in roles if roles[n] == "column" and gathered_whole(cap, plan, n)})
    # a whole matrix run on this rank's s/tp tokens: its gradient summed over the ranks by an f
    weight_fs = {c.tensor for c in plan.comms if c.kind == "f" and c.src == c.dst == "R"}
    hidden = model.config.hidden_size
    roles.update({n: "tokens" for n in roles if roles[n] == "replicate" and hidden <= 1024
                  and _placeholder(cap, n) in weight_fs})
    described = ", ".join(f"{n}={roles[n]}" for _, n in layer)
    sequence = " ".join(roles[n] for _, n in layer) + " "
    block = r"((column|replicate|kv-row) )*column ((column|replicate|kv-row) )*(row|column-gathered) "
    assert re.fullmatch(f"({block}|(tokens )+)+", sequence), f"layer 1 in graph order: {described}"
    blocks = len(re.findall(r"(row|column-gathered) ", sequence))
    whole = len(re.findall(r"(tokens )+", sequence))
    assert blocks >= 1 and blocks + whole == 2, f"{blocks} split blocks and {whole} whole in layer 1: {described}"

    # attention itself runs split by head (multi-query and grouped layouts included)
    split = [m for m in plan.attention if _layer_of(m + ".") == 1]
    assert split and all(len(plan.attention[m]) == TP and min(plan.attention[m]) >= 1 for m in split), \
        (split, plan.attention)

    in_layer = [c for c in plan.comms if _layer_of(c.module + ".") == 1]
    # a norm's statistic over split heads (OLMo2's q/k norms: one number per token, kept as a
    # size-1 dim) is made whole (or reduce-scattered) by a reduction of its own, not one of the block's
    shapes = {n.name: n.meta["val"].shape for n in cap.graph.nodes if hasattr(n.meta.get("val"), "shape")}
    kv_made_whole = {_product_of(cap, n).name for n in kv_rows}
    reductions = [c for c in in_layer if c.kind in ("g", "reduce_scatter") and c.src == "P"
                  and shapes[c.tensor][-1] != 1 and c.tensor not in kv_made_whole]
    shown = ", ".join(f"{c.kind}@{c.module}" for c in in_layer)
    # attention and MLP side by side (one residual add) may share one reduction
    assert 1 <= len(reductions) <= blocks, f"{len(reductions)} forward reductions in layer 1 ({shown})"
    # sequence parallelism splits (b, s, h) along s, nothing else (where a model flattens it to
    # (b*s, h), OPT's MLP: the rank's tokens' rows, b runs of s/tp)
    assert all(c.dst in ("S(1)", "P(tokens 0)") for c in in_layer if c.kind == "reduce_scatter"), shown

    vocab = model.config.vocab_size
    outside = [n for n in plan.roles if _layer_of(n) is None and vocab in plan.shapes[n]]
    assert outside, "no vocabulary-sized matrix found"
    split = {n: plan.params[n] for n in outside}
    assert all(isinstance(p, Shard) for p in split.values()), f"a vocabulary-sized matrix held whole: {split}"
    heads = [n for n in outside if read_by_product(cap, n)]   # the output layer (tied or not)
    assert heads and all(plan.shapes[n][split[n].dim] == vocab for n in heads), split


#: one published size of every family, the figure drawn for each
FIGURE_SIZES = [pytest.param(next(iter(f.published)), marks=[pytest.mark.slow] if f.task == "seq2seq" else [])
                for f in zoo.FAMILIES.values()]
_SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("size", FIGURE_SIZES)
def test_every_family_draws_its_layer_with_the_matrices_f_and_g(size):
    """The figure of a repeated layer (autotp.figure) draws every weight matrix of the layer by
    its name and split, and marks f and g where the plan puts them (sequence-parallel regions:
    Megatron-SP's all-gather with its f, AGf, and reduce-scatter, RS, in their place)."""
    from autotp.plan.figure import pick_flow

    _, _, plan = plan_at_size(size)
    svg = plan.figure()
    root = ET.fromstring(svg)
    texts = {t.text for t in root.iter(f"{_SVG}text")}
    marks = {t.text for t in root.iter(f"{_SVG}text") if "comm" in (t.get("class") or "")}
    # an f (or its gather, AGf) into the layer's column-parallel products and a forward reduction
    # (g, or RS where a sequence-parallel region follows: falcon-7b's last layer into ln_f)
    assert marks & {"f", "AGf"} and marks & {"g", "RS"}, marks
    flow = pick_flow(plan)
    prefix = f"{flow.stack}.{flow.indices[0]}."
    matrices = [n[len(prefix):] for n in plan.params if n.startswith(prefix) and len(plan.shapes[n]) >= 2]
    assert matrices and all(m in texts for m in matrices), (matrices, sorted(t for t in texts if t))
    roles = {t.split(" ")[0] for t in texts if t and t.split(" ")[0] in ("column", "row", "replicate")}
    assert {"column", "row"} <= roles, roles


#: Phi-3-medium's q | k | v: 40 query heads beside 10 key and 10 value heads, read back with slices;
#: at tp 8 (and 4) its 10 groups (a kv head with its 4 query heads) are dealt unevenly
GROUPED_FUSED = [("phi-3-medium", 2), ("phi-3-medium", 8), ("phi-3-medium", 10)]


@pytest.mark.parametrize("size, tp", GROUPED_FUSED, ids=[f"{s}-tp{t}" for s, t in GROUPED_FUSED])
def test_a_fused_qkv_with_grouped_kv_heads_splits_by_head_as_megatron_would(size, tp):
    """Blocks of unequal size (``S(0x4:1:1/128)``): each rank holds its run of the query heads and
    the key/value heads they use, so attention runs split with no collective before it and the
    output projection is row-parallel; the cost model chooses it, and a pin of that layout costs
    no less (where the groups divide evenly, it gives the same plan). Before, the q|k|v was dealt
    as 6 equal blocks and k and v gathered at attention. Where tp does not divide the 10 groups
    (tp 8) the first ranks (rotated by layer) take one more group: 8 query heads with their 2 kv
    heads on 2 ranks, 4 with 1 on the other 6. There the output projection is row-parallel over an
    even split of its 5120 inputs, the attention output moved there from its split by head by one
    all-to-all, as the pin has it (before, the matrix rule offered a free weight a row split along
    its input's own uneven split alone, and the solver's plan was 58 us a step dearer than the
    pin's at h100-dgx)."""
    family = zoo.family_of(size).name
    model = zoo.build(family, zoo.published_config(size, layers=2), device="meta", dtype=torch.bfloat16)
    cap = capture_cache.capture(model)
    # the norms as written: fused (autotp/passes/norms.py), a column-parallel o_proj whose output is
    # gathered whole (the attention output all-gathered, then an all-to-all along s) ties the row one
    # exactly at tp 8 (19.084 ms predicted both), and the solver may return either
    plan = autotp.plan(model, tp, fuse_norms=False)
    qkv, o = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    rotate = 1 if 10 % tp else 0   # layer 1 of an uneven split: rank tp-1 takes the first run
    assert plan.params[qkv] == Shard(0, 3, 128, rotate, sizes=(4, 1, 1)), plan.params[qkv]
    groups = [10 // tp + (r < 10 % tp) for r in range(tp)]
    assert plan.attention["model.layers.1.self_attn"] == [4 * groups[(r + rotate) % tp] for r in range(tp)]
    attention = [c for c in plan.comms if c.module == "model.layers.1.self_attn"]
    assert attention == [], [(c.kind, c.tensor) for c in attention]
    pinned = autotp.plan(model, tp, layout={"*.qkv_proj.weight": "column", "*.o_proj.weight": "row"},
                         fuse_norms=False)
    assert plan.compute_s + plan.comm_s <= (pinned.compute_s + pinned.comm_s) * (1 + 1e-12)
    assert (matrix_role(cap, plan, qkv), matrix_role(cap, plan, o)) == ("column", "row"), (plan.params[qkv],
                                                                                         plan.params[o])
    if 10 % tp == 0:
        assert pinned.params == plan.params
    else:   # o_proj's inputs even, reached from the split by head by one all-to-all
        assert is_even(5120, plan.params[o], tp), plan.params[o]
        into = [c for c in plan.comms if c.consumer == _product_of(cap, o).name]
        assert [c.kind for c in into] == ["all_to_all"], [(c.kind, c.module, c.consumer) for c in plan.comms]


#: a row-parallel product's partial sum met first by a dropout (Phi-3's resid_attn_dropout /
#: resid_mlp_dropout, p 0 but in the graph) or a cast (OLMo-2's post-norms upcast to float32)
PARTIAL_MEETS = [("phi-3-mini", aten.dropout.default, ("self_attn.o_proj", "mlp.down_proj")),
                 ("olmo-2-7b", aten.to.dtype, ("self_attn.o_proj", "mlp.down_proj"))]


@pytest.mark.parametrize("size, meets, rows", PARTIAL_MEETS, ids=[c[0] for c in PARTIAL_MEETS])
def test_a_partial_sum_met_by_a_dropout_or_a_cast_is_reduce_scattered_there(size, meets, rows):
    """Sequence parallelism enters where the partial sum meets its first elementwise op, as at an
    add: reduce-scattered along s there, the dropout or the post-norm run on s/tp tokens, the
    output projections row-parallel, no all-reduce in the layer. (Only an add took a partial
    sum along the sequence before: these layers kept their residual stream split along the
    hidden dim instead, an all-gather of the attention into a column-parallel output projection
    and an all-gather of every norm's squares.)"""
    _, cap, plan = plan_at_size(size)
    nodes = {n.name: n for n in cap.graph.nodes}
    in_layer = [c for c in plan.comms if _layer_of(c.module + ".") == 1]
    entries = [c for c in in_layer if c.kind == "reduce_scatter" and nodes[c.consumer].target is meets]
    assert len(entries) == 2 and all((c.src, c.dst) == ("P", "S(1)") for c in entries), entries
    # no activation all-reduced or gathered whole: only a norm's statistic may be, one number a token
    # (OLMo-2's q/k norms over the whole width of their column-parallel q and k: the float32 sums of
    # squares, a g and an f of [b, s, 1], cheaper by a hair than a reduce-scatter and an all-gather
    # of them with their staging copies once priced at float32's 4 bytes)
    whole = [c for c in in_layer if c.kind in ("g", "all_gather") and nodes[c.tensor].meta["val"].shape[-1] != 1]
    assert not whole, [(c.kind, c.tensor) for c in in_layer]
    for row in rows:
        assert matrix_role(cap, plan, f"model.layers.1.{row}.weight") == "row", row
