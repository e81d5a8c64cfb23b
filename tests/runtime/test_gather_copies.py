"""The copies an all-gather and a reduce-scatter make to lay a split of an inner dim out, counted on
one rank on torch's ``fake`` backend, against what the cost model prices for them
(``propagate.layout_copy_seconds``): an even split after a few leading rows (the sequence of
``[b, s, h]`` at a batch of 2 to ``gather_scatter.ROWS_COALESCED``) copies nothing and is priced
nothing beyond its collective, issued as one coalesced call of one collective a row (one kernel
under NCCL); more rows (the hidden after ``b*s``), or an uneven split, one copy of the whole tensor (read
and written) each way a gather or reduce-scatter moves it, priced so. (Before, every split of an
inner dim after more than one element was staged through a ``[tp, ...]`` buffer: one copy.)"""
from types import SimpleNamespace

import pytest
import sympy
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.distributed import collectives as C
from autotp.passes.propagate import layout_copy_seconds
from autotp.passes.rules.contract import TensorMeta
from autotp.placements import Shard, local_size
from tests.cost_model.kernel_counts import KernelCounter
from tests.helpers import fake_process_group

COPIES = ("copy_", "cat", "clone", "contiguous", "_to_copy")
MAPPINGS = {"all_gather": C.gather_from_tp, "all_gather_f": C.gather_into_tp, "reduce_scatter": C.reduce_scatter_to_tp}


class _Profile:
    """One byte a second (each copy priced at its bytes read and written), ``launch_s`` a kernel."""

    def __init__(self, launch_s: float) -> None:
        self.launch_s = launch_s

    def bandwidth(self, kind: str) -> float:
        return 1.0


class _Collectives(TorchDispatchMode):
    """The c10d collectives called, with the tensors each moves (a coalesced call: one a row)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            moved = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.calls.append((func.overloadpacket.__name__, len(moved)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["all_gather", "all_gather_f", "reduce_scatter"])
@pytest.mark.parametrize("shape,dim,tp,rows", [
    ((2, 8, 6), 1, 2, 2), ((8, 4, 6), 1, 4, 8),   # the sequence at a batch of 2 and of 8: row by row
    ((2, 3, 8), 2, 2, 6),                           # the hidden after b*s = 6 rows: row by row
    ((9, 4, 6), 1, 2, None), ((2, 8, 6), 2, 2, None),   # 9 rows, 16 rows: staged by one copy
    ((2, 7, 6), 1, 2, None)])                       # uneven: staged
def test_a_split_after_leading_rows_copies_and_launches_what_is_priced(kind, shape, dim, tp, rows):
    with fake_process_group(tp, 0) as group:
        whole = kind == "reduce_scatter"   # a summand of the whole tensor; the others a rank's part
        local = list(shape)
        local[dim] = shape[dim] if whole else local_size(shape[dim], Shard(dim), tp, 0)
        x = torch.randn(local, dtype=torch.float64, requires_grad=True)
        counter = KernelCounter(fills=("zero_", "fill_", "zeros", "new_zeros"), allocations=("empty", "new_empty"))
        calls = _Collectives()
        with counter, calls:
            y = MAPPINGS[kind](x, group, Shard(dim), shape[dim])
            # (the gradient as the mapping's backward returns it: accumulated into x.grad, a
            # gather's strided slice would be copied by autograd, no collective's copy)
            grad, = torch.autograd.grad(y, x, torch.ones_like(y))
    assert grad.shape == x.shape
    counted = sum(moved for name, moved in counter.calls if name in COPIES)
    meta = TensorMeta(tuple(sympy.Integer(n) for n in shape), torch.float64)
    full = 8 * torch.Size(shape).numel()
    index = SimpleNamespace(env={}, sequence=frozenset())
    moving = 1 if kind == "all_gather" else 2   # a gather's backward is a slice: no collective
    args = (kind, meta, Shard(dim), Shard(dim) if kind != "all_gather" else None, full)
    assert counted == layout_copy_seconds(*args, _Profile(0.0), tp, True, index)
    if rows is not None:
        assert counted == 0
        # one coalesced call each way (one kernel under NCCL, as the collective is priced), a
        # collective a row; no copy, and no launch priced beyond the collective's own
        assert [n for _, n in calls.calls] == [rows] * moving, calls.calls
        assert layout_copy_seconds(*args, _Profile(1.0), tp, True, index) == 0
    else:
        assert counted == moving * 2 * full   # one copy of the whole, read and written, each way
        assert [n for _, n in calls.calls] == [1] * moving, calls.calls
