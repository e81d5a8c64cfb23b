"""The rank benchmarks' per-call timer (``benchmarks/op_timer.py``): every ATen call of a step,
forward and backward, each at its least time over the repeats; a step that changes is refused."""
from __future__ import annotations

import pytest
import torch

from benchmarks.op_timer import op_times


def test_every_call_of_forward_and_backward_is_timed_once_per_step():
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 8)

    def step():
        w.grad = None
        (x @ w).relu().sum().backward()

    ops = op_times(step, repeats=2)
    names = [op for op, _, _ in ops.calls]
    assert names.count("mm") == 2          # forward x @ w, backward x^T @ grad (x needs none)
    assert "relu" in names and "threshold_backward" in names
    assert ("mm", (3, 4)) in {(op, s) for op, s, _ in ops.calls}
    assert all(t >= 0 for _, _, t in ops.calls) and ops.total == pytest.approx(sum(ops.by_op.values()))


def test_a_step_that_runs_other_ops_is_refused():
    calls = iter(range(10))

    def step():
        torch.ones(2).mul(2) if next(calls) % 2 else torch.ones(2).add(2)

    with pytest.raises(RuntimeError, match="other ATen ops"):
        op_times(step, repeats=2)


def test_a_modules_step_is_timed_by_both_clocks_and_told_by_kind():
    from types import SimpleNamespace

    from benchmarks.op_timer import CATEGORIES, by_category, module_step

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return SimpleNamespace(loss=(x @ self.w).relu().sum())

    model = Tiny()
    ops = op_times(module_step(model, {"x": torch.randn(3, 8)}), repeats=3)
    assert len(ops.clock) == 3 and ops.step > 0   # each unmoded step's wall clock, the least thread time
    kinds = by_category(ops)
    assert kinds["other products"] == pytest.approx(ops.by_op["mm"])
    assert sum(kinds.values()) == pytest.approx(max(ops.step, ops.total))
    assert set(kinds) == set(CATEGORIES)
