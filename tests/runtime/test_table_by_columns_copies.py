"""The copies of a row-split table read by columns (``EmbeddingByColumns``), counted on one rank
on torch's ``fake`` backend, against what the cost model prices for them
(``propagate.table_by_columns_copies``): forward, the rank's ``[V/tp, h]`` rows packed into ``tp``
column blocks, one strided copy per width of the hidden's split (one where tp divides the hidden,
two where it does not: 20 columns on 3 ranks are 7, 7 and 6), the blocks received in rank order
taken as the ``[V, h/tp]`` table; backward, the ``[V, h/tp]`` gradient sent as it is and the blocks
received joined back into the rank's rows by one copy. Each side reads and writes the rank's rows
once. GPT-2's vocabulary of 50257 does not divide by 8: the uneven vocabularies here hold the same
count. (Before, a hidden tp does not divide took the run-by-run path: each side copied the rank's
rows three times, in 2 + 2 tp kernels.)"""
import pytest
import torch

from autotp.distributed.functional import EmbeddingByColumns
from autotp.passes.propagate import table_by_columns_copies
from autotp.placements import Shard, local_ranges
from tests.cost_model.kernel_counts import KernelCounter
from tests.helpers import fake_process_group

B, S = 2, 16
COPIES = ("copy_", "cat", "clone", "contiguous", "_to_copy")


def _copies(counter: KernelCounter) -> list:
    return [(name, moved) for name, moved in counter.calls if name in COPIES]


def _counter() -> KernelCounter:
    return KernelCounter(fills=("zero_", "fill_", "zeros", "new_zeros"), allocations=("empty", "new_empty"))


@pytest.mark.parametrize("vocab,hidden,unit,tp,rank", [
    (64, 32, 1, 8, 0), (67, 32, 1, 8, 0), (67, 32, 1, 8, 7), (61, 32, 1, 8, 3),   # tp divides the hidden
    (67, 20, 1, 3, 0), (67, 20, 1, 3, 2), (67, 20, 1, 8, 0), (67, 20, 1, 8, 5), (64, 20, 1, 8, 0),   # it does not
    (61, 4, 1, 8, 0),   # fewer columns than ranks: four ranks hold none
    (67, 24, 8, 2, 0), (67, 20, 5, 3, 1),   # whole heads of 8 (16 and 8 columns) and of 5 (10, 5, 5)
    (67, 24, -2, 3, 0), (67, 20, -2, 8, 0)])   # columns dealt in two chunks (interleaved): run by run
def test_the_table_read_by_columns_copies_what_is_priced(vocab, hidden, unit, tp, rank):
    columns = Shard(1, unit=unit) if unit > 0 else Shard(1, chunks=-unit)
    with fake_process_group(tp, rank) as group:
        (start, stop), = local_ranges(vocab, Shard(0), tp, rank)
        width = sum(b - a for a, b in local_ranges(hidden, columns, tp, rank))
        weight = torch.randn(stop - start, hidden, dtype=torch.float64, requires_grad=True)
        ids = torch.randint(0, vocab, (B, S))
        module = EmbeddingByColumns(group, Shard(0), columns, vocab)
        forward, backward = _counter(), _counter()
        with forward:
            out = module(weight, ids)
        with backward:
            out.backward(torch.ones_like(out))
    assert out.shape == (B, S, width) and weight.grad.shape == weight.shape
    rows = (stop - start) * hidden * 8
    # each side reads and writes this rank's rows once (and, run by run, its columns once)
    table = vocab * width * 8 if columns.chunks > 1 else 0
    assert sum(m for _, m in _copies(forward)) == 2 * (rows + table)
    assert sum(m for _, m in _copies(backward)) == 2 * (rows + table)
    counted = _copies(forward) + _copies(backward)
    priced_bytes, priced_launches = table_by_columns_copies(vocab * hidden * 8, vocab, tp, hidden, Shard(0), columns)
    if rank == 0:   # the rank holding the most rows, which the cost model prices
        assert (sum(m for _, m in counted), len(counted)) == (priced_bytes, priced_launches)
    else:
        assert sum(m for _, m in counted) <= priced_bytes and len(counted) == priced_launches


@pytest.mark.parametrize("hidden,unit,tp,launches", [(32, 1, 8, 2), (20, 1, 3, 3), (20, 1, 8, 3), (4, 1, 8, 2),
                                                     (21, 1, 3, 2), (24, 1, 2, 2), (24, 8, 2, 3)])
def test_a_hidden_split_unevenly_is_priced_one_more_copy_kernel(hidden, unit, tp, launches):
    assert table_by_columns_copies(67 * hidden * 8, 67, tp, hidden, Shard(0), Shard(1, unit=unit))[1] == launches
