"""Which node holds the inverse of a permutation, read per ATen op from the graph
(``passes/rules/routing.inverted`` and ``inverses``, ``rules/row_reads.inverse_permutations``):
``inv[p] = arange(n)`` (``index_put_``, transformers' way), ``inv.scatter_(0, p, arange(n))`` or
``scatter``, ``argsort(p)`` and ``p.argsort()``, ``sort(p)[1]``, each of a permutation ``p``; and
look-alikes that are not: a sort of ids that are not a permutation, a descending argsort, an arange
of another length, a scatter into a longer tensor (an entry of the base kept), a scatter that sums
into a tensor already holding values. Hypothesis runs the exported graph and checks that every
pair the graph is said to hold is an inverse pair by value, and that each look-alike is not."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import Interpreter

from autotp.passes.rules.routing import inverted, inverses, is_permutation
from autotp.passes.rules.row_reads import inverse_permutations

N = 6
#: the module's outputs that are the inverse of perm, by how each is made
INVERSES = ("index_put_", "argsort", "method_argsort", "sort_indices", "scatter_", "scatter")
#: the module's outputs that look like one but are not
LOOK_ALIKES = ("argsort_of_ids", "descending", "shorter_arange", "longer_base", "summed_into_ones")


class _Inverses(torch.nn.Module):
    """``perm`` (a sort of ids by value) and its inverse made six ways, beside five look-alikes."""

    def forward(self, ids):
        _, perm = torch.sort(ids)                              # (n,) a permutation
        n = perm.size(0)
        put = torch.empty_like(perm)
        put[perm] = torch.arange(n)
        scattered_ = torch.empty_like(perm).scatter_(0, perm, torch.arange(n))
        made = {"index_put_": put, "argsort": torch.argsort(perm), "method_argsort": perm.argsort(),
                "sort_indices": torch.sort(perm)[1], "scatter_": scattered_,
                "scatter": torch.empty_like(perm).scatter(0, perm, torch.arange(n))}
        alike = {"argsort_of_ids": torch.argsort(ids),           # a permutation, not perm's inverse
                 "descending": torch.argsort(perm, descending=True),
                 "shorter_arange": torch.zeros_like(perm).scatter(0, perm[:-1], torch.arange(n - 1)),
                 "longer_base": torch.ones(n + 1, dtype=perm.dtype).scatter(0, perm, torch.arange(n)),
                 "summed_into_ones": torch.ones_like(perm).scatter(0, perm, torch.arange(n), reduce="add")}
        return (perm, *(made[k] for k in INVERSES), *(alike[k] for k in LOOK_ALIKES))


@functools.cache
def _exported():
    ep = torch.export.export(_Inverses(), (torch.randint(0, 3, (N,)),))
    outs = list(ep.graph.output_node().args[0])
    return ep, outs[0], dict(zip(INVERSES, outs[1:])), dict(zip(LOOK_ALIKES, outs[1 + len(INVERSES):]))


def test_an_inverse_made_by_a_scatter_of_an_arange_is_a_permutation():
    _, perm, made, alike = _exported()
    assert all(is_permutation(made[k]) for k in INVERSES), {k: is_permutation(made[k]) for k in INVERSES}
    assert not is_permutation(alike["shorter_arange"]) and not is_permutation(alike["longer_base"])
    assert not is_permutation(alike["summed_into_ones"])


@pytest.mark.parametrize("kind", INVERSES)
def test_each_way_of_making_the_inverse_is_known_both_ways(kind):
    _, perm, made, _ = _exported()
    inverse = made[kind]
    assert inverted(inverse) is perm, (kind, inverted(inverse))   # inverse's own inverse is perm
    assert inverse_permutations(inverse)[0] is perm
    held = inverse_permutations(perm)
    assert _unwrap(inverse) in [_unwrap(m) for m in held], (kind, held)
    # every inverse of perm the graph makes, and nothing else
    assert {_unwrap(m) for m in held} == {_unwrap(made[k]) for k in INVERSES}, held


@pytest.mark.parametrize("kind", LOOK_ALIKES)
def test_a_look_alike_is_not_an_inverse(kind):
    _, perm, _, alike = _exported()
    assert inverted(alike[kind]) is None, kind
    assert _unwrap(alike[kind]) not in {_unwrap(m) for m in inverses(perm)}, kind


def _unwrap(node):
    # the node that makes the values (export may read an in-place write through an alias)
    while node.target in (torch.ops.aten.clone.default, torch.ops.aten.alias.default):
        node = node.args[0]
    return node


def _values(ids) -> tuple:
    """Every node's value where the exported graph runs on ``ids``, by name; and perm's value."""
    ep, perm, _, _ = _exported()
    values = {}

    class _Record(Interpreter):
        def run_node(self, n):
            values[n.name] = super().run_node(n)
            return values[n.name]

    _Record(ep.graph_module).run(torch.tensor(ids))
    return values, values[perm.name]


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(0, 4), min_size=N, max_size=N))
def test_what_the_graph_holds_as_an_inverse_is_one_by_value(ids):
    values, p = _values(ids)
    held = inverse_permutations(_exported()[1])
    assert len(held) == len(INVERSES)
    for inverse in held:
        assert _inverse_pair(p, values[inverse.name]), (inverse, ids)


@pytest.mark.parametrize("kind", LOOK_ALIKES)
def test_a_look_alike_is_not_the_inverse_by_value(kind):
    # ids for which each look-alike's values differ from perm's inverse (on others they may agree:
    # the graph must not take them for it)
    values, p = _values([3, 0, 4, 1, 2, 0])
    assert not _inverse_pair(p, values[_exported()[3][kind].name]), kind


def _inverse_pair(p, v) -> bool:
    ident = torch.arange(len(p))
    return (v.shape == p.shape and bool(((v >= 0) & (v < len(p))).all())
            and torch.equal(p[v], ident) and torch.equal(v[p], ident))
