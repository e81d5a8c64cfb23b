"""The vocab-parallel cross-entropy's own arithmetic on one rank (its ranges the whole
vocabulary, in one or several runs): loss and gradient equal torch's cross_entropy for every
reduction, with ignored targets; and the vocab-parallel embedding's lookups, summed over the
ranks of a split computed here in one process, equal the whole table's, with each rank's table
gradient the rows it holds of the serial one, a padding row included (the split across ranks is
tested end to end in tests/e2e/test_embeddings.py)."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autotp.placements import Shard, local_ranges
from autotp.distributed.shards import local_shard
from autotp.distributed.functional import _VocabParallelCrossEntropy, vocab_parallel_embedding


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), vocab=st.integers(2, 40), reduction=st.sampled_from([0, 1, 2]),
       cut=st.floats(0.0, 1.0), ignored=st.floats(0.0, 0.5), seed=st.integers(0, 999))
def test_loss_and_gradient_equal_cross_entropy(n, vocab, reduction, cut, ignored, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, vocab, generator=g, dtype=torch.float64)).requires_grad_()
    target = torch.randint(0, vocab, (n,), generator=g)
    target[torch.rand(n, generator=g) < ignored] = -100
    if (target == -100).all() and reduction == 1:
        target[0] = 0            # a mean over no targets is nan both ways
    # the whole vocabulary held as two runs, in the order a rank's local columns follow
    at = int(cut * vocab)
    ranges = ((0, at), (at, vocab)) if 0 < at < vocab else ((0, vocab),)
    ours = _VocabParallelCrossEntropy.apply(logits, target, None, ranges, -100, reduction)
    want = F.cross_entropy(logits, target, ignore_index=-100, reduction=["none", "mean", "sum"][reduction])
    upstream = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    (got_grad,) = torch.autograd.grad(ours, logits, upstream)
    (want_grad,) = torch.autograd.grad(want, logits, upstream)
    assert torch.allclose(ours, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(got_grad, want_grad, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 40), tp=st.integers(1, 5), chunks=st.sampled_from([1, 2]), padding=st.floats(-0.3, 1.0),
       shape=st.sampled_from([(6,), (2, 5), (3, 1)]), seed=st.integers(0, 999))
def test_embedding_over_ranks_equals_the_whole_lookup_padding_row_included(vocab, tp, chunks, padding, shape, seed):
    vocab = max(vocab, tp) * chunks        # a fused table: chunks equal blocks of rows
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, 3, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, shape, generator=g)
    pad = None if padding < 0 else min(int(padding * vocab), vocab - 1)
    if pad is not None:
        ids.view(-1)[seed % ids.numel()] = pad      # the padding token is looked up
    upstream = torch.randn(*shape, 3, generator=g, dtype=torch.float64)
    whole = weight.clone().requires_grad_()
    want = F.embedding(ids, whole, padding_idx=pad)
    want.backward(upstream)
    shard = Shard(0, chunks=chunks) if chunks > 1 else Shard(0)   # fused tables: runs of rows per rank
    total = torch.zeros_like(want)
    for rank in range(tp):
        local = local_shard(weight, shard, tp, rank).clone().requires_grad_()
        ranges = tuple(local_ranges(vocab, shard, tp, rank))
        out = vocab_parallel_embedding(local, ids, ranges, -1 if pad is None else pad)
        out.backward(upstream)
        total += out.detach()
        assert torch.equal(local.grad, local_shard(whole.grad, shard, tp, rank)), (rank, ranges, pad)
    assert torch.allclose(total, want.detach(), rtol=0, atol=0)
