"""A view splitting a rank's token rows back into dims is a merge's shard only where those rows can
be a merge's (rules/token_rows.token_split): a token's top-k rows ``[b*s*k, h]`` viewed as
``[b*s, k, h]`` are held by their token's rank, so no shard of the top-k slots says them (the
rank's program found no merge of ``(b*s, k)`` and raised its PlanError, "splits rows back ... no
merge made", where a pricing that made the top-k sum dearer tipped the solver to it); Mamba2's
heads merged with the batch ``[b*h, d, n] -> [b, h, d, n]`` and a static sequence's tokens
``[b*7, h] -> [b, 7, h]`` are. Rows a merge made of a dim split by head (``Routed.heads``:
Gated DeltaNet's normed ``[b, s, h, d] -> [b*s*h, d]``) split back even where the sequence is
merged before the heads, and with each row folded into the last dim (``[b, s, h*d]``, the out
projection's input); rows of a sequence split never are."""
import sympy
import torch

from autotp.passes.rules import OpInfo, TensorMeta
from autotp.passes.rules.token_rows import token_rows, token_split
from autotp.placements import Routed, Shard

aten = torch.ops.aten
B, S = sympy.symbols("s0 s1", integer=True, positive=True)


def _view(before: tuple, after: tuple, sequence: frozenset, tp: int = 2) -> OpInfo:
    x = TensorMeta(before, torch.float64)
    info = OpInfo(aten.view.default, (x, list(after)), {}, (x,), TensorMeta(after, torch.float64), tp)
    info.sequence, info.uneven = sequence, True
    return info


def test_a_tokens_top_k_rows_viewed_by_token_are_no_merges_shard():
    combine = Routed(0, tokens=True, reordered=True, ascending=True)   # the rows put back in token order
    for sequence, tokens in ((frozenset({S}), B * S), (frozenset({7}), 7 * B)):   # dynamic, static length
        info = _view((tokens * 2, sympy.Integer(16)), (tokens, sympy.Integer(2), sympy.Integer(16)), sequence)
        assert token_split(info, combine) is None
        assert token_split(info, Routed(0, tokens=True, reordered=True)) is None


def test_a_merges_rows_split_back_are_its_shard():
    # Mamba2's heads merged with the batch, and a static sequence's tokens after the top-k sums
    heads = _view((B * 4, sympy.Integer(8)), (B, sympy.Integer(4), sympy.Integer(8)), frozenset({S}))
    assert token_split(heads, Routed(0, tokens=True)) == Shard(1)
    tokens = _view((B * 7, sympy.Integer(16)), (B, sympy.Integer(7), sympy.Integer(16)), frozenset({7}))
    assert token_split(tokens, Routed(0, tokens=True, reordered=True)) == Shard(1)


def test_rows_merged_by_head_split_back_past_the_sequence_and_folded_into_the_last_dim():
    h, d = sympy.Integer(4), sympy.Integer(8)
    merge = _view((B, S, h, d), (B * S * h, d), frozenset({S}))
    rows = token_rows(merge, Shard(2))
    assert rows == Routed(0, tokens=True, heads=4)
    # a sequence split merged is not by head, nor a static length's
    assert token_rows(_view((B, S, h * d), (B * S, h * d), frozenset({S})), Shard(1)) == Routed(0, tokens=True)
    static = _view((B, sympy.Integer(7), d), (B * 7, d), frozenset({7}))
    assert token_rows(static, Shard(1)) == Routed(0, tokens=True)
    # back into its dims, the sequence merged before the heads
    assert token_split(_view((B * S * h, d), (B, S, h, d), frozenset({S})), rows) == Shard(2)
    # folded into the last dim with its head: a rank's heads' elements contiguous
    folded = _view((B * S * h, d), (B, S, h * d), frozenset({S}))
    assert token_split(folded, rows) == Shard(2, unit=8)
    assert token_split(folded, Routed(0, tokens=True, unit=2, heads=4)) == Shard(2, unit=16)
    # rows of a sequence split (a token's top-k rows) are held by their token: never a fold's shard
    assert token_split(folded, Routed(0, tokens=True)) is None
    assert token_split(folded, Routed(0, tokens=True, reordered=True)) is None
    # a fold that does not hold whole rows, or other heads than those merged: none
    assert token_split(_view((B * S * h, d), (B, S, sympy.Integer(12)), frozenset({S})), rows) is None
    assert token_split(_view((B * S * h, d), (B, S * 2, sympy.Integer(16)), frozenset({S})), rows) is None
    assert token_split(_view((B * S * h, d), (B, S * 2, sympy.Integer(2), d), frozenset({S})), rows) is None
