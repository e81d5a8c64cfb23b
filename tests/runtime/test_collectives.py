"""The mappings f, g, gather, scatter and reduce-scatter match their definitions.

Ranks build their inputs and upstream gradients from a seed, run one mapping forward and
backward, and send back (output, input gradient); this process recomputes both from the same
seeds with plain single-process tensor code. World 4, TP groups of 1, 2 and 4 ranks, float64.
"""
from __future__ import annotations

import copy
import datetime
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import fx, nn

from autotp.errors import CommError
from autotp.placements import Shard, local_ranges, local_size
from autotp.distributed import collectives as C
from autotp.distributed import comm_modules, gather_scatter, shards
from autotp.distributed.mesh import get_mesh

WORLD = 4


@dataclass(frozen=True)
class Case:
    tp: int
    shard: Shard
    shape: tuple[int, ...]  # the full tensor's shape
    seed: int

    @property
    def full_size(self) -> int:
        return self.shape[self.shard.dim]

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.shard.dim] = local_size(self.full_size, self.shard, self.tp, rank)
        return tuple(shape)


@st.composite
def cases(draw, tps=(1, 2, 4), tails: bool = False) -> Case:
    tp = draw(st.sampled_from(tps))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    # a tail (k and v kept whole on every rank) only where no collective turns data into one
    tail = draw(st.integers(0, 2)) if tails else 0
    chunks = draw(st.integers(1, 3))
    # blocks of unequal size (a q|k|v of fewer kv heads), each dealt on its own, where no tail
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=chunks, max_size=chunks))) if not tail else ()
    # blocks every rank holds whole among dealt ones (Mamba2's one B and C): like a tail, replicated data
    whole = tuple(draw(st.sets(st.integers(0, chunks - 1), max_size=chunks - 1))) if tails and sizes and chunks > 1 \
        else ()
    shard = Shard(dim, chunks, draw(st.integers(1, 3)), draw(st.integers(0, tp - 1)) if tails else 0,
                  tail, sizes=sizes if chunks > 1 else (), whole=whole)
    # Fewer atoms than ranks, a multiple of tp, or a remainder: empty, even and uneven shards.
    atoms = draw(st.integers(1, 2 * tp + 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = shard.parts * shard.unit * atoms + shard.chunks * shard.unit * tail
    return Case(tp, shard, tuple(shape), draw(st.integers(0, 2**31 - 1)))


def _tensor(seed: int, shape, *key) -> torch.Tensor:
    """A float64 tensor determined by (seed, key): ranks and this process draw the same one."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seed,) + key).encode()))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------- local layouts (no ranks)

@settings(max_examples=200, deadline=None)
@given(case=cases(tps=range(1, 9), tails=True))
def test_local_shard_holds_local_ranges_and_assemble_inverts_it(case):
    from autotp.placements import block_bounds, owned_ranges

    full = torch.arange(torch.Size(case.shape).numel(), dtype=torch.float64).reshape(case.shape)
    d, shard, n = case.shard.dim, case.shard, case.full_size
    pieces = [shards.local_shard(full, shard, case.tp, r) for r in range(case.tp)]
    owned = []
    for r, piece in enumerate(pieces):
        index = [i for a, b in local_ranges(n, shard, case.tp, r) for i in range(a, b)]
        assert piece.shape == case.local_shape(r)
        assert piece.is_contiguous()
        assert torch.equal(piece, full.index_select(d, torch.tensor(index, dtype=torch.long)))
        owned += [i for a, b in owned_ranges(n, shard, case.tp, r) for i in range(a, b)]
        # a tail: every rank holds each block's last tail atoms, after its run
        block = n // shard.chunks
        tail = [c * block + i for c in range(shard.chunks) for i in range(block - shard.tail * shard.unit, block)]
        assert set(tail) <= set(index)
        # whole blocks: every rank holds all of each
        whole = [i for b in shard.whole for i in range(*block_bounds(n, shard)[b])]
        assert set(whole) <= set(index)
    assert sorted(owned) == list(range(n))    # the owned ranges partition the dim (a tail on rank 0)
    assert torch.equal(shards.assemble(pieces, shard, n), full)


def test_group_none_is_one_rank_without_communication():
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    shard = Shard(1, chunks=3)
    for fn in (C.copy_to_tp, C.reduce_from_tp):
        y = fn(x, None)
        (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert torch.equal(y, x) and torch.equal(grad, torch.ones_like(x))
    for fn in (C.gather_from_tp, C.scatter_to_tp, C.reduce_scatter_to_tp):
        y = fn(x, None, shard, 6)
        (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert torch.equal(y, x) and torch.equal(grad, torch.ones_like(x))


# ---------------------------------------------------------------- the mappings on 4 ranks

def _rank_inputs(op: str, case: Case, block: int, r: int) -> torch.Tensor:
    if op in ("f", "scatter"):  # Replicate: the same in the whole TP group
        return _tensor(case.seed, case.shape, "x", block)
    if op == "gather":  # Shard of one replicated full tensor
        return shards.local_shard(_tensor(case.seed, case.shape, "x", block), case.shard, case.tp, r)
    return _tensor(case.seed, case.shape, "x", block, r)  # Partial: a summand per rank


def run_mapping(op: str, case: Case, c10d: bool = False, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in a rank: the mapping's output and the gradient of its input. ``c10d``: gather
    the way gloo groups of GPU tensors do (c10d's all_gather_into_tensor), on these CPU ones.
    ``in_place``: an f or a g reduces in the tensor's storage (its input, or the gradient handed
    to backward, which nothing else reads here)."""
    if c10d:
        saved, gather_scatter._gloo_on_device = gather_scatter._gloo_on_device, lambda t, group: True
        try:
            return run_mapping(op, case, in_place=in_place)
        finally:
            gather_scatter._gloo_on_device = saved
    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    x = _rank_inputs(op, case, block, r).requires_grad_()
    if op == "f":
        y = C.copy_to_tp(x, group, in_place)
    elif op == "g":
        y = C.reduce_from_tp(x.clone(), group, in_place)   # a partial nothing else reads
    else:
        fn = {"gather": C.gather_from_tp, "scatter": C.scatter_to_tp,
              "reduce_scatter": C.reduce_scatter_to_tp}[op]
        y = fn(x, group, case.shard, case.full_size)
    y.backward(_tensor(case.seed, y.shape, "dy", block, r))
    return y.detach(), x.grad


def _expected(op: str, case: Case, block: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process definitions of the mapping's output and input gradient on TP rank r."""
    s, tp, ranks = case.shard, case.tp, range(case.tp)
    x_full = _tensor(case.seed, case.shape, "x", block)
    x_sum = sum(_tensor(case.seed, case.shape, "x", block, q) for q in ranks)
    dy_full = [_tensor(case.seed, case.shape, "dy", block, q) for q in ranks]
    dy_local = [_tensor(case.seed, case.local_shape(q), "dy", block, q) for q in ranks]
    if op == "f":
        return x_full, sum(dy_full)
    if op == "g":
        return x_sum, dy_full[r]
    if op == "gather":
        return x_full, shards.local_shard(dy_full[r], s, tp, r)
    if op == "scatter":
        return shards.local_shard(x_full, s, tp, r), shards.assemble(dy_local, s, case.full_size)
    return shards.local_shard(x_sum, s, tp, r), shards.assemble(dy_local, s, case.full_size)


def _check(cluster, op: str, case: Case, c10d: bool = False, in_place: bool = False) -> None:
    results = cluster.run(run_mapping, op, case, c10d, in_place)
    for rank, (y, grad) in enumerate(results):
        want_y, want_grad = _expected(op, case, rank // case.tp, rank % case.tp)
        torch.testing.assert_close(y, want_y, msg=lambda m: f"{op} forward, rank {rank}: {m}")
        torch.testing.assert_close(grad, want_grad, msg=lambda m: f"{op} backward, rank {rank}: {m}")


@settings(max_examples=25, deadline=None)
@given(case=cases(), in_place=st.booleans())
def test_f_is_identity_forward_and_sums_gradients_backward(cluster, case, in_place):
    _check(cluster, "f", case, in_place=in_place)


@settings(max_examples=25, deadline=None)
@given(case=cases(), in_place=st.booleans())
def test_g_sums_forward_and_is_identity_backward(cluster, case, in_place):
    _check(cluster, "g", case, in_place=in_place)


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_gather_assembles_full_forward_and_slices_backward(cluster, case):
    _check(cluster, "gather", case)


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_scatter_slices_forward_and_gathers_full_gradient_backward(cluster, case):
    _check(cluster, "scatter", case)


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_reduce_scatter_sums_to_local_shard_and_gathers_backward(cluster, case):
    _check(cluster, "reduce_scatter", case)


@settings(max_examples=10, deadline=None)
@given(case=cases(), op=st.sampled_from(["gather", "scatter"]))
def test_gathers_through_c10d_as_gloo_on_a_gpu_does_match_the_definitions(cluster, case, op):
    # gloo groups of CUDA tensors gather with c10d's all_gather_into_tensor (torch 2.11's
    # functional all-gather kills the process there); the same path on CPU tensors
    _check(cluster, op, case, c10d=True)


def _held(t: torch.Tensor, dims) -> list[int]:
    """``dims`` of ``t`` from the outermost in its memory to the innermost."""
    return sorted(dims, key=lambda i: -t.stride(i))


def run_held_gather(case: Case, order: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """Runs in a rank: a gather of a shard held as a permutation of its memory (``order``: its
    dims from the outermost, as attention's output ``[b, heads, s, d]`` is held ``[b, s, heads,
    d]``); the output, the input's gradient, and the order in memory of the dims longer than one
    in both, in the input and in the output."""
    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    local = _rank_inputs("gather", case, block, r)
    x = local.permute(order).contiguous().permute(sorted(range(local.dim()), key=order.__getitem__))
    x.requires_grad_()
    y = C.gather_from_tp(x, group, case.shard, case.full_size)
    y.backward(_tensor(case.seed, y.shape, "dy", block, r))
    long = [i for i in range(x.dim()) if x.shape[i] > 1 and y.shape[i] > 1]
    return y.detach(), x.grad, _held(x, long), _held(y, long)


@settings(max_examples=25, deadline=None)
@given(case=cases(tps=(2, 4)), data=st.data())
@example(case=Case(2, Shard(1), (2, 4, 3), 7), data=None)
@example(case=Case(2, Shard(0), (1, 2, 2), 0), data=None)   # rank 1's part empty: contiguous
def test_a_gather_of_a_permuted_shard_keeps_its_layout_and_values(cluster, case, data):
    # an even split's part gathered in its memory's order (no copy to make it contiguous) and
    # returned held as the input is, so the program's views of it are views as in serial; the
    # gradient's slice a view. Every rank's blocks travel in its own memory's order: a rank
    # whose part is held otherwise (an uneven split's empty part) must not garble the others'
    order = (0, 2, 1) if data is None else tuple(data.draw(st.permutations(range(len(case.shape)))))
    for rank, (y, grad, held_x, held_y) in enumerate(cluster.run(run_held_gather, case, order)):
        want_y, want_grad = _expected("gather", case, rank // case.tp, rank % case.tp)
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
        # an uneven split's parts differ in shape, so in layout: they are made contiguous
        if shards._split(case.full_size, case.shard, case.tp).even:
            assert held_y == held_x, (order, held_x, held_y)


def run_held_reduce_scatter(case: Case, order: tuple[int, ...]) -> tuple:
    """Runs in a rank: a reduce-scatter of a summand held as a permutation of its memory
    (``order``, as :func:`run_held_gather`'s); the output, the input's gradient, the order in
    memory of the dims longer than one in both; the output of the same summand held contiguous;
    and the copies the collective made forward for each of the two, beyond the collective's own
    (gloo writes its result by a copy)."""
    from autotp.testing.work import CopyCounter

    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    summand = _rank_inputs("reduce_scatter", case, block, r)
    memory = summand.permute(order).contiguous()
    x = memory.permute(sorted(range(summand.dim()), key=order.__getitem__)).requires_grad_()
    made = []
    for t, shard in ((x, case.shard), (memory, Shard(order.index(case.shard.dim)))):
        with CopyCounter() as copies:
            y = C.reduce_scatter_to_tp(t, group, shard, case.full_size)
        made.append(len([c for c in copies.copies if c.site == "gather_scatter._reduce_scatter"]))
        if t is x:
            y.backward(_tensor(case.seed, y.shape, "dy", block, r))
            out = y.detach()
    long = [i for i in range(x.dim()) if x.shape[i] > 1 and out.shape[i] > 1]
    whole = C.reduce_scatter_to_tp(summand, group, case.shard, case.full_size)
    return out, x.grad, _held(x, long), _held(out, long), whole, made


@settings(max_examples=25, deadline=None)
@given(case=cases(tps=(2, 4)), data=st.data())
# split along the dim the memory holds outermost: the summand is the ranks' blocks in rank order
@example(case=Case(2, Shard(1), (2, 4, 3), 7), data=None)
@example(case=Case(4, Shard(2), (3, 2, 8), 5), data=None)
@example(case=Case(4, Shard(0, unit=3), (12, 3), 0), data=None)   # summed in another order by the ring
def test_a_reduce_scatter_of_a_permuted_summand_keeps_its_layout_and_values(cluster, case, data):
    # an even split's summand reduce-scattered in its memory's order, the shard returned held so:
    # no copy beyond those of the contiguous tensor it is a permutation of (before: one more, to
    # make it contiguous or to stage it), the sum the contiguous summand's to float64's rounding
    order = (1, 0, 2)[:len(case.shape)] if data is None else tuple(data.draw(st.permutations(range(len(case.shape)))))
    if data is None and case.shard.dim == 2:
        order = (2, 0, 1)
    for rank, (y, grad, held_x, held_y, whole, made) in enumerate(
            cluster.run(run_held_reduce_scatter, case, order)):
        want_y, want_grad = _expected("reduce_scatter", case, rank // case.tp, rank % case.tp)
        torch.testing.assert_close(y, want_y)
        # gloo's ring sums each chunk of a buffer starting at another rank, so the summand laid out
        # otherwise in the buffer may round otherwise in the last bits (4.4e-16 seen: tp 4,
        # Shard(0, unit=3), (12, 3), order (1, 0)): the sums agree to float64's rounding, not bitwise
        torch.testing.assert_close(y, whole, rtol=2**-50, atol=2**-50)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
        if shards._split(case.full_size, case.shard, case.tp).even:
            assert held_y == held_x, (order, held_x, held_y)
            assert made[0] == made[1], (order, made)


@st.composite
def rows_cases(draw) -> Case:
    """An even contiguous split of dim 1 or 2 after 2 to ``gather_scatter.ROWS_COALESCED`` leading rows (the
    sequence of ``[b, s, h]`` at a batch above one; the hidden after as few ``b*s``): the layouts
    gathered and reduce-scattered row by row."""
    tp = draw(st.sampled_from((2, 4)))
    dim = draw(st.sampled_from((1, 2)))
    shape = [draw(st.integers(1, gather_scatter.ROWS_COALESCED)), draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    if dim == 2:   # b*s rows
        shape[1] = draw(st.integers(1, gather_scatter.ROWS_COALESCED // shape[0]))
    shape[dim] = tp * draw(st.integers(1, 3))
    rows = shape[0] * (shape[1] if dim == 2 else 1)
    if rows < 2:   # one row: the ranks' blocks in rank order already, another path
        shape[0] = 2
    return Case(tp, Shard(dim), tuple(shape), draw(st.integers(0, 2**31 - 1)))


def run_rows_mapping(op: str, case: Case, loop: bool = False) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Runs in a rank: a gather, gather_into or reduce-scatter of a split after a few rows, forward
    and backward through its autograd Function; the output, the input's gradient, and the copies
    the two collectives made (sites in gather_scatter.py, CopyCounter's). ``loop``: the rows one
    collective after another, as a backend without coalesced collectives takes them."""
    from autotp.testing.work import CopyCounter

    if loop:
        saved, gather_scatter._backend_coalesces = gather_scatter._backend_coalesces, lambda group, device: False
        try:
            return run_rows_mapping(op, case)
        finally:
            gather_scatter._backend_coalesces = saved

    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    x = _rank_inputs("gather" if op == "gather_into" else op, case, block, r).requires_grad_()
    fn = {"gather": C.gather_from_tp, "gather_into": C.gather_into_tp, "reduce_scatter": C.reduce_scatter_to_tp}[op]
    with CopyCounter() as copies:
        y = fn(x, group, case.shard, case.full_size)
        y.backward(_tensor(case.seed, y.shape, "dy", block, r))
    made = [c.site for c in copies.copies if c.site in ("gather_scatter._all_gather", "gather_scatter._reduce_scatter")]
    return y.detach(), x.grad, made


@settings(max_examples=20, deadline=None)
@given(op=st.sampled_from(["gather", "gather_into", "reduce_scatter"]), case=rows_cases(), loop=st.booleans())
@example(op="reduce_scatter", case=Case(2, Shard(1), (2, 4, 3), 7), loop=False)
@example(op="gather_into", case=Case(4, Shard(2), (2, 3, 8), 5), loop=True)
def test_collectives_after_a_few_rows_go_row_by_row_exactly_and_copy_nothing(cluster, op, case, loop):
    """A split of the sequence of [b, s, h] at a batch of 2 to ROWS_COALESCED (or of the hidden
    after as few rows): one collective a row, in one coalesced call (gloo's on CPU here) or
    (``loop``) one after another, straight between the tensor and the result. Forward and backward equal the definitions
    (a gather's values bit for bit; a sum to float64's rounding: gloo's ring adds each block
    starting at another rank), and neither direction stages the tensor (before: one copy of it
    each way)."""
    rows = case.shape[0] * (case.shape[1] if case.shard.dim == 2 else 1)
    assert 2 <= rows <= gather_scatter.ROWS_COALESCED, case
    for rank, (y, grad, made) in enumerate(cluster.run(run_rows_mapping, op, case, loop)):
        block, r = rank // case.tp, rank % case.tp
        want_y, want_grad = _expected("gather" if op == "gather_into" else op, case, block, r)
        if op == "gather_into":   # the gradient reduce-scattered: this rank's slice of the ranks' sum
            dy = sum(_tensor(case.seed, case.shape, "dy", block, q) for q in range(case.tp))
            want_grad = shards.local_shard(dy, case.shard, case.tp, r)
        exact = {"rtol": 0, "atol": 0}   # a gather, a slice; a sum to float64's rounding
        torch.testing.assert_close(y, want_y, **({} if op == "reduce_scatter" else exact),
                                   msg=lambda m: f"{op} forward, rank {rank}: {m}")
        torch.testing.assert_close(grad, want_grad, **(exact if op == "gather" else {}),
                                   msg=lambda m: f"{op} backward, rank {rank}: {m}")
        assert made == [], (op, case, made)


def run_gathers_in_a_row(first: Case, second: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in a rank: two gathers one after the other (the second reuses the first's kept
    staging buffer on the CPU); the first result is returned as it stands after the second."""
    mesh = get_mesh(first.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // first.tp
    ys = [C.gather_from_tp(_rank_inputs("gather", c, block, r), group, c.shard, c.full_size) for c in (first, second)]
    return ys[0], ys[1]


@settings(max_examples=10, deadline=None)
@given(first=cases(tps=(2, 4)), seed=st.integers(0, 2**31 - 1))
# the even split of a dim after dims of size 1, where laying out the buffer needs no copy
@example(first=Case(2, Shard(1), (1, 4, 3), 7), seed=8)
@example(first=Case(2, Shard(2), (1, 1, 6), 7), seed=8)
def test_gathered_tensors_never_share_the_kept_staging_buffer(cluster, first, seed):
    # the same layout again with other values: the one case the reused buffer fits exactly
    second = Case(first.tp, first.shard, first.shape, seed)
    for rank, ys in enumerate(cluster.run(run_gathers_in_a_row, first, second)):
        block = rank // first.tp
        for y, case in zip(ys, (first, second)):
            torch.testing.assert_close(y, _tensor(case.seed, case.shape, "x", block), rtol=0, atol=0)


def run_dynamic_module(op: str, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in a rank: a comm module built without a full size (a dynamic dim, as under
    sequence parallelism); the gather is told the size at call time, the others read it off
    their whole input."""
    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    x = _rank_inputs(op, case, block, r).requires_grad_()
    if op == "gather":
        y = comm_modules.GatherFromTP(group, case.shard, None)(x, case.full_size)
    else:
        cls = {"scatter": comm_modules.ScatterToTP, "reduce_scatter": comm_modules.ReduceScatterToTP}[op]
        y = cls(group, case.shard, None)(x)
    y.backward(_tensor(case.seed, y.shape, "dy", block, r))
    return y.detach(), x.grad


@settings(max_examples=10, deadline=None)
@given(op=st.sampled_from(["gather", "scatter", "reduce_scatter"]),
       case=cases().filter(lambda c: (c.shard.chunks, c.shard.unit) == (1, 1)))
def test_comm_modules_of_a_dynamic_dim_take_its_size_at_call_time(cluster, op, case):
    results = cluster.run(run_dynamic_module, op, case)
    for rank, (y, grad) in enumerate(results):
        want_y, want_grad = _expected(op, case, rank // case.tp, rank % case.tp)
        torch.testing.assert_close(y, want_y, msg=lambda m: f"{op} forward, rank {rank}: {m}")
        torch.testing.assert_close(grad, want_grad, msg=lambda m: f"{op} backward, rank {rank}: {m}")


def run_eager_module(op: str, case: Case, static: bool, in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in a rank: the mapping through its comm module's ``eager_forward``, what a program's
    eager code calls (autotp/runtime/module/eager_code.py). ``static``: the module holds the full
    size; else the gather is told it at call time and the others read it off their input."""
    mesh = get_mesh(case.tp)
    group, r, block = mesh.tp_group, mesh.tp_rank, dist.get_rank() // case.tp
    x = _rank_inputs("gather" if op == "gather_into" else op, case, block, r).requires_grad_()
    if op in ("f", "g"):
        module = (comm_modules.CopyToTP if op == "f" else comm_modules.ReduceFromTP)(group, in_place)
        y = module.eager_forward(x if op == "f" else x.clone())   # g: a partial nothing else reads
    else:
        cls = {"gather": comm_modules.GatherFromTP, "gather_into": comm_modules.GatherIntoTP,
               "scatter": comm_modules.ScatterToTP, "reduce_scatter": comm_modules.ReduceScatterToTP}[op]
        module = cls(group, case.shard, case.full_size if static else None)
        y = module.eager_forward(x, None if static or op in ("scatter", "reduce_scatter") else case.full_size)
    y.backward(_tensor(case.seed, y.shape, "dy", block, r))
    return y.detach(), x.grad


@settings(max_examples=25, deadline=None)
@given(op=st.sampled_from(["f", "g", "gather", "gather_into", "scatter", "reduce_scatter"]), case=cases(),
       static=st.booleans(), in_place=st.booleans())
def test_comm_modules_eager_forward_matches_the_definitions(cluster, op, case, static, in_place):
    """The eager code's call of a collective module (its Function through autograd's C++ apply,
    no module call) computes the mapping: forward and backward, every layout, tp 1, 2 and 4.
    gather_into is a gather forward whose gradient is reduce-scattered: each rank's slice of the
    sum of the ranks' gradients."""
    results = cluster.run(run_eager_module, op, case, static, in_place)
    for rank, (y, grad) in enumerate(results):
        block, r = rank // case.tp, rank % case.tp
        want_y, want_grad = _expected("gather" if op == "gather_into" else op, case, block, r)
        if op == "gather_into":
            dy = sum(_tensor(case.seed, case.shape, "dy", block, q) for q in range(case.tp))
            want_grad = shards.local_shard(dy, case.shard, case.tp, r)
        torch.testing.assert_close(y, want_y, msg=lambda m: f"{op} forward, rank {rank}: {m}")
        torch.testing.assert_close(grad, want_grad, msg=lambda m: f"{op} backward, rank {rank}: {m}")


def test_gather_of_a_dynamic_dim_without_its_size_names_the_missing_argument():
    with pytest.raises(CommError, match="gathered size of a dynamic dim"):
        comm_modules.GatherFromTP(None, Shard(1), None)(torch.zeros(2, 3))


def all_reduce_in_dtype(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in a rank: g forward and f backward on small integers (exact in every dtype)."""
    group, rank = get_mesh(WORLD).tp_group, dist.get_rank()
    y = C.reduce_from_tp(torch.full((3,), float(rank + 1), dtype=dtype), group)
    x = torch.zeros(3, dtype=dtype, requires_grad=True)
    C.copy_to_tp(x, group).backward(torch.full((3,), float(rank), dtype=dtype))
    return y, x.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_all_reduce_supports_float_dtypes_on_gloo(cluster, dtype):
    for y, grad in cluster.run(all_reduce_in_dtype, dtype):
        assert y.dtype == grad.dtype == dtype
        assert torch.equal(y, torch.full((3,), 10.0, dtype=dtype))  # 1 + 2 + 3 + 4
        assert torch.equal(grad, torch.full((3,), 6.0, dtype=dtype))  # 0 + 1 + 2 + 3


def all_reduce_alone_in_a_short_timeout_group() -> str | None:
    """Runs in a rank: rank 0 enters an all-reduce that rank 1 never joins."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() != 0:
        return None
    try:
        C.reduce_from_tp(torch.ones(2), group)
    except CommError as e:
        return str(e)
    return "no error"


def test_collective_timeout_is_a_comm_error_naming_op_group_and_fix(cluster):
    message = cluster.run(all_reduce_alone_in_a_short_timeout_group)[0]
    assert "all_reduce in g (forward)" in message
    assert "ranks [0, 1]" in message
    assert "rank died" in message and "DEFAULT_TIMEOUT" in message and "timeout=" in message


# ---------------------------------------------------------------- modules for fx graphs

def test_comm_modules_are_named_call_modules_that_hold_no_state():
    group = object()  # stands in for a ProcessGroup: never copied, never a buffer
    shard = Shard(1, chunks=3, unit=2)
    mods = {
        "f": comm_modules.CopyToTP(group), "g": comm_modules.ReduceFromTP(group),
        "gather": comm_modules.GatherFromTP(group, shard, 12), "scatter": comm_modules.ScatterToTP(group, shard, 12),
        "rs": comm_modules.ReduceScatterToTP(group, shard, 12),
    }
    assert [m.kind for m in mods.values()] == ["f", "g", "all_gather", "scatter", "reduce_scatter"]
    graph = fx.Graph()
    node = graph.placeholder("x")
    for name in mods:
        node = graph.call_module(name, (node,))
    graph.output(node)
    root = nn.Module()
    for name, mod in mods.items():
        root.add_module(name, mod)
    gm = fx.GraphModule(root, graph)

    assert "self.gather(" in gm.code and "self.rs(" in gm.code
    assert "GatherFromTP(ranks=?, shard=S(1x3/2), full_size=12)" in str(gm)
    assert gm.state_dict() == {} and list(gm.buffers()) == []
    copied = copy.deepcopy(gm)
    assert all(copied.get_submodule(name).group is group for name in mods)


# ---------------------------------------------------------------- under torch.compile

#: each mapping on a tp-2 group, its input's full shape, and the collective its backward issues
_COMPILED = {
    "f": (lambda x, g: C.copy_to_tp(x, g), (4, 6), "all_reduce"),
    "g": (lambda x, g: C.reduce_from_tp(x, g), (4, 6), None),
    "gather": (lambda x, g: C.gather_from_tp(x, g, Shard(0), 4), (2, 6), None),
    "scatter": (lambda x, g: C.scatter_to_tp(x, g, Shard(0), 4), (4, 6), "all_gather_into_tensor"),
    "reduce_scatter": (lambda x, g: C.reduce_scatter_to_tp(x, g, Shard(0), 4), (4, 6), "all_gather_into_tensor"),
}


@pytest.mark.parametrize("op", sorted(_COMPILED))
def test_a_mapping_of_a_buffer_written_through_slices_keeps_its_backward_under_compile(fake_rank, op):
    # DeepSeek-V3's key is a new_empty written through two slices (its k_nope and its k_rot), then
    # scattered to the rank's heads. Dynamo read the buffer as needing no gradient (the flag it
    # had when made), traced scatter's forward inline and dropped its backward's all-gather: only
    # the rank's own heads' gradient reached k_rot (compiled gradients 1.7e-3 off eager's)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    mapping, shape, backward_collective = _COMPILED[op]
    group = dist.group.WORLD
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def step(x):
        buf = x.new_empty(shape)   # needs no gradient when made ...
        buf[:, :2].copy_(x[:, :2])   # ... and needs one from here on
        buf[:, 2:].copy_(2 * x[:, 2:])
        y = mapping(buf, group)
        return (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum()

    step(x).backward()
    eager, x.grad = x.grad, None
    collectives = []

    def backward(gm, example_inputs):
        collectives.extend(n.target._opname for n in gm.graph.nodes
                           if n.op == "call_function" and "_c10d_functional" in str(n.target))
        return make_boxed_func(gm)

    torch._dynamo.reset()
    torch.compile(step, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=backward),
                  fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, eager, rtol=0, atol=0)
    if backward_collective is not None:   # the Function's own backward, not its forward's derivative
        assert backward_collective in collectives, collectives



def test_grad_if_of_a_buffer_written_through_slices_keeps_its_backward_under_compile():
    # no collective: grad_if passes no gradient back where keep is 0 (a per-block tail's copy on
    # a rank other than its set's first); traced inline, it passed the gradient back
    from autotp.distributed.functional import grad_if

    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def step(x):
        buf = x.new_empty(x.shape)
        buf[:, :2].copy_(x[:, :2])
        buf[:, 2:].copy_(3 * x[:, 2:])
        y = grad_if(buf, 0) + x
        return (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum()

    step(x).backward()
    eager, x.grad = x.grad, None
    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, eager, rtol=0, atol=0)
