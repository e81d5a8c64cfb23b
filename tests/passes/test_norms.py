"""An RMSNorm's statistic written out is recognized from the graph (``autotp/passes/norms.py``)
and replaced by one ``aten.rms_norm``; every look-alike stays as written.

Each spelling is captured as models run it (``torch.export``, ATen training IR) and fused; the
fused graph computes what the written one does, forward and every gradient (float64, and float32
bit for bit on CPU, where ``aten.rms_norm`` runs the same ops in the same order).
"""
import pytest
import torch

from autotp.passes.norms import fuse_norm_graph

aten = torch.ops.aten
EPS = 1e-6


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))

    def forward(self, x):
        return self.fn(x, self.weight)


def llama(x, w):
    """HF's LlamaRMSNorm, as it is written."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    return w * h.to(dtype)


FUSED = {
    "llama (upcast, cast back, weight)": llama,
    "float64 throughout": lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)),
    "x * x, eps first, rsqrt first": lambda x, w: torch.rsqrt(EPS + (x * x).mean(dim=[-1], keepdim=True)) * x,
    "square, divided by the root": lambda x, w: x / torch.sqrt(torch.square(x).mean(-1, keepdim=True) + EPS),
    "gemma's (1 + w)": lambda x, w: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)) * (1.0 + w),
    "over the last two dims": lambda x, w: x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + EPS),
}
NOT_FUSED = {
    "eps added to the root": lambda x, w: x * (torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + EPS),
    "eps inside the mean": lambda x, w: x * torch.rsqrt((x.pow(2) + EPS).mean(-1, keepdim=True)),
    "eps after the root's division": lambda x, w: x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + EPS),
    "mean over another dim": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + EPS),
    "no rsqrt": lambda x, w: x * (x.pow(2).mean(-1, keepdim=True) + EPS),
    "a cube's mean": lambda x, w: x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + EPS),
    "another tensor normalized": lambda x, w: (2 * x) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS),
    "a negative eps": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) - EPS),
    "the statistic read elsewhere": lambda x, w: (
        lambda r: (x * r, r))(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)),
    "the mean read elsewhere": lambda x, w: (
        lambda v: (x * torch.rsqrt(v + EPS), v))(x.pow(2).mean(-1, keepdim=True)),
}


def _graphs(fn, dtype=torch.float64):
    """(the written module, the fused module, what was fused) of ``fn``."""
    x = torch.randn(2, 3, 4, 6, dtype=dtype)
    model = _Fn(fn).to(dtype)
    written = torch.export.export(model, (x,), strict=False).module()
    fused = torch.export.export(model, (x,), strict=False).module()
    what = fuse_norm_graph(fused.graph)
    fused.recompile()
    return written, fused, what


def _run(gm, x):
    """Every output and the gradients of x and the weight (a sum of every output's entries)."""
    x = x.clone().requires_grad_(True)
    out = gm(x)
    outs = out if isinstance(out, tuple) else (out,)
    params = [p for p in gm.parameters()]
    grads = torch.autograd.grad(sum(o.sum() for o in outs), [x, *params], allow_unused=True)
    return [o.detach() for o in outs] + [g for g in grads if g is not None]


@pytest.mark.parametrize("name", list(FUSED))
def test_every_spelling_of_the_statistic_is_one_rms_norm(name):
    written, fused, what = _graphs(FUSED[name])
    assert [(f.op, f.nodes) for f in what] == [("RMSNorm", 5)]
    ops = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert aten.rms_norm.default in ops and aten.rsqrt.default not in ops and aten.sqrt.default not in ops
    assert aten.mean.dim not in ops and aten.pow.Tensor_Scalar not in ops
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    for got, want in zip(_run(fused, x), _run(written, x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_the_casts_and_the_weight_stay_as_written_and_float32_is_bit_for_bit_on_cpu():
    written, fused, what = _graphs(llama, torch.float32)
    norm = next(n for n in fused.graph.nodes if n.target is aten.rms_norm.default)
    assert norm.args[1:] == ([6], None, EPS)
    assert norm.args[0].target in (aten.to.dtype, aten._to_copy.default)       # the upcast, kept
    cast_back = [u.target for u in norm.users if u.target is not aten._assert_tensor_metadata.default]
    assert cast_back in ([aten.to.dtype], [aten._to_copy.default])
    x = torch.randn(2, 3, 4, 6, dtype=torch.float32)
    for got, want in zip(_run(fused, x), _run(written, x), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(NOT_FUSED))
def test_look_alikes_stay_as_written(name):
    _, fused, what = _graphs(NOT_FUSED[name])
    assert what == [] and aten.rms_norm.default not in [n.target for n in fused.graph.nodes]


def test_fuse_norms_takes_a_bool_only():
    import autotp
    from autotp.errors import ConfigError
    from tests.helpers import tiny_gpt2

    with pytest.raises(ConfigError, match="fuse_norms='no': fuse_norms is True or False"):
        autotp.plan(tiny_gpt2(device="meta"), 2, fuse_norms="no")


class _Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6, dtype=torch.float64)

    def forward(self, ids, y):
        return llama(self.embed(ids), 1.0), llama(y * 2.0, 1.0)


def test_a_norm_of_the_token_embedding_stays_as_written():
    """The embedding's output is what a plan may split by hidden columns: written out, the
    statistic keeps that split (only x squared gathered); a norm of another tensor is fused."""
    ids, y = torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 6, dtype=torch.float64)
    gm = torch.export.export(_Embedded(), (ids, y), strict=False).module()
    what = fuse_norm_graph(gm.graph)
    assert len(what) == 1
    norm = next(n for n in gm.graph.nodes if n.target is aten.rms_norm.default)
    assert aten.embedding.default not in {a.target for a in norm.args[0].all_input_nodes}
    assert sum(n.target is aten.rsqrt.default for n in gm.graph.nodes) == 1
