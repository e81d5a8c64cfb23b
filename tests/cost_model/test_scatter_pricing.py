"""A scatter is priced as the kernel it runs, in place or not, whichever overload.

In place (``scatter_`` of a tensor or of one value, ``scatter_add_``): one kernel reading the
index and the values and writing the entries they land on (an add reads those entries too). Out
of place (``scatter`` of a tensor or a value, ``scatter_add``): ATen's kernel copies the input
into the output, then runs the in-place kernel on it: counted as that copy (``clone``) and the
in-place call. Each ATen call a launch of the price, the bytes each touches summed to the price's
bytes (``kernel_counts.KernelCounter``). Before, ``scatter_.src``, ``scatter_.value``,
``scatter.value`` and ``scatter_add_`` were priced as an elementwise op over every operand, and
``scatter.src`` and ``scatter_add`` as one pass over every operand in two launches."""
import pytest
import sympy
import torch

from autotp.cost_model.kernels import op_work
from autotp.passes.rules import OpInfo, TensorMeta
from autotp.passes.rules.contract import Strategy
from autotp.placements import REPLICATE
from tests.cost_model.kernel_counts import KernelCounter

aten = torch.ops.aten
#: the entries of the written tensor, the entries written (a layer's inverse permutation's size, small)
N, M = 4096, 1024


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(sympy.Integer(s) for s in t.shape), t.dtype)


def _operands(dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(N, dtype=dtype)
    index = torch.randperm(N, generator=gen)[:M]
    values = torch.arange(M).to(dtype)
    return x, index, values


#: each op: its call on (x, index, values) and the ATen op it captures as
CALLS = {
    "scatter_.src": (lambda x, i, v: x.scatter_(0, i, v), aten.scatter_.src),
    "scatter_.value": (lambda x, i, v: x.scatter_(0, i, 3), aten.scatter_.value),
    "scatter_add_": (lambda x, i, v: x.scatter_add_(0, i, v), aten.scatter_add_.default),
    "scatter.src": (lambda x, i, v: x.scatter(0, i, v), aten.scatter.src),
    "scatter.value": (lambda x, i, v: x.scatter(0, i, 3), aten.scatter.value),
    "scatter_add": (lambda x, i, v: x.scatter_add(0, i, v), aten.scatter_add.default),
}
#: out of place: the copy ATen makes, then the in-place kernel (what the counter counts)
IN_PLACE_OF = {"scatter.src": "scatter_.src", "scatter.value": "scatter_.value", "scatter_add": "scatter_add_"}


def _priced(name: str, dtype: torch.dtype) -> tuple[int, int]:
    x, index, values = _operands(dtype)
    target = CALLS[name][1]
    mx, mi, mv = _meta(x), _meta(index), _meta(values)
    if target in (aten.scatter_.value, aten.scatter.value):
        args, inputs = (mx, 0, mi, 3), (mx, mi)
    else:
        args, inputs = (mx, 0, mi, mv), (mx, mi, mv)
    info = OpInfo(target, args, {}, inputs, mx, 1)
    info.grad_inputs = (False,) * len(inputs)
    work = op_work(info, Strategy((REPLICATE,) * len(inputs), REPLICATE), 1, dtype.itemsize, dtype)
    return work.launches, int(sum(b for _, b in work.moved))


def _counted(name: str, dtype: torch.dtype) -> tuple[int, int]:
    x, index, values = _operands(dtype)
    with KernelCounter(fills=()) as counted:
        if name in IN_PLACE_OF:
            CALLS[IN_PLACE_OF[name]][0](x.clone(), index, values)
        else:
            CALLS[name][0](x, index, values)
    return counted.launches, counted.bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_scatter_is_priced_as_the_kernels_it_runs(name, dtype):
    assert _priced(name, dtype) == _counted(name, dtype)


def test_an_in_place_scatter_is_priced_below_its_copy():
    # the in-place scatter of M entries into N touches no entry it does not write: its price
    # grows with M, not N
    launches, moved = _priced("scatter_.src", torch.int64)
    assert (launches, moved) == (1, 3 * M * 8)
