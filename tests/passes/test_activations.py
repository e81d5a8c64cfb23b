"""Activations written as pointwise arithmetic are recognized by the function they compute
(``autotp/passes/activations.py``), in every spelling, and nothing else is.

Each spelling is captured as the models run it (``torch.export``, ATen training IR) and fused;
the fused graph computes what the written one does (float64), and a constant off by more than
a rounding, a second tensor, or an intermediate read elsewhere leaves the region as written.
"""
import math

import pytest
import torch

from autotp.passes.activations import fuse_graph

aten = torch.ops.aten
C = math.sqrt(2.0 / math.pi)

GELU_TANH = {
    "hf NewGELU": lambda x: 0.5 * x * (1.0 + torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0)))),
    "FastGELU": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "x * 0.5 first, x*x*x": lambda x: x * 0.5 * (1.0 + torch.tanh(C * (x + 0.044715 * (x * x * x)))),
    "as a sigmoid": lambda x: x * torch.sigmoid(2 * C * (x + 0.044715 * x ** 3)),
    "subtracted": lambda x: 0.5 * x - (-0.5) * x * torch.tanh(C * x + C * 0.044715 * x ** 3),
}
GELU_ERF = {
    "divided": lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "literal": lambda x: x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476)),
}
SILU = {
    "x * sigmoid(x)": lambda x: x * torch.sigmoid(x),
    "sigmoid(x) * x": lambda x: torch.sigmoid(x) * x,
    "x / (1 + exp(-x))": lambda x: x / (1 + torch.exp(-x)),
    "x * (1 / (1 + exp(-x)))": lambda x: x * (1 / (1 + torch.exp(-x))),
    "x * reciprocal(1 + exp(-x))": lambda x: x * torch.reciprocal(1 + torch.exp(-x)),
    "x / (2 + 2 exp(-x)) * 2": lambda x: x / (2.0 + 2.0 * torch.exp(-x)) * 2.0,
}


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


def _fused(fn):
    """(the fused graph's ops, its outputs, the written graph's outputs) of ``fn(x, y)``."""
    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    gm = torch.export.export(_Fn(fn), (x, y), strict=False).module()
    want = gm(x, y)
    fused = fuse_graph(gm.graph)
    gm.recompile()
    ops = [(n.target, dict(n.kwargs)) for n in gm.graph.nodes if n.op == "call_function"]
    return fused, ops, gm(x, y), want


def _ops(ops):
    return [t for t, _ in ops if t is not aten.alias.default]


@pytest.mark.parametrize("name", list(GELU_TANH))
def test_every_spelling_of_tanh_gelu_is_one_gelu(name):
    fused, ops, got, want = _fused(lambda x, y: GELU_TANH[name](x))
    assert [f.op for f in fused] == ["tanh-GELU"]
    assert ops == [(aten.gelu.default, {"approximate": "tanh"})]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, target, kwargs, fns", [
    (n, aten.gelu.default, {}, GELU_ERF) for n in GELU_ERF] + [(n, aten.silu.default, {}, SILU) for n in SILU])
def test_erf_gelu_and_silu_are_one_op(name, target, kwargs, fns):
    fused, ops, got, want = _fused(lambda x, y: fns[name](x))
    assert ops == [(target, kwargs)], ops
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_region_inside_a_larger_chain_is_fused_alone():
    fused, ops, got, want = _fused(lambda x, y: 2.0 * GELU_TANH["hf NewGELU"](x) + 1.0)
    assert [f.op for f in fused] == ["tanh-GELU"] and fused[0].nodes == 8
    assert _ops(ops) == [aten.gelu.default, aten.mul.Tensor, aten.add.Tensor]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


NOT_FUSED = {
    "another constant": lambda x, y: 0.5 * x * (1.0 + torch.tanh(C * (x + 0.0447 * torch.pow(x, 3.0)))),
    "sqrt(2/pi) to 4 digits": lambda x, y: 0.5 * x * (1.0 + torch.tanh(0.7979 * (x + 0.044715 * x ** 3))),
    "QuickGELU": lambda x, y: x * torch.sigmoid(1.702 * x),   # no one ATen op computes it
    "QuickGELU with exp": lambda x, y: x / (1 + torch.exp(-1.702 * x)),
    "x / (1 + 2 exp(-x))": lambda x, y: x / (1 + 2.0 * torch.exp(-x)),
    "x / (1 - exp(-x))": lambda x, y: x / (1 - torch.exp(-x)),
    "x / (1 + exp(x))": lambda x, y: x / (1 + torch.exp(x)),
    "x * exp(-x)": lambda x, y: x * torch.exp(-x),
    "a second tensor": lambda x, y: 0.5 * x * (1.0 + torch.tanh(C * (y + 0.044715 * torch.pow(x, 3.0)))),
    "an intermediate read elsewhere": lambda x, y: (
        lambda t: (0.5 * x * (1.0 + t), t))(torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0)))),
    "tanh alone": lambda x, y: torch.tanh(x),
}


@pytest.mark.parametrize("name", list(NOT_FUSED))
def test_other_functions_and_shared_intermediates_stay_as_written(name):
    fused, ops, got, want = _fused(NOT_FUSED[name])
    assert fused == [] and aten.gelu.default not in _ops(ops) and aten.silu.default not in _ops(ops)


def test_fuse_activations_takes_a_bool_only():
    import autotp
    from autotp.errors import ConfigError
    from tests.helpers import tiny_gpt2

    with pytest.raises(ConfigError, match="fuse_activations='no': fuse_activations is True or False"):
        autotp.plan(tiny_gpt2(device="meta"), 2, fuse_activations="no")
