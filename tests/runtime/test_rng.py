"""The counter-based RNG tracker: draws are a function of (stream, draw count), the count is
never changed in place, and a compiled draw gives the eager one's numbers and gradients."""
from __future__ import annotations

import torch

from autotp.distributed.rng import RNGTracker, counter_based_op


def _tracker() -> RNGTracker:
    return RNGTracker(seed=3, tp_rank=1, dp_rank=0, device=torch.device("cpu"), counter_based=True)


def test_a_draw_replaces_the_count_and_a_snapshot_redraws_the_same_numbers():
    tracker = _tracker()
    before = tracker.snapshot()
    held = tracker.counters["sharded"]
    first = tracker.uniform("sharded", (3, 4), torch.float32)
    second = tracker.uniform("sharded", (3, 4), torch.float32)
    assert int(held) == 0 and int(tracker.counters["sharded"]) == 2   # the old count is untouched
    assert not torch.equal(first, second)
    tracker.restore(before)
    assert torch.equal(tracker.uniform("sharded", (3, 4), torch.float32), first)
    assert int(tracker.counters["replicated"]) == 0


def _dropout_model(tracker: RNGTracker) -> torch.nn.Module:
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(-1, 1, 48, dtype=torch.float64).view(6, 8))

        def forward(self, x):
            y = counter_based_op(torch.ops.aten.dropout.default, (x @ self.weight, 0.5, True), {}, tracker, "sharded")
            return (y.sin() * (x @ self.weight)).sum()

    return Model()


def test_compiled_dropout_draws_the_eager_masks_and_their_gradients():
    # the backward of a compiled program uses the masks its forward drew (GPT-2 with dropout at
    # every place, compiled whole: tests/e2e/test_compile.py)
    tracker = _tracker()
    model, x = _dropout_model(tracker), torch.randn(5, 6, dtype=torch.float64)
    start = tracker.snapshot()
    model(x).backward()
    eager = model.weight.grad.clone()
    model.weight.grad = None
    tracker.restore(start)
    torch._dynamo.reset()
    torch.compile(model, backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(model.weight.grad, eager, rtol=1e-12, atol=0)
    assert int(tracker.counters["sharded"]) == 1
