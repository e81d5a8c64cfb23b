"""Expert-TP's gathered rows are laid out rank by rank by a counting pass, not a sort.

``distributed/gathered_rows.GatherRowsTP`` all-gathers each rank's tokens' (token, expert) rows
and lays them out in their sorted order; the order of the gathered rows (rank by rank, each
rank's in ascending sorted position) is a stable sort of the rows' holders. A counting pass
gives it (``holders_order``): each row's place is its rank's first row plus its rank's rows
before it, from a cumulative count of each rank's rows. The same order and its inverse as the
stable sort (hypothesis: tp 2-8, uneven counts, holders in any order), and a rank's gather runs
no sort (counted on the fake backend; before, a radix sort of the ``T*k`` holders on every
rank)."""
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.distributed.gathered_rows import GatherRowsTP, holders_order


@st.composite
def holders(draw):
    tp = draw(st.integers(2, 8))
    counts = draw(st.lists(st.integers(0, 12), min_size=tp, max_size=tp))
    holder = torch.tensor([r for r, n in enumerate(counts) for _ in range(n)], dtype=torch.long)
    seed = draw(st.integers(0, 2**16))
    return tp, counts, holder[torch.randperm(holder.numel(), generator=torch.Generator().manual_seed(seed))]


@settings(max_examples=60, deadline=None)
@given(case=holders())
def test_the_counting_pass_orders_the_rows_as_a_stable_sort_of_their_holders(case):
    tp, counts, holder = case
    order, place = holders_order(holder, tp)
    assert torch.equal(order, torch.sort(holder, stable=True).indices)
    assert torch.equal(place[order], torch.arange(holder.numel()))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_ranks_gathered_rows_are_ordered_with_no_sort():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tp, batch, seq, k, hidden = 4, 2, 8, 2, 3
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        tokens = batch * seq
        owners = (torch.arange(tokens) % seq) // (seq // tp)     # each token's rank: runs of s/tp positions
        rows = torch.nonzero(owners == 0).flatten()             # rank 0's tokens, ascending
        index = torch.randperm(tokens * k, generator=torch.Generator().manual_seed(0)) // k   # perm // k
        x = torch.randn(rows.numel(), hidden, requires_grad=True)
        with _Ops() as ops:
            out = GatherRowsTP(dist.group.WORLD, k)(x, index, rows, owners, [batch], seq)
        assert out.shape == (tokens * k, hidden)
        assert "sort" not in ops.names and "argsort" not in ops.names, ops.names
    finally:
        dist.destroy_process_group()
