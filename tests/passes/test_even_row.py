"""The even row split (``autotp/passes/rules/matrix.py: _even_row``): a free weight split evenly on its
input features where its input arrives split on them unevenly (heads, or groups of heads, that tp
does not deal evenly: Phi-3-medium's 10 groups at tp 8), the input moved there by one all-to-all.

The rule offers it beside the row split along the input's own split; the strategy, run on real
gloo ranks (the input's uneven part resharded by ``reshard_tp``, each rank's product of the even
parts, their Partial sum made whole by a g), equals the serial product in float64: the output, the
input's gradient (each rank's uneven part of it) and the weight's (each rank's even columns).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autotp.distributed import collectives as C
from autotp.distributed import shards
from autotp.distributed.mesh import get_mesh
from autotp.passes.rules import strategies
from autotp.placements import PARTIAL, Shard, is_even
from tests.passes.test_rules import op_info

aten = torch.ops.aten


@dataclass(frozen=True)
class Product:
    tp: int
    have: Shard   # x's split of its features as it arrives: whole atoms of ``unit``, uneven
    k: int        # x's features (the product's contracted dim)
    n: int        # the product's output features
    seed: int


@st.composite
def products(draw, tps=(2, 4)) -> Product:
    """``heads`` atoms of ``unit`` features (a head, or a group of heads sharing k and v) that tp does
    not deal evenly, in one block or two (chunks), the first run rotated to any rank; the features
    a multiple of tp, so that an even split of them exists."""
    tp = draw(st.sampled_from(tps))
    chunks = draw(st.integers(1, 2))
    heads = draw(st.integers(tp + 1, 3 * tp).filter(lambda h: h % tp))
    unit = tp * draw(st.integers(1, 2))
    return Product(tp, Shard(2, chunks, unit, draw(st.integers(0, tp - 1))), chunks * heads * unit,
                   draw(st.integers(1, 5)), draw(st.integers(0, 2**31 - 1)))


def _tensor(seed: int, shape, *key) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seed,) + key).encode()))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def _whole(case: Product) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (b, s, k), W (n, k) and the output's gradient (b, s, n)."""
    return (_tensor(case.seed, (2, 3, case.k), "x"), _tensor(case.seed, (case.n, case.k), "w"),
            _tensor(case.seed, (2, 3, case.n), "dy"))


def _even_row_strategy(case: Product):
    x, w, _ = _whole(case)
    info = op_info(aten.linear.default, (x, w), {}, case.tp)
    offered = strategies(info, (case.have, None))
    even = [s for s in offered if s.output == PARTIAL and s.inputs[0] != case.have]
    assert len(even) == 1, offered
    return even[0]


def run_even_row(case: Product, want: Shard, w_split: Shard) -> tuple[torch.Tensor, ...]:
    """Runs in a rank: x's uneven part resharded to ``want`` by one all-to-all, times the rank's
    columns of W, the Partial sum made whole by a g; backward from the whole output's gradient."""
    mesh = get_mesh(case.tp)
    group, r = mesh.tp_group, mesh.tp_rank
    x, w, dy = _whole(case)
    part = shards.local_shard(x, case.have, case.tp, r).requires_grad_()
    columns = shards.local_shard(w, w_split, case.tp, r).requires_grad_()
    y = C.reduce_from_tp(torch.nn.functional.linear(C.reshard_tp(part, group, case.have, want, case.k), columns),
                         group)
    y.backward(dy)
    return y.detach(), part.grad, columns.grad


def _check(cluster, case: Product) -> None:
    strategy = _even_row_strategy(case)
    want, w_split = strategy.inputs
    assert want.dim == 2 and is_even(case.k, want, case.tp) and w_split == want.with_dim(1), strategy
    x, w, dy = _whole(case)
    x.requires_grad_(), w.requires_grad_()
    y = torch.nn.functional.linear(x, w)
    y.backward(dy)
    for rank, (got, x_grad, w_grad) in enumerate(cluster.run(run_even_row, case, want, w_split)):
        r = rank % case.tp
        torch.testing.assert_close(got, y.detach(), rtol=1e-12, atol=1e-12, msg=lambda m: f"output, rank {rank}: {m}")
        torch.testing.assert_close(x_grad, shards.local_shard(x.grad, case.have, case.tp, r), rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"x's gradient, rank {rank}: {m}")
        torch.testing.assert_close(w_grad, shards.local_shard(w.grad, w_split, case.tp, r), rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"W's gradient, rank {rank}: {m}")


@settings(max_examples=20, deadline=None)
@given(case=products())
# Phi-3-medium's o_proj at tp 8 made small: 10 groups at tp 4 (3, 3, 2, 2), rotated as in layer 1
@example(case=Product(4, Shard(2, 1, 8, 1), 80, 3, 1))
def test_an_even_row_split_of_an_unevenly_split_input_equals_the_serial_product(cluster, case):
    _check(cluster, case)


@settings(max_examples=6, deadline=None)
@given(case=products(tps=(3,)))
def test_an_even_row_split_at_tp3_equals_the_serial_product(cluster_of, case):
    _check(cluster_of(3), case)


@settings(max_examples=30, deadline=None)
@given(case=products(tps=(2, 3, 4, 8)))
def test_the_even_row_split_is_offered_beside_the_inputs_own_and_not_for_an_even_input(case):
    x, w, _ = _whole(case)
    info = op_info(aten.linear.default, (x, w), {}, case.tp)
    own = (case.have, case.have.with_dim(1))
    rows = [s.inputs for s in strategies(info, (case.have, None)) if s.output == PARTIAL]
    assert own in rows and (Shard(2), Shard(1)) in rows, rows
    # an input split evenly already: nothing to balance, no reshard offered
    even = [s.inputs for s in strategies(info, (Shard(2), None)) if s.output == PARTIAL]
    assert even == [(Shard(2), Shard(1))], even
