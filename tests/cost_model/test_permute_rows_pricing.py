"""A reorder of rows by a permutation (``distributed.functional.permute_rows``, the experts' output
put back in token order) is priced as the kernels it runs: forward one gather; backward one
kernel, a gather of the gradient by the inverse permutation where the graph holds it, else a copy
of each gradient row to its row (``index_copy_``), not the inverse made first (an ``arange`` and a
``scatter_``). Each ATen call a launch of the price, the bytes each touches summed to the price's
bytes (``kernel_counts.py``)."""
import pytest
import sympy
import torch

from autotp.cost_model.kernels import op_work
from autotp.distributed.functional import permute_rows
from autotp.passes.rules import OpInfo, TensorMeta
from autotp.passes.rules.contract import Strategy
from autotp.placements import REPLICATE
from tests.cost_model.kernel_counts import KernelCounter

aten = torch.ops.aten
#: a layer's (token, expert) rows and their width, small: the counts scale with them
ROWS, HIDDEN = 512, 64
FILLS = ("arange",)
ALLOCATIONS = ("empty_like", "new_empty")


def _meta(*shape, dtype) -> TensorMeta:
    return TensorMeta(tuple(sympy.Integer(s) for s in shape), dtype)


def _priced() -> tuple[int, int]:
    rows, index = _meta(ROWS, HIDDEN, dtype=torch.bfloat16), _meta(ROWS, dtype=torch.long)
    info = OpInfo(aten.index.Tensor, (rows, [index]), {}, (rows, index), rows, 1)
    info.grad_inputs, info.permutes_rows = (True, False), True
    work = op_work(info, Strategy((REPLICATE, REPLICATE), REPLICATE), 1, 2, torch.bfloat16)
    return work.launches, int(sum(b for _, b in work.moved))


@pytest.mark.parametrize("held", [False, True], ids=["inverse-made", "inverse-held"])
def test_a_reorder_by_a_permutation_is_priced_as_the_kernels_it_runs(held):
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(ROWS, generator=gen)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(ROWS)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.bfloat16)
    with KernelCounter(FILLS, ALLOCATIONS) as counted:
        torch.autograd.grad(permute_rows(x, inv_perm, perm if held else None), x, grad)
    assert _priced() == (counted.launches, counted.bytes), counted.calls
