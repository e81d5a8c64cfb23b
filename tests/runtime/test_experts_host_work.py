"""An expert layer's host work on a rank: what its step adds to serial's that has no purpose.

Under expert parallelism with the all-to-all dispatch (the tokens split along the sequence, each
rank routing its own), a rank's expert layer makes one read to the host (its split sizes and
bounds, ``tests/runtime/test_host_syncs.py``) and the ops the read's numbers size. These tests
count the rest device-independently (:mod:`autotp.testing.host`) on one rank of tp 2 on torch's
``fake`` backend, after a warm-up, and hold the counts exactly, so that a change which adds a
call per layer shows (``benchmarks/rank_host.md``: the same counts at tp 8). What may not cost a
step anything:

* the row map of a dispatching layer's rows sorted by expert (``expert_rows``, an ``arange``):
  its products take the rows as they arrive, so nothing reads it; the rewrite erases it;
* the holders of the experts (``_rank_of_experts``), made once per layout: no Python per rank
  to look them up.
"""
from __future__ import annotations

import pytest
import torch

import autotp
from autotp import zoo
from autotp.capture import EXAMPLE_SEQ
from autotp.distributed import experts as E
from autotp.testing.host import AtenCalls, PythonCalls

TP = 2
#: the exact counts of a step of the rank below (2 layers of 4 experts, top-2). Before the cuts
#: 468 and 908 ATen calls (the unread row maps' ``arange``, one a layer), 676 and 1091 Python
#: calls (those maps' calls, and generators over the experts' runs and the batch's shape); then
#: 466 and 906 (the dispatch plan's identity ``order``, an ``arange`` a layer, and the gathers of
#: the rank's own rows by it, before the dispatch and after the combine, and their backwards)
COUNTS = {"inference": dict(aten=460, python=666), "training": dict(aten=896, python=1081)}


@pytest.fixture(scope="module")
def dispatching_rank(request):
    from tests.helpers import fake_process_group

    with fake_process_group(TP):
        config = zoo.tiny_config("mixtral", layers=2, heads=4, kv_heads=2, head_dim=4, vocab=61, experts=4, top_k=2)
        model = zoo.build("mixtral", config, dtype=torch.float32, seed=1)
        inputs = zoo.example_batch("mixtral", config, batch=2, seq=EXAMPLE_SEQ, seed=2)
        # o_proj pinned by rows: its split is a tie in time and memory at this size, which the solver
        # may settle either way by layer (a column-split o_proj adds a gather and drops a region's
        # sequence-parallel ops): the counts below are the expert layers', not the solver's tie-break
        layout = {"*.experts.*": "expert", "*.o_proj.*": "row"}
        pm = autotp.parallelize(model, TP, layout=layout, batch=64, seq=4096,
                                profile="h100-dgx", sequence_parallel=True, expert_dispatch=True)
        pm.deferred_checks = True   # as under NCCL
        yield pm, inputs


def _step(pm, inputs, kind: str):
    pm.train(kind == "training")

    def step():
        if kind == "training":
            pm.zero_grad(set_to_none=True)
            pm(**inputs).loss.backward()
        else:
            with torch.no_grad():
                pm(input_ids=inputs["input_ids"])
    step()
    step()
    return step


def test_a_dispatching_layer_makes_no_row_map_it_does_not_read(dispatching_rank):
    pm, _ = dispatching_rank
    kinds = [type(m).__name__ for m in pm.graph_module.modules()]
    assert kinds.count("DispatchRows") == 2, kinds
    made = [n.name for n in pm.graph_module.graph.nodes if n.target is E.expert_rows]
    assert made == []


@pytest.mark.parametrize("kind", ["inference", "training"])
def test_a_dispatching_ranks_step_makes_exactly_its_calls(dispatching_rank, kind):
    pm, inputs = dispatching_rank
    step = _step(pm, inputs, kind)
    with AtenCalls() as aten:
        step()
    with PythonCalls() as python:
        step()
    routing = {k: n for k, n in python.by_function.items() if k.startswith("autotp/distributed/expert")}
    assert not [k for k in routing if k.endswith("<genexpr>")], routing
    assert "autotp/distributed/experts.py:expert_rows" not in routing
    assert dict(aten=aten.total, python=python.total) == COUNTS[kind]
