"""A program's eager code (autotp/runtime/module/eager_code.py) computes what fx's forward computes,
each ATen op bound to its C++ callable; where a call site is not found as fx writes it, it declines
(None) and the program runs fx's own forward, never a forward with a site left unbound."""
import torch
from torch import fx

from autotp.runtime.module import eager_code


def _graph_module() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, x))
    z = g.call_function(torch.ops.aten.add.Tensor, (y, x))
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (z, 2.0)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_eager_code_computes_fx_forward_with_each_op_bound():
    gm = _graph_module()
    forward = eager_code.eager_forward(gm)
    assert forward is not None
    assert "ops" in type(gm).forward.__code__.co_names   # fx looks each op up: torch.ops.aten.mul.Tensor
    assert "ops" not in forward.__code__.co_names   # every op bound, none looked up
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(forward(gm, x), gm(x), rtol=0, atol=0)


def test_eager_code_declines_where_a_call_site_is_not_as_fx_writes_it(monkeypatch):
    gm = _graph_module()
    # another torch's codegen, standing in: the name fx would write is not in the source
    monkeypatch.setattr(fx.node, "_get_qualified_name", lambda target: "torch.ops.aten.other.default")
    assert eager_code.eager_forward(gm) is None
