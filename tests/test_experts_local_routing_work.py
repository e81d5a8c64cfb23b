"""A dispatching layer routes a rank's own rows: its router, sort and counts counted, on torch's ``fake`` backend.

Mixtral and DeepSeek-V3 (zoo families; DeepSeek-V3's router group-limited: 8 experts in 2 groups,
each token's experts from its best group) with their tokens split along the sequence and their
experts dispatched by the all-to-all (sequence parallelism forced, the dispatch forced): rank 0
of tp 2 and 4 runs one training step, every ATen call recorded with its first operand's shape.
The rank's router runs on its own ``T/tp`` tokens (its scores, the groups' scores and mask, the
top-k and the weights' gather: DeepSeek-V3's ``scatter_``, ``masked_fill`` and ``gather`` too,
rules/misc.along_dim_rule), its step sorts its own ``T*k/tp`` (token, expert) rows (``T``
tokens in the step, top-``k``), not every one of the ``T*k``, and runs no ``histc`` over every
row: every expert's count comes from the counts its sort exchanged
(autotp/passes/rules/local_routing.py). Before, every rank all-gathered every token's ids and
weights, sorted all ``T*k`` of them and counted them whole; DeepSeek-V3's router ran whole on
every rank (its scores all-gathered). (On the fake backend an all-gather fills each peer's block
with the rank's own: its peers route as it does, which sizes the dispatch consistently; the
values are not this test's. Eight experts, so that rank 0's experts at tp 4 get rows of its own
tokens: the fake all-to-all refuses an empty send buffer where rows are expected back,
benchmarks/fake_peers.py.)
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp import zoo

BATCH, SEQ, TOP_K, EXPERTS, GROUPS = 2, 16, 2, 8, 2
#: each family's config beyond the tiny one: DeepSeek-V3's router picks each token's experts from
#: its best group of two
CONFIG = {"mixtral": {}, "deepseek-v3": dict(n_group=GROUPS, topk_group=1)}
#: a router's sort by argsort, the ids then gathered by it (``ids[argsort(ids)]``): Mixtral's
#: experts run by transformers' grouped path so written (argsort_experts below)
ARGSORT = "mixtral-argsort"
#: a count of the sorted ids by ``bincount`` (bincount_experts below): of the rank's own ids
BINCOUNT = "mixtral-bincount"
#: a router's sort asked stable (``torch.sort(ids, stable=True)``: ``aten.sort.stable``), its
#: rows counted by ``histc`` as transformers' grouped path counts (stable_sort_experts below)
STABLE = "mixtral-stable-sort"
#: the router's ops on its [tokens, experts] scores (DeepSeek-V3's [tokens, groups] and
#: [tokens, groups, experts a group] too), forward and backward
ROUTER_OPS = frozenset(("aten::topk", "aten::sigmoid", "aten::_softmax", "aten::masked_fill", "aten::gather",
                        "aten::scatter_", "aten::bitwise_not", "aten::sigmoid_backward",
                        "aten::_softmax_backward_data"))


class _Sizes(TorchDispatchMode):
    """Each ATen call's op name and its first tensor operand's shape."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.calls.append((func._schema.name, tuple(first.shape) if first is not None else ()))
        return func(*args, **(kwargs or {}))


def _grouped_linear(x, weight, offs, is_transposed):
    """transformers' fallback grouped product (float64 on CPU, which torch's kernel does not take)."""
    import transformers.integrations.moe  # noqa: F401  (registers the fallback product's op)

    weight = weight if is_transposed else weight.transpose(-2, -1)
    return torch.ops.transformers.grouped_mm_fallback(x.to(weight.dtype), weight, offs=offs)


def _experts_in_order(self, hidden_states, rows, counts, weights, perm, top_k):
    """The experts' products on ``rows`` (sorted by expert, ``counts`` rows an expert), each weighted,
    put back in token order (the inverse of ``perm``) and summed over a token's ``top_k``, as
    transformers' grouped path does after its sort."""
    tokens, hidden = hidden_states.size(0), hidden_states.size(-1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    out = self._apply_gate(_grouped_linear(rows, self.gate_up_proj, offsets, is_transposed=self.is_transposed))
    out = _grouped_linear(out, self.down_proj, offsets, is_transposed=self.is_transposed) * weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inverse].view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def argsort_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped experts (``grouped_mm_experts_forward``, no biases) sorting by
    ``argsort`` and gathering the ids by it, as another family's router might. Its products are
    transformers' fallback grouped product, which takes float64 on CPU (torch's kernel does not)."""
    top_k = top_k_index.size(-1)
    weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)   # (T*k,)
    perm = torch.argsort(ids, stable=True)
    ids_sorted = ids[perm]
    rows = hidden_states[perm // top_k]                                   # (T*k, h) sorted by expert
    counts = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    return _experts_in_order(self, hidden_states, rows, counts, weights[perm], perm, top_k)


def bincount_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped experts counting the sorted rows per expert by ``bincount`` with
    ``minlength`` every expert (its length said, so that it is captured with
    one), as a model may count where transformers' grouped path uses ``histc``."""
    top_k = top_k_index.size(-1)
    weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)   # (T*k,)
    ids_sorted, perm = torch.sort(ids)
    rows = hidden_states[perm // top_k]                                   # (T*k, h) sorted by expert
    counts = torch.bincount(ids_sorted, minlength=self.num_experts)      # (E,)
    torch._check(counts.size(0) == self.num_experts)
    return _experts_in_order(self, hidden_states, rows, counts, weights[perm], perm, top_k)


def stable_sort_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped experts sorting the ids with ``stable=True`` (``aten.sort.stable``)."""
    top_k = top_k_index.size(-1)
    weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)   # (T*k,)
    ids_sorted, perm = torch.sort(ids, stable=True)
    rows = hidden_states[perm // top_k]                                   # (T*k, h) sorted by expert
    counts = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    return _experts_in_order(self, hidden_states, rows, counts, weights[perm], perm, top_k)


#: each experts implementation beyond transformers' own, by its case's name
IMPLEMENTATIONS = {ARGSORT: ("argsort_grouped_mm", argsort_experts), BINCOUNT: ("bincount_grouped_mm", bincount_experts),
                   STABLE: ("stable_sort_grouped_mm", stable_sort_experts)}


def _rank_step(family: str, tp: int) -> list[tuple[str, tuple]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    implementation = "grouped_mm"
    if family in IMPLEMENTATIONS:
        implementation, forward = IMPLEMENTATIONS[family]
        family = "mixtral"
        ALL_EXPERTS_FUNCTIONS.register(implementation, forward)
    config = zoo.tiny_config(family, layers=1, heads=4, kv_heads=2, head_dim=8, vocab=48, experts=EXPERTS,
                             top_k=TOP_K, positions=64, **CONFIG[family])
    config._experts_implementation = implementation
    model = zoo.build(family, config, seed=0)
    batch = zoo.example_batch(family, config, batch=BATCH, seq=SEQ, seed=1)
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        pm = autotp.parallelize(model, tp, layout={"*.experts.*": "expert"}, batch=64, seq=4096,
                                sequence_parallel=True, profile="h100-dgx", expert_dispatch=True)
        with _Sizes() as sizes:
            pm(**batch).loss.backward()
    finally:
        dist.destroy_process_group()
    return sizes.calls


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("family", sorted(CONFIG) + [ARGSORT, BINCOUNT, STABLE])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_dispatching_rank_routes_sorts_and_counts_its_own_rows_alone(family, tp):
    calls = _rank_step(family, tp)
    tokens = BATCH * SEQ
    rows = tokens * TOP_K   # every (token, expert) row of the step
    sorts = [_numel(s) for op, s in calls if op == "aten::sort"]
    counts = [_numel(s) for op, s in calls if op in ("aten::histc", "aten::bincount")]
    # the routing's sort, and token_sums' order of the rank's rows (distributed/experts.py): the
    # rank's own rows each (SEQ a multiple of tp)
    assert sorts and max(sorts) == rows // tp, (sorts, rows)
    # one sort in the step, the routing's: the rows come back to the top-k sums in the rank's
    # tokens' order (out[inv]), so token_sums_in_order sums them with no sort of their ids
    assert len(sorts) == 1, sorts
    assert all(n < rows for n in counts), (counts, rows)   # no count over every row
    # the rank holds no tensor of every (token, expert) row of the routing: its largest
    # integer index (sorted ids, permutations, their inverse) is its own rows'
    assert not [(op, s) for op, s in calls if op in ("aten::index_put_", "aten::floor_divide") and _numel(s) >= rows]
    # the router runs on the rank's own tokens: every call on scores, groups or top-k (the last
    # dim one of those sizes; attention's are the sequence's or the heads') has its T/tp rows
    widths = {EXPERTS, GROUPS, EXPERTS // GROUPS, TOP_K}
    router = [(op, s) for op, s in calls if op in ROUTER_OPS and len(s) >= 2 and s[-1] in widths]
    assert router and all(s[0] == tokens // tp for _, s in router), router
