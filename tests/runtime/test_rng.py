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


def test_a_dropout_on_the_tokens_rows_draws_from_the_sharded_state(fake_rank):
    # OPT's MLP dropout on [b*s, h] under sequence parallelism runs on the rank's own tokens'
    # rows (P(tokens 0)): its mask must be the rank's own, as a dropout on S(1) draws, not the
    # replicated state's (every rank would mask its different tokens with the same pattern)
    import autotp
    from autotp import zoo
    from autotp.distributed.rng import RandomOp
    from autotp.placements import Routed

    config = zoo.tiny_config("opt", layers=2, heads=4, kv_heads=None, head_dim=8, vocab=61)
    config.dropout = 0.1
    model = zoo.build("opt", config, dtype=torch.float32, seed=1)
    pm = autotp.parallelize(model, 2, batch=64, seq=4096, profile="h100-dgx", sequence_parallel=True,
                            layout={"*.out_proj.weight": "row", "*.fc2.weight": "row"})
    ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    pm(input_ids=ids, labels=ids).loss.backward()   # the program is written at the first call
    draws = {n.name: (pm.graph_module.get_submodule(n.target).state, n.meta.get("autotp_placement"))
             for n in pm.graph_module.graph.nodes
             if n.op == "call_module" and isinstance(pm.graph_module.get_submodule(n.target), RandomOp)}
    on_rows = {name: state for name, (state, placement) in draws.items()
               if isinstance(placement, Routed) and placement.tokens}
    assert len(on_rows) == 2 and set(on_rows.values()) == {"sharded"}, draws   # one a layer
