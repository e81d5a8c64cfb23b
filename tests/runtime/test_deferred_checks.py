"""``deferred_checks``: the per-call checks read without stopping the host (what NCCL ranks do by
default), with what they guarantee kept: a call whose inputs differ across the group raises
DisagreementError on every rank before any rank is handed its outputs; ranks in the backward
passes of different calls raise out of ``loss.backward()``; a token id outside the vocabulary raises its
InputError on every rank at the next call (or at ``flush_checks()``), naming the call it was in.
On gloo ranks, with inputs of equal shapes, so that the call's own collectives pair up
(docs/errors.md, "Checks read late")."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.errors import DisagreementError, InputError
from autotp.testing import MEGATRON_GPT2
from tests.helpers import batch, tiny_gpt2

pytestmark = pytest.mark.timeout(300)


def _module():
    # the vocabulary split: an id outside it looks up zeros there, which only the check refuses
    layout = {**MEGATRON_GPT2, "transformer.wte.weight": "vocab"}
    pm = autotp.parallelize(tiny_gpt2(n_layer=1), tp=dist.get_world_size(), layout=layout)
    pm.deferred_checks = True
    return pm


def other_values_on_the_last_rank() -> dict:
    pm = _module()
    pm.check_inputs = "values"
    out = {"first": pm(**batch(100)).loss.item()}   # agreed: the outputs come back
    handed = False
    try:
        pm(**batch(100, seed=2 if dist.get_rank() == dist.get_world_size() - 1 else 1))
        handed = True
    except DisagreementError as e:
        out["error"] = str(e)
    out["handed"] = handed
    out["again"] = pm(**batch(100)).loss.item()   # the refused call is made again under its number
    return out


def test_a_call_that_disagrees_hands_no_rank_its_outputs(cluster_of):
    results = cluster_of(2).run(other_values_on_the_last_rank)
    for r in results:
        assert not r["handed"] and "the inputs of this call differ" in r["error"] and "values" in r["error"]
        assert r["again"] == r["first"]


def backward_of_another_call_on_the_last_rank() -> str:
    pm = _module()
    first, second = pm(**batch(100)).loss, pm(**batch(100)).loss
    try:   # the same shapes: the passes' collectives pair up, and the check read at their end differs
        (second if dist.get_rank() == dist.get_world_size() - 1 else first).backward()
    except DisagreementError as e:
        return str(e)
    return "no error"


def test_a_backward_pass_of_another_call_raises_out_of_backward(cluster_of):
    for text in cluster_of(2).run(backward_of_another_call_on_the_last_rank):
        assert "are in different calls" in text and "the backward pass of call 1" in text, text
        assert "the backward pass of call 2" in text, text


def an_id_outside_the_vocabulary() -> dict:
    pm = _module()
    bad = batch(100)
    bad["input_ids"][0, 3] = 100
    out = {"bad_call_ran": bool(torch.isfinite(pm(**bad).loss))}   # no read of the device: it runs
    try:
        pm(**batch(100))
    except InputError as e:
        out["next_call"] = str(e)
    pm(**bad)
    try:
        pm.flush_checks()
    except InputError as e:
        out["flushed"] = str(e)
    pm.flush_checks()   # read once: nothing left
    return out


def test_an_id_outside_the_vocabulary_raises_at_the_next_call_on_every_rank(cluster_of):
    for r in cluster_of(2).run(an_id_outside_the_vocabulary):
        assert r["bad_call_ran"]
        assert r["next_call"].startswith("input_ids of call 1 of GPT2LMHeadModel") and "holds 100, outside [0, 100)" in r["next_call"]
        assert "holds 100" in r["flushed"] and "of call 2" in r["flushed"]
