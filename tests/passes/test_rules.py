"""Every strategy a sharding rule offers computes its op.

The harness plays the ranks of a tensor-parallel group in one process. Each tensor input is laid
out as the strategy asks (Replicate: the whole tensor on every rank; Shard: ``local_shard``;
Partial: random float64 summands that add up to it), every rank runs the op on its pieces with
the arguments its localizer writes, and the ranks' outputs, combined as the strategy's output
placement says, must equal the op on the whole tensors (Replicate: every rank's output; Shard:
each rank holds ``local_shard`` of it and ``assemble`` gives it back; Partial: the sum).
Forward values only, float64, rtol 1e-12. The current placements a rule is shown are drawn
freely; the strategies it answers with are what is checked.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import sympy
import torch
import torch.utils._pytree as pytree
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autotp.passes import rules
from autotp.passes.rules import pointwise
from autotp.passes.rules import LocalContext, OpInfo, Strategy, TensorMeta, localizer, strategies
from autotp.passes.rules.view_map import map_view_shard
from autotp.placements import PARTIAL, REPLICATE, Partial, Replicate, Routed, Shard
from autotp.distributed.shards import assemble, local_shard
from autotp.distributed.functional import vocab_parallel_embedding
from autotp.passes.rules.nn import BY_COLUMNS

aten = torch.ops.aten
R, P = REPLICATE, PARTIAL
F64 = torch.float64

# ---------------------------------------------------------------- hypothesis strategies

tps = st.integers(1, 8)
sizes = st.integers(1, 12)
seeds = st.integers(0, 2**32 - 1)


def shapes(min_ndim: int = 1, max_ndim: int = 4, size=sizes):
    return st.lists(size, min_size=min_ndim, max_size=max_ndim).map(tuple)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def block_sizes(draw, parts: int) -> tuple:
    """Relative sizes of 2 or more blocks that sum to ``parts`` (a q|k|v of fewer kv heads), or ()."""
    if parts < 3 or draw(st.booleans()):
        return ()
    cuts = sorted(draw(st.sets(st.integers(1, parts - 1), min_size=1, max_size=min(3, parts - 1))))
    return tuple(b - a for a, b in zip([0] + cuts, cuts + [parts]))


@st.composite
def shards(draw, shape: tuple, tp: int, dims=None) -> Shard:
    """A shard of one of ``dims`` of ``shape``: any chunks and unit that factor the dim (fewer
    atoms than ranks, even and uneven alike), any rotation; sometimes blocks of unequal size."""
    dim = draw(st.sampled_from(list(range(len(shape)) if dims is None else dims)))
    chunks = draw(st.sampled_from(_divisors(shape[dim])))
    unit = draw(st.sampled_from(_divisors(shape[dim] // chunks)))
    sizes = draw(block_sizes(chunks))
    return Shard(dim, len(sizes) if sizes else chunks, unit, draw(st.integers(0, tp - 1)), sizes=sizes)


@st.composite
def placements(draw, shape: tuple, tp: int, partial: bool = True, dims=None):
    """A current placement for a tensor of ``shape``: a shard (half the time: shards are where
    the rules differ), free (None), R, or P (floats only)."""
    if shape and (dims is None or dims) and draw(st.booleans()):
        return draw(shards(shape, tp, dims))
    return draw(st.sampled_from([None, R, P] if partial else [None, R]))


@st.composite
def hints_for(draw, size: int, tp: int) -> tuple:
    """A fresh-shard hint (chunks, unit, rotate[, tail, grouped, sizes]) for an output dim of
    ``size`` (fused q/k/v, heads; sometimes blocks of unequal size, a q|k|v of fewer kv heads)."""
    chunks = draw(st.sampled_from(_divisors(size)))
    unit = draw(st.sampled_from(_divisors(size // chunks)))
    sizes = draw(block_sizes(chunks))
    return (chunks, unit, draw(st.integers(0, tp - 1))) + ((0, False, sizes) if sizes else ())


@st.composite
def broadcast_shapes(draw, n: int) -> tuple[tuple, list[tuple]]:
    """An output shape and ``n`` input shapes that broadcast to it (leading dims dropped, dims set to 1)."""
    out = draw(shapes(1, 4, st.integers(1, 6)))
    ins = []
    for _ in range(n):
        lead = draw(st.integers(0, len(out)))
        ins.append(tuple(1 if draw(st.booleans()) and draw(st.booleans()) else s for s in out[lead:]))
    return out, ins


# ---------------------------------------------------------------- the harness

@dataclass
class Case:
    """One op call on whole tensors, the group size, and the inputs' current placements."""

    target: Any
    args: tuple
    kwargs: dict
    tp: int
    placements: tuple
    hints: dict = field(default_factory=dict)
    uneven: bool = False
    seed: int = 0

    def __repr__(self) -> str:
        show = pytree.tree_map(_meta_of_tensor, (self.args, self.kwargs))
        return (f"Case({rules.op_name(self.target)}, args={show}, tp={self.tp}, "
                f"placements={self.placements}, hints={self.hints}, uneven={self.uneven})")

    def info(self) -> OpInfo:
        return op_info(self.target, self.args, self.kwargs, self.tp, self.hints, self.uneven)


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(sympy.Integer(s) for s in t.shape), t.dtype)


def _tensors_in(args) -> list[torch.Tensor]:
    return [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]


def _meta_of_tensor(a: Any) -> Any:
    return _meta(a) if isinstance(a, torch.Tensor) else a


def _out_meta(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return _meta(out)
    if isinstance(out, (list, tuple)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(_meta(o) for o in out)
    return None


def op_info(target, args, kwargs, tp, hints=None, uneven=False) -> OpInfo:
    """What propagation would show a rule: tensors replaced by TensorMeta, output meta from a run."""
    out = target(*args, **kwargs)
    targs, tkwargs = pytree.tree_map(_meta_of_tensor, (tuple(args), dict(kwargs)))
    inputs = tuple(_meta(a) for a in _tensors_in((tuple(args), dict(kwargs))))
    return OpInfo(target, targs, tkwargs, inputs, _out_meta(out), tp, dict(hints or {}), uneven)


def distribute(full: torch.Tensor, want, tp: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Each rank's piece of ``full`` laid out as ``want``."""
    if isinstance(want, Replicate):
        return [full.clone() for _ in range(tp)]
    if isinstance(want, Shard):
        return [local_shard(full, want, tp, r) for r in range(tp)]
    if isinstance(want, Partial):
        if full.is_floating_point():
            # Unequal shares of the value plus noise that cancels: a non-linear op cannot hide.
            w = torch.rand(tp, generator=gen, dtype=F64) + 0.1
            w = (w / w.sum()).to(full.dtype)
            noise = torch.randn((tp,) + tuple(full.shape), generator=gen, dtype=full.dtype)
            noise = noise - noise.mean(0)
            return [full * w[r] + noise[r] for r in range(tp)]
        if full.dtype != torch.bool:
            others = [torch.randint(-5, 5, full.shape, generator=gen, dtype=full.dtype) for _ in range(tp - 1)]
            return [full - sum(others, torch.zeros_like(full))] + others
    pytest.fail(f"strategy asks for an input of dtype {full.dtype} to be {want!r}")


def _close(actual, expected, what: str) -> None:
    if not isinstance(expected, torch.Tensor):
        assert actual == expected, what
        return
    assert isinstance(actual, torch.Tensor), what
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def combine_and_compare(outs: list, placement, full, tp: int, what: str) -> None:
    """The ranks' outputs, combined as ``placement`` says, equal ``full``."""
    if isinstance(full, (list, tuple)):
        each = placement if isinstance(placement, tuple) else (placement,) * len(full)
        assert len(each) == len(full), f"{what}: {len(each)} output placements for {len(full)} outputs"
        for i, (p, f) in enumerate(zip(each, full)):
            combine_and_compare([o[i] for o in outs], p, f, tp, f"{what} output {i}")
        return
    if not isinstance(full, torch.Tensor) or isinstance(placement, Replicate):
        for r, o in enumerate(outs):
            _close(o, full, f"{what} on rank {r}")
    elif isinstance(placement, Shard):
        for r, o in enumerate(outs):
            _close(o, local_shard(full, placement, tp, r), f"{what} on rank {r}")
        _close(assemble(outs, placement, full.shape[placement.dim]), full, f"{what} assembled")
    elif isinstance(placement, Partial):
        _close(sum(outs[1:], outs[0]), full, f"{what} summed over ranks")
    else:
        pytest.fail(f"{what}: a tensor output placed as {placement!r}")


def check_strategy(info: OpInfo, strategy: Strategy, args: tuple, kwargs: dict, seed: int = 0) -> None:
    """Run ``strategy`` on simulated ranks; see the module docstring."""
    tp = info.tp
    what = f"{rules.op_name(info.target)} {strategy!r} (tp={tp})"
    full = info.target(*args, **kwargs)
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    at = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
    assert len(strategy.inputs) == len(at), f"{what}: {len(strategy.inputs)} placements, {len(at)} tensor inputs"
    gen = torch.Generator().manual_seed(seed)
    per_rank = [list(leaves) for _ in range(tp)]
    for i, want in zip(at, strategy.inputs):
        for r, piece in enumerate(distribute(leaves[i], want, tp, gen)):
            per_rank[r][i] = piece
    loc = localizer(info.target)
    if _splits_the_statistic(info, strategy):
        xs = [per_rank[r][at[0]] for r in range(tp)]
        return combine_and_compare(_split_rms_norm_on_ranks(info, xs, args), strategy.output, full, tp, what)
    outs = []
    for r in range(tp):
        a, kw = pytree.tree_unflatten(per_rank[r], spec)
        target = info.target
        if _picks_routed_rows(info, strategy):
            outs.append(_routed_pick_on_rank(info, strategy, a, r, full))
            continue
        if _reads_by_columns(strategy):   # its all-to-all, simulated: every rank's rows, cut by columns
            rows = assemble([per_rank[q][at[0]] for q in range(tp)], strategy.inputs[0], leaves[at[0]].shape[0])
            a = (local_shard(rows, strategy.output.with_dim(1), tp, r),) + tuple(a[1:])
        elif loc is not None:
            target, a, kw = loc(info, strategy, tuple(a), dict(kw), LocalContext(tp, r))
        outs.append(_call(target, a, kw))
    combine_and_compare(outs, strategy.output, full, tp, what)


def _reads_by_columns(strategy: Strategy) -> bool:
    """An embedding's vocab-split table read by columns (rules/nn.py): the rank's program runs the
    lookup on the table an all-to-all made (``EmbeddingByColumns``), which these simulated ranks
    cannot run; the op itself then runs on what the all-to-all hands the rank."""
    return any(kind == BY_COLUMNS for kind, _ in strategy.internal)


def _splits_the_statistic(info: OpInfo, strategy: Strategy) -> bool:
    """An ``rms_norm`` (no weight) split along a normalized dim: the rank's program runs
    ``SplitRmsNorm``, whose all-reduce of each rank's sum of squares these simulated ranks make."""
    return info.target is aten.rms_norm.default and any(kind == "all_reduce" for kind, _ in strategy.internal)


def _split_rms_norm_on_ranks(info: OpInfo, xs: list, args: tuple) -> list:
    """What ``SplitRmsNorm`` computes on each rank, its all-reduce made here: every rank's sum of
    squares over the normalized dims summed over ranks, each rank's part scaled by it."""
    k = len(args[1])
    dims = list(range(xs[0].ndim - k, xs[0].ndim))
    count = 1
    for size in args[1]:
        count *= int(size)
    eps = args[3] if len(args) > 3 and args[3] is not None else torch.finfo(xs[0].dtype).eps
    total = sum(x.square().sum(dims, keepdim=True) for x in xs)
    return [x * torch.rsqrt(total / count + eps) for x in xs]


def _picks_routed_rows(info: OpInfo, strategy: Strategy) -> bool:
    """``weight[ids]`` with the stack split by whole experts and the rows it picks ``Routed``."""
    return (info.target is aten.index.Tensor and isinstance(strategy.output, Routed)
            and not isinstance(strategy.inputs[0], Routed))


def _routed_pick_on_rank(info: OpInfo, strategy: Strategy, args: tuple, rank: int, full: torch.Tensor):
    """What rank ``rank`` runs of a pick of its own experts' rows (the rewrite's program:
    ``distributed.experts.picked_rows`` and ``routed_pick``), its compact rows put back in place
    among zeros, so the ranks' results sum to the whole pick as a Routed value's do."""
    from autotp.placements import local_ranges
    from autotp.distributed import experts as E

    weight, (ids,) = args[0], args[1]
    total = int(info.inputs[0].shape[0])
    ((first, stop),) = local_ranges(total, strategy.inputs[0], info.tp, rank) or ((0, 0),)
    rows = E.picked_rows(ids, first, stop - first, total)
    out = full.new_zeros(full.shape)
    out[rows] = E.routed_pick(weight, ids, rows, first, total)
    return out


_SDPA_CRASHES_ON_NO_HEADS = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)


def _call(target, args, kwargs):
    """``target(*args, **kwargs)``, except where torch < 2.12's CPU attention kernel kills the
    process (SIGFPE) on a local shard of zero heads: its result, empty, is made here. autotp
    never runs one (tp above the heads is refused), but drawn shards here can be empty."""
    if _SDPA_CRASHES_ON_NO_HEADS and target is aten.scaled_dot_product_attention.default \
            and 0 in args[0].shape[:-2]:
        q, v = args[0], args[2]
        return q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    return target(*args, **kwargs)


def check_case(case: Case, only=lambda s: True) -> list[Strategy]:
    """Every strategy the rule offers for ``case`` (those ``only`` selects) computes the op."""
    info = case.info()
    assert len(case.placements) == len(info.inputs)
    offered = strategies(info, tuple(case.placements))
    assert offered, f"no strategy for {case!r}"
    for s in offered:
        if only(s):
            check_strategy(info, s, case.args, case.kwargs, case.seed)
    return offered


def _tensor(gen: torch.Generator, shape, dtype=F64, low: int = 0, high: int = 5) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(tuple(shape), generator=gen) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(low, high, tuple(shape), generator=gen, dtype=dtype)
    return torch.randn(tuple(shape), generator=gen, dtype=dtype)


@st.composite
def _case(draw, target, tensors: list, other_args=(), kwargs=None, hints=None, uneven=False, tp=None,
          partial=True, place=None, keep=()) -> Case:
    """A Case calling ``target(*tensors, *other_args, **kwargs)`` with drawn current placements;
    half the time the first tensor is sharded on one of ``keep``, the dims the op can keep split."""
    tp = draw(tps) if tp is None else tp
    ps = place if place is not None else tuple(
        draw(placements(tuple(t.shape), tp, partial and t.is_floating_point())) for t in tensors
    )
    if place is None and keep and draw(st.booleans()):
        ps = (draw(shards(tuple(tensors[0].shape), tp, keep)),) + ps[1:]
    return Case(target, tuple(tensors) + tuple(other_args), dict(kwargs or {}), tp, ps, hints or {}, uneven,
                draw(seeds))


def _gen(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(seeds))


def _offers(offered: list[Strategy], inputs: tuple, output) -> bool:
    return any(s.inputs == inputs and s.output == output for s in offered)


# ---------------------------------------------------------------- matrix products

@st.composite
def mm_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    m, k, n = draw(sizes), draw(sizes), draw(sizes)
    x, w = _tensor(gen, (m, k)), _tensor(gen, (k, n))
    hints = {1: draw(hints_for(n, tp))} if draw(st.booleans()) else {}
    return draw(_case(aten.mm.default, [x, w], hints=hints, uneven=draw(st.booleans()), tp=tp))


@st.composite
def linear_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    batch = draw(shapes(1, 2, st.integers(1, 6)))
    k, n = draw(sizes), draw(sizes)
    x, w = _tensor(gen, batch + (k,)), _tensor(gen, (n, k))
    hints = {len(batch): draw(hints_for(n, tp))} if draw(st.booleans()) else {}
    return draw(_case(aten.linear.default, [x, w], hints=hints, uneven=draw(st.booleans()), tp=tp))


@st.composite
def bmm_cases(draw) -> Case:
    gen = _gen(draw)
    target = draw(st.sampled_from([aten.bmm.default, aten.matmul.default]))
    batch = (draw(st.integers(1, 6)),) if target is aten.bmm.default else draw(shapes(0, 2, st.integers(1, 4)))
    m, k, n = draw(sizes), draw(sizes), draw(sizes)
    return draw(_case(target, [_tensor(gen, batch + (m, k)), _tensor(gen, batch + (k, n))]))


@settings(max_examples=100, deadline=None)
@given(case=mm_cases())
def test_mm_column_row_and_batch_parallel_strategies_compute_mm(case):
    check_case(case)


@settings(max_examples=100, deadline=None)
@given(case=linear_cases())
def test_linear_strategies_compute_linear(case):
    check_case(case)


@settings(max_examples=60, deadline=None)
@given(case=bmm_cases())
def test_bmm_and_matmul_strategies_compute_the_batched_product(case):
    check_case(case)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_linear_with_a_bias_runs_replicated(data):
    gen, tp = _gen(data.draw), data.draw(tps)
    x, w, b = _tensor(gen, (3, 4)), _tensor(gen, (5, 4)), _tensor(gen, (5,))
    offered = check_case(data.draw(_case(aten.linear.default, [x, w, b], tp=tp)))
    assert offered == [Strategy((R, R, R), R)]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_column_shard_follows_the_output_hint(data):
    # Fused q/k/v: each rank's heads of q, k and v, not a contiguous third of the columns.
    tp = data.draw(tps)
    gen = _gen(data.draw)
    heads, head_dim = tp * data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    n = 3 * heads * head_dim
    case = data.draw(_case(aten.mm.default, [_tensor(gen, (4, 5)), _tensor(gen, (5, n))],
                           hints={1: (3, head_dim, 0)}, tp=tp, place=(R, None)))
    column = Shard(1, 3, head_dim)
    assert _offers(check_case(case), (R, column), column)


# ---------------------------------------------------------------- embedding

@st.composite
def embedding_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    vocab, hidden = draw(sizes), draw(sizes)
    weight = _tensor(gen, (vocab, hidden))
    indices = _tensor(gen, draw(shapes(1, 2, st.integers(1, 6))), torch.long, 0, vocab)
    hints = {indices.ndim: draw(hints_for(hidden, tp))} if draw(st.booleans()) else {}
    return draw(_case(aten.embedding.default, [weight, indices], hints=hints, uneven=draw(st.booleans()), tp=tp))


@settings(max_examples=100, deadline=None)
@given(case=embedding_cases())
def test_embedding_strategies_compute_the_lookup(case):
    check_case(case)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_a_vocab_sharded_embedding_is_partial_through_vocab_parallel_embedding(data):
    tp, gen = data.draw(tps), _gen(data.draw)
    chunks, unit = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    vocab = chunks * unit * data.draw(st.integers(tp, 2 * tp + 1))   # every rank holds a row
    weight, indices = _tensor(gen, (vocab, 3)), _tensor(gen, (2, 5), torch.long, 0, vocab)
    vocab_shard = Shard(0, chunks, unit, data.draw(st.integers(0, tp - 1)))
    case = data.draw(_case(aten.embedding.default, [weight, indices], tp=tp, place=(vocab_shard, R)))
    offered = check_case(case)
    assert _offers(offered, (vocab_shard, R), P)
    strategy = next(s for s in offered if s.inputs == (vocab_shard, R))
    target, _, _ = localizer(aten.embedding.default)(case.info(), strategy, case.args, {}, LocalContext(tp, 0))
    assert target is vocab_parallel_embedding


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_vocab_split_table_may_be_read_by_columns(data):
    """A table split by vocabulary (tied to a vocab-parallel head) read by columns: its all-to-all
    inside the op (``Strategy.internal``), each rank looking up every id in its columns, the output
    split on its last dim; simulated here (:func:`_reads_by_columns`), run on gloo ranks in
    tests/e2e/test_embedding_by_columns.py."""
    tp, gen = data.draw(tps), _gen(data.draw)
    vocab = data.draw(st.integers(tp, 3 * tp + 2))   # every rank holds a row; tp need not divide it
    hidden = tp * data.draw(st.integers(1, 3))
    weight, indices = _tensor(gen, (vocab, hidden)), _tensor(gen, (2, 5), torch.long, 0, vocab)
    case = data.draw(_case(aten.embedding.default, [weight, indices], tp=tp, place=(Shard(0), R)))
    offered = check_case(case)
    by_columns = [s for s in offered if s.internal]
    assert [(s.inputs, s.output, [k for k, _ in s.internal]) for s in by_columns] \
        == [((Shard(0), R), Shard(2), [BY_COLUMNS])], offered


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_an_embedding_that_scales_by_frequency_or_is_sparse_is_not_split_by_vocabulary(data):
    """scale_grad_by_freq counts each index's uses, and a vocab split's masked positions would
    count as uses of every rank's row 0; a sparse gradient is not split by rows here. The padding
    row, though, goes through (vocab_parallel_embedding takes it on)."""
    tp, gen = data.draw(tps), _gen(data.draw)
    vocab = data.draw(st.integers(tp, 2 * tp + 1))
    weight, indices = _tensor(gen, (vocab, 3)), _tensor(gen, (2, 5), torch.long, 0, vocab)
    pad = data.draw(st.integers(-1, vocab - 1))
    freq, sparse = data.draw(st.sampled_from([(True, False), (False, True), (False, False)]))
    case = data.draw(_case(aten.embedding.default, [weight, indices, pad, freq, sparse], tp=tp,
                           place=(Shard(0), R)))
    offered = check_case(case)
    assert _offers(offered, (Shard(0), R), P) == (not freq and not sparse)
    if not (freq or sparse):
        strategy = next(s for s in offered if s.inputs == (Shard(0), R))
        _, args, _ = localizer(aten.embedding.default)(case.info(), strategy, case.args, {}, LocalContext(tp, 0))
        assert args[3] == pad


# ---------------------------------------------------------------- normalization, attention, softmax, reductions

@st.composite
def norm_cases(draw) -> Case:
    gen = _gen(draw)
    shape = draw(shapes(1, 4, st.integers(1, 6)))
    normalized = shape[len(shape) - draw(st.integers(1, len(shape))):]
    params = [_tensor(gen, normalized) if draw(st.booleans()) else None for _ in range(2)]
    x = _tensor(gen, shape)
    if draw(st.booleans()):
        target, args = aten.layer_norm.default, [x, list(normalized), params[0], params[1], 1e-5]
    else:
        target, args = aten.rms_norm.default, [x, list(normalized), params[0], 1e-5]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    case = draw(_case(target, tensors, keep=range(len(shape) - len(normalized))))
    return replace(case, args=tuple(args))


@settings(max_examples=80, deadline=None)
@given(case=norm_cases())
def test_layer_norm_and_rms_norm_strategies_compute_the_norm(case):
    offered = check_case(case)
    normalized = len(case.args[1])
    # split along a normalized dim only as SplitRmsNorm (an rms_norm without a weight, its
    # statistic all-reduced), checked above on the simulated ranks like every strategy
    assert all(not isinstance(s.output, Shard) or s.output.dim < case.args[0].ndim - normalized
               or (case.target is aten.rms_norm.default and case.args[2] is None and s.internal)
               for s in offered)


@st.composite
def sdpa_cases(draw, ndim: int = 4) -> Case:
    gen = _gen(draw)
    lead = tuple(draw(st.integers(1, 4)) for _ in range(ndim - 2))   # (b, heads) for 4-D
    s, s_kv, d = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    q, k, v = _tensor(gen, lead + (s, d)), _tensor(gen, lead + (s_kv, d)), _tensor(gen, lead + (s_kv, d))
    tensors, kwargs = [q, k, v], {"dropout_p": 0.0}
    mask = draw(st.sampled_from(["none", "bool", "causal"]))
    if mask == "bool":
        mask_shape = (lead[0],) + (1,) * (ndim - 3) + (s, s_kv) if draw(st.booleans()) else (s, s_kv)
        m = _tensor(gen, mask_shape, torch.bool)
        m[..., 0] = True   # every query sees a key: no all-masked rows
        tensors.append(m)
    kwargs["is_causal"] = mask == "causal"
    if draw(st.booleans()):
        kwargs["scale"] = 0.3
    case = draw(_case(aten.scaled_dot_product_attention.default, tensors))
    args = case.args[:3]
    if len(case.args) > 3:
        kwargs["attn_mask"] = case.args[3]
    return replace(case, args=args, kwargs=kwargs)


@settings(max_examples=100, deadline=None)
@given(case=sdpa_cases())
def test_attention_split_by_batch_or_heads_computes_attention(case):
    check_case(case)


@settings(max_examples=60, deadline=None)
@given(case=sdpa_cases(ndim=3))
def test_three_dim_attention_is_never_split_along_the_sequence(case):
    check_case(case)


@st.composite
def softmax_cases(draw) -> Case:
    gen = _gen(draw)
    shape = draw(shapes(1, 4, st.integers(1, 6)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    target = draw(st.sampled_from([aten._softmax.default, aten._log_softmax.default,
                                   aten.softmax.int, aten.log_softmax.int]))
    other = (dim, False) if target in (aten._softmax.default, aten._log_softmax.default) else (dim,)
    keep = [d for d in range(len(shape)) if d != dim % len(shape)]
    return draw(_case(target, [_tensor(gen, shape)], other, keep=keep))


@settings(max_examples=80, deadline=None)
@given(case=softmax_cases())
def test_softmax_strategies_keep_the_softmax_dim_whole(case):
    check_case(case)


@st.composite
def topk_cases(draw) -> Case:
    gen = _gen(draw)
    shape = draw(shapes(1, 3, st.integers(1, 6)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    k = draw(st.integers(1, shape[dim]))
    keep = [d for d in range(len(shape)) if d != dim % len(shape)]
    # distinct values: ties would let a rank pick another of equal indices than the whole op
    x = torch.randperm(math.prod(shape), generator=gen).to(F64).reshape(shape)
    return draw(_case(aten.topk.default, [x], (k, dim), keep=keep))


@settings(max_examples=60, deadline=None)
@given(case=topk_cases())
def test_topk_strategies_keep_a_shard_of_another_dim(case):
    # a router's top-k experts per token on the tokens a rank holds: values and indices alike
    offered = check_case(case)
    p, dim = case.placements[0], case.args[2] % case.args[0].ndim
    if isinstance(p, Shard) and p == Shard(p.dim) and p.dim != dim:
        assert Strategy((p,), (p, p)) in offered, offered


REDUCTIONS = [aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.correction]


@st.composite
def reduction_cases(draw, target=None) -> Case:
    gen = _gen(draw)
    target = draw(st.sampled_from(REDUCTIONS)) if target is None else target
    shape = draw(shapes(1, 4, st.integers(1, 6)))
    some = st.lists(st.integers(0, len(shape) - 1), unique=True, min_size=1, max_size=len(shape))
    dims = draw(st.one_of(some, st.just([])))   # dim=[]: every dim
    dims = [d - len(shape) if draw(st.booleans()) else d for d in dims]   # negative dims too
    keep = draw(st.booleans())
    if target is aten.var.correction:
        other, kwargs = (dims,), {"correction": 1, "keepdim": keep}
    else:
        other, kwargs = (dims, keep), {}
    kept = [d for d in range(len(shape)) if dims and d not in [e % len(shape) for e in dims]]
    return draw(_case(target, [_tensor(gen, shape)], other, kwargs, keep=kept))


@settings(max_examples=100, deadline=None)
@given(case=reduction_cases())
def test_reduction_strategies_compute_the_reduction(case):
    check_case(case)


@st.composite
def max_dim_cases(draw) -> Case:
    gen = _gen(draw)
    target = draw(st.sampled_from([aten.max.dim, aten.min.dim]))
    shape = draw(shapes(1, 4, st.integers(1, 6)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    keep = draw(st.booleans())
    kept = [d for d in range(len(shape)) if d != dim % len(shape)]
    return draw(_case(target, [_tensor(gen, shape)], (dim, keep), keep=kept))


@settings(max_examples=30, deadline=None)
@given(case=max_dim_cases())
def test_max_along_a_dim_keeps_another_dims_shard(case):
    offered = check_case(case)
    p = case.placements[0]
    dim = case.args[1] % case.args[0].ndim
    if isinstance(p, Shard) and p.dim != dim:
        assert any(s.inputs == (p,) and isinstance(s.output, tuple) for s in offered)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_a_sum_over_a_sharded_dim_is_partial(data):
    tp, gen = data.draw(tps), _gen(data.draw)
    x = _tensor(gen, data.draw(shapes(1, 3)))
    shard = data.draw(shards(tuple(x.shape), tp))
    dims = sorted({shard.dim} | set(data.draw(st.lists(st.integers(0, x.ndim - 1), max_size=2))))
    case = data.draw(_case(aten.sum.dim_IntList, [x], (dims, data.draw(st.booleans())), tp=tp, place=(shard,)))
    assert _offers(check_case(case), (shard,), P)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_mean_over_a_dim_split_into_heads_is_partial(data):
    """OLMo2's q_norm statistic: the mean of squares over all heads' width, split by head (atoms of
    head_dim, uneven runs and rotation drawn), is each rank's sum over the whole count; a plain
    split of the dim (the residual stream's hidden dim) is not offered it."""
    tp, gen = data.draw(tps), _gen(data.draw)
    heads, head_dim = data.draw(st.integers(1, 6)), data.draw(st.integers(2, 4))
    lead = data.draw(shapes(0, 2, st.integers(1, 4)))
    x = _tensor(gen, lead + (heads * head_dim,))
    shard = Shard(len(lead), 1, head_dim, data.draw(st.integers(0, tp - 1)))
    case = data.draw(_case(aten.mean.dim, [x], ([-1], True), tp=tp, place=(shard,)))
    assert _offers(check_case(case), (shard,), P)
    plain = Shard(len(lead))
    assert not _offers(strategies(case.info(), (plain,)), (plain,), P)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_unbind_strategies_compute_the_pieces(data):
    """ModernBERT's ``[b, s, 3, heads, d].unbind(2)``: a shard of another dim (the heads) passes to
    every piece."""
    gen = _gen(data.draw)
    shape = data.draw(shapes(2, 4, st.integers(1, 5)))
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    others = [d for d in range(len(shape)) if d != dim % len(shape)]
    case = data.draw(_case(aten.unbind.int, [_tensor(gen, shape)], (dim,), keep=others))
    offered = check_case(case)
    p = case.placements[0]
    if isinstance(p, Shard) and p.dim != dim % len(shape):
        assert any(s.inputs == (p,) and isinstance(s.output[0], Shard) for s in offered), offered


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_nll_loss_runs_replicated(data):
    gen, n, c = _gen(data.draw), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    logp, target = torch.log_softmax(_tensor(gen, (n, c)), -1), _tensor(gen, (n,), torch.long, 0, c)
    op = data.draw(st.sampled_from([aten.nll_loss_forward.default, aten.nll_loss.default]))
    case = data.draw(_case(op, [logp, target], (None, 1, -100)))
    assert all(set(s.inputs) == {R} for s in check_case(case))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_cross_entropy_whole_computes_the_loss_and_the_vocab_parallel_form_declares_its_collectives(data):
    # The vocab-parallel form communicates inside itself; the runtime tests run it on real ranks.
    gen, tp = _gen(data.draw), data.draw(tps)
    n, vocab = data.draw(st.integers(1, 6)), data.draw(sizes)
    logits, target = _tensor(gen, (n, vocab)), _tensor(gen, (n,), torch.long, 0, vocab)
    case = data.draw(_case(aten.cross_entropy_loss.default, [logits, target], (None, 1, -100, 0.0), tp=tp))
    offered = check_case(case, only=lambda s: set(s.inputs) == {R})
    assert _offers(offered, (R, R), R)
    assert all(s.internal for s in offered if set(s.inputs) != {R})


# ---------------------------------------------------------------- views

def _regroup(draw, factors: list[int]) -> tuple:
    """``factors`` cut into consecutive runs (each run one dim), with size-1 dims sprinkled in."""
    dims, run = [], 1
    for i, f in enumerate(factors):
        run *= f
        if i == len(factors) - 1 or draw(st.booleans()):
            dims.append(run)
            run = 1
    for _ in range(draw(st.integers(0, 2 if dims else 1))):
        dims.insert(draw(st.integers(0, len(dims))), 1)
    return tuple(dims)


@st.composite
def view_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    factors = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    src, dst = _regroup(draw, factors), _regroup(draw, factors)
    sizes_arg = list(dst)
    if dst and draw(st.booleans()):
        sizes_arg[draw(st.integers(0, len(dst) - 1))] = -1
    target = draw(st.sampled_from([aten.view.default, aten.reshape.default, aten._unsafe_view.default]))
    return draw(_case(target, [_tensor(gen, src)], (sizes_arg,), tp=tp))


@settings(max_examples=150, deadline=None)
@given(case=view_cases())
def test_view_moves_a_shard_onto_the_output_dim_holding_the_same_elements(case):
    check_case(case)


B, S = 2, 3
GPT2_VIEWS = [
    # (input shape, view sizes, input shard, output shard)
    ((B, S, 32), [B, S, 4, 8], Shard(2, 1, 8), Shard(2)),             # split heads
    ((B, S, 32), [B, S, -1, 8], Shard(2, 1, 8), Shard(2)),            # split heads as GPT-2 writes it
    ((B, S, 4, 8), [B, S, 32], Shard(2), Shard(2, 1, 8)),             # merge heads
    ((B * S, 16), [B, S, 16], Shard(1), Shard(2)),                    # (b*s, h) -> (b, s, h)
    ((B, S, 16), [-1, 16], Shard(2), Shard(1)),                       # (b, s, h) -> (b*s, h)
    ((B, S, 16), [-1, 16], Shard(0), Shard(0, 1, S)),                 # batch-parallel rows
    ((B * S, 96), [B, S, 96], Shard(1, 3, 8), Shard(2, 3, 8)),        # fused q/k/v, 4 heads of 8
]


@pytest.mark.parametrize("shape, sizes_arg, shard, expected", GPT2_VIEWS, ids=str)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_gpt2_views_map_the_head_shard(shape, sizes_arg, shard, expected, data):
    tp, gen = data.draw(tps), _gen(data.draw)
    rotate = data.draw(st.integers(0, tp - 1))
    shard, expected = replace(shard, rotate=rotate), replace(expected, rotate=rotate)
    case = data.draw(_case(aten.view.default, [_tensor(gen, shape)], (sizes_arg,), tp=tp, place=(shard,)))
    assert map_view_shard(case.info().inputs[0].shape, case.info().output.shape, shard) == expected
    assert _offers(check_case(case), (shard,), expected)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fused_qkv_split_gives_each_piece_the_rank_heads(data):
    # (b, s, 3h) with each rank's heads of q, k and v -> three (b, s, h) pieces, one block each.
    tp, gen = data.draw(tps), _gen(data.draw)
    heads, head_dim = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 4))
    h = heads * head_dim
    qkv = Shard(2, 3, head_dim, data.draw(st.integers(0, tp - 1)))
    case = data.draw(_case(aten.split.Tensor, [_tensor(gen, (2, 3, 3 * h))], (h, 2), tp=tp, place=(qkv,)))
    piece = Shard(2, 1, head_dim, qkv.rotate)
    assert _offers(check_case(case), (qkv,), (piece, piece, piece))


@st.composite
def split_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    shape = draw(shapes(1, 3))
    dim = draw(st.integers(0, len(shape) - 1))
    if draw(st.booleans()):
        target, other = aten.split.Tensor, (draw(st.integers(1, shape[dim])), dim)
    else:
        cuts = draw(st.lists(st.integers(1, shape[dim] - 1), unique=True, max_size=3)) if shape[dim] > 1 else []
        bounds = [0] + sorted(cuts) + [shape[dim]]
        target, other = aten.split_with_sizes.default, ([b - a for a, b in zip(bounds, bounds[1:])], dim)
    return draw(_case(target, [_tensor(gen, shape)], other, tp=tp))


@settings(max_examples=80, deadline=None)
@given(case=split_cases())
def test_split_strategies_compute_the_pieces(case):
    check_case(case)


@st.composite
def reshaping_cases(draw) -> Case:
    """transpose, t, permute, unsqueeze, squeeze, select, slice, expand and the identities."""
    gen = _gen(draw)
    shape = draw(shapes(1, 4, st.integers(1, 6)))
    nd = len(shape)
    dim = draw(st.integers(-nd, nd - 1))
    kind = draw(st.sampled_from(["transpose", "t", "permute", "unsqueeze", "squeeze", "select", "slice",
                                 "expand", "identity"]))
    if kind == "transpose":
        target, other = aten.transpose.int, (dim, draw(st.integers(-nd, nd - 1)))
    elif kind == "t":
        shape = shape[:2]
        target, other = aten.t.default, ()
    elif kind == "permute":
        target, other = aten.permute.default, (draw(st.permutations(range(nd))),)
    elif kind == "unsqueeze":
        target, other = aten.unsqueeze.default, (draw(st.integers(-nd - 1, nd)),)
    elif kind == "squeeze":
        shape = tuple(1 if draw(st.booleans()) else s for s in shape)
        target, other = draw(st.sampled_from([(aten.squeeze.dim, (dim,)), (aten.squeeze.default, ()),
                                              (aten.squeeze.dims, ([dim],))]))
    elif kind == "select":
        target, other = aten.select.int, (dim, draw(st.integers(-shape[dim], shape[dim] - 1)))
    elif kind == "slice":
        start = draw(st.integers(-shape[dim], shape[dim]))
        end = draw(st.sampled_from([shape[dim], 2**63 - 1, max(start, 0) + 1]))
        target, other = aten.slice.Tensor, (dim, start, end, draw(st.integers(1, 2)))
    elif kind == "expand":
        lead = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2))))
        shape = tuple(1 if draw(st.booleans()) else s for s in shape)
        wide = [draw(st.integers(1, 3)) if s == 1 else draw(st.sampled_from([s, -1])) for s in shape]
        target, other = aten.expand.default, (list(lead) + wide,)
    else:
        target, other = draw(st.sampled_from([aten.contiguous.default, aten.clone.default, aten.alias.default,
                                              aten.detach.default, aten.lift_fresh_copy.default])), ()
    return draw(_case(target, [_tensor(gen, shape)], other))


@settings(max_examples=200, deadline=None)
@given(case=reshaping_cases())
# a squeeze of the split dim itself, of size 1, its trailing sizes matched by the output's: once
# offered as keeping the shard (S(1) -> S(0)), where rank 1's empty local dim is not squeezed
@example(case=Case(aten.squeeze.dim, (torch.tensor([[[1.5]]], dtype=torch.float64), 1), {}, 2, (Shard(1),), {},
                   False, 0))
def test_transposes_squeezes_slices_and_expands_carry_the_shard_along(case):
    check_case(case)


@st.composite
def block_slice_cases(draw) -> Case:
    """A slice of whole blocks of a dim split in blocks of heads (Phi-3's fused q|k|v read back
    with ``qkv[..., :q]``, ``[q:q+k]``, ``[q+k:]``): every rank holds the same heads of each block."""
    gen, tp = _gen(draw), draw(tps)
    chunks, atoms, unit = draw(st.integers(2, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    lead = draw(shapes(0, 2, st.integers(1, 3)))
    block = atoms * unit
    first = draw(st.integers(0, chunks - 1))
    last = draw(st.integers(first + 1, chunks))
    dim = len(lead)
    shard = Shard(dim, chunks, unit, draw(st.integers(0, tp - 1)))
    x = _tensor(gen, lead + (chunks * block,))
    return draw(_case(aten.slice.Tensor, [x], (dim, first * block, last * block), place=(shard,), tp=tp))


def _slice_or_split_of_blocks(draw, gen, tp: int, shard: Shard, sizes: tuple, unit: int, per: int,
                              lead: tuple) -> Case:
    """A slice or a split of whole blocks (``sizes`` atoms of ``unit`` each, ``per`` times)
    along the dim after ``lead``, of a tensor placed ``shard``."""
    dim = len(lead)
    widths = [x * per * unit for x in sizes]
    x = _tensor(gen, lead + (sum(widths),))
    edges = [sum(widths[:i]) for i in range(len(widths) + 1)]
    if draw(st.booleans()):
        first = draw(st.integers(0, len(sizes) - 1))
        last = draw(st.integers(first + 1, len(sizes)))
        return draw(_case(aten.slice.Tensor, [x], (dim, edges[first], edges[last]), place=(shard,), tp=tp))
    cuts = sorted(draw(st.sets(st.sampled_from(edges[1:-1]), min_size=1)))
    pieces = [b - a for a, b in zip([0] + cuts, cuts + [edges[-1]])]
    return draw(_case(aten.split_with_sizes.default, [x], (pieces, dim), place=(shard,), tp=tp))


@st.composite
def unequal_block_cases(draw) -> Case:
    """Blocks of unequal size (Phi-3's q | k | v of 4 | 1 | 1 parts: fewer kv heads), dealt in
    groups, evenly or not (``per`` groups at any tp), read back by a slice or a split of whole
    blocks, as Phi-3 and a split would; or equal blocks (1 | 1 | 1: a plain shard of several
    blocks) split into pieces of different block counts (q|k and v)."""
    gen, tp = _gen(draw), draw(tps)
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=4)))
    unit, per = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    lead = draw(shapes(0, 2, st.integers(1, 3)))
    dim = len(lead)
    shard = Shard(dim, len(sizes), unit, draw(st.integers(0, tp - 1)), sizes=sizes)
    return _slice_or_split_of_blocks(draw, gen, tp, shard, sizes, unit, per, lead)


@settings(max_examples=100, deadline=None)
@given(case=unequal_block_cases())
def test_a_slice_or_split_of_whole_unequal_blocks_keeps_each_ranks_run_of_each(case):
    offered = check_case(case)
    assert any(isinstance(s.output, Shard) or (isinstance(s.output, tuple) and isinstance(s.output[0], Shard))
               for s in offered if s.inputs[0] == case.placements[0]), offered


@st.composite
def whole_block_cases(draw) -> Case:
    """Blocks of unequal size some of which every rank holds whole (Mamba2's one group: its
    ``x | B | C`` after the convolution, B and C whole), read back by a split or a slice of whole
    blocks: a piece of dealt blocks keeps each rank's run, a piece of whole blocks alone is
    Replicate, a mixed piece keeps which of its blocks are whole."""
    gen, tp = _gen(draw), draw(tps)
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=5)))
    whole = tuple(draw(st.sets(st.integers(0, len(sizes) - 1), min_size=1, max_size=len(sizes) - 1)))
    unit, per = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    lead = draw(shapes(0, 2, st.integers(1, 3)))
    dim = len(lead)
    shard = Shard(dim, len(sizes), unit, draw(st.integers(0, tp - 1)), sizes=sizes, whole=whole)
    return _slice_or_split_of_blocks(draw, gen, tp, shard, sizes, unit, per, lead)


@settings(max_examples=100, deadline=None)
@given(case=whole_block_cases())
def test_a_slice_or_split_of_blocks_some_held_whole_keeps_them_whole(case):
    offered = check_case(case)
    kept = [s for s in offered if s.inputs[0] == case.placements[0]]
    assert kept, offered
    outs = kept[0].output if isinstance(kept[0].output, tuple) else (kept[0].output,)
    assert any(isinstance(p, Shard) for p in outs) or all(p == Replicate() for p in outs), kept


def test_one_group_of_b_and_c_held_whole_beside_dealt_heads():
    """bamba-9b's in_proj rows [z | x | B | C | dt]: 128 heads of 64, one group of a 128-wide state,
    at tp=8: each rank its 16 heads' z, x and dt, B and C whole; the whole blocks owned by rank 0."""
    from autotp.placements import from_json, local_ranges, local_size, owned_ranges, to_json

    shard = Shard(0, 5, 1, sizes=(64, 64, 1, 1, 1), whole=(2, 3))
    assert repr(shard) == "S(0x64:64:[1]:[1]:1)" and from_json(to_json(shard)) == shard
    assert shard != Shard(0, 5, 1, sizes=(64, 64, 1, 1, 1))
    n = 2 * 8192 + 2 * 128 + 128
    assert local_ranges(n, shard, 8, 1) == ((1024, 2048), (9216, 10240), (16384, 16512), (16512, 16640),
                                            (16656, 16672))
    assert local_size(n, shard, 8, 7) == 2 * 1024 + 256 + 16
    assert owned_ranges(n, shard, 8, 0) == local_ranges(n, shard, 8, 0)
    assert owned_ranges(n, shard, 8, 1) == ((1024, 2048), (9216, 10240), (16656, 16672))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_repeat_interleave_of_whole_groups_gives_each_rank_its_heads(data):
    # Mamba2's B (or C), [b, s, groups, d_state] whole on every rank, each group repeated for its
    # heads: each rank repeats the groups of its own heads alone (the f in front sums the
    # gradient); one group, or fewer groups than ranks (2 at tp 4), or more, evenly or not
    gen, tp = _gen(data.draw), data.draw(tps)
    uneven = data.draw(st.booleans())
    heads = tp * data.draw(st.integers(1, 3)) + (data.draw(st.integers(0, tp - 1)) if uneven else 0)
    groups = data.draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    x = _tensor(gen, (2, 3, groups, data.draw(st.integers(1, 3))))
    case = Case(aten.repeat_interleave.self_int, (x, heads // groups, 2), {"output_size": heads}, tp,
                (Replicate(),), seed=data.draw(seeds), uneven=uneven)
    assert _offers(check_case(case), (Replicate(),), Shard(2))


def test_blocks_of_unequal_size_deal_each_block_on_its_own():
    """Phi-3-medium's q | k | v (40 | 10 | 10 heads of 128) at tp=2: each rank holds its half of the
    query heads and the matching half of the key and value heads; equal sizes are plain blocks."""
    from autotp.placements import from_json, local_ranges, to_json

    shard = Shard(0, 3, 128, sizes=(40, 10, 10))
    assert shard.sizes == (4, 1, 1) and repr(shard) == "S(0x4:1:1/128)"
    assert Shard(0, 3, 128, sizes=(2, 2, 2)) == Shard(0, 3, 128)
    assert from_json(to_json(shard)) == shard
    heads = 128
    assert local_ranges(7680, shard, 2, 0) == ((0, 20 * heads), (40 * heads, 45 * heads), (50 * heads, 55 * heads))
    assert local_ranges(7680, shard, 2, 1) == ((20 * heads, 40 * heads), (45 * heads, 50 * heads),
                                               (55 * heads, 60 * heads))


def test_blocks_of_unequal_size_deal_groups_of_heads_where_tp_does_not_divide_them():
    """Phi-3-medium's q | k | v at tp=8: its 10 groups (a kv head with its 4 query heads) dealt 2, 2,
    1, ...: a rank holds the query heads of its own kv heads, the same run of every block (dealing
    each block's heads on its own would give rank 0 q heads 0-4 beside kv heads 0-1)."""
    from autotp.placements import local_ranges, local_size

    shard, heads = Shard(0, 3, 128, sizes=(4, 1, 1)), 128
    assert local_ranges(7680, shard, 8, 0) == ((0, 8 * heads), (40 * heads, 42 * heads), (50 * heads, 52 * heads))
    assert local_ranges(7680, shard, 8, 7) == ((36 * heads, 40 * heads), (49 * heads, 50 * heads),
                                               (59 * heads, 60 * heads))
    assert [local_size(7680, shard, 8, r) // heads for r in range(8)] == [12, 12, 6, 6, 6, 6, 6, 6]
    rotated = Shard(0, 3, 128, 1, sizes=(4, 1, 1))   # layer 1: rank 7 takes the first run
    assert local_ranges(7680, rotated, 8, 7) == local_ranges(7680, shard, 8, 0)


@settings(max_examples=100, deadline=None)
@given(case=block_slice_cases())
def test_a_slice_of_whole_blocks_keeps_the_heads_of_each_block(case):
    offered = check_case(case)
    if case.args[2] or case.args[3] != case.args[0].shape[case.args[1]]:   # not the whole dim: the block strategy
        assert any(isinstance(s.output, Shard) for s in offered), offered


# ---------------------------------------------------------------- rotary embeddings and fused attention

@st.composite
def join_cases(draw) -> Case:
    """cat (rotate_half's ``cat([-x2, x1], -1)``, NeoX's partial rotary) and stack (GPT-J's
    interleaved rotation) of 1-3 tensors; half the time every input holds the same shard."""
    gen, tp = _gen(draw), draw(tps)
    shape = draw(shapes(1, 4, st.integers(1, 6)))
    nd = len(shape)
    n = draw(st.integers(1, 3))
    if draw(st.booleans()):
        target, dim = aten.cat.default, draw(st.integers(-nd, nd - 1))
        # pieces differ along the join dim only; an empty piece too (NeoX's rotary_pct=1 tail)
        tensors = [_tensor(gen, shape[:dim % nd] + (draw(st.integers(0, 4)),) + shape[dim % nd + 1:])
                   for _ in range(n)]
        others = [d for d in range(nd) if d != dim % nd]
    else:
        target, dim = aten.stack.default, draw(st.integers(-nd - 1, nd))
        tensors = [_tensor(gen, shape) for _ in range(n)]
        others = list(range(nd))
    ps = [draw(placements(tuple(t.shape), tp, dims=[d for d, k in enumerate(t.shape) if k])) for t in tensors]
    if others and draw(st.booleans()):
        shard = draw(shards(tuple(tensors[0].shape), tp, others))
        ps = [shard] * n
    elif draw(st.booleans()):
        ps = [P] * n
    return Case(target, ([*tensors], dim), {}, tp, tuple(ps), seed=draw(seeds))


@settings(max_examples=150, deadline=None)
@given(case=join_cases())
def test_cat_and_stack_keep_a_shard_of_any_other_dim(case):
    offered = check_case(case)
    p = case.placements[0]
    nd = case.args[0][0].ndim
    dim = case.args[1] % (nd + (case.target is aten.stack.default))
    if isinstance(p, Shard) and all(q == p for q in case.placements) and (
            case.target is aten.stack.default or p.dim != dim):
        od = p.dim + 1 if case.target is aten.stack.default and p.dim >= dim else p.dim
        assert _offers(offered, case.placements, p.with_dim(od)), f"{case!r}: the shard is not kept"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_cat_of_inputs_split_by_head_along_the_join_dim_is_a_block_shard(data):
    # Gated DeltaNet joins q | k | v, each split by head, along the dim they are split on, for
    # one depthwise conv: each input is a block of the result, dealt as it was (before: only
    # whole, the three all-gathered)
    gen, tp = _gen(data.draw), data.draw(tps)
    groups = data.draw(st.integers(tp, 3 * tp))   # heads dealt to the ranks, unevenly too
    widths = data.draw(st.lists(st.integers(1, 3), min_size=2, max_size=3))   # a head's elements per input
    lead = data.draw(shapes(0, 2, st.integers(1, 3)))
    tensors = [_tensor(gen, lead + (groups * w,)) for w in widths]
    dim = len(lead)
    ps = tuple(Shard(dim, unit=w) for w in widths)
    offered = check_case(Case(aten.cat.default, (tensors, -1), {}, tp, ps, seed=data.draw(seeds)))
    blocks = [s.output for s in offered if isinstance(s.output, Shard) and s.output.dim == dim]
    assert len(blocks) == 1 and blocks[0].chunks == len(widths), offered


def test_rotate_half_keeps_the_heads_shard_local():
    # Llama: q [b, heads, s, d] split by heads; rotate_half cats halves of d.
    q = torch.randn(2, 8, 5, 6, dtype=F64)
    x1, x2 = q[..., :3], q[..., 3:]
    case = Case(aten.cat.default, ([-x2, x1], -1), {}, 4, (Shard(1), Shard(1)))
    assert _offers(check_case(case), (Shard(1), Shard(1)), Shard(1))
    # halves split along d itself: no plain shard of d (a rank's -x2 and x1 are not a run of the
    # result); the two as blocks of one shard are (every offered strategy computes the op)
    halves = Case(aten.cat.default, ([-x2, x1], -1), {}, 4, (Shard(3), Shard(3)))
    assert [s.output for s in check_case(halves) if isinstance(s.output, Shard)] == [Shard(3, 2)]


def test_cat_with_a_legacy_empty_input_keeps_the_heads_shard():
    # A KV cache's first update: cat(empty 1-D start, keys [b, kv heads, s, d]) along s. torch
    # skips the empty piece; the keys' heads shard must survive (the cache stays split by head).
    keys = torch.randn(2, 4, 5, 3, dtype=F64)
    empty = torch.empty(0, dtype=F64)
    case = Case(aten.cat.default, ([empty, keys], -2), {}, 2, (REPLICATE, Shard(1)))
    assert _offers(check_case(case), (REPLICATE, Shard(1)), Shard(1))


@st.composite
def copy_cases(draw) -> Case:
    """flatten, repeat, repeat_interleave, broadcast_to, chunk, numpy_T: GPT-J's and Falcon's
    rotary and fused-qkv plumbing."""
    gen, tp = _gen(draw), draw(tps)
    shape = draw(shapes(1, 4, st.integers(1, 5)))
    nd = len(shape)
    kind = draw(st.sampled_from(["flatten", "repeat", "repeat_interleave", "broadcast_to", "chunk", "numpy_T"]))
    if kind == "flatten":
        start = draw(st.integers(-nd, nd - 1))
        end = draw(st.integers(start % nd, nd - 1))
        target, other = aten.flatten.using_ints, (start, end - nd if draw(st.booleans()) else end)
    elif kind == "repeat":
        lead = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))]
        target, other = aten.repeat.default, (lead + [draw(st.integers(1, 3)) for _ in shape],)
    elif kind == "repeat_interleave":
        dim = draw(st.one_of(st.none(), st.integers(-nd, nd - 1)))
        target, other = aten.repeat_interleave.self_int, (draw(st.integers(1, 3)), dim)
    elif kind == "broadcast_to":
        shape = tuple(1 if draw(st.booleans()) else s for s in shape)
        lead = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))]
        target, other = aten.broadcast_to.default, (lead + [draw(st.integers(1, 3)) if s == 1 else s
                                                           for s in shape],)
    elif kind == "chunk":
        target, other = aten.chunk.default, (draw(st.integers(1, 4)), draw(st.integers(-nd, nd - 1)))
    else:
        target, other = aten.numpy_T.default, ()
    return draw(_case(target, [_tensor(gen, shape)], other, tp=tp))


@settings(max_examples=200, deadline=None)
@given(case=copy_cases())
def test_flatten_repeat_broadcast_chunk_and_transpose_carry_the_shard_along(case):
    offered = check_case(case)
    p = case.placements[0]
    if isinstance(p, Shard) and case.target is aten.chunk.default and p.dim != case.args[2] % case.args[0].ndim:
        assert any(s.inputs == (p,) and isinstance(s.output, tuple) for s in offered)
    if isinstance(p, Shard) and case.target is aten.repeat_interleave.self_int and case.args[2] is not None:
        # any dim keeps its shard, the repeated one with atoms repeats times wider (kv heads
        # repeated for their query heads)
        assert any(s.inputs == (p,) and isinstance(s.output, Shard) for s in offered), offered


def test_gpt_j_rotary_keeps_the_heads_shard_local():
    # x [b, s, heads, d]: stack(-x_odd, x_even) on a new last dim, then flatten(-2) back to d.
    x = torch.randn(2, 3, 4, 6, dtype=F64)
    heads = Shard(2)
    stacked = Case(aten.stack.default, ([-x[..., 1::2], x[..., ::2]], -1), {}, 2, (heads, heads))
    assert _offers(check_case(stacked), (heads, heads), heads)
    flat = Case(aten.flatten.using_ints, (torch.stack([x[..., 1::2], x[..., ::2]], -1), -2), {}, 2, (heads,))
    assert _offers(check_case(flat), (heads,), heads)
    sin = torch.randn(1, 3, 1, 3, dtype=F64)
    widened = Case(aten.repeat_interleave.self_int, (sin, 2, 3), {}, 2, (Shard(1),))
    assert _offers(check_case(widened), (Shard(1),), Shard(1))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_repeat_interleave_with_its_output_size_keeps_a_shard_of_the_repeated_dim(data):
    # Mamba2's B and C: [b, s, groups, d_state] repeated for each group's heads along dim 2,
    # export writing the repeated size (output_size=heads): each rank's groups become its heads
    gen, tp = _gen(data.draw), data.draw(tps)
    groups, reps = tp * data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    x = _tensor(gen, (2, 3, groups, data.draw(st.integers(1, 3))))
    case = Case(aten.repeat_interleave.self_int, (x, reps, 2), {"output_size": groups * reps}, tp, (Shard(2),),
                seed=data.draw(seeds))
    assert _offers(check_case(case), (Shard(2),), Shard(2, 1, reps))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_chunked_scan_pads_sums_and_zeros_per_head(data):
    # Mamba2's chunked scan on [b, s, heads, d] split by heads: the sequence padded to whole
    # chunks, A's running sum over each chunk, the first chunk state zeros_like another's
    gen, tp = _gen(data.draw), data.draw(tps)
    x = _tensor(gen, (2, data.draw(st.integers(1, 5)), tp * data.draw(st.integers(1, 2)), 3))
    heads = data.draw(shards(tuple(x.shape), tp, [2]))
    pad = data.draw(st.integers(0, 3))
    for op, args in ((aten.pad.default, (x, [0, 0, 0, 0, 0, pad], "constant", 0.0)),
                     (aten.constant_pad_nd.default, (x, [0, 0, 0, 0, pad, 0], 0.0)),
                     (aten.cumsum.default, (x, 1)), (aten.zeros_like.default, (x,))):
        assert _offers(check_case(Case(op, args, {}, tp, (heads,), seed=data.draw(seeds))), (heads,), heads)
    for op, args in ((aten.pad.default, (x, [0, 0, 0, 0, 0, pad], "constant", 0.0)), (aten.cumsum.default, (x, 1))):
        assert _offers(check_case(Case(op, args, {}, tp, (P,), seed=data.draw(seeds))), (P,), P)
    padded = check_case(Case(aten.pad.default, (x, [0, 0, 1, 0], "constant", 0.0), {}, tp, (heads,)))
    assert not any(s.output == heads for s in padded)   # the split dim itself padded: not kept


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_free_weight_under_a_transpose_is_cut_the_way_the_product_hints(data):
    # Falcon: x @ W.T with W [3*heads*d, h] fused q|k|v by heads.
    tp = data.draw(tps)
    gen = _gen(data.draw)
    heads, head_dim = tp * data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    n = 3 * heads * head_dim
    target = data.draw(st.sampled_from([aten.numpy_T.default, aten.t.default]))
    case = Case(target, (_tensor(gen, (n, 2 * tp)),), {}, tp, (None,), hints={1: (1, 3 * head_dim, 0)})
    column = Shard(1, 1, 3 * head_dim)
    offered = check_case(case)
    assert _offers(offered, (column.with_dim(0),), column)
    assert any(s.output == Shard(0) and s.inputs == (Shard(1),) for s in offered)   # for a row-parallel use


@st.composite
def matmul_weight_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    batch = draw(shapes(1, 2, st.integers(1, 4)))
    k, n = draw(sizes), draw(sizes)
    hints = {len(batch): draw(hints_for(n, tp))} if draw(st.booleans()) else {}
    return draw(_case(aten.matmul.default, [_tensor(gen, batch + (k,)), _tensor(gen, (k, n))], hints=hints,
                      uneven=draw(st.booleans()), tp=tp))


@settings(max_examples=80, deadline=None)
@given(case=matmul_weight_cases())
def test_matmul_with_a_two_dim_weight_is_column_or_row_parallel(case):
    offered = check_case(case)
    if case.placements[0] == Shard(case.args[0].ndim - 1) and case.args[0].shape[-1] >= case.tp:
        assert any(isinstance(s.output, Partial) for s in offered)


@st.composite
def left_matrix_cases(draw) -> Case:
    """Mamba's ``dt_proj.weight @ time_step.transpose(1, 2)``: a 2-D weight on the left of a
    batched x, ``[M, K] @ [..., K, N]``."""
    gen, tp = _gen(draw), draw(tps)
    batch = draw(shapes(1, 2, st.integers(1, 4)))
    m, k, n = draw(sizes), draw(sizes), draw(sizes)
    hints = {len(batch): draw(hints_for(m, tp))} if draw(st.booleans()) else {}
    return draw(_case(aten.matmul.default, [_tensor(gen, (m, k)), _tensor(gen, batch + (k, n))], hints=hints,
                      uneven=draw(st.booleans()), tp=tp))


@settings(max_examples=80, deadline=None)
@given(case=left_matrix_cases())
def test_matmul_with_a_two_dim_weight_on_the_left_is_column_or_row_parallel(case):
    offered = check_case(case)
    w, x = case.args[0], case.args[1]
    if case.placements[0] is None and w.shape[0] >= case.tp and (case.uneven or w.shape[0] % case.tp == 0) \
            and not case.hints:
        # a free weight is offered split on its rows (column-parallel), x whole
        assert any(s.inputs[1] == R and isinstance(s.inputs[0], Shard) and s.inputs[0].dim == 0 for s in offered)
    if case.placements[1] == Shard(x.ndim - 2):
        assert any(isinstance(s.output, Partial) for s in offered)   # row-parallel as x arrives


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_index_keeps_a_shard_of_a_dim_before_the_first_index_tensor(data):
    # Falcon's new architecture picks k and v out of [b, s, kv, n_rep + 2, d] with x[:, :, :, [-2]].
    gen, tp = _gen(data.draw), data.draw(tps)
    shape = data.draw(shapes(2, 4, st.integers(1, 5)))
    at = data.draw(st.integers(0, len(shape) - 1))
    idx = _tensor(gen, (data.draw(st.integers(1, 3)),), torch.long, -shape[at], shape[at])
    x = _tensor(gen, shape)
    p = data.draw(placements(shape, tp))
    case = Case(aten.index.Tensor, (x, [None] * at + [idx]), {}, tp, (p, R), seed=data.draw(seeds))
    offered = check_case(case)
    if isinstance(p, Shard) and p.dim < at:
        assert _offers(offered, (p, R), p)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_in_place_add_never_converts_the_tensor_it_mutates(data):
    # Falcon's ``mlp_output += attention_output``; the harness cannot rerun an in-place op on
    # the inputs it mutated, so each strategy runs on fresh copies here. The one exception: a
    # Partial written with a term that is not one (Llama-4's shared expert's output plus its
    # gathered routed sum) keeps it only by converting the term to a Partial, which no
    # collective does: every input replicated instead, the rewrite writing a copy.
    gen, tp = _gen(data.draw), data.draw(tps)
    out, (_, b_shape) = data.draw(broadcast_shapes(2))
    a, b = _tensor(gen, out), _tensor(gen, b_shape)
    have = data.draw(placements(out, tp))
    other = data.draw(placements(b_shape, tp))
    info = op_info(aten.add.Tensor, (a, b), {}, tp)
    info = replace(info, target=aten.add_.Tensor)
    offered = strategies(info, (have, other))
    assert offered
    unreachable = isinstance(have, Partial) and other is not None and not isinstance(other, Partial)
    for s in offered:
        assert have is None or s.inputs[0] == have or unreachable, f"{s!r} converts the mutated input {have!r}"
        assert not (unreachable and s.inputs[0] == have), f"{s!r} asks {other!r} to become a Partial"
        shim = replace(info, target=lambda x, y: aten.add_.Tensor(x.clone(), y))
        check_strategy(shim, s, (a, b), {}, data.draw(seeds))



@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_copy_into_a_tensor_keeps_its_placement_and_a_fresh_buffer_takes_the_sources(data):
    # transformers writes a recurrent layer's conv and SSM states with ``copy_``: into a
    # ``zeros`` buffer in the prefill (nothing else reads it: ``writes_alone``), into the state
    # handed in for a decode step. dest stays as it is (views of it see the write); only a buffer
    # read by nothing else may take src's shard, each rank writing its slice (no gather). Each
    # strategy runs on fresh copies (the harness cannot rerun an in-place op).
    gen, tp = _gen(data.draw), data.draw(tps)
    out, (src_shape,) = data.draw(broadcast_shapes(1))
    dest, src = _tensor(gen, out), _tensor(gen, src_shape)
    have, other = data.draw(placements(out, tp)), data.draw(placements(src_shape, tp))
    alone = data.draw(st.booleans())
    info = replace(op_info(aten.copy_.default, (dest.clone(), src), {}, tp), writes_alone=alone)
    offered = strategies(info, (have, other))
    assert Strategy((R, R), R) in offered
    for s in offered:
        assert s.inputs[0] in (have, R) or alone, f"{s!r} converts the written {have!r}"
        shim = replace(info, target=lambda d, x: aten.copy_.default(d.clone(), x))
        check_strategy(shim, s, (dest, src), {}, data.draw(seeds))
    if alone and isinstance(other, Shard) and src_shape[other.dim] == out[other.dim + len(out) - len(src_shape)]:
        mine = other.with_dim(other.dim + len(out) - len(src_shape))
        assert Strategy((mine, other), mine) in offered, offered


def test_a_zeros_buffer_written_by_a_split_state_is_written_split():
    # Mamba2's prefill: ``zeros([b, conv_dim, k]).copy_(padded[..., -k:])`` with the conv input
    # split by head group; before, copy_ had no rule and the split state was all-gathered into a
    # whole buffer on every rank (and handed to the decode steps whole)
    state = Shard(1, 3, 1, sizes=(4, 1, 1))
    info = replace(op_info(aten.copy_.default, (torch.zeros(2, 12, 4), torch.ones(2, 12, 4)), {}, 2),
                   writes_alone=True)
    assert Strategy((state, state), state) in strategies(info, (R, state))
    # a buffer something else reads stays whole: the split source is gathered into it
    kept = replace(info, writes_alone=False)
    assert strategies(kept, (R, state)) == [Strategy((R, R), R)]


IN_PLACE = [(aten.relu_.default, ()), (aten.mul_.Scalar, (1.5,)), (aten.clamp_.default, (-0.5, 0.5)),
            (aten.sigmoid_.default, ()), (aten.neg_.default, ())]


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_in_place_ops_take_their_twins_rule_and_keep_the_tensor_they_write_where_they_can(data):
    # ``nn.ReLU(inplace=True)`` between a column and a row product: the op has no rule of its
    # own; its out-of-place twin's rule, less every strategy that converts the written tensor
    # (views of it would miss the update), unless none keeps it (then all replicated, and the
    # rewrite writes a clone of the conversion). Each strategy runs on fresh copies.
    op, extra = data.draw(st.sampled_from(IN_PLACE))
    gen, tp = _gen(data.draw), data.draw(tps)
    shape = data.draw(shapes(1, 4))
    x = _tensor(gen, shape)
    have = data.draw(placements(shape, tp))
    assert rules.functional_of(op) is not None and rules.mutates_first(op)
    info = replace(op_info(rules.functional_of(op), (x, *extra), {}, tp), target=op)
    offered = strategies(info, (have,))
    assert offered
    if have is not None and not isinstance(have, Partial):
        assert all(s.inputs[0] == have for s in offered), (have, offered)
    for s in offered:
        shim = replace(info, target=lambda t, *a, op=op: op(t.clone(), *a))
        check_strategy(shim, s, (x, *extra), {}, data.draw(seeds))


# ---------------------------------------------------------------- pointwise

POSITIVE = "positive"   # inputs kept away from zero and negative values (pow, log, ...)
# op, non-tensor arguments, kwargs, dtype of the tensor input
UNARY_CASES = [
    (aten.tanh.default, (), {}, F64), (aten.exp.default, (), {}, F64), (aten.log.default, (), {}, POSITIVE),
    (aten.sqrt.default, (), {}, POSITIVE), (aten.rsqrt.default, (), {}, POSITIVE),
    (aten.relu.default, (), {}, F64), (aten.gelu.default, (), {}, F64), (aten.silu.default, (), {}, F64),
    (aten.sigmoid.default, (), {}, F64), (aten.abs.default, (), {}, F64), (aten.sin.default, (), {}, F64),
    (aten.cos.default, (), {}, F64), (aten.erf.default, (), {}, F64), (aten.square.default, (), {}, F64),
    (aten.reciprocal.default, (), {}, POSITIVE), (aten.softplus.default, (), {}, F64),
    (aten.pow.Tensor_Scalar, (3,), {}, F64), (aten.pow.Tensor_Scalar, (0.5,), {}, POSITIVE),
    (aten.to.dtype, (torch.float32,), {}, F64),
    (aten.to.dtype_layout, (), {"dtype": torch.float32, "layout": torch.strided}, F64),
    (aten._to_copy.default, (), {"dtype": torch.float32}, F64),
    (aten.to.device, (torch.device("cpu"), torch.float32), {}, F64),
    # casts to the input's own dtype: the identity (or a copy), a Partial passes
    (aten.to.dtype, (F64,), {}, F64), (aten._to_copy.default, (), {"dtype": F64}, F64),
    (aten.to.dtype_layout, (), {"dtype": F64, "layout": torch.strided}, F64),
    (aten.dropout.default, (0.0, True), {}, F64), (aten.dropout.default, (0.5, False), {}, F64),
    (aten.add.Scalar, (1.5,), {}, F64), (aten.sub.Scalar, (1.5,), {}, F64),
    (aten.ne.Scalar, (0.0,), {}, F64), (aten.eq.Scalar, (1,), {}, torch.long),
    (aten.lt.Scalar, (0.0,), {}, F64), (aten.le.Scalar, (0.0,), {}, F64),
    (aten.gt.Scalar, (0.0,), {}, F64), (aten.ge.Scalar, (0.0,), {}, F64),
    (aten.logical_not.default, (), {}, torch.bool), (aten.bitwise_not.default, (), {}, torch.bool),
    (aten.clamp.default, (-0.5, 0.5), {}, F64),
    (aten.tril.default, (0,), {}, F64), (aten.triu.default, (1,), {}, F64),
    (aten.floor.default, (), {}, F64), (aten.log1p.default, (), {}, POSITIVE),
    # linear in their one tensor
    (aten.neg.default, (), {}, F64), (aten.mul.Scalar, (2.5,), {}, F64), (aten.div.Scalar, (2.5,), {}, F64),
    (aten.mul.Tensor, (3.0,), {}, F64), (aten.div.Tensor, (4.0,), {}, F64),
    (aten.add.Tensor, (0,), {}, F64), (aten.sub.Tensor, (0.0,), {}, F64),
    # affine: a Partial must not pass
    (aten.add.Tensor, (2.0,), {}, F64), (aten.sub.Tensor, (1,), {}, F64),
]


def _ids(cases: list[tuple]) -> list[str]:
    return [f"{c[0]}-{n}" for n, c in enumerate(cases)]


def _min_ndim(op) -> int:
    return 2 if op in (aten.tril.default, aten.triu.default) else 1


def _input(gen, shape, dtype):
    if dtype == POSITIVE:
        return _tensor(gen, shape).abs() + 0.5
    return _tensor(gen, shape, dtype)


@pytest.mark.parametrize("op, other, kwargs, dtype", UNARY_CASES, ids=_ids(UNARY_CASES))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_unary_pointwise_strategies_compute_the_op(op, other, kwargs, dtype, data):
    gen = _gen(data.draw)
    x = _input(gen, data.draw(shapes(_min_ndim(op), 3, st.integers(1, 6))), dtype)
    check_case(data.draw(_case(op, [x], other, kwargs)))


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_a_cast_to_its_own_dtype_keeps_a_partial_and_a_cast_to_another_does_not(data):
    # an MoE layer's combine ``.to(hidden.dtype)``: its partial sum goes on to the residual add
    # (a reduce-scatter into the sequence split there), where a cast that changes the dtype would
    # round each rank's summand apart
    gen = _gen(data.draw)
    x = _tensor(gen, data.draw(shapes(1, 3, st.integers(1, 6))))
    tp = data.draw(tps)
    for op, other, kwargs in ((aten.to.dtype, (F64,), {}), (aten._to_copy.default, (), {"dtype": F64})):
        case = data.draw(_case(op, [x], other, kwargs, tp=tp, place=(PARTIAL,)))
        assert _offers(check_case(case), (PARTIAL,), PARTIAL), op
    for op, other, kwargs in ((aten.to.dtype, (torch.float32,), {}),
                              (aten._to_copy.default, (), {"dtype": torch.float32})):
        case = data.draw(_case(op, [x], other, kwargs, tp=tp, place=(PARTIAL,)))
        assert not _offers(check_case(case), (PARTIAL,), PARTIAL), op


# op, dtypes of its tensor inputs ("out": the output's shape; "scalar": a 0-dim tensor),
# non-tensor arguments after them, kwargs
BINARY_CASES = [
    (aten.add.Tensor, (F64, F64), (), {}), (aten.sub.Tensor, (F64, F64), (), {}),
    (aten.add.Tensor, (F64, F64), (), {"alpha": 2}),
    (aten.mul.Tensor, (F64, F64), (), {}), (aten.div.Tensor, (F64, POSITIVE), (), {}),
    (aten.pow.Tensor_Tensor, (POSITIVE, F64), (), {}), (aten.maximum.default, (F64, F64), (), {}),
    (aten.minimum.default, (F64, F64), (), {}),
    (aten.eq.Tensor, (torch.long, torch.long), (), {}), (aten.ne.Tensor, (torch.long, torch.long), (), {}),
    (aten.lt.Tensor, (F64, F64), (), {}), (aten.le.Tensor, (F64, F64), (), {}),
    (aten.gt.Tensor, (F64, F64), (), {}), (aten.ge.Tensor, (F64, F64), (), {}),
    (aten.__and__.Tensor, (torch.bool, torch.bool), (), {}),
    (aten.__or__.Tensor, (torch.bool, torch.bool), (), {}),
    (aten.bitwise_and.Tensor, (torch.bool, torch.bool), (), {}),
    (aten.bitwise_or.Tensor, (torch.bool, torch.bool), (), {}),
    (aten.logical_and.default, (torch.bool, torch.bool), (), {}),
    (aten.logical_or.default, (torch.bool, torch.bool), (), {}),
    (aten.where.self, (torch.bool, F64, F64), (), {}),
    (aten.where.ScalarOther, (torch.bool, F64), (2.5,), {}),
    (aten.masked_fill.Scalar, ("out", torch.bool), (-1.5,), {}),
    (aten.masked_fill.Tensor, ("out", torch.bool, "scalar"), (), {}),
    (aten.polar.default, (POSITIVE, F64), (), {}),
]


@pytest.mark.parametrize("op, dtypes, other, kwargs", BINARY_CASES, ids=_ids(BINARY_CASES))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_broadcasting_pointwise_strategies_compute_the_op(op, dtypes, other, kwargs, data):
    gen = _gen(data.draw)
    out, in_shapes = data.draw(broadcast_shapes(len(dtypes)))
    tensors = []
    for dtype, shape in zip(dtypes, in_shapes):
        if dtype == "out":       # masked_fill's self: the output's shape
            tensors.append(_tensor(gen, out))
        elif dtype == "scalar":  # masked_fill's value: a 0-dim tensor
            tensors.append(_tensor(gen, ()))
        else:
            tensors.append(_input(gen, shape, dtype))
    check_case(data.draw(_case(op, tensors, other, kwargs)))


# ---------------------------------------------------------------- replicate-only and metadata ops

def _misc(gen) -> list[tuple]:
    """(op, arguments with whole tensors) for the replicate-only, factory and size-query ops."""
    x, i = _tensor(gen, (4, 5)), _tensor(gen, (4, 3), torch.long, 0, 4)
    b = _tensor(gen, (4, 5), torch.bool)
    return [
        (aten.diff.default, (x, 1, -1)), (aten.cumsum.default, (x, 1)),
        (aten.index.Tensor, (x, [_tensor(gen, (3,), torch.long, 0, 4)])),
        (aten.pad.default, (x, [1, 2], "constant", 0.5)), (aten.constant_pad_nd.default, (x, [1, 1, 0, 2], 0.0)),
        (aten.gather.default, (x, 1, i)), (aten.index_select.default, (x, 0, i[0])),
        (aten.scatter.src, (x, 1, i, _tensor(gen, (4, 3)))),
        (aten.topk.default, (x, 2)), (aten.sort.default, (x,)), (aten.argmax.default, (x, 1)),
        (aten.any.default, (b,)), (aten.all.default, (b,)),
        (aten.flip.default, (x, [0, 1])), (aten.roll.default, (x, [1], [1])),
        (aten.arange.default, (5,)), (aten.arange.start, (2, 7)), (aten.arange.start_step, (1, 9, 3)),
        (aten.zeros.default, ([2, 3],)), (aten.ones.default, ([2, 3],)), (aten.full.default, ([2, 3], 1.5)),
        (aten.scalar_tensor.default, (2.5,)), (aten.eye.default, (4,)), (aten.eye.m, (3, 5)),
        (aten.new_ones.default, (x, [2, 3])), (aten.new_zeros.default, (x, [3])),
        (aten.new_full.default, (x, [2], 7.0)),
        (aten.zeros_like.default, (x,)), (aten.ones_like.default, (x,)), (aten.full_like.default, (x, 2.0)),
        (aten.sym_size.int, (x, 1)), (aten.sym_size.int, (x, -2)), (aten.sym_numel.default, (x,)),
        (aten.sym_stride.int, (x, 0)),
    ]


MISC_OPS = [op for op, _ in _misc(torch.Generator())]
MISC_IDS = [f"{op}-{n}" for n, op in enumerate(MISC_OPS)]


@pytest.mark.parametrize("n", range(len(MISC_OPS)), ids=MISC_IDS)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_replicated_factory_and_metadata_ops_compute_the_op(n, data):
    op, args = _misc(_gen(data.draw))[n]
    tp = data.draw(tps)
    place = tuple(data.draw(placements(tuple(t.shape), tp, t.is_floating_point())) for t in _tensors_in(args))
    check_case(Case(op, args, {}, tp, place, seed=data.draw(seeds)))


# ---------------------------------------------------------------- the registry

def test_every_op_of_gpt2_training_graph_has_a_rule():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from autotp.capture import capture

    hf_logging.set_verbosity_error()
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    graph = capture(model).graph
    ops = {n.target for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem}
    assert ops
    assert [rules.op_name(t) for t in ops if not rules.has_rule(t)] == []


def test_an_op_without_a_rule_runs_replicated_with_a_warning_naming_it(caplog, monkeypatch):
    monkeypatch.setattr(rules.registry, "_warned", set())
    assert not rules.has_rule(aten.erfinv.default)
    x = torch.rand(4, 6, dtype=F64) - 0.5
    info = op_info(aten.erfinv.default, (x,), {}, tp=2)
    with caplog.at_level(logging.WARNING, logger="autotp.rules"):
        offered = strategies(info, (Shard(0),))
    assert offered == [Strategy((R,), R)]
    assert any("aten.erfinv.default" in r.getMessage() for r in caplog.records if r.name == "autotp.rules")
    check_strategy(info, offered[0], (x,), {})


# ---------------------------------------------------------------- Partial only through linear ops

def _linear_groups(case: Case) -> list[set[int]]:
    """The sets of tensor inputs the op is linear in, jointly (a Partial may stand exactly there)."""
    op, n = case.target, len(case.placements)
    if op in (aten.cat.default, aten.stack.default):
        return [set(range(n))]
    if op in (aten.add.Tensor, aten.sub.Tensor):
        scalars = [a for a in case.args[1:2] if not isinstance(a, torch.Tensor)]
        return [set(range(n))] if all(a == 0 for a in scalars) else []
    if op in (aten.mul.Tensor, aten.mm.default, aten.linear.default, aten.bmm.default, aten.matmul.default):
        return [{i} for i in range(n)]
    if op in (aten.div.Tensor, aten.neg.default, aten.mul.Scalar, aten.div.Scalar, aten.sum.dim_IntList,
              aten.mean.dim, aten.embedding.default) \
            or rules._RULES[op].__module__.endswith((".view", ".pieces", ".joins")) \
            or op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):   # (rules/token_rows.py
        # extends the sized views: the tokens of a sequence split, flattened)
        return [{0}]
    if op in pointwise.CASTS and _casts_to_own_dtype(case):
        return [{0}]   # the identity on each summand
    return []


def _casts_to_own_dtype(case: Case) -> bool:
    x = case.args[0]
    want = next((a for a in (*case.args[1:], *case.kwargs.values()) if isinstance(a, torch.dtype)), x.dtype)
    return want == x.dtype


def assert_partial_only_where_linear(case: Case) -> None:
    """With every float input Partial, a strategy may keep Partial only on inputs the op is linear
    in, and its output is then Partial."""
    case = replace(case, placements=tuple(
        P if t.is_floating_point() else p for t, p in
        zip(_tensors_in((case.args, case.kwargs)), case.placements)
    ))
    for s in strategies(case.info(), case.placements):
        partial = {i for i, p in enumerate(s.inputs) if isinstance(p, Partial)}
        if not partial:
            continue
        assert partial in _linear_groups(case), f"{case!r}: {s!r} sums a non-linear op over ranks"
        outputs = s.output if isinstance(s.output, tuple) else (s.output,)
        assert all(isinstance(o, Partial) for o in outputs), f"{case!r}: {s!r} drops the Partial"


@settings(max_examples=60, deadline=None)
@given(case=st.one_of(mm_cases(), linear_cases(), bmm_cases()))
def test_matrix_rules_never_take_two_partial_factors(case):
    assert_partial_only_where_linear(case)


@settings(max_examples=60, deadline=None)
@given(case=st.one_of(view_cases(), split_cases(), reshaping_cases()))
def test_view_rules_keep_a_partial_input_partial(case):
    assert_partial_only_where_linear(case)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_pointwise_rules_pass_partial_only_through_linear_ops(data):
    gen = _gen(data.draw)
    op, other, kwargs, dtype = data.draw(st.sampled_from([c for c in UNARY_CASES if c[3] in (F64, POSITIVE)]))
    x = _input(gen, data.draw(shapes(_min_ndim(op), 3, st.integers(1, 6))), dtype)
    assert_partial_only_where_linear(data.draw(_case(op, [x], other, kwargs)))
    op = data.draw(st.sampled_from([aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
                                    aten.maximum.default, aten.pow.Tensor_Tensor]))
    _, (a, b) = data.draw(broadcast_shapes(2))
    assert_partial_only_where_linear(data.draw(_case(op, [_input(gen, a, POSITIVE), _input(gen, b, POSITIVE)])))


def test_add_of_a_partial_and_a_replicated_term_is_not_partial():
    # The replicated term would be added once per rank: a row-parallel bias waits for the g.
    x, b = torch.ones(2, 4, dtype=F64), torch.ones(4, dtype=F64)
    offered = strategies(op_info(aten.add.Tensor, (x, b), {}, tp=2), (P, R))
    assert not any(P in s.inputs for s in offered if s.inputs != (P, P))
    assert _offers(offered, (P, P), P)


def test_a_cast_passes_a_partial_only_to_the_dtype_it_has():
    # the experts' combine (a Partial) is cast to the hidden states' dtype before the residual add:
    # where that is its own dtype, the cast is the identity and the Partial passes to the add's
    # reduce-scatter; a cast to another dtype rounds each rank's part, not their sum
    x = torch.ones(2, 4, dtype=F64)
    for op, args, kwargs in ((aten.to.dtype, (x, F64), {}), (aten._to_copy.default, (x,), {"dtype": F64})):
        assert _offers(strategies(op_info(op, args, kwargs, tp=2), (P,)), (P,), P)
    for op, args, kwargs in ((aten.to.dtype, (x, torch.float32), {}),
                             (aten._to_copy.default, (x,), {"dtype": torch.float32})):
        assert not any(s.output == P for s in strategies(op_info(op, args, kwargs, tp=2), (P,)))


def test_tanh_of_a_partial_is_not_offered():
    offered = strategies(op_info(aten.tanh.default, (torch.ones(2, 4, dtype=F64),), {}, tp=2), (P,))
    assert offered == [Strategy((R,), R)]


@settings(max_examples=80, deadline=None)
@given(case=st.one_of(embedding_cases(), norm_cases(), sdpa_cases(), softmax_cases(), reduction_cases()))
def test_nn_rules_pass_partial_only_through_linear_ops(case):
    assert_partial_only_where_linear(case)


@pytest.mark.parametrize("n", range(len(MISC_OPS)), ids=MISC_IDS)
def test_misc_rules_take_partial_only_where_the_op_reads_no_values(n):
    # Factories and size queries read a tensor's dtype or shape, never its values.
    op, args = _misc(torch.Generator().manual_seed(0))[n]
    info = op_info(op, args, {}, tp=2)
    metadata_only = op in (aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
                           aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int)
    for s in strategies(info, tuple(P if t.is_floating_point() else R for t in _tensors_in(args))):
        if op in (aten.index.Tensor, aten.cumsum.default, aten.pad.default, aten.constant_pad_nd.default) \
                and s.inputs[0] == P and P not in s.inputs[1:] and s.output == P:
            # linear in the values: a pick by integer indices (rows reordered: the expert-TP
            # combine), a running sum, a pad with zeros (Mamba2's chunked scan)
            x = args[0]
            parts = [x * 0.25, x * 0.75]
            assert torch.allclose(sum(op(part, *args[1:]) for part in parts), op(x, *args[1:]))
            continue
        assert metadata_only or P not in s.inputs, f"{op}: {s!r}"


# ---------------------------------------------------------------- sequence parallelism

def _sequence_add_info(uneven: bool) -> OpInfo:
    b, s = sympy.Symbol("b", integer=True, positive=True), sympy.Symbol("s", integer=True, positive=True)
    x, bias = TensorMeta((b, s, sympy.Integer(32)), F64), TensorMeta((sympy.Integer(32),), F64)
    info = OpInfo(torch.ops.aten.add.Tensor, (x, bias), {}, (x, bias), x, 4, uneven=uneven)
    info.sequence = frozenset({s})
    return info


def test_add_of_a_partial_offers_a_reduce_scatter_along_the_sequence_only():
    offered = strategies(_sequence_add_info(uneven=True), (PARTIAL, REPLICATE))
    fresh = [st for st in offered if isinstance(st.output, Shard)]
    # The Partial operand is reduce-scattered along s; the bias broadcasts along s and stays whole.
    assert fresh == [Strategy((Shard(1), REPLICATE), Shard(1))]


def test_sequence_shards_need_uneven_splits_since_the_length_is_known_only_at_run_time():
    offered = strategies(_sequence_add_info(uneven=False), (PARTIAL, REPLICATE))
    assert not any(isinstance(st.output, Shard) for st in offered)


@pytest.mark.parametrize("target", [aten.layer_norm.default, aten.rms_norm.default])
def test_a_norm_over_a_hidden_split_input_may_take_it_resharded_into_the_sequence(target):
    # an embedding split by columns reaches the first norm: gathered whole before, now also resharded
    # into the sequence split by one all-to-all (sequence parallelism's region), where a sequence is offered
    b, s = sympy.Symbol("b", integer=True, positive=True), sympy.Symbol("s", integer=True, positive=True)
    x, w = TensorMeta((b, s, sympy.Integer(32)), F64), TensorMeta((sympy.Integer(32),), F64)
    args = (x, [32], w, 1e-5) if target is aten.rms_norm.default else (x, [32], w, w, 1e-5)
    metas = (x, w) if target is aten.rms_norm.default else (x, w, w)
    info = OpInfo(target, args, {}, metas, x, 4, uneven=True)
    before = strategies(info, (Shard(2),) + (REPLICATE,) * (len(metas) - 1))
    assert [st.output for st in before] == [REPLICATE]   # no sequence offered: gathered whole
    info.sequence = frozenset({s})
    offered = strategies(info, (Shard(2),) + (REPLICATE,) * (len(metas) - 1))
    assert Strategy((Shard(1),) + (REPLICATE,) * (len(metas) - 1), Shard(1)) in offered, offered
    # and it is the norm on the rank's tokens: every row whole on the rank that holds it
    gen = torch.Generator().manual_seed(0)
    xt, wt = torch.randn(2, 7, 32, generator=gen, dtype=F64), torch.randn(32, generator=gen, dtype=F64)
    tensors = (xt, wt) if target is aten.rms_norm.default else (xt, wt, wt)
    concrete = OpInfo(target, tuple(_meta(t) for t in tensors), {}, tuple(_meta(t) for t in tensors),
                      _meta(xt), 4, uneven=True)
    call = (xt, [32], wt, 1e-5) if target is aten.rms_norm.default else (xt, [32], wt, wt, 1e-5)
    concrete.args = tuple(_meta_of_tensor(a) for a in call)
    check_strategy(concrete, Strategy((Shard(1),) + (REPLICATE,) * (len(tensors) - 1), Shard(1)), call, {})


def test_a_sequence_shard_survives_a_view_that_keeps_the_sequence_dim_and_not_a_flatten():
    b, s = sympy.Symbol("b", integer=True, positive=True), sympy.Symbol("s", integer=True, positive=True)
    h = sympy.Integer(32)
    assert map_view_shard((b, s, h), (b, s, h), Shard(1)) == Shard(1)
    assert map_view_shard((b, s, h), (b * s, h), Shard(1)) is None   # tokens of b sequences interleave


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_complex_views_of_real_pairs_keep_a_shard_of_every_other_dim(data):
    # Llama-4's rotary: q as [..., head_dim / 2, 2] pairs read as complex numbers, times the
    # rotation, read back as pairs; a shard of the heads passes both ways, the pairs stay whole
    gen = _gen(data.draw)
    pairs = _tensor(gen, data.draw(shapes(1, 3, st.integers(1, 6))) + (2,))
    if data.draw(st.booleans()):
        case = data.draw(_case(aten.view_as_complex.default, [pairs]))
    else:
        case = data.draw(_case(aten.view_as_real.default, [torch.view_as_complex(pairs)]))
    offered = check_case(case)
    p = case.placements[0]
    if isinstance(p, Shard) and p.dim < pairs.ndim - 1:
        assert _offers(offered, (p,), p), offered

# ---------------------------------------------------------------- the hybrids' mixers: einsum, depthwise conv1d

#: the einsums of Mamba2's chunked scan (transformers' mamba2_chunk_scan) and two more forms
EINSUMS = ("bclhn,bcshn->bclsh", "bclsh,bcshp->bclhp", "bclhn,bclhp->bchpn", "bzch,bzhpn->bchpn",
           "bclhn,bchpn->bclhp", "ij,jk->ik", "bhd,bhe->bde")


@st.composite
def einsum_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    equation = draw(st.sampled_from(EINSUMS))
    operands = equation.split("->")[0].split(",")
    size = {letter: draw(st.integers(1, 6)) for letter in sorted(set("".join(operands)))}
    tensors = [_tensor(gen, tuple(size[c] for c in op)) for op in operands]
    ps = tuple(draw(placements(tuple(t.shape), tp, partial=False)) for t in tensors)
    return Case(aten.einsum.default, (equation, tensors), {}, tp, ps, {}, False, draw(seeds))


@settings(max_examples=100, deadline=None)
@given(case=einsum_cases())
def test_einsum_strategies_split_a_letter_alike_and_sum_a_contracted_one(case):
    offered = check_case(case)
    operands, result = case.args[0].split("->")[0].split(","), case.args[0].split("->")[1]
    seen = set()
    for i, p in enumerate(case.placements):   # a split letter of one size everywhere is kept, never gathered
        if isinstance(p, Shard) and operands[i][p.dim] not in seen:   # as its first operand splits it
            letter = operands[i][p.dim]
            seen.add(letter)
            ins = tuple(p.with_dim(op.index(letter)) if letter in op else R for op in operands)
            if len({t.shape[op.index(letter)] for t, op in zip(case.args[1], operands) if letter in op}) == 1:
                assert any(s.inputs == ins for s in offered), f"{case!r}: {letter} split not kept"
                out = next(s.output for s in offered if s.inputs == ins)
                assert out == (p.with_dim(result.index(letter)) if letter in result else P)


@st.composite
def conv1d_cases(draw) -> Case:
    gen, tp = _gen(draw), draw(tps)
    batch, channels, length, kernel = draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 9)), \
        draw(st.integers(1, 4))
    depthwise = draw(st.booleans())
    x = _tensor(gen, (batch, channels, length))
    w = _tensor(gen, (channels, 1 if depthwise else channels, kernel))
    bias = [_tensor(gen, (channels,))] if draw(st.booleans()) else []
    groups = channels if depthwise else 1
    tensors = [x, w] + bias
    args = (x, w, bias[0] if bias else None, [1], [kernel - 1], [1], groups)
    ps = tuple(draw(placements(tuple(t.shape), tp, partial=False)) for t in tensors)
    if draw(st.booleans()):
        ps = (draw(shards(tuple(x.shape), tp, (1,))),) + ps[1:]
    return Case(aten.conv1d.default, args, {}, tp, ps, {}, draw(st.booleans()), draw(seeds))


@settings(max_examples=100, deadline=None)
@given(case=conv1d_cases())
def test_conv1d_splits_a_depthwise_convolution_by_channel(case):
    offered = check_case(case)
    px, depthwise = case.placements[0], case.args[6] == case.args[0].shape[1] and case.args[1].shape[1] == 1
    if isinstance(px, Shard) and px.dim == 1 and depthwise \
            and all(local_shard(case.args[0], px, case.tp, r).shape[1] for r in range(case.tp)):
        assert any(s.output == px for s in offered), "a depthwise convolution keeps its channel split"
    if not depthwise:
        assert all(not (isinstance(s.output, Shard) and s.output.dim == 1) for s in offered)


# ---------------------------------------------------------------- whole, its gradient a summand

def _vjp_summands_add_up(target, args: tuple, kwargs: dict, wrt: int, tp: int, gen: torch.Generator) -> None:
    """Each rank runs the op whole and sends back its own summand of the output's gradient: the
    ranks' gradients of input ``wrt``, summed (the f in front of it), equal serial's gradient
    for the whole output gradient."""
    x = args[wrt].detach().requires_grad_(True)
    call = list(args)
    call[wrt] = x
    out = target(*call, **kwargs)
    summands = [torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype) for _ in range(tp)]
    whole = sum(summands[1:], summands[0])
    want, = torch.autograd.grad(out, x, whole, retain_graph=True)
    got = [torch.autograd.grad(out, x, g, retain_graph=True)[0] for g in summands]
    _close(sum(got[1:], got[0]), want, f"{rules.op_name(target)}: the ranks' gradient summands, summed")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_rows_gathered_for_an_expert_product_are_whole_with_their_gradient_a_summand(data):
    # h[perm // k]: the (token, expert) rows an expert-TP product reads whole. Its f may sit on the
    # tokens h in front (k times fewer bytes summed backward): every rank gathers every row
    # (forward exact) and its backward, a scatter-add linear in the incoming gradient, carries
    # each rank's summand back to h
    from autotp.placements import REPLICATE_PARTIAL_GRAD

    gen = _gen(data.draw)
    tokens, k, h = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
    tp = data.draw(st.integers(2, 4))
    x = torch.randn(tokens, h, generator=gen, dtype=F64)
    index = torch.randperm(tokens * k, generator=gen) // k
    info = replace(op_info(aten.index.Tensor, (x, [index]), {}, tp), gathers_expert_rows=True)
    have = data.draw(st.sampled_from([R, P, Shard(0)]))   # the tokens as they arrive (each strategy converts)
    offered = strategies(info, (have, R))
    assert Strategy((R, R), REPLICATE_PARTIAL_GRAD) in offered, offered
    for s in offered:
        if s.output == REPLICATE_PARTIAL_GRAD:
            assert s.inputs == (R, R), s   # read whole; the f goes to the float input
            check_strategy(info, replace(s, output=R), (x, [index]), {})   # forward: whole on every rank
            _vjp_summands_add_up(aten.index.Tensor, (x, [index]), {}, 0, tp, gen)
    # not offered where the rows are not a grouped product's alone, nor at tp 1
    assert REPLICATE_PARTIAL_GRAD not in [s.output for s in strategies(op_info(aten.index.Tensor, (x, [index]), {}, tp),
                                                                       (R, R))]
    assert REPLICATE_PARTIAL_GRAD not in [s.output for s in strategies(replace(info, tp=1), (R, R))]


VALUE_KEEPING_CASES = [   # (op, args after x, kwargs)
    (aten.to.dtype, (F64,), {}), (aten.to.dtype, (torch.float32,), {}),
    (aten._to_copy.default, (), {"dtype": F64}), (aten._to_copy.default, (), {"dtype": torch.float32}),
    (aten.clone.default, (), {}), (aten.contiguous.default, (), {}), (aten.alias.default, (), {}),
    (aten.neg.default, (), {}), (aten.silu.default, (), {}),
]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_tensor_whole_with_its_gradient_a_summand_passes_only_ops_that_keep_its_value(data):
    # a cast to its own dtype and a copy keep each rank's gradient summand as it is (the f behind
    # them sums it); a cast to another dtype would round the summands apart, and any other op
    # reads it as Replicate, which only an f serves (propagate.copied_seconds)
    from autotp.passes.propagate import copied_seconds
    from autotp.placements import REPLICATE_PARTIAL_GRAD

    gen = _gen(data.draw)
    op, more, kwargs = data.draw(st.sampled_from(VALUE_KEEPING_CASES))
    x = torch.randn(data.draw(shapes(1, 3, st.integers(1, 5))), generator=gen, dtype=F64)
    tp = data.draw(st.integers(2, 4))
    info = op_info(op, (x, *more), kwargs, tp)
    offered = strategies(info, (REPLICATE_PARTIAL_GRAD,))
    kept = [s for s in offered if REPLICATE_PARTIAL_GRAD in (s.output, *s.inputs)]
    keeps = op not in (aten.neg.default, aten.silu.default) and op(x, *more, **kwargs).dtype == x.dtype
    assert kept == ([Strategy((REPLICATE_PARTIAL_GRAD,), REPLICATE_PARTIAL_GRAD)] if keeps else []), offered
    if keeps:
        check_strategy(info, Strategy((R,), R), (x, *more), kwargs)
        _vjp_summands_add_up(op, (x, *more), kwargs, 0, tp, gen)
    # read as Replicate: only behind an f, or where no gradient flows; never split
    assert copied_seconds(R, True, True) == 0.0 and copied_seconds(R, False, False) == 0.0
    assert copied_seconds(R, False, True) == math.inf
    assert copied_seconds(Shard(0), False, True) == math.inf and copied_seconds(P, False, True) == math.inf


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_rows_reordered_by_a_permutation_gather_their_gradient_back(data):
    # x[inv_perm], inv_perm a permutation of x's rows (the experts' output back to token order):
    # every strategy's rank program computes the op, and its backward, a gather by the inverse
    # permutation (not autograd's scatter-add into zeros), gives serial's gradient exactly
    gen = _gen(data.draw)
    rows, h = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 5))
    tp = data.draw(st.integers(1, 4))
    x = torch.randn(rows, h, generator=gen, dtype=F64)
    index = torch.randperm(rows, generator=gen)
    info = replace(op_info(aten.index.Tensor, (x, [index]), {}, tp), permutes_rows=True)
    have = data.draw(st.sampled_from([R, P, Shard(1)]))
    for s in strategies(info, (have, R)):
        check_strategy(info, s, (x, [index]), {})
        target, args, kwargs = localizer(aten.index.Tensor)(info, s, (x, [index]), {}, LocalContext(tp, 0))
        assert rules.op_name(target).endswith("permute_rows"), target
    want = x.detach().requires_grad_(True)
    got = x.detach().requires_grad_(True)
    grad = torch.randn(rows, h, generator=gen, dtype=F64)
    want[index].backward(grad)
    target(got, index).backward(grad)
    assert torch.equal(got.grad, want.grad)


def test_a_shard_of_a_leading_dim_survives_a_view_that_regroups_only_the_dims_after_it():
    # Gated DeltaNet's padded sequence viewed as chunks: [b, heads, s + pad, d] -> [b, heads,
    # (s + pad) // 64, 64, d], the padded length written with Mod terms no grouping divides
    b, s = sympy.Symbol("b", integer=True, positive=True), sympy.Symbol("s", integer=True, positive=True)
    padded = s + sympy.Mod(64 - sympy.Mod(s, 64), 64)
    src, dst = (b, sympy.Integer(4), padded, sympy.Integer(8)), (b, sympy.Integer(4), padded // 64,
                                                                 sympy.Integer(64), sympy.Integer(8))
    assert map_view_shard(src, dst, Shard(1)) == Shard(1)
    assert map_view_shard(src, dst, Shard(1, 1, 2)) == Shard(1, 1, 2)
    assert map_view_shard(dst, src, Shard(1)) == Shard(1)          # and back
    assert map_view_shard(src, dst, Shard(2)) is None               # the regrouped dim itself
    assert map_view_shard(src, dst, Shard(3)) == Shard(4)           # the common tail, as before
    moved = (b, sympy.Integer(2), sympy.Integer(2), padded // 64, sympy.Integer(64), sympy.Integer(8))
    assert map_view_shard(src, moved, Shard(1)) is None             # the heads dim itself regrouped
