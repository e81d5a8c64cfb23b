"""Which sibling products a plan runs fused (:mod:`autotp.passes.products`), decided by the plan.

A set of siblings joined into one product splits only as one layout: every weight by the same
heads' groups (q | k | v, Megatron's fused projection), or every weight whole. Where the solver
would split them differently (fewer kv heads than ranks: q by head, k and v whole on every rank)
the joined product has no such layout and runs whole. So a fresh plan is solved with every set
fused; where a set's weights come out whole at tp > 1, the capture with those sets apart is solved
too and the cheaper predicted step kept (as :mod:`autotp.passes.row_scales`' moved scales are). A
replayed plan (a later program's) fuses only the sets its weights' placements can join: all
whole, or all split along their rows.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import PlanError
from ..passes.products import Siblings, find_siblings, fuse_products
from ..placements import REPLICATE, Shard


def _weights(cap: Any, sibs: Siblings) -> list[str]:
    return [cap.param_names[p.args[1].name] for p in sibs.products]


def apart_in(plan: Any, cap: Any) -> frozenset:
    """The sets of ``cap`` whose weights ``plan`` places so that no join holds them: some whole
    and some split, or split along another dim than their rows."""
    skip = set()
    for sibs in find_siblings(cap.graph, cap.param_names):
        held = [plan.params.get(name, REPLICATE) for name in _weights(cap, sibs)]
        whole = all(p == REPLICATE for p in held)
        rows = all(isinstance(p, Shard) and p.dim == 0 for p in held)
        if not (whole or rows):
            skip.add(sibs.key)
    return frozenset(skip)


def fused_cheaper(cap: Any, tp: int, plan: Any, attempt: Callable[[Any], tuple]) -> tuple[tuple, list, str | None]:
    """``attempt`` (a capture -> its (plan, index, propagation)) on ``cap`` with its sibling
    products fused as the module docstring says: the result, what was fused, and a note where
    sets were kept apart (None where none was)."""
    if plan is not None:
        skip = apart_in(plan, cap)
        fused_cap, fused = fuse_products(cap, skip)
        return attempt(fused_cap), fused, _apart_note(len(skip), "the plan splits their weights differently")
    fused_cap, fused = fuse_products(cap)
    result = attempt(fused_cap)
    if tp == 1 or not fused:
        return result, fused, None
    whole = frozenset(s.key for s in find_siblings(cap.graph, cap.param_names)
                      if all(result[0].params.get(name, REPLICATE) == REPLICATE for name in _weights(cap, s)))
    if not whole:
        return result, fused, None
    apart_cap, apart = fuse_products(cap, whole)
    try:
        other = attempt(apart_cap)
    except PlanError:   # no plan with them apart (a memory limit): the fused one stands
        return result, fused, None
    if other[2].total_s < result[2].total_s:
        return other, apart, _apart_note(len(whole), "fused, their joined product would run whole: apart, "
                                         "the plan splits them cheaper")
    return result, fused, None


def _apart_note(n: int, why: str) -> str | None:
    if not n:
        return None
    return f"sibling products kept apart: {n} set{'s' if n > 1 else ''} ({why})"
