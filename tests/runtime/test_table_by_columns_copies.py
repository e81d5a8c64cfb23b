"""The copies of a row-split table read by columns (``EmbeddingByColumns``), counted on one rank
of tp 8 on torch's ``fake`` backend, against what the cost model prices for them
(``propagate.table_by_columns_copies``): forward, the rank's ``[V/tp, h]`` rows packed once into
``tp`` column blocks, the blocks received in rank order taken as the ``[V, h/tp]`` table; backward,
the ``[V, h/tp]`` gradient sent as it is and the blocks received folded back into the rank's rows
by one copy. GPT-2's vocabulary of 50257 does not divide by 8: the uneven vocabularies here hold
the same count (before, each side copied the rank's rows three times: ``local_shard``'s ``cat``,
then ``_all_to_all``'s ``cat`` and ``copy_``)."""
import pytest
import torch

from autotp.distributed.functional import EmbeddingByColumns
from autotp.passes.propagate import table_by_columns_copies
from autotp.placements import Shard, local_ranges
from tests.cost_model.kernel_counts import KernelCounter
from tests.helpers import fake_process_group

TP, H, B, S = 8, 32, 2, 16
COPIES = ("copy_", "cat", "clone", "contiguous", "_to_copy")


@pytest.mark.parametrize("vocab,rank", [(64, 0), (67, 0), (67, 7), (61, 3)])
def test_the_table_read_by_columns_copies_what_is_priced(vocab, rank):
    with fake_process_group(TP, rank) as group:
        (start, stop), = local_ranges(vocab, Shard(0), TP, rank)
        weight = torch.randn(stop - start, H, dtype=torch.float64, requires_grad=True)
        ids = torch.randint(0, vocab, (B, S))
        module = EmbeddingByColumns(group, Shard(0), Shard(1), vocab)
        counter = KernelCounter(fills=("zero_", "fill_", "zeros", "new_zeros"), allocations=("empty", "new_empty"))
        with counter:
            out = module(weight, ids)
            out.backward(torch.ones_like(out))
        assert out.shape == (B, S, H // TP) and weight.grad.shape == weight.shape
        copies = [(name, moved) for name, moved in counter.calls if name in COPIES]
        priced_bytes, priced_launches = table_by_columns_copies(vocab * H * 8, vocab, TP)
        rows = (stop - start) * H * 8
        # one copy each way, reading and writing this rank's rows
        assert copies == [("clone", 2 * rows)] * 2
        if rank == 0:   # the rank holding the most rows, which the cost model prices
            assert (sum(m for _, m in copies), len(copies)) == (priced_bytes, priced_launches)
        else:
            assert sum(m for _, m in copies) <= priced_bytes
