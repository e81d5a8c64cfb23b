"""GPT-2's embeddings on a rank's share, planned on the meta device, no ranks (issue 44).

GPT-2 ties ``wte`` to ``lm_head``, which the plan splits by vocabulary. Before, the lookup was
Megatron's masked one: each rank looked up every token in its rows and wrote the whole
``[b, s, h]`` (zeros where another rank holds the row), reduce-scattered along the sequence, and
scattered every token's gradient row back: 8x its share at tp 8, the largest "bytes above the
share" of gpt2-xl's rank (``benchmarks/rank_gap.md``). Now the lookup may read the table by
columns (one all-to-all of the table inside the op, ``rules/nn.py``): each rank writes its
``h/tp`` columns of every token, and the norm behind the embeddings takes them resharded into
the sequence split by one all-to-all. The cost model weighs the table's bytes against the
tokens': with few tokens (a decode step) the masked lookup stays."""
import functools

import torch

from autotp import zoo
from autotp.capture import capture
from autotp.capture.program import op_name
from autotp.cost_model import get_profile
from autotp.cost_model.symbolic import evaluate, op_work
from autotp.placements import PARTIAL, Shard
from autotp.planner import build_plan

TP = 8
BY_COLUMNS = "all_to_all_columns"


@functools.lru_cache(maxsize=None)
def _capture():
    model = zoo.build("gpt2", zoo.published_config("gpt2-xl", layers=2), device="meta", dtype=torch.bfloat16)
    return capture(model)


def _bytes(index, prop, node, profile, tp, rank) -> float:
    work = op_work(index.infos[node], prop.chosen[node], profile, tp, rank)
    return sum(evaluate(b, index.env) for _, b in work.moved)


def _front(index, prop) -> dict:
    """The placements from the lookups to the first layer norm, by role."""
    nodes = list(index.capture.graph.nodes)
    lookups = [n for n in nodes if n in prop.chosen and op_name(n.target) == "aten.embedding.default"]
    norm = next(n for n in nodes if n in prop.chosen and op_name(n.target) == "aten.layer_norm.default")
    between = [n for n in nodes[nodes.index(lookups[0]):nodes.index(norm)]
               if n in prop.chosen and op_name(n.target) in ("aten.add.Tensor", "aten.dropout.default")
               and index.infos[n].output.is_float]
    return {"wte": prop.chosen[lookups[0]], "wpe": prop.chosen[lookups[1]], "between": [prop.chosen[n] for n in between],
            "norm": prop.chosen[norm], "lookups": lookups}


def test_gpt2_xl_looks_up_its_embeddings_at_its_share_under_sequence_parallelism():
    profile = get_profile("h200")
    cap = _capture()
    plan, index, prop = build_plan(cap, TP, batch=8, seq=1024, profile=profile, memory_limit=float("inf"))
    assert any(note.startswith("sequence parallelism") for note in plan.notes), plan.notes
    assert plan.params["lm_head.weight"] == Shard(0)   # the tied table stays split by vocabulary
    front = _front(index, prop)
    # the tied table read by columns (its all-to-all inside the lookup), the positions' table split
    # by columns: both lookups, their sum and the embeddings' dropout on the rank's h/8 columns
    assert front["wte"].internal and front["wte"].internal[0][0] == BY_COLUMNS, front["wte"]
    assert front["wte"].output == Shard(2) and front["wpe"].output == Shard(2), (front["wte"], front["wpe"])
    assert front["between"] and all(s.output == Shard(2) for s in front["between"]), front["between"]
    assert front["norm"].output == Shard(1), front["norm"]   # then the sequence split, by one all-to-all
    assert [c.kind for c in plan.comms if c.kind in (BY_COLUMNS, "reduce_scatter") and "embedding" in c.tensor] \
        == [BY_COLUMNS]
    # the cost model's bytes of each lookup (forward, the table's gradient zeroed, the rows' gradients
    # scattered) on the busiest rank: serial's / 8, where the masked lookup moved serial's whole; within
    # 1%: every rank reads every id (8 bytes a token, beside the 2 x 200 of its columns) and rank 0
    # zeroes one vocabulary row more (50257 rows dealt 8 ways)
    _, serial_index, serial_prop = build_plan(cap, 1, batch=8, seq=1024, profile=profile)
    serial = {n.name: n for n in serial_prop.chosen}
    for node in front["lookups"]:
        whole = _bytes(serial_index, serial_prop, serial[node.name], profile, 1, None)
        rank = max(_bytes(index, prop, node, profile, TP, r) for r in range(TP))
        assert rank <= whole / TP * 1.01, (node.name, rank, whole / TP)

    # a decode step's workload: the table's all-to-all (7/64 of 50257 x 1600 each way) costs more than
    # every token's masked row; the cost model reads the table by columns through no all-to-all there:
    # Megatron's lookup, or (since a product's price stopped falling as it contracts more, which had
    # priced the weights' gradients of a one-token step, contracting 1 row, at 101 kernels' fixed
    # cost) the table stored split by columns, its head row-parallel, 813 us against 820 at h200
    _, index, prop = build_plan(cap, TP, batch=1, seq=1, profile=profile, memory_limit=float("inf"))
    wte = _front(index, prop)["wte"]
    assert wte.output in (PARTIAL, Shard(2)) and not wte.internal, wte
