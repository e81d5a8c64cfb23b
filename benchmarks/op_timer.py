"""Time per ATen op call of a step, robust to a shared machine: each call's least over repeats.

A step of a program runs the same ATen ops in the same order every time (forward and backward:
the dispatch mode sees the autograd engine's calls too). :func:`op_times` runs the step
``repeats`` times under a :class:`torch.utils._python_dispatch.TorchDispatchMode` that times each
call (``time.thread_time``: this thread's CPU time, so time another process takes from the core
is not counted) and keeps, for the k-th call of the step, its least time over the repeats: on two
cores shared by several jobs a step's wall time moves by 2x, the least of each call does not.
Each call is keyed by its op and its output's shape, so a reader can tell the experts' rows from
the tokens and a zero-fill of a whole tensor from one of a shard.

The mode's own bookkeeping (a few microseconds a call) is outside the timed span; what the step
spends outside ATen ops (Python, the autograd engine, the fx program's calls) is not in any call:
``StepOps.wall`` (the least whole step's thread time, the mode off) minus the calls' sum says how
much that is.

    python -c "from benchmarks.op_timer import op_times; ..."   # used by benchmarks/moe_rank.py
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _shape(out) -> tuple:
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            return tuple(t.shape)
    return ()


class _Timer(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        spent = time.thread_time() - start
        self.calls.append((str(func.overloadpacket).replace("aten::", "").removeprefix("aten."), _shape(out), spent))
        return out


@dataclass
class StepOps:
    """One step's ATen op calls, each at its least time over the repeats."""

    calls: list[tuple[str, tuple, float]]   # (op, output shape, seconds), in the step's order
    wall: float                              # the least whole step (thread time, no mode active)
    by_op: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for op, _, t in self.calls:
            self.by_op[op] = self.by_op.get(op, 0.0) + t

    @property
    def total(self) -> float:
        return sum(t for _, _, t in self.calls)

    def by_op_shape(self) -> dict[tuple[str, tuple], tuple[float, int]]:
        out: dict[tuple[str, tuple], tuple[float, int]] = {}
        for op, shape, t in self.calls:
            s, n = out.get((op, shape), (0.0, 0))
            out[(op, shape)] = (s + t, n + 1)
        return out


def op_times(step: Callable[[], None], repeats: int = 5) -> StepOps:
    """``step`` (a forward + backward) timed call by call, each call's least over ``repeats``
    steps, and the least step's thread time with no mode on. Raises if a step runs other ops
    than the first (a program that is not the same step every time)."""
    best: list[tuple[str, tuple, float]] | None = None
    for _ in range(repeats):
        with _Timer() as timer:
            step()
        if best is None:
            best = timer.calls
            continue
        got, want = [(op, s) for op, s, _ in timer.calls], [(op, s) for op, s, _ in best]
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise RuntimeError(f"the step ran other ATen ops than the first (call {at} of {len(want)}: "
                               f"{got[at:at + 3]} against {want[at:at + 3]}): not one program")
        best = [(op, s, min(t, u)) for (op, s, t), (_, _, u) in zip(best, timer.calls)]
    walls = []
    for _ in range(repeats):
        start = time.thread_time()
        step()
        walls.append(time.thread_time() - start)
    return StepOps(best or [], min(walls))
