"""A tensor split along one dim and wanted split along another, by no consumer whole, moves by one
all-to-all: 1/tp of the bytes of the all-gather and cut the plan made before.

BERT's plan at the planning workload (64 x 4096 on ``h100-dgx``) splits its embeddings by
features and wants them split along the sequence (``S(2) -> S(1)``), and its attention's joined
q|k|v product (sibling products, autotp/passes/products.py) the other way, along the sequence to
its heads (``S(1) -> S(2x3/4)``; apart, its k and v went ``S(2) -> S(1)``). One
rank of tp 8 on the fake backend runs a training step of that plan twice: as planned (an
``all_to_all``), and with the same placements run the old way (every reshard gathered whole and
cut). It issues the collectives its plan lists, and the reshards receive tp times fewer bytes.
Four gloo ranks hold the program to serial (float64, forward and backward); three (slow tier) an
uneven one (16 features at tp 3, rotated in the second layer).
"""
from __future__ import annotations

import re

import pytest
import sympy
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp import zoo
from autotp.distributed import comm_modules
from autotp.passes import propagate

PLANNING = dict(batch=64, seq=4096, profile="h100-dgx")


def _model(dtype: torch.dtype, heads: int = 8):
    config = zoo.tiny_config("bert", layers=2, heads=heads, head_dim=4, vocab=61)
    return zoo.build("bert", config, dtype=dtype, seed=1), config


class _Received(TorchDispatchMode):
    """Bytes a rank receives from the others in the all-gathers and all-to-alls it issues: their
    output, but for the rank's own block (even splits here: 1/tp of it)."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp, self.calls = tp, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        to_all = "all_to_all" in name or "alltoall" in name   # functional, or c10d's (eager code's)
        if "allgather" in name or "all_gather" in name or to_all:
            got = args[0] if name.endswith("_") else out   # c10d's ops write into their first argument
            # a coalesced call's outputs (the rows of a sequence split at a batch of a few) together
            got = list(got) if isinstance(got, (list, tuple)) else [got]
            got = [t for g in got for t in (g if isinstance(g, (list, tuple)) else [g])]
            self.calls.append(("all_to_all" if to_all else "all_gather",
                               sum(t.numel() * t.element_size() for t in got) * (self.tp - 1) // self.tp))
        return out


def _step(pm, batch, tp: int) -> tuple[int, _Received]:
    from torch.distributed.tensor.debug import CommDebugMode

    pm.train()
    with CommDebugMode() as comm, _Received(tp) as received:
        pm(**batch).loss.backward()
    return comm.get_total_counts(), received


@pytest.fixture
def fake_tp8():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    yield 8
    dist.destroy_process_group()


def test_a_reshard_issues_one_all_to_all_of_a_tp_th_of_the_gathers_bytes(fake_tp8, monkeypatch):
    tp = fake_tp8
    model, config = _model(torch.float32)
    batch = zoo.example_batch("bert", config, batch=2, seq=8, seed=2)   # seq 8, hidden 32: even at tp 8
    pm = autotp.parallelize(model, tp, **PLANNING)
    a2a = [c for c in pm.plan.comms if c.kind == "all_to_all"]
    # the embeddings' sum S(2) -> S(1); each attention's q|k|v, joined for one product (bias
    # included), sequence-split S(1) -> its heads' blocks S(2x3/4) (written apart, k and v went
    # S(2) -> S(1) for attention instead): each a split along one dim wanted along another
    dims = [(re.match(r"S\((\d+)", c.src), re.match(r"S\((\d+)", c.dst)) for c in a2a]
    assert a2a and all(src and dst and src[1] != dst[1] for src, dst in dims), pm.plan.comms
    assert not [c for c in pm.plan.comms if c.kind == "reshard"]
    modules = [m for m in pm.graph_module.modules() if isinstance(m, comm_modules.ReshardTP)]
    assert len(modules) == len(a2a)
    # the listing names it, and the plan's cost expressions price what it lists
    assert "all_to_all" in pm.plan.table(full=True)
    b, s = sympy.symbols("b s", integer=True, positive=True)
    comm_s = sympy.sympify(pm.plan.expressions["comm_s"], locals={"b": b, "s": s})
    assert float(comm_s.subs({b: 64, s: 4096})) == pytest.approx(pm.plan.comm_s, rel=1e-4)
    assert sum(pm.plan.comm_seconds().values()) == pytest.approx(pm.plan.comm_s)
    # the rank issues what its plan lists: one collective per direction a comm moves bytes in,
    # and the call's two agreements
    listed = sum((c.fwd_bytes > 0) + (c.bwd_bytes > 0) for c in pm.plan.comms) + 2
    issued, new = _step(pm, batch, tp)
    assert issued == listed

    # the same plan, its rank running each reshard as before: gathered whole and cut
    from autotp.passes import rewrite

    def gathered_and_cut(have, wanted):
        return [("reshard" if kind == "all_to_all" else kind, dst, entry)
                for kind, dst, entry in propagate.gather_parts(have, wanted)]

    monkeypatch.setattr(rewrite, "gather_parts", gathered_and_cut)
    old_pm = autotp.parallelize(model, tp, **PLANNING)   # solved again: the same plan
    assert old_pm.plan.comms == pm.plan.comms
    assert not [m for m in old_pm.graph_module.modules() if isinstance(m, comm_modules.ReshardTP)]
    issued_old, before = _step(old_pm, batch, tp)
    assert issued_old == listed   # a reshard was two all-gathers (forward, backward), now two all-to-alls
    # the vocabulary-split table read by columns moves by its lookup's own all-to-all (forward,
    # backward), listed apart (all_to_all_columns) and issued alike by both programs: no reshard
    columns = [c for c in pm.plan.comms if c.kind == "all_to_all_columns"]
    table = [n for kind, n in before.calls if kind == "all_to_all"]
    assert len(table) == 2 * len(columns)
    assert len([k for k, _ in new.calls if k == "all_to_all"]) == 2 * len(a2a) + len(table)
    sent = sum(n for kind, n in new.calls if kind == "all_to_all") - sum(table)
    # issued: what the reshards' all-gathers received is tp times what their all-to-alls receive
    gathered = sum(n for kind, n in before.calls if kind == "all_gather") \
        - sum(n for kind, n in new.calls if kind == "all_gather")
    assert sent > 0 and gathered == tp * sent


def _matches_serial(tp: int, heads: int) -> dict:
    from autotp.testing import equivalence_errors, tolerance

    model, config = _model(torch.float64, heads)
    pm = autotp.parallelize(model, tp, **PLANNING)
    batch = zoo.example_batch("bert", config, batch=2, seq=7, seed=3)   # seq 7: uneven at tp 3 and 4
    return {"errors": equivalence_errors(model, pm, batch), "bound": tolerance(model, batch),
            "all_to_all": sum(isinstance(m, comm_modules.ReshardTP) for m in pm.graph_module.modules()),
            "listed": [c.kind for c in pm.plan.comms if c.kind in ("all_to_all", "reshard")]}


@pytest.mark.parametrize("tp, heads", [
    (4, 8),   # features even (32 = 4 x 8), the sequence not (7 = 2+2+2+1)
    # 16 features at tp 3 (6, 5, 5), rotated in the second layer, into the sequence (3, 2, 2)
    pytest.param(3, 4, marks=pytest.mark.slow)])
def test_a_program_that_reshards_by_all_to_all_trains_as_serial(cluster_of, tp, heads):
    """float64: the loss, the outputs and every gradient equal serial's."""
    for rank, r in enumerate(cluster_of(tp).run(_matches_serial, tp, heads)):
        assert r["all_to_all"] and set(r["listed"]) == {"all_to_all"}, (rank, r)
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= r["bound"], (rank, worst, r["errors"][worst])
