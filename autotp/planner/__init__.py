"""The planner: a capture -> a :class:`~autotp.plan.Plan`.

Input: a :class:`~autotp.capture.Capture`, tp, the planning workload (batch, seq), a device
profile, and optionally a layout of roles or a saved plan to replay. Output: the plan, with the
graph index and the propagation it was written from (the rewrite's inputs). The passes do the
work (index, propagation, the exact solve); the planner pins, asks, and writes the answer.

- :mod:`.planner`  :func:`build_plan`: index -> pins -> solve (or replay) -> the plan, its notes
- :mod:`.roles`    a layout's role names (column, row, vocab, replicate) -> the placements pinned
- :mod:`.experts`  why each MoE layer got its experts layout: the other one solved and priced
"""
from .planner import build_plan

__all__ = ["build_plan"]
