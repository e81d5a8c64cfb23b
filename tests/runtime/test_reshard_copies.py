"""The copies a reshard by all-to-all makes between splits of two dims (``reshard_tp``), counted on
one rank on torch's ``fake`` backend, against what the cost model prices for them
(``propagate.all_to_all_copy_seconds``, at one byte a second): where each split gives every rank
one run in rank order, even or not (the sequence of 7 or a hidden of 20 on 3 ranks), each side
reads and writes the rank's part once where dims of more than one element come before the dim
it is cut (or laid out) along, and not at all where none do. (Before, an uneven split was cut
and put in place run by run: three copies a side, priced as two.)"""
import pytest
import sympy
import torch

from autotp.distributed.collectives import reshard_tp
from autotp.passes.propagate import all_to_all_copy_seconds
from autotp.passes.rules.contract import TensorMeta
from autotp.placements import Shard, local_size
from tests.cost_model.kernel_counts import KernelCounter
from tests.helpers import fake_process_group

COPIES = ("copy_", "cat", "clone", "contiguous", "_to_copy")


class _OneBytePerSecond:
    def bandwidth(self, kind: str) -> float:
        return 1.0


@pytest.mark.parametrize("shape,have,want,tp", [
    ((2, 7, 20), 2, 1, 3), ((2, 7, 20), 1, 2, 3),   # the sequence and the hidden both uneven
    ((2, 6, 24), 2, 1, 3),                           # both even
    ((1, 7, 20), 2, 1, 3), ((1, 9, 20), 1, 2, 4),    # a batch of one: the sequence's blocks in order
    ((7, 20), 0, 1, 3), ((20, 7), 1, 0, 3)])         # a table's rows and columns
def test_a_reshard_between_ordered_splits_copies_what_is_priced(shape, have, want, tp):
    with fake_process_group(tp, 0) as group:
        local = list(shape)
        local[have] = local_size(shape[have], Shard(have), tp, 0)
        x = torch.randn(local, dtype=torch.float64, requires_grad=True)
        counter = KernelCounter(fills=("zero_", "fill_", "zeros", "new_zeros"), allocations=("empty", "new_empty"))
        with counter:
            y = reshard_tp(x, group, Shard(have), Shard(want), shape[have])
            y.backward(torch.ones_like(y))
    assert y.shape[want] == local_size(shape[want], Shard(want), tp, 0) and x.grad.shape == x.shape
    counted = sum(moved for name, moved in counter.calls if name in COPIES)
    meta = TensorMeta(tuple(sympy.Integer(n) for n in shape), torch.float64)
    full = 8 * torch.Size(shape).numel()
    assert counted == all_to_all_copy_seconds(meta, Shard(have), Shard(want), full, _OneBytePerSecond(), tp)


@pytest.mark.parametrize("shape,have,want,tp", [
    ((2, 16, 4), Shard(1), Shard(1, unit=2), 3),           # Gemma's 16 heads at tp 3: (6, 5, 5), then pairs (6, 6, 4)
    ((2, 9, 24), Shard(2, chunks=3), Shard(1), 3),         # fused q|k|v columns into the sequence
    ((2, 12, 16), Shard(1), Shard(2, chunks=2, unit=2), 4)])
def test_a_reshard_run_by_run_reads_and_writes_each_part_once_a_side(shape, have, want, tp):
    # each side one pass over the rank's part: its runs copied into the send buffer, the blocks
    # received copied into place (before: local_shard's cat, then the send's cat, three passes);
    # priced at a part of 1/tp of the tensor each side: exact where the rank's parts are that
    # (not Gemma's heads: rank 0 holds 6 and then 6 of 16, its passes counted alone)
    with fake_process_group(tp, 0) as group:
        local = list(shape)
        local[have.dim] = local_size(shape[have.dim], have, tp, 0)
        x = torch.randn(local, dtype=torch.float64, requires_grad=True)
        counter = KernelCounter(fills=("zero_", "fill_", "zeros", "new_zeros"), allocations=("empty", "new_empty"))
        with counter:
            y = reshard_tp(x, group, have, want, shape[have.dim])
            y.backward(torch.ones_like(y))
    assert y.shape[want.dim] == local_size(shape[want.dim], want, tp, 0) and x.grad.shape == x.shape
    counted = sum(moved for name, moved in counter.calls if name in COPIES)
    assert counted == 2 * 2 * (x.numel() + y.numel()) * 8   # read and written, each side, each way
    meta = TensorMeta(tuple(sympy.Integer(n) for n in shape), torch.float64)
    full = 8 * torch.Size(shape).numel()
    if x.numel() == y.numel() == torch.Size(shape).numel() // tp:
        assert counted == all_to_all_copy_seconds(meta, have, want, full, _OneBytePerSecond(), tp)
