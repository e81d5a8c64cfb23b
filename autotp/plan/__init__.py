"""The plan: what autotp decided, as a value a person reads and a program reloads.

Input: a propagation the planner chose (:func:`autotp.planner.build_plan` writes the plan from
it), or a plan file (``Plan.from_json``). Output: a :class:`Plan`, every parameter's placement
and role, every collective with its bytes per step, the predicted cost per rank, and its views.
Nothing here runs a model or talks to another rank.

- :mod:`.plan`    the :class:`Plan` value: table, JSON, and what the planner records in it
- :mod:`.schema`  what a plan file may hold: every field checked before ``from_json`` builds it
- :mod:`.flow`    how data flows through each distinct layer (steps, collectives on edges)
- :mod:`.view`    the plan folded: repeated layers once, what varies in a line
- :mod:`.diff`    two plans compared: layouts, collectives per layer, step time and memory
- :mod:`.figure`  one layer drawn as SVG: matrices cut by rank, placements, f and g
"""
from .plan import CommOp, DeferredExpressions, Plan

__all__ = ["Plan", "CommOp", "DeferredExpressions"]
