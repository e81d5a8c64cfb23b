"""Narrow runs (autotp/passes/segments.py): a run of ops that reads one tensor while others wait
past it is stepped by its transfer, every state at once, to the same optimum as op by op, with
fewer transitions; with a memory limit too (the transfer's (time, memory) fronts)."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from autotp.capture import capture
from autotp.errors import PlanError
from autotp.passes import solve as solve_module
from autotp.passes.propagate import GraphIndex
from autotp.passes.segments import LEAST_OPS, find_segments
from autotp.passes.solve import _Solver, solve
from tests.passes.test_solve import profiles


class Waiting(nn.Module):
    """Two products' outputs wait past a chain of row-wise ops on a third's (Gated DeltaNet's
    unrolled row updates in small)."""

    def __init__(self, d: int, hidden: int, steps: int):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, d)
        self.steps = steps

    def forward(self, x):
        h, g, u = self.a(x), self.b(x), self.c(x)
        for _ in range(self.steps):
            h = h + torch.tanh(h) * 0.5
        return self.out(h * g + u)


@functools.lru_cache(maxsize=None)
def waiting_capture(steps: int):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Waiting(8, 16, steps)
    return capture(model, example_kwargs={"x": torch.empty(2, 8, 8, device="meta")})


def _solved(index, profile, segments: bool, limit: float | None = None):
    saved = solve_module.find_segments
    if not segments:
        solve_module.find_segments = lambda *args, **kwargs: {}
    try:
        solver = _Solver(index, profile, {}, limit)
        forced, seconds, memory = solver.solve()
    finally:
        solve_module.find_segments = saved
    return solver, forced, seconds, memory


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(3, 6), tp=st.sampled_from([2, 3, 4]), profile=profiles)
def test_a_run_stepped_by_its_transfer_reaches_the_same_optimum_with_fewer_transitions(steps, tp, profile):
    index = GraphIndex.build(waiting_capture(steps), tp, 64, 512, uneven=True)
    whole, forced, seconds, memory = _solved(index, profile, True)
    ops, _, op_seconds, op_memory = _solved(index, profile, False)
    # the chain of tanh, mul and add on h is one segment; the products are in none
    (seg,) = whole.segments.values()
    assert len(seg.nodes) >= min(LEAST_OPS, 3 * steps) and {str(n.target) for n in seg.nodes} <= {
        "aten.tanh.default", "aten.mul.Tensor", "aten.add.Tensor"}, seg.nodes
    assert len(seg.ext_map) == 1   # it reads h alone
    assert seconds == pytest.approx(op_seconds, rel=1e-12, abs=1e-18)
    assert memory == pytest.approx(op_memory, rel=1e-12)
    assert whole.stepped < ops.stepped
    # the plan replays to the solver's figures (solve's own check), and equals op by op's
    assert solve(index, profile).propagation.total_s == pytest.approx(op_seconds, rel=1e-12, abs=1e-18)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([2, 4]), quantile=st.floats(0, 1), profile=profiles)
def test_under_a_memory_limit_a_segments_fronts_keep_the_same_optimum(tp, quantile, profile):
    index = GraphIndex.build(waiting_capture(4), tp, 64, 512, uneven=True)
    fastest, _, _, most = _solved(index, profile, False)
    floor = fastest.least_memory()
    limit = floor + quantile * (most - floor)
    outcomes = []
    for segments in (True, False):
        try:
            outcomes.append(_solved(index, profile, segments, limit=limit)[2:])
        except PlanError as exc:   # no plan within the limit: the same for both
            outcomes.append(type(exc))
    assert outcomes[0] == pytest.approx(outcomes[1], rel=1e-12, abs=1e-18) \
        if isinstance(outcomes[1], tuple) else outcomes[0] is outcomes[1]


def test_no_segment_where_nothing_waits_or_the_run_reads_too_much():
    # a chain with nothing waiting past it (steps of the same h, no g or u) is stepped op by op
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            h = self.a(x)
            for _ in range(6):
                h = h + torch.tanh(h) * 0.5
            return self.out(h)

    with torch.device("meta"):
        cap = capture(Chain(), example_kwargs={"x": torch.empty(2, 8, 8, device="meta")})
    index = GraphIndex.build(cap, 2, 64, 512, uneven=True)
    solver = _Solver(index, _profile(), {}, None)
    solver.solve()
    assert solver.segments == {}
    body = [n for n in cap.graph.nodes if n.op != "placeholder"]
    everything = find_segments(body, solver.pos, solver.last_use, solver._reads, solver._tracked, set(body))
    assert everything == {}   # nothing found among ops it is told to skip


def _profile():
    from autotp.cost_model import DeviceProfile

    return DeviceProfile("drawn", 1e12, 1e11, 1e10, 1e-5, 1e12, 2)
