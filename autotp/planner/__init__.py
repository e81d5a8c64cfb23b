"""The planner: a capture -> a :class:`~autotp.plan.Plan`.

Input: a :class:`~autotp.capture.Capture`, tp, the planning workload (batch, seq), a device
profile, and optionally a layout of roles or a saved plan to replay. Output: the plan, with the
graph index and the propagation it was written from (the rewrite's inputs). The passes do the
work (index, propagation, the exact solve); the planner pins, asks, and writes the answer.

- :mod:`.planner`     :func:`build_plan`: index -> pins -> solve (or replay) -> the plan, its notes
- :mod:`.replay`      a saved plan's placements on another program (a later call's): held exactly, never moved
- :mod:`.roles`       a layout's role names (column, row, vocab, replicate) -> the placements pinned
- :mod:`.sequence`    sequence parallelism counted and explained: regions, notes, a forced program's errors
- :mod:`.notes`       memory (no plan fits: what the fastest needs) and what a plan leaves whole, and why
- :mod:`.host_reads`  ``host_reads=False``: the model's own reads and whole-expert pins refused
- :mod:`.experts`     why each MoE layer got its experts layout: the other one solved and priced
- :mod:`.scales`      per-row scales (routing weights) offered to move to a product's input
"""
from .planner import build_plan

__all__ = ["build_plan"]
