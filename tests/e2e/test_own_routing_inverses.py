"""A rank routing its own (token, expert) rows builds the inverse of its sort in every form the
graph's one recognizer knows (``passes/rules/routing.inverted``), against serial.

A tiny mixture of experts written here (an embedding, an RMS norm, a router's softmax and top-k,
two grouped products over the experts' rows sorted by expert) puts the experts' output back in
token order by the inverse of the sort ``perm``, made as ``argsort(perm)``, ``sort(perm)[1]``,
``inv.scatter_(0, perm, arange)`` or ``inv[perm] = arange``. Planned with its tokens split along
the sequence and its experts dispatched by the all-to-all (both forced), each rank routes its own
rows (rules/local_routing.py: the counts per expert all-gathered, ``P(tokens 0, reordered, own)``)
whichever form it is, and its program equals serial in float64 on gloo, forward and every
gradient, tp 2 (fast) and 3 (slow tier). Before, the ``scatter_`` and ``sort`` forms were never
offered a rank's own rows (the ids and weights all-gathered, every row sorted on every rank), and
the ``argsort`` form was planned so but its rank's program refused to build (a PlanError).

Look-alikes, ``argsort(perm, descending=True)`` and ``inv[perm] = arange(n).flip(0)`` (not the
inverse), are not routed on the rank's own rows, and the layer still equals serial (the second
was planned so before, and its rank's program refused)."""
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import autotp
from autotp.testing import TOLERANCE

H, F, E, K, VOCAB = 8, 12, 4, 2, 32
#: the inverse's forms: each the inverse of perm, but the last (a look-alike)
INVERSES = ("argsort", "sort", "scatter_", "index_put_")
#: look-alikes: a permutation made from perm that is not its inverse
LOOK_ALIKES = ("descending argsort", "flipped index_put_")
#: the all-gather of every rank's counts per expert: taken only where a rank routes its own rows
OWN = "P(tokens 0, reordered, own)"


def _grouped(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The experts' grouped product (transformers' fallback op: float64 on CPU)."""
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    return torch.ops.transformers.grouped_mm_fallback(x, weight, offs=offs)


class _Experts(nn.Module):
    def __init__(self, inverse: str):
        super().__init__()
        self.inverse = inverse
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * F) / H ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(E, F, H) / F ** 0.5)

    def forward(self, h, ids, weights):                                   # (T, H), (T, K), (T, K)
        tokens = h.size(0)
        ids, weights = ids.reshape(-1), weights.reshape(-1)               # (T*K,)
        ids_sorted, perm = torch.sort(ids)
        rows = h[perm // K]                                               # (T*K, H) by expert
        offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
        gate, up = _grouped(rows, self.gate_up_proj, offs).chunk(2, dim=-1)
        y = _grouped(nn.functional.silu(gate) * up, self.down_proj, offs) * weights[perm].unsqueeze(-1)
        arange = torch.arange(perm.size(0), device=perm.device)
        if self.inverse == "argsort":
            inverse = torch.argsort(perm)
        elif self.inverse == "sort":
            inverse = torch.sort(perm)[1]
        elif self.inverse == "scatter_":
            inverse = torch.empty_like(perm).scatter_(0, perm, arange)
        elif self.inverse == "descending argsort":
            inverse = torch.argsort(perm, descending=True)
        else:
            inverse = torch.empty_like(perm)
            inverse[perm] = arange.flip(0) if self.inverse.startswith("flipped") else arange
        return y[inverse].view(tokens, K, H).sum(1)                       # (T, H) in token order


class _Block(nn.Module):
    def __init__(self, inverse: str):
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = _Experts(inverse)

    def forward(self, x):                                                 # (b, s, H)
        b, s, _ = x.shape
        h = self.norm(x).reshape(b * s, H)                                # (b*s, H)
        w, ids = self.router(h).softmax(-1).topk(K)                       # (b*s, K)
        return x + self.experts(h, ids, w / w.sum(-1, keepdim=True)).view(b, s, H)


class _TinyMoE(nn.Module):
    def __init__(self, inverse: str):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.mlp = _Block(inverse)

    def forward(self, input_ids):                                         # (b, s)
        return self.mlp(self.embed(input_ids))                            # (b, s, H)


#: the plan's workload: where a rank's own routing and the dispatch are forced
WORKLOAD = dict(layout={"*.experts.*": "expert"}, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True,
                expert_dispatch=True)


def _model(inverse: str) -> _TinyMoE:
    torch.manual_seed(0)
    return _TinyMoE(inverse).double()


def _ids(seed: int, seq: int = 6) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))


def _built(inverse: str, tp: int):
    """The plan of the model of ``inverse`` and rank 0's program, built on the fake backend."""
    from tests.helpers import fake_process_group

    with fake_process_group(tp):
        pm = autotp.parallelize(_model(inverse), tp, example_inputs=(_ids(0),), **WORKLOAD)
    graph = pm.programs[0].graph_module
    ran = {getattr(n.target, "__name__", "") for n in graph.graph.nodes if n.op == "call_function"} \
        | {type(graph.get_submodule(n.target)).__name__ for n in graph.graph.nodes if n.op == "call_module"}
    return pm.plan, ran


@pytest.mark.parametrize("inverse", ["argsort", "sort", "scatter_"])
def test_a_rank_routes_its_own_rows_whichever_way_the_inverse_is_made(inverse):
    plan, ran = _built(inverse, 2)
    assert [c.kind for c in plan.comms if c.src == OWN] == ["all_gather"], plan.comms
    # the rank's program routes its own rows; a scatter writes its own sorted rows' positions
    assert "RouteLocally" in ran and ("own_arange" in ran) is (inverse == "scatter_"), sorted(ran)


def test_a_look_alike_of_the_inverse_runs_on_every_row():
    # inv[perm] = arange(n).flip(0): another permutation, no inverse; before, planned on the rank's
    # own rows and refused when its program was built
    plan, _ = _built("flipped index_put_", 2)
    assert not [c for c in plan.comms if c.src == OWN], plan.comms


@functools.cache
def _parallel(inverse: str, tp: int):
    """The serial model and this rank's program (one per rank process, reused across examples)."""
    model = _model(inverse)
    return model, autotp.parallelize(model, tp, example_inputs=(_ids(0),), **WORKLOAD)


def check_against_serial(inverse: str, tp: int, seed: int) -> dict:
    """Forward and every gradient of this rank's program against serial: the relative errors,
    the program's routing calls."""
    from autotp.testing import relative_error
    from tests.helpers import whole

    model, pm = _parallel(inverse, tp)
    ids = _ids(seed)
    grad = torch.randn(*ids.shape, H, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    pm.zero_grad(set_to_none=True)
    want = model(ids)
    want.backward(grad)
    got = whole(pm(ids))
    got.backward(grad)
    errors = {"output": relative_error(got, want)}
    for (name, p), (_, q) in zip(pm.named_parameters(), model.named_parameters()):
        errors[name] = relative_error(whole(p.grad), q.grad)
    graph = pm.programs[0].graph_module
    ran = {getattr(n.target, "__name__", "") for n in graph.graph.nodes if n.op == "call_function"} \
        | {type(graph.get_submodule(n.target)).__name__ for n in graph.graph.nodes if n.op == "call_module"}
    return {"errors": errors, "ran": ran}


def _assert_equal_serial(cluster_of, inverse: str, tp: int, seed: int, own: bool = True) -> None:
    for rank, result in enumerate(cluster_of(tp).run(check_against_serial, inverse, tp, seed)):
        assert ("RouteLocally" in result["ran"]) is own, (rank, sorted(result["ran"]))
        for key, error in result["errors"].items():
            assert error <= TOLERANCE[torch.float64], (rank, key, error)


@pytest.mark.parametrize("inverse", ["argsort", "scatter_"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16))
def test_own_routing_with_each_inverse_equals_serial_at_tp2(cluster_of, inverse, seed):
    _assert_equal_serial(cluster_of, inverse, 2, seed)


@pytest.mark.slow   # a program a form and a tp on loaded cores
@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("inverse", INVERSES + LOOK_ALIKES)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16))
def test_own_routing_with_every_inverse_equals_serial(cluster_of, inverse, tp, seed):
    _assert_equal_serial(cluster_of, inverse, tp, seed, own=inverse not in LOOK_ALIKES)
