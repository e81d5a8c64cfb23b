"""A dispatching layer routes a rank's own rows: its sort and counts counted, on torch's ``fake`` backend.

Mixtral (a zoo family) with its tokens split along the sequence and its experts dispatched by
the all-to-all (sequence parallelism forced, planned where the dispatch pays): rank 0 of tp 2
and 4 runs one training step, every ATen call recorded with its first operand's size. The
rank's step sorts its own ``T*k/tp`` (token, expert) rows (``T`` tokens in the step, top-``k``),
not every one of the ``T*k``, and runs no ``histc`` over every row: every expert's count comes
from the counts its sort exchanged (autotp/passes/rules/local_routing.py). Before, every rank
all-gathered every token's ids and weights, sorted all ``T*k`` of them and counted them whole.
(On the fake backend an all-gather fills each peer's block with the rank's own: its peers route
as it does, which sizes the dispatch consistently; the values are not this test's. Eight
experts, so that rank 0's experts at tp 4 get rows of its own tokens: the fake all-to-all
refuses an empty send buffer where rows are expected back, benchmarks/fake_peers.py.)
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp import zoo

BATCH, SEQ, TOP_K = 2, 16, 2


class _Sizes(TorchDispatchMode):
    """Each ATen call's op name and its first tensor operand's number of elements."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.calls.append((func._schema.name, first.numel() if first is not None else 0))
        return func(*args, **(kwargs or {}))


def _rank_step(tp: int) -> list[tuple[str, int]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = zoo.tiny_config("mixtral", layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=8,
                             top_k=TOP_K, positions=64)
    config._experts_implementation = "grouped_mm"
    model = zoo.build("mixtral", config, seed=0)
    batch = zoo.example_batch("mixtral", config, batch=BATCH, seq=SEQ, seed=1)
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        pm = autotp.parallelize(model, tp, layout={"*.experts.*": "expert"}, batch=64, seq=4096,
                                sequence_parallel=True, profile="h100-dgx", expert_dispatch=True)
        with _Sizes() as sizes:
            pm(**batch).loss.backward()
    finally:
        dist.destroy_process_group()
    return sizes.calls


@pytest.mark.parametrize("tp", [2, 4])
def test_a_dispatching_rank_sorts_and_counts_its_own_rows_alone(tp):
    calls = _rank_step(tp)
    rows = BATCH * SEQ * TOP_K   # every (token, expert) row of the step
    sorts = [n for op, n in calls if op == "aten::sort"]
    counts = [n for op, n in calls if op in ("aten::histc", "aten::bincount")]
    # the routing's sort, and token_sums' order of the rank's rows (distributed/experts.py): the
    # rank's own rows each (SEQ a multiple of tp)
    assert sorts and max(sorts) == rows // tp, (sorts, rows)
    assert all(n < rows for n in counts), (counts, rows)   # no count over every row
    # the rank holds no tensor of every (token, expert) row of the routing: its largest
    # integer index (sorted ids, permutations, their inverse) is its own rows'
    assert not [(op, n) for op, n in calls if op in ("aten::index_put_", "aten::floor_divide") and n >= rows]
