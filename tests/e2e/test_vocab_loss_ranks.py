"""The vocab-parallel cross-entropy across gloo ranks (tp 2-4, float64) equals torch's
cross_entropy on the whole logits: the loss, and each rank's slice of the logits' gradient, for
every reduction, with ignored labels (-100) and vocabularies tp does not divide (uneven columns,
and fused heads whose rows a rank holds in several runs)."""
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from autotp.placements import Shard, local_ranges


def vocab_loss_errors(case: dict) -> tuple[float, float]:
    import torch.distributed as dist

    from autotp.distributed.shards import local_shard
    from autotp.distributed.functional import VocabParallelCrossEntropy

    tp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(case["seed"])
    n, vocab, reduction = case["n"], case["vocab"], case["reduction"]
    logits = case["spread"] * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (n,), generator=g)
    target[torch.rand(n, generator=g) < case["ignored"]] = -100
    target[0] = case["seed"] % vocab          # a mean over no targets is nan both ways
    upstream = torch.randn(() if reduction else (n,), generator=g, dtype=torch.float64)
    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole, target, reduction=["none", "mean", "sum"][reduction])
    want.backward(upstream)
    shard = Shard(1, chunks=case["chunks"]) if case["chunks"] > 1 else Shard(1)
    local = local_shard(logits, shard, tp, rank).clone().requires_grad_()
    loss = VocabParallelCrossEntropy(dist.group.WORLD, local_ranges(vocab, shard, tp, rank), -100, reduction)
    got = loss(local, target)
    got.backward(upstream)
    loss_error = (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)
    expected = local_shard(whole.grad, shard, tp, rank)
    grad_error = (local.grad - expected).abs().max().item() / max(whole.grad.abs().max().item(), 1e-300)
    return loss_error, grad_error


@settings(max_examples=12, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)
@given(tp=st.integers(2, 4), n=st.integers(1, 9), vocab=st.integers(5, 41), chunks=st.sampled_from([1, 2]),
       reduction=st.sampled_from([0, 1, 2]), ignored=st.floats(0.0, 0.6), spread=st.sampled_from([1.0, 30.0]),
       seed=st.integers(0, 999))
def test_vocab_parallel_loss_and_gradient_equal_serial(cluster_of, tp, n, vocab, chunks, reduction, ignored,
                                                      spread, seed):
    vocab = max(vocab, tp) * chunks if chunks > 1 else max(vocab, tp)   # fused heads: equal blocks of rows
    case = dict(n=n, vocab=vocab, chunks=chunks, reduction=reduction, ignored=ignored, spread=spread, seed=seed)
    for loss_error, grad_error in cluster_of(tp).run(vocab_loss_errors, case):
        assert loss_error <= 1e-12 and grad_error <= 1e-12, (loss_error, grad_error)
