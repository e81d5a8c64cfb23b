"""A split becomes another (along another dim, or the same dealt another way) by one all-to-all
(``reshard_tp``).

Ranks build their part of one seeded float64 tensor (split as ``have``) and an upstream gradient
of their part of it split as ``want``, run the reshard forward and backward, and send back the
output and the input's gradient; this process recomputes both from the same seeds as the
definitions (the whole tensor cut as ``want``; the whole gradient assembled and cut as ``have``).
The ranks also run the gather-then-cut the plan made before (``gather_from_tp`` then
``scatter_to_tp``), which must give the same tensors, bit for bit. Even, uneven, interleaved
(chunks, unit, unequal blocks) and rotated splits, of two dims or of one dim dealt two ways, with parts that are empty where a dim has fewer
atoms than ranks; tp 1, 2 and 4 on the shared four ranks, tp 3 on three.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from autotp.distributed import collectives as C
from autotp.distributed import comm_modules, shards
from autotp.distributed.mesh import get_mesh
from autotp.errors import PlanError
from autotp.placements import Shard, local_size, resharded_by_all_to_all


@dataclass(frozen=True)
class Reshard:
    tp: int
    have: Shard
    want: Shard
    shape: tuple[int, ...]   # the whole tensor's
    seed: int

    def local_shape(self, shard: Shard, rank: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[shard.dim] = local_size(self.shape[shard.dim], shard, self.tp, rank)
        return tuple(shape)


@st.composite
def _split(draw, dim: int, tp: int) -> Shard:
    chunks = draw(st.integers(1, 3))
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=chunks, max_size=chunks))) if chunks > 1 else ()
    return Shard(dim, chunks, draw(st.integers(1, 2)), draw(st.integers(0, tp - 1)), sizes=sizes)


@st.composite
def reshards(draw, tps=(1, 2, 4)) -> Reshard:
    """Two splits of different dims, or of one dim dealt two ways, and sizes that factor under
    both (atoms: fewer than, a multiple of, or a remainder over the ranks)."""
    tp = draw(st.sampled_from(tps))
    ndim = draw(st.integers(2, 3))
    a, b = draw(st.permutations(range(ndim)))[:2]
    if draw(st.booleans()):
        b = a
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    have, want = draw(_split(a, tp)), draw(_split(b, tp))
    if a == b:
        assume(have != want)
        shape[a] = math.lcm(have.parts * have.unit, want.parts * want.unit) * draw(st.integers(1, 2 * tp + 1))
    else:
        shape[a] = have.parts * have.unit * draw(st.integers(1, 2 * tp + 1))
        shape[b] = want.parts * want.unit * draw(st.integers(1, 2 * tp + 1))
    return Reshard(tp, have, want, tuple(shape), draw(st.integers(0, 2**31 - 1)))


def _tensor(seed: int, shape, *key) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seed,) + key).encode()))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def run_reshard(case: Reshard) -> tuple[torch.Tensor, ...]:
    """Runs in a rank: (output, input gradient) of the all-to-all and of the gather then cut."""
    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    have_size = case.shape[case.have.dim]
    part = shards.local_shard(_tensor(case.seed, case.shape, "x", block), case.have, case.tp, r)
    dy = _tensor(case.seed, case.local_shape(case.want, r), "dy", block, r)
    x = part.clone().requires_grad_()
    y = C.reshard_tp(x, group, case.have, case.want, have_size)
    y.backward(dy)
    old = part.clone().requires_grad_()
    whole = C.gather_from_tp(old, group, case.have, have_size)
    cut = C.scatter_to_tp(whole, group, case.want, case.shape[case.want.dim])
    cut.backward(dy)
    return y.detach(), x.grad, cut.detach(), old.grad


def _check(cluster, case: Reshard) -> None:
    tp = case.tp
    for rank, (y, grad, cut, cut_grad) in enumerate(cluster.run(run_reshard, case)):
        block, r = rank // tp, rank % tp
        full = _tensor(case.seed, case.shape, "x", block)
        dy = [_tensor(case.seed, case.local_shape(case.want, q), "dy", block, q) for q in range(tp)]
        want_grad = shards.local_shard(shards.assemble(dy, case.want, case.shape[case.want.dim]), case.have, tp, r)
        torch.testing.assert_close(y, shards.local_shard(full, case.want, tp, r), rtol=0, atol=0,
                                   msg=lambda m: f"forward, rank {rank}: {m}")
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0, msg=lambda m: f"backward, rank {rank}: {m}")
        # the same tensors as the all-gather and cut the plan made before, bit for bit
        torch.testing.assert_close(y, cut, rtol=0, atol=0)
        torch.testing.assert_close(grad, cut_grad, rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(case=reshards())
# the sequence-parallel residual's: a product's output split by features, wanted split along s
@example(case=Reshard(4, Shard(2), Shard(1), (2, 8, 12), 1))
# the same at tp 4 with an uneven hidden (10 = 3+3+2+2) and a rotated one
@example(case=Reshard(4, Shard(2, rotate=1), Shard(1), (2, 7, 10), 2))
# and back: dim 0 to an inner dim (no copy to stage the send, one to lay out the receive)
@example(case=Reshard(2, Shard(0), Shard(1), (4, 6), 3))
# the same dim dealt another way: heads one by one, then in pairs (16 heads at tp 4: 4 each both ways,
# nothing moves but the rotation's)
@example(case=Reshard(4, Shard(1), Shard(1, unit=2, rotate=1), (2, 16, 3), 6))
def test_reshard_moves_each_part_to_the_rank_that_wants_it_and_its_gradient_back(cluster, case):
    _check(cluster, case)


def run_held_reshard(case: Reshard, order: tuple[int, ...]) -> tuple:
    """Runs in a rank: :func:`run_reshard`'s all-to-all of a part held as a permutation of its
    memory (``order``: its dims from the outermost); (output, input gradient, the copies the
    all-to-all made forward, whether the output's dims longer than one are held in the input's
    order)."""
    from autotp.testing.work import CopyCounter

    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    part = shards.local_shard(_tensor(case.seed, case.shape, "x", block), case.have, case.tp, r)
    x = part.permute(order).contiguous().permute(sorted(range(part.dim()), key=order.__getitem__))
    x.requires_grad_()
    with CopyCounter() as copies:
        y = C.reshard_tp(x, group, case.have, case.want, case.shape[case.have.dim])
    y.backward(_tensor(case.seed, case.local_shape(case.want, r), "dy", block, r))
    made = len([c for c in copies.copies if c.site == "exchange._all_to_all"])
    long = [i for i in range(x.dim()) if x.shape[i] > 1 and y.shape[i] > 1]
    held = lambda t: sorted(long, key=lambda i: -t.stride(i))   # noqa: E731
    return y.detach(), x.grad, made, held(x) == held(y)


@settings(max_examples=15, deadline=None)
@given(tp=st.sampled_from([2, 4]), ndim=st.integers(2, 3), data=st.data())
# attention's output [b, heads, s, d] held [b, s, heads, d], the heads wanted split along s: sent
# in memory's order, the cut along s the outermost dim after b's one (no staging), the heads laid
# out after it (one copy)
@example(tp=2, ndim=4, data=None)
def test_a_reshard_of_a_permuted_part_keeps_its_layout_and_values(cluster, tp, ndim, data):
    # between even splits of two dims, a part held as a permutation of a contiguous tensor is sent
    # in its memory's order and the part received held so: a side needs no copy where its dim
    # comes first in memory after dims of size one (before: the send made contiguous, one copy)
    if data is None:
        case, order = Reshard(2, Shard(1), Shard(2), (1, 4, 6, 3), 11), (0, 2, 1, 3)
    else:
        a, b = data.draw(st.permutations(range(ndim)))[:2]
        shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
        shape[a], shape[b] = tp * data.draw(st.integers(1, 3)), tp * data.draw(st.integers(1, 3))
        case = Reshard(tp, Shard(a), Shard(b), tuple(shape), data.draw(st.integers(0, 2**31 - 1)))
        order = tuple(data.draw(st.permutations(range(ndim))))
    a, b = case.have.dim, case.want.dim
    part = list(case.local_shape(case.have, 0))
    out = list(case.local_shape(case.want, 0))
    # the order the memory holds the dims in, as the collective reads it (dims of size one aside,
    # a permutation may be contiguous)
    x = torch.zeros(part).permute(order).contiguous().permute(sorted(range(len(part)), key=order.__getitem__))
    memory = shards.dense_order(x) or list(range(len(part)))
    send = 0 if all(part[i] == 1 for i in memory[:memory.index(b)]) else 1
    receive = 0 if all(out[i] == 1 for i in memory[:memory.index(a)]) else 1
    results = cluster.run(run_held_reshard, case, order)
    for rank, (y, grad, made, held) in enumerate(results):
        block, r = rank // tp, rank % tp
        full = _tensor(case.seed, case.shape, "x", block)
        dy = [_tensor(case.seed, case.local_shape(case.want, q), "dy", block, q) for q in range(tp)]
        torch.testing.assert_close(y, shards.local_shard(full, case.want, tp, r), rtol=0, atol=0)
        want_grad = shards.local_shard(shards.assemble(dy, case.want, case.shape[b]), case.have, tp, r)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
        assert held, (case, order)
        assert made == send + receive, (case, order, made, send, receive)


@settings(max_examples=8, deadline=None)
@given(case=reshards(tps=(3,)))
@example(case=Reshard(3, Shard(2), Shard(1), (2, 7, 16), 4))
# Gemma's heads at tp 3: 16 dealt one by one (6, 5, 5), then in pairs (6, 6, 4): one head moves
@example(case=Reshard(3, Shard(1), Shard(1, unit=2), (2, 16, 3), 6))
def test_reshard_at_tp3_is_uneven_and_moves_each_part_as_the_definitions_say(cluster_of, case):
    _check(cluster_of(3), case)


def test_reshard_of_a_layout_one_all_to_all_cannot_move_is_a_plan_error():
    x = torch.zeros(4, 6)
    for have, want in [(Shard(0), Shard(1, chunks=2, tail=1)),      # a tail every rank holds whole
                       (Shard(1, chunks=2, tail=1), Shard(1)),
                       (Shard(0), Shard(1, chunks=2, per_block=True))]:
        assert not resharded_by_all_to_all(have, want)
        with pytest.raises(PlanError, match="all-gather and a cut"):
            C.reshard_tp(x, None, have, want, 4)
    assert resharded_by_all_to_all(Shard(2, chunks=3, unit=2, rotate=1, sizes=(4, 1, 1)), Shard(1))
    assert resharded_by_all_to_all(Shard(1), Shard(1, unit=2))


def test_reshard_in_a_group_of_one_is_the_tensor_itself():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = C.reshard_tp(x, None, Shard(0), Shard(1), 3)
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(y, x) and torch.equal(grad, torch.ones_like(x))


def run_dynamic(case: Reshard) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in a rank: the graph's module built without the split dim's size (a dynamic one,
    the sequence under sequence parallelism), told it at call time."""
    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    x = shards.local_shard(_tensor(case.seed, case.shape, "x", block), case.have, case.tp, r).requires_grad_()
    module = comm_modules.ReshardTP(group, case.have, case.want, None)
    y = module(x, case.shape[case.have.dim])
    y.backward(_tensor(case.seed, y.shape, "dy", block, r))
    return y.detach(), x.grad


def test_the_module_takes_a_dynamic_dims_size_at_call_time_and_is_named_all_to_all(cluster):
    case = Reshard(4, Shard(1), Shard(2), (2, 7, 8), 5)   # the sequence (7: 2+2+2+1) to the features
    module = comm_modules.ReshardTP(object(), case.have, case.want, None)
    assert module.kind == "all_to_all" and "want=S(2)" in repr(module) and "full_size=dynamic" in repr(module)
    for rank, (y, grad) in enumerate(cluster.run(run_dynamic, case)):
        block, r = rank // 4, rank % 4
        full = _tensor(case.seed, case.shape, "x", block)
        torch.testing.assert_close(y, shards.local_shard(full, case.want, 4, r), rtol=0, atol=0)
        dy = [_tensor(case.seed, case.local_shape(case.want, q), "dy", block, q) for q in range(4)]
        torch.testing.assert_close(grad, shards.local_shard(shards.assemble(dy, case.want, 8), case.have, 4, r),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("shape,have,want,tp", [
    ((2, 6, 8), Shard(2), Shard(1), 2),                  # (2, 6, 8/2) -> (2, 6/2, 8): even
    ((2, 20, 7), Shard(2), Shard(1), 3),                 # uneven both: packed by width, joined by a cat
    ((67, 20), Shard(0), Shard(1), 3),                   # a table's rows into its columns
    ((2, 16, 4), Shard(1), Shard(1, unit=2), 3)])        # one dim dealt two ways: run by run
def test_reshard_traces_under_compile_with_its_all_to_all_forward_and_backward(shape, have, want, tp):
    # a functional all_to_all_single each way in the compiled graphs: one program, no graph break,
    # the output and the gradient bit for bit eager code's (c10d's all-to-all there)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from tests.helpers import fake_process_group

    full = shape[have.dim]
    local = list(shape)
    local[have.dim] = local_size(full, have, tp, 0)
    with fake_process_group(tp, 0) as group:
        x = torch.randn(local, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)

        def step(x):
            y = C.reshard_tp(x * 2, group, have, want, full)
            return (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum(), y

        loss, y_eager = step(x)
        loss.backward()
        eager, x.grad = x.grad, None
        found = {"forward": [], "backward": []}

        def collect(where):
            def compiler(gm, example_inputs):
                found[where] += [n.target for n in gm.graph.nodes if n.op == "call_function"
                                 and n.target is torch.ops._c10d_functional.all_to_all_single.default]
                return make_boxed_func(gm)
            return compiler

        torch._dynamo.reset()
        loss, y = torch.compile(step, backend=aot_autograd(fw_compiler=collect("forward"),
                                                           bw_compiler=collect("backward")), fullgraph=True)(x)
        loss.backward()
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, eager, rtol=0, atol=0)
    assert len(found["forward"]) == 1 and len(found["backward"]) == 1, found
