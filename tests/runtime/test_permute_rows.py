"""``distributed.functional.permute_rows(x, index, inverse)`` is ``x[index]`` for a permutation
``index`` of x's rows, forward and gradient, whether its backward makes the inverse permutation
(``inverse`` None: a scatter of an arange) or is given it (the graph's own, ``perm`` for
``inv_perm``). Hypothesis draws the rows, their width and the permutation; float64, exact: both
directions only move values."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autotp.distributed.functional import permute_rows


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 12), width=st.integers(1, 5), seed=st.integers(0, 2**16), held=st.booleans())
def test_permute_rows_is_the_index_forward_and_backward(rows, width, seed, held):
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(rows, generator=gen)
    index = torch.empty_like(perm)
    index[perm] = torch.arange(rows)   # inv_perm, as transformers makes it: its inverse is perm
    x = torch.randn(rows, width, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    want = x[index]
    (want_grad,) = torch.autograd.grad(want, x, grad)
    got = permute_rows(x, index, perm if held else None)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    assert torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)
