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
``StepOps.step`` (the least whole step's thread time, the mode off) minus the calls' sum says how
much that is. The same unmoded steps give the wall clock too (``StepOps.clock``: each step's
``time.perf_counter`` seconds, waiting for a core included), for a reader to set beside it.

:func:`module_step` is the step both rank benchmarks time (a forward and a backward of a module on
one batch, its gradients dropped first), and :func:`category` the kinds the time is told by.

    from benchmarks.op_timer import module_step, op_times
    ops = op_times(module_step(model, batch), repeats=3)   # benchmarks/moe_rank.py, rank_efficiency.py
"""
from __future__ import annotations

import statistics
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
    step: float                              # the least whole step (thread time, no mode active)
    clock: list[float] = field(default_factory=list)   # each unmoded step's wall-clock seconds
    by_op: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for op, _, t in self.calls:
            self.by_op[op] = self.by_op.get(op, 0.0) + t

    @property
    def clock_median(self) -> float:
        return statistics.median(self.clock) if self.clock else float("nan")

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
    steps, and the least step's thread time with no mode on (and each such step's wall clock).
    Raises if a step runs other ops than the first (a program that is not the same step every
    time)."""
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
    threads, clocks = [], []
    for _ in range(repeats):
        start, clock = time.thread_time(), time.perf_counter()
        step()
        clocks.append(time.perf_counter() - clock)
        threads.append(time.thread_time() - start)
    return StepOps(best or [], min(threads), clocks)


def fwd_bwd(module, batch: dict) -> None:
    """A forward and a backward of ``module`` on ``batch`` (its loss made whole where it is a
    DTensor)."""
    loss = module(**batch).loss
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss.backward()


def module_step(module, batch: dict) -> Callable[[], None]:
    """The step the rank benchmarks time: ``module``'s gradients dropped, then a forward and a
    backward on ``batch``."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        fwd_bwd(module, batch)

    return step


#: measured ATen ops (the dispatch mode's names) that are products, and attention
PRODUCT_OPS = ("mm", "bmm", "addmm", "baddbmm", "addmv", "mv", "dot")
ATTENTION_OPS = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
INDEX_OPS = ("index", "_index_put", "scatter", "gather", "sort", "argsort", "topk", "bucketize", "nonzero", "histc",
             "bincount", "masked", "take", "embedding", "cumsum", "repeat_interleave", "one_hot", "where")
ALLOC_OPS = ("new_zeros", "zeros", "zeros_like", "fill_", "zero_", "new_empty", "empty", "empty_like", "new_full",
             "full", "new_empty_strided", "empty_strided", "arange", "ones", "new_ones", "ones_like", "full_like",
             "scalar_tensor", "lift_fresh")
COPY_OPS = ("copy_", "clone", "_to_copy", "contiguous", "cat", "stack", "to", "_copy_from", "expand_copy")
VIEW_OPS = ("view", "_unsafe_view", "reshape", "slice", "select", "permute", "transpose", "t", "expand", "as_strided",
            "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "alias", "detach", "narrow", "unbind",
            "_reshape_alias", "unflatten", "flatten", "view_as", "diagonal")
#: the kinds a step's time is told by, in the order of the benchmarks' tables
CATEGORIES = ("experts' products", "other products", "attention", "index, scatter, gather, sort, top-k",
              "allocations, zero-fills", "copies, cat", "views", "elementwise, reductions, norms, the loss",
              "collectives (the fake backend's copies)", "outside ATen ops (Python, autograd, the program's calls)")


def category(op: str) -> str:
    """The kind of an ATen op (by the dispatch mode's name) among ``CATEGORIES``."""
    if "grouped_mm" in op:
        return CATEGORIES[0]
    if op in PRODUCT_OPS:
        return CATEGORIES[1]
    if op.startswith(ATTENTION_OPS):
        return CATEGORIES[2]
    if "c10d" in op:
        return CATEGORIES[8]
    if op.startswith(INDEX_OPS):
        return CATEGORIES[3]
    if op in ALLOC_OPS:
        return CATEGORIES[4]
    if op in COPY_OPS:
        return CATEGORIES[5]
    if op in VIEW_OPS:
        return CATEGORIES[6]
    return CATEGORIES[7]


def by_category(ops: StepOps) -> dict[str, float]:
    """Seconds per category of a step's least-time op calls, with what the step spent outside
    any ATen op."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for op, t in ops.by_op.items():
        out[category(op)] += t
    out[CATEGORIES[-1]] = max(0.0, ops.step - ops.total)
    return out
