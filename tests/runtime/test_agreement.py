"""Ranks agree before they talk: a rank that would run another program, or got other inputs,
makes every rank of its TP group raise DisagreementError saying what differs (never a hang)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import autotp
from autotp.errors import DisagreementError
from autotp.distributed.agreement import Fingerprint, _first_difference, fingerprint
from autotp.testing import MEGATRON_GPT2
from tests.helpers import batch, tiny_gpt2

pytestmark = pytest.mark.timeout(300)


def _last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def parallelize_with_another_layout_on_the_last_rank() -> None:
    layout = dict(MEGATRON_GPT2)
    if _last_rank():
        layout["*.mlp.c_fc.weight"] = "replicate"
    autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=layout, profile="h100-dgx")


def call_with_a_longer_batch_on_the_last_rank() -> None:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1), tp=4, layout=MEGATRON_GPT2)
    pm(**batch(100, s=9 if _last_rank() else 7))


def uneven_heads_losses() -> tuple[float, float]:
    pm = autotp.parallelize(tiny_gpt2(n_layer=1, n_head=6), tp=4, layout=MEGATRON_GPT2)
    checked = pm(**batch(100)).loss.item()
    pm.check_inputs = False
    return checked, pm(**batch(100)).loss.item()


def test_a_rank_with_another_layout_makes_every_rank_raise_naming_the_parameter(cluster):
    with pytest.raises(DisagreementError) as info:
        cluster.run(parallelize_with_another_layout_on_the_last_rank)
    text = str(info.value)
    assert "ranks [0, 1, 2, 3] of the TP group disagree before their first collective" in text
    assert "the plan's parameter placements differ" in text and "transformer.h.0.mlp.c_fc" in text
    assert "ranks 0, 1, 2: " in text and "rank 3: " in text
    assert "ranks that failed: [0, 1, 2, 3]" in text  # every rank raised; none was left waiting


def test_inputs_of_another_shape_on_one_rank_make_every_rank_raise(cluster):
    with pytest.raises(DisagreementError, match=r"the inputs of this call differ across the TP group of ranks "
                                                r"\[0, 1, 2, 3\]: entry 0: ranks 0, 1, 2: 'input_ids: \(2, 7\) "
                                                r"int64'; rank 3: 'input_ids: \(2, 9\) int64'") as info:
        cluster.run(call_with_a_longer_batch_on_the_last_rank)
    assert "ranks that failed: [0, 1, 2, 3]" in str(info.value)


def test_ranks_of_an_uneven_split_agree_although_their_local_sizes_differ(cluster):
    # 6 heads over 4 ranks: ranks hold 2, 2, 1, 1 heads and their view sizes differ
    losses = cluster.run(uneven_heads_losses)
    assert len(set(losses)) == 1 and losses[0][0] == losses[0][1]


def test_fingerprint_leaves_out_local_sizes_but_keeps_the_graph_structure():
    from autotp.capture import capture
    from autotp.passes.rewrite import rewrite
    from autotp.planner import build_plan

    cap = capture(tiny_gpt2(n_layer=1, n_head=6))
    plan, index, prop = build_plan(cap, 4, batch=2, seq=8, layout=MEGATRON_GPT2)
    graphs = [rewrite(index, prop, rank, None, None) for rank in range(4)]
    prints = [fingerprint(plan, gm) for gm in graphs]
    assert len({gm.code for gm in graphs}) > 1  # the ranks' programs differ in local sizes ...
    assert len({tuple(p.digests()) for p in prints}) == 1  # ... and agree all the same


def test_first_difference_names_each_distinct_entry_and_its_ranks():
    per_rank = [["a", "b"], ["a", "b"], ["a", "c"]]
    assert _first_difference(per_rank, [4, 5, 6]) == "entry 1: ranks 4, 5: 'b'; rank 6: 'c'"
    assert _first_difference([["a"], ["a", "x"]], [0, 1]).startswith("entry 1: rank 0: '(nothing")
    assert Fingerprint((("s", ("a",)),)).digests() == Fingerprint((("t", ("a",)),)).digests()
