"""Per-block shards: fused groups of heads fewer than the ranks, each group dealt to its own set.

Falcon's new layout with fewer key/value groups than ranks and fewer query heads in a group than
ranks (2 groups of 3 heads at tp=4): each group goes to a set of ranks, its query heads dealt
among them and its k and v whole on each. The layout itself is checked as a property (every
element owned once, one block per rank, views in and out of the grouped dims); on gloo ranks
the parallel model equals the serial one (float64, every gradient), clip_grad_norm_ counts
each group's whole k and v once, torch.distributed.checkpoint saves it and loads it at other
tps, and from_pretrained reads each rank's own rows.
"""
import logging

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autotp
from autotp.passes.rules.view_map import map_view_shard, plain_if_same
from autotp.placements import (Shard, block_sets, from_json, layout, local_ranges, local_size, outer_block,
                               owned_ranges, to_json)

FUSED = "transformer.h.{}.self_attention.query_key_value.weight"


@st.composite
def per_block_shards(draw):
    tp = draw(st.integers(3, 8))
    chunks = draw(st.integers(2, tp - 1))
    widest = max(count for _, count in block_sets(chunks, tp))
    dealt = draw(st.integers(widest, widest + 5))
    tail = draw(st.integers(0, 2))
    unit = draw(st.sampled_from([1, 3, 4]))
    shard = Shard(0, chunks, unit, draw(st.integers(0, tp - 1)), tail, per_block=True)
    return shard, chunks * (dealt + tail) * unit, tp, dealt


@settings(max_examples=200, deadline=None)
@given(case=per_block_shards())
def test_a_per_block_shard_gives_each_rank_one_block_and_every_element_one_owner(case):
    shard, size, tp, dealt = case
    block = size // shard.chunks
    owned = sorted(r for rank in range(tp) for a, b in owned_ranges(size, shard, tp, rank) for r in range(a, b))
    assert owned == list(range(size))                           # every element owned exactly once
    runs = {}
    for rank in range(tp):
        ranges = local_ranges(size, shard, tp, rank)
        blocks = {a // block for a, _ in ranges} | {(b - 1) // block for _, b in ranges}
        assert len(blocks) == 1                                  # one block per rank
        (held,) = blocks
        assert held == outer_block(shard, tp, rank)
        assert local_size(size, shard, tp, rank) == sum(b - a for a, b in ranges)
        tail = (held * block + (block - shard.tail * shard.unit), (held + 1) * block)
        assert (not shard.tail) or ranges[-1] == tail             # the block's tail whole, last
        run = sum(b - a for a, b in ranges) - shard.tail * shard.unit
        assert run >= shard.unit                                  # no rank without an atom
        runs.setdefault(held, []).append(run // shard.unit)
    assert sorted(runs) == list(range(shard.chunks))
    assert all(sum(r) == dealt for r in runs.values())            # a block's atoms dealt once in its set
    assert from_json(to_json(shard)) == shard


def test_a_view_moves_the_blocks_onto_a_dim_of_their_own_and_back():
    b, s = sympy.Symbol("b"), sympy.Symbol("s")
    fused = Shard(2, 2, 4, 1, 2, per_block=True)                # 2 groups of (4 q + k + v) heads of 4
    flat, split = (b, s, sympy.Integer(48)), (b, s, sympy.Integer(2), sympy.Integer(6), sympy.Integer(4))
    grouped = map_view_shard(flat, split, fused)
    assert grouped == Shard(3, 2, 1, 1, 2, per_block=True, outer=2)
    assert map_view_shard(split, flat, grouped) == fused
    for tp in (4, 8):
        for rank in range(tp):     # the same elements: [group, head] flattened is the fused dim / 4
            heads = [h for a, z in local_ranges(6, grouped, tp, rank) for h in range(a, z)]
            mine = [outer_block(grouped, tp, rank) * 6 + h for h in heads]
            assert [e // 4 for a, z in local_ranges(48, fused, tp, rank) for e in range(a, z, 4)] == mine
    # the query heads alone, flattened: a plain head shard where the sets hold runs in rank order
    query = Shard(3, 2, 1, 0, 0, per_block=True, outer=2)
    heads = map_view_shard((b, s, sympy.Integer(2), sympy.Integer(4), sympy.Integer(4)),
                           (b, s, sympy.Integer(8), sympy.Integer(4)), query)
    assert heads == Shard(2, 2, 1, 0, 0, per_block=True)
    assert plain_if_same(heads, sympy.Integer(8), 8) == Shard(2)
    assert plain_if_same(heads, sympy.Integer(8), 4) == Shard(2)     # 2 + 2 | 2 + 2 in order
    uneven = Shard(2, 2, 1, 0, 0, per_block=True)
    assert plain_if_same(uneven, sympy.Integer(6), 4) == uneven        # 2, 1 | 2, 1: not contiguous runs
    assert layout(6, uneven, 4) == (((0, 2),), ((2, 3),), ((3, 5),), ((5, 6),))


def _falcon(seed: int, heads: int = 6, kv: int = 2):
    from autotp import zoo
    from autotp.testing import keep_loss_precision

    config = zoo.tiny_config("falcon-new", layers=2, heads=heads, kv_heads=kv, head_dim=4, vocab=37)
    return config, keep_loss_precision(zoo.build("falcon-new", config, dtype=torch.float64, seed=seed))


def _batch(config, seed: int):
    from autotp import zoo

    return zoo.example_batch("falcon-new", config, batch=2, seq=5, seed=seed)


def _through_the_stack(path: str, tp: int) -> dict:
    from autotp.runtime.checkpoint import dcp
    from autotp.testing import equivalence_errors

    logging.getLogger("autotp").setLevel(logging.ERROR)
    config, model = _falcon(0)
    pm = autotp.parallelize(model, tp, batch=64, seq=2048, profile="h100-dgx")
    data = _batch(config, 3)
    errors = equivalence_errors(model, pm, data)    # forward and backward: every gradient
    serial = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
    got = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e-3).full_tensor().item()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt.step()
    dcp.save(pm, path, opt)
    loaded = {}
    for other_tp in (tp, 2, 1):
        _, other = _falcon(1)
        loading = autotp.parallelize(other, other_tp, batch=64, seq=2048, profile="h100-dgx")
        loading_opt = torch.optim.AdamW(loading.parameters(), lr=0.5)
        dcp.load(loading, path, loading_opt)
        a, b = dict(pm.named_parameters()), dict(loading.named_parameters())
        sa, sb = opt.state_dict()["state"], loading_opt.state_dict()["state"]
        loaded[other_tp] = max([(a[n].full_tensor() - b[n].full_tensor()).abs().max().item() for n in a] +
                               [(sa[i][k].full_tensor() - sb[i][k].full_tensor()).abs().max().item()
                                for i in sa for k in sa[i] if k != "step"])
    return {"placements": [pm.plan.params[FUSED.format(i)] for i in (0, 1)], "attention": pm.plan.attention,
            "worst": max(errors.values()), "norm": (serial, got), "loaded": loaded}


@pytest.mark.slow   # 19 s on two cores; the fast tier clips and checkpoints a tailed layout's rows
# (tests/runtime/test_tailed_layouts.py) and deals per-block shards (above)
def test_fewer_groups_and_heads_than_ranks_match_serial_through_clip_and_dcp(cluster, tmp_path):
    # 2 groups of 3 query heads at tp=4: sets of 2 ranks, a group's heads dealt 2 + 1 (the next
    # layer rotates which rank takes 2)
    results = cluster.run(_through_the_stack, str(tmp_path / "ckpt"), 4)
    for r in results:
        assert all(p.per_block and p.chunks == 2 and p.tail == 2 for p in r["placements"]), r["placements"]
        assert sorted(r["attention"]["transformer.h.0.self_attention"]) == [1, 1, 2, 2], r["attention"]
        assert r["attention"]["transformer.h.0.self_attention"] != r["attention"]["transformer.h.1.self_attention"]
        assert r["worst"] <= 1e-9, r["worst"]
        serial, got = r["norm"]
        assert abs(got - serial) <= 1e-12 * serial, r["norm"]
        assert r["loaded"] == {4: 0.0, 2: 0.0, 1: 0.0}, r["loaded"]


def _loaded(path: str) -> dict:
    from transformers import FalconForCausalLM

    from autotp.testing import equivalence_errors, keep_loss_precision
    from tests.test_checkpoint import _precise_from_config

    logging.getLogger("autotp").setLevel(logging.ERROR)
    pm = autotp.from_pretrained(path, tp=4, batch=64, seq=2048, profile="h100-dgx", progress=False,
                                model_class=_precise_from_config)
    serial = keep_loss_precision(FalconForCausalLM.from_pretrained(path, dtype=torch.float64))
    errors = equivalence_errors(serial, pm, _batch(serial.config, 4))
    return {"placement": pm.plan.params[FUSED.format(0)], "rows": pm.local_parameter(FUSED.format(0)).shape[0],
            "worst": max(errors.values())}


@pytest.mark.slow   # 17 s; the fast tier loads a tailed layout's rows (test_tailed_layouts.py)
def test_from_pretrained_reads_each_ranks_group_rows(cluster, tmp_path):
    _, model = _falcon(7)
    model.save_pretrained(tmp_path)
    rows = []
    for r in cluster.run(_loaded, str(tmp_path)):
        assert r["placement"].per_block and r["worst"] <= 1e-9, r
        rows.append(r["rows"])
    assert sorted(rows) == [(1 + 2) * 4, (1 + 2) * 4, (2 + 2) * 4, (2 + 2) * 4]   # its query heads, k, v
