"""The rank benchmark's mirrored peers (``benchmarks/fake_peers.py``): torch's fake backend leaves
what the emulation assumes, the mirrored scatter is what a real world's scatter and all-reduce
give when every peer routes its tokens as this rank does, and under it a rank that gets its
experts' rows by the all-to-all dispatch computes exactly the rows a rank gathering the tokens
computes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp import zoo
from autotp.distributed.experts import routed_scatter, token_rows
from benchmarks.fake_peers import EMULATED, _mirrored_scatter, _token_rows, mirrored_peers


def test_the_fake_backend_fills_what_the_emulation_assumes(fake_world):
    import torch.distributed._functional_collectives as funcol

    fake_world(4)
    group = dist.group.WORLD
    x = torch.arange(8.0).unsqueeze(1)
    # an all-gather: every rank's block is this rank's (the peers mirror it)
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x[:2], 0, group))
    assert torch.equal(gathered, x[:2].repeat(4, 1))
    # an all-to-all: each peer's block is the first rows of this rank's send buffer
    got = funcol.wait_tensor(funcol.all_to_all_single(x, [1, 1, 3, 3], [2, 2, 2, 2], group))
    assert torch.equal(got.flatten(), torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 1.0, 2.0]))


@pytest.mark.parametrize("rank", [0, 2])
def test_the_mirrored_scatter_is_every_peers_scatter_summed(rank):
    # outer 2 sequences of 8 tokens split 4 ways: a rank holds 2 of each; every peer p holds its
    # own positions with this rank's values, and the all-reduce of their scatters is the sum
    tp, seq, outer, hidden = 4, 8, 2, 3
    local = torch.randn(outer, seq // tp, hidden, dtype=torch.float64)
    x = local.reshape(-1, hidden).requires_grad_()
    shape = [outer * seq, hidden]
    from benchmarks import fake_peers

    fake_peers._PLAIN.update(token_rows=token_rows, routed_scatter=routed_scatter)
    rows = _token_rows(local, 1, [outer], seq, tp, rank)
    want = sum(routed_scatter(x, token_rows(local, 1, [outer], seq, tp, p), 0, 1, shape) for p in range(tp))
    before = EMULATED["scatters"]
    got = _mirrored_scatter(x, rows, 0, 1, shape)
    assert EMULATED["scatters"] == before + 1
    assert torch.equal(got, want)
    # backward: the rank's own rows of the gradient, as the real scatter's (the all-reduce's is the identity)
    grad = torch.randn(shape, dtype=torch.float64)
    (mine,) = torch.autograd.grad(got, x, grad)
    (real,) = torch.autograd.grad(routed_scatter(x, rows, 0, 1, shape), x, grad)
    assert torch.equal(mine, real)
    # rows of experts (no token map) are scattered as they are
    plain = torch.tensor([1, 5])
    assert torch.equal(_mirrored_scatter(x[:2], plain, 0, 1, shape), routed_scatter(x[:2], plain, 0, 1, shape))


def _experts_rows(fake_world, dispatch: bool) -> tuple[int, int]:
    """(the rank's grouped-product FLOPs in one forward + backward, token tensors mirrored)."""
    from autotp.testing.work import WorkCounter

    fake_world(2)
    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4, top_k=2,
                             positions=16)
    config._experts_implementation = "grouped_mm"
    model = zoo.build("mixtral", config, seed=0, dtype=torch.float32)
    batch = zoo.example_batch("mixtral", config, batch=2, seq=16, seed=1)
    EMULATED["scatters"] = 0
    with mirrored_peers():
        # attention pinned Megatron's way: its row-parallel output meets the residual add, which
        # sequence parallelism splits, so the MoE block's tokens arrive split along the sequence
        layout = {"*.experts.*": "expert", "*.o_proj.weight": "row", "*_proj.weight": "column"}
        pm = autotp.parallelize(model, 2, layout=layout, batch=2, seq=16, profile="cpu-gloo",
                                sequence_parallel=True, expert_dispatch=dispatch, example_kwargs=batch)
        with WorkCounter() as work:
            pm(**batch).loss.backward()
    assert any(c.kind == "all_to_all" and not c.src.startswith("S(") for c in pm.plan.comms) is dispatch
    grouped = sum(flops for op, flops in work.by_op.items() if "grouped_mm" in op)
    return grouped, EMULATED["scatters"]


def test_a_dispatching_rank_computes_the_rows_a_gathering_rank_does(fake_world, caplog):
    # the gathering rank routes the fake all-gather's copies of its tokens; the dispatching rank,
    # its tokens' routing mirrored, receives from each peer what its own tokens send its experts.
    # Both all-gather their token rows along the sequence as their real programs do (the fake
    # all-gather mirrors them): nothing emulated by the mirrored scatter. Before, the patched row
    # map hid itself from the rewrite, which scattered and all-reduced those rows instead (logged)
    with caplog.at_level("WARNING", logger="autotp"):
        gathered, none = _experts_rows(fake_world, False)
        dispatched, mirrored = _experts_rows(fake_world, True)
    assert none == 0 and mirrored == 0
    assert not [r for r in caplog.records if "without their sequence's row map" in r.getMessage()]
    assert gathered > 0 and dispatched == gathered


def test_an_all_to_all_with_nothing_to_send_gets_zeros_under_the_mirror(fake_world):
    # a rank whose experts got none of its own tokens' rows combines back nothing, and expects
    # its tokens' rows from the peers' experts: the fake backend refuses an empty send buffer
    from autotp.distributed import experts as E
    from autotp.errors import CommError

    fake_world(4)
    empty = torch.zeros(0, 3)
    with pytest.raises(CommError, match="inputBuffer is empty"):
        E._all_to_all(empty, [0, 0, 0, 0], [1, 2, 0, 1], dist.group.WORLD, "combine")
    with mirrored_peers():
        got = E._all_to_all(empty, [0, 0, 0, 0], [1, 2, 0, 1], dist.group.WORLD, "combine")
        sent = E._all_to_all(torch.ones(4, 3), [1, 1, 1, 1], [2, 2, 2, 2], dist.group.WORLD, "dispatch")
    assert torch.equal(got, torch.zeros(4, 3))
    assert sent.shape == (8, 3)   # anything with rows to send goes through the fake backend as before
