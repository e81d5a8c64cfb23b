"""Rows reordered by a permutation run backward as one kernel: no scatter to make the inverse.

transformers' MoE layers sort their (token, expert) rows by expert (``perm``) and put the experts'
output back by ``inv_perm``, made as ``inv_perm[perm] = arange`` (``index_put_``). The rank's
program runs that reorder as ``distributed.functional.permute_rows`` (a gather each way, no
scatter-add). The output's backward gathers by the inverse of ``inv_perm``, which is ``perm``, a
value the graph already holds (``passes/rules/row_reads.inverse_permutations``); the routing
weights' reorder ``w[perm]`` gathers by ``inv_perm``, which the rank's program makes before it
(``passes/rewrite._inverses_first``; the model makes it only after). Counted by a dispatch mode
over the backward of a Mixtral step on torch's ``fake`` backend (collectives return at once), at
tp 1 and on rank 0 of tp 2 (experts as planned, whole per rank, or split): no ``arange``
scattered into an inverse, no row copied to its row.
"""
import functools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autotp
from autotp import zoo
from tests.cost_model.kernel_counts import KernelCounter
from tests.helpers import fake_process_group, whole

LAYERS = 2


#: the experts' layouts pinned: as planned, whole experts per rank, every expert split
LAYOUTS = {"planned": None, "ep": {"*.experts.*": "expert"},
           "etp": {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"}}


def _backward_calls(tp: int, layout: str) -> tuple[Counter, list]:
    """The ATen calls (by short name) of the backward of a Mixtral step on rank 0 of tp ``tp``, its
    experts laid out ``layout``, and the reorders the rank's program runs as ``permute_rows``:
    whether each is given its inverse."""
    config = zoo.tiny_config("mixtral", layers=LAYERS, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=4,
                             top_k=2)
    model = zoo.build("mixtral", config, dtype=torch.float64, seed=1)
    batch = zoo.example_batch("mixtral", config, batch=2, seq=7, seed=2)
    with fake_process_group(tp):
        pm = autotp.parallelize(model, tp, batch=8, seq=7, layout=LAYOUTS[layout])
        pm(**batch).loss.backward()   # warm: the program built
        pm.zero_grad(set_to_none=True)
        loss = pm(**batch).loss
        with KernelCounter(fills=()) as counted:
            loss.backward()
    reorders = [len(n.args) > 2 and n.args[2] is not None for n in pm.graph_module.graph.nodes
                if n.op == "call_function" and getattr(n.target, "__name__", "") == "permute_rows"]
    return Counter(name for name, _ in counted.calls), reorders


@pytest.mark.parametrize("tp,layout", [(1, "planned"), (2, "planned"), (2, "ep"), (2, "etp")])
def test_a_reorder_back_to_token_order_makes_no_inverse_in_backward(tp, layout):
    calls, reorders = _backward_calls(tp, layout)
    assert calls["scatter_"] == 0 and calls["arange"] == 0, calls
    # a layer's two reorders, the weights' by perm and the output's by inv_perm, each given its
    # inverse (inv_perm made before the first): both gather their gradient back, no index_copy_
    assert calls["index_copy_"] == 0, calls
    assert calls["index_select"] == 2 * LAYERS, calls
    assert reorders == [True] * 2 * LAYERS, reorders


T, H, E, K = 6, 4, 3, 2


class _SortedExperts(torch.nn.Module):
    """A router's top-k rows sorted by expert, weighted by ``w[perm]`` and put back by the inverse
    of ``perm`` made ``kind`` ways (after the weights' reorder, as transformers does); ``"base
    first"``: ``inv_perm``'s tensor allocated before the weights' reorder (the write into it moves
    before the reorder all the same); ``"base read"``: the tensor also read between the reorder and
    the write (a sum, zero before the write): the rank's program keeps the write where it is, and
    the weights' reorder copies its rows back."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.router = torch.nn.Linear(H, E, bias=False)
        self.proj = torch.nn.Linear(H, H, bias=False)

    def forward(self, x):                                      # (T, H)
        w, ids = self.router(x).softmax(-1).topk(K)            # (T, K)
        _, perm = torch.sort(ids.reshape(-1))                  # (T*K,)
        base = torch.zeros_like(perm) if self.kind.startswith("base") else None
        weights = w.reshape(-1)[perm]                          # (T*K,) by expert
        if self.kind == "base read":
            weights = weights + base.sum()                     # + 0: read before the write below
        y = self.proj(x[perm // K]) * weights[:, None]         # (T*K, H)
        arange = torch.arange(perm.size(0), device=perm.device)
        if self.kind == "argsort":
            inverse = torch.argsort(perm)
        elif self.kind == "method argsort":
            inverse = perm.argsort()
        elif self.kind == "scatter_":
            inverse = torch.empty_like(perm).scatter_(0, perm, arange)
        elif self.kind == "scatter":
            inverse = torch.empty_like(perm).scatter(0, perm, arange)
        else:
            inverse = torch.empty_like(perm) if base is None else base
            inverse[perm] = arange
        return y[inverse].view(T, K, H).sum(1)                 # (T, H) in token order


KINDS = ("index_put_", "argsort", "method argsort", "scatter_", "scatter", "base first", "base read")


@functools.cache
def _parallel(kind: str, tp: int):
    """The module of ``kind`` (float64, seeded) and its rank-0 program at ``tp`` on the fake backend,
    whether each reorder the program runs as ``permute_rows`` is given its inverse."""
    torch.manual_seed(3)
    model = _SortedExperts(kind).double()
    x = torch.randn(T, H, dtype=torch.float64)
    with fake_process_group(tp):
        pm = autotp.parallelize(model, tp, example_inputs=(x,))
    held = [len(n.args) > 2 and n.args[2] is not None for n in pm.graph_module.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "permute_rows"]
    return model, pm, held


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_every_reorder_by_a_permutation_is_given_the_inverse_the_graph_makes(kind, tp):
    _, _, held = _parallel(kind, tp)
    # the weights' reorder by perm, then the rows' by the inverse; where inv_perm's tensor is read
    # between the first and the write, the write stays after it: that one copies its rows back
    assert held == ([False, True] if kind == "base read" else [True, True]), held


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_reorders_given_their_inverse_equal_serial_forward_and_every_gradient(kind, seed):
    model, pm, _ = _parallel(kind, 1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    grad = torch.randn(T, H, generator=gen, dtype=torch.float64)
    with fake_process_group(1):
        xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        pm.zero_grad(set_to_none=True)
        want = model(xs)
        want.backward(grad)
        got = pm(xp)
        with KernelCounter(fills=()) as counted:
            got.backward(grad)
    assert torch.equal(got, want)
    assert torch.equal(xp.grad, xs.grad)
    for (name, p), (_, q) in zip(pm.named_parameters(), model.named_parameters()):
        assert torch.equal(whole(p.grad), q.grad), name
    calls = Counter(name for name, _ in counted.calls)
    assert calls["index_copy_"] == (1 if kind == "base read" else 0), calls
