"""autotp.testing's equivalence measure: relative to the scale of a parameter's group."""
import torch

from autotp.testing import TOLERANCE, relative_error
from autotp.testing.equivalence import _module_grad_norms


def test_a_gradient_zero_in_exact_arithmetic_passes_against_its_modules_scale():
    # A key projection's bias: serial and parallel both give rounding noise around zero.
    weight_grad = torch.randn(8, 8, dtype=torch.float64)
    serial_bias, parallel_bias = torch.full((8,), 3e-17, dtype=torch.float64), torch.full((8,), -2e-17, dtype=torch.float64)
    assert relative_error(parallel_bias, serial_bias) > 1e-1                       # against itself: "wrong"
    assert relative_error(parallel_bias, serial_bias, weight_grad.norm().item()) <= TOLERANCE[torch.float64]


def test_a_wrong_small_gradient_still_fails_against_its_modules_scale():
    weight_grad = torch.randn(8, 8, dtype=torch.float64)
    serial_bias = torch.zeros(8, dtype=torch.float64)
    wrong = torch.full((8,), 0.05, dtype=torch.float64)
    assert relative_error(wrong, serial_bias, weight_grad.norm().item()) > TOLERANCE[torch.float32]


def test_group_norms_are_per_module():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    norms = _module_grad_norms(model)
    first = torch.cat([model[0].weight.grad.flatten(), model[0].bias.grad]).norm().item()
    assert set(norms) == {"0", "1"} and abs(norms["0"] - first) < 1e-12


def test_a_nan_or_inf_on_one_side_only_is_an_infinite_error():
    # a nan error would pass max() and every <= check silently: it must fail them instead
    nan, inf = float("nan"), float("inf")
    one = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert relative_error(torch.tensor([1.0, nan], dtype=torch.float64), one) == inf
    assert relative_error(one, torch.tensor([1.0, nan], dtype=torch.float64)) == inf
    assert relative_error(torch.tensor([inf, 2.0], dtype=torch.float64), one) == inf
    assert relative_error(torch.tensor([-inf]), torch.tensor([inf])) == inf
    assert max([1e-16, relative_error(torch.tensor(nan), torch.tensor(3.0))]) > TOLERANCE[torch.float32]
    # the same nan or inf in the same place on both sides is equal there; the rest is compared
    both = torch.tensor([nan, inf, 2.0], dtype=torch.float64)
    assert relative_error(both, both.clone()) == 0.0
    assert relative_error(both, torch.tensor([nan, inf, 2.5], dtype=torch.float64)) == 0.5 / 2.5
