"""A router's ops on the tokens a rank holds (a sequence split's rows, ``P(tokens 0)``) compute
the router's rows of those tokens.

DeepSeek-V3's group-limited router (transformers' ``DeepseekV3TopkRouter``) makes each token's
group mask from its scores: ``zeros_like``, ``scatter_`` at the chosen groups, ``unsqueeze``,
``expand``, ``reshape``, a cast to bool, ``bitwise_not``, ``masked_fill`` of the scores, then the
top-k ids and ``gather`` of the scores at them. Each reads and writes a token's row alone, so a
rank runs them on its own tokens (rules/misc.along_dim_rule gives ``gather``/``scatter`` their
shard of another dim than the one they index; rules/routed.ROW_WISE and ROW_BY_ROW carry the
rows through each op). Hypothesis draws tp 2-3, a batch and a sequence length (uneven runs
included), the experts and groups, float64 scores; each rank holds its tokens' rows (its ``b``
runs of the sequence, distributed/experts.token_rows) and runs each op as its program would
(the routed localizer); its rows must equal the whole op's at its tokens, for every rank.
"""
from __future__ import annotations

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autotp.distributed.experts import token_rows
from autotp.passes.rules import OpInfo, Strategy, TensorMeta, strategies
from autotp.passes.rules.routed_localizer import routed_localizer
from autotp.placements import REPLICATE, Routed, Shard

aten = torch.ops.aten
TOKENS = Routed(0, tokens=True)
F64 = torch.float64


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(sympy.Integer(s) for s in t.shape), t.dtype)


class _Rank:
    """What the routed localizer reads of a rank's program: every routed operand holds the same
    rows (the rank's tokens), so no row map is matched and no node is made."""

    def __init__(self, tp: int, rank: int, n: int):
        self.tp, self.rank = tp, rank
        self.inputs = [object() for _ in range(n)]
        self.rows = object()

    def rows_of(self, node):
        return self.rows

    def size(self, expr):
        return int(expr)


def _router_steps(scores: torch.Tensor, groups: int, top_groups: int, top_k: int, mask_dtype) -> list:
    """Each op of the group-limited router as (target, args), tensors as they flow."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, groups, experts // groups).topk(min(2, experts // groups), dim=-1)[0].sum(-1)
    group_ids = torch.topk(group_scores, k=top_groups, dim=-1, sorted=False)[1]
    zeros = torch.zeros_like(group_scores)
    mask = zeros.clone().scatter_(1, group_ids, 1)
    wide = mask.unsqueeze(-1).expand(-1, groups, experts // groups)
    keep = wide.reshape(-1, experts).to(mask_dtype)
    drop = torch.bitwise_not(keep.bool())
    masked = scores.masked_fill(drop, float("-inf"))
    ids = torch.topk(masked, k=top_k, dim=-1, sorted=False)[1]
    return [
        (aten.zeros_like.default, (group_scores,)),
        (aten.scatter_.value, (zeros.clone(), 1, group_ids, 1)),
        (aten.scatter.value, (zeros, 1, group_ids, 1.0)),
        (aten.scatter.src, (zeros, 1, group_ids, torch.ones_like(group_ids, dtype=F64))),
        (aten.expand.default, (mask.unsqueeze(-1), [-1, groups, experts // groups])),
        (aten.bitwise_not.default, (keep.bool(),)),
        (aten.logical_not.default, (keep.bool(),)),
        (aten.masked_fill.Scalar, (scores, drop, float("-inf"))),
        (aten.masked_fill.Tensor, (scores, drop, torch.tensor(-1.0, dtype=F64))),
        (aten.topk.default, (masked, top_k, -1, True, False)),
        (aten.gather.default, (scores, 1, ids)),
    ]


@settings(max_examples=40, deadline=None)
@given(tp=st.integers(2, 3), batch=st.integers(1, 2), seq=st.integers(2, 7), groups=st.sampled_from([1, 2, 4]),
       per_group=st.integers(2, 3), top_groups=st.integers(1, 2), top_k=st.integers(1, 2), seed=st.integers(0, 99))
def test_the_group_limited_routers_ops_run_on_a_ranks_own_tokens(tp, batch, seq, groups, per_group, top_groups,
                                                                 top_k, seed):
    if seq < tp:
        return
    experts, top_groups = groups * per_group, min(top_groups, groups)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch * seq, experts, generator=gen, dtype=F64)
    for target, args in _router_steps(scores, groups, top_groups, min(top_k, per_group * top_groups), F64):
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.ndim]
        full = target(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        outs = full if isinstance(full, tuple) else (full,)
        info = OpInfo(target, tuple(_meta(a) if isinstance(a, torch.Tensor) else a for a in args), {},
                      tuple(_meta(a) for a in args if isinstance(a, torch.Tensor)),
                      tuple(_meta(o) for o in outs) if isinstance(full, tuple) else _meta(full), tp)
        placed = tuple(TOKENS if isinstance(a, torch.Tensor) and a.ndim else REPLICATE
                       for a in args if isinstance(a, torch.Tensor))
        keep = [s for s in strategies(info, placed) if s.inputs == placed
                and all(o == TOKENS for o in (s.output if isinstance(s.output, tuple) else (s.output,)))]
        assert keep, (target, strategies(info, placed))
        strategy = keep[0]
        for rank in range(tp):
            local = scores.new_zeros(batch, seq // tp + (rank < seq % tp))
            rows = token_rows(local, 1, (batch,), seq, tp, rank)
            mine = [a[rows].clone() if isinstance(a, torch.Tensor) and a.ndim else a for a in args]
            ctx = _Rank(tp, rank, len(tensors))
            local_target, local_args, local_kwargs = routed_localizer(info, strategy, tuple(mine), {}, ctx)
            got = local_target(*local_args, **local_kwargs)
            for g, want in zip(got if isinstance(got, tuple) else (got,), outs):
                torch.testing.assert_close(g, want[rows], rtol=0, atol=0,
                                           msg=lambda m: f"{target} rank {rank} of {tp}: {m}")


@pytest.mark.parametrize("target, make", [
    (aten.gather.default, lambda x, i: (x, 1, i)),
    (aten.scatter.value, lambda x, i: (x, 1, i, 2.0)),
    (aten.scatter.src, lambda x, i: (x, 1, i, torch.ones(i.shape, dtype=F64))),
])
def test_gather_and_scatter_keep_no_shard_of_the_dim_they_index(target, make):
    # a token's scores picked or written along the experts: split by tokens they run on each
    # rank's rows; split by experts an index points into other ranks' columns
    x, ids = torch.zeros(6, 4, dtype=F64), torch.zeros(6, 2, dtype=torch.long)
    args = make(x, ids)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    info = OpInfo(target, tuple(_meta(a) if isinstance(a, torch.Tensor) else a for a in args), {},
                  tuple(_meta(t) for t in tensors), _meta(target(*args)), 2)
    rows = tuple(Shard(0) for _ in tensors)
    assert Strategy(rows, Shard(0)) in strategies(info, rows)
    experts = tuple(Shard(1) for _ in tensors)
    assert all(s.output == REPLICATE for s in strategies(info, experts))
