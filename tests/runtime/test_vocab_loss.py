"""The vocab-parallel cross-entropy's own arithmetic on one rank (its ranges the whole
vocabulary, in one or several runs): loss and gradient equal torch's cross_entropy for every
reduction, with ignored targets (the split across ranks is tested end to end in
tests/e2e/test_embeddings.py)."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autotp.runtime.functional import _VocabParallelCrossEntropy


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
