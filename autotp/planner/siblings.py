"""Which sibling products a plan runs fused (:mod:`autotp.passes.products`), decided by the plan.

A set of siblings joined into one product splits only as one layout: every weight by the same
heads' groups (q | k | v, Megatron's fused projection), or every weight whole. Where the solver
would split them differently (fewer kv heads than ranks: q by head, k and v whole on every rank)
the joined product has no such layout and runs whole. So a fresh plan is solved with every set
fused; where a set's weights come out whole at tp > 1, the capture with those sets apart is solved
too; and the capture with every set apart (the join copies the rank's weight shards each step,
which costs more than it saves where the weights are large against the tokens: a decode step, a
whole model at tp 1); the cheapest predicted step is kept (as :mod:`autotp.passes.row_scales`'
moved scales are). A replayed plan (a later program's) joins only the sets its weights'
placements can join (all whole, or all split along their rows), or none where that is cheaper.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..errors import PlanError, SolverError
from ..passes.products import Siblings, find_siblings, fuse_products
from ..placements import REPLICATE, Shard

log = logging.getLogger(__name__)


def _weights(cap: Any, sibs: Siblings) -> list[str]:
    return [cap.param_names[p.args[1].name] for p in sibs.products]


def apart_in(held: Any, cap: Any, free: bool = False) -> frozenset:
    """The sets of ``cap`` whose weights ``held`` (parameter name -> placement: a plan's, or a
    layout's pins) places so that no join holds them: some whole and some split, or split along
    another dim than their rows (a ``row`` pin: the joined weight splits only along its rows).
    A weight ``held`` leaves out is whole (a plan's) or, with ``free``, follows the others (a
    layout's unpinned one)."""
    skip = set()
    for sibs in find_siblings(cap.graph, cap.param_names):
        names = _weights(cap, sibs)
        places = [held[n] for n in names if n in held] if free else [held.get(n, REPLICATE) for n in names]
        whole = all(p == REPLICATE for p in places)
        rows = all(isinstance(p, Shard) and p.dim == 0 for p in places)
        if not (whole or rows):
            skip.add(sibs.key)
    return frozenset(skip)


def fused_cheaper(cap: Any, tp: int, plan: Any, attempt: Callable[[Any], tuple],
                  pins: Any = None, only: frozenset | None = None) -> tuple[tuple, list, str | None]:
    """``attempt`` (a capture -> its (plan, index, propagation)) on ``cap`` with its sibling
    products fused where that is cheaper (module docstring): the result, what was fused, and a
    note where sets were kept apart (None where none was). The join is paid each step (a copy of
    the rank's weight shards forward) where the written products pay an ``add`` of their input's
    gradient per sibling and run narrower: it pays at a training workload split over ranks, not
    where the weights are large against the tokens (a decode step, a whole model on one rank),
    so the capture with every set apart is solved too and the cheaper predicted step kept.
    ``pins`` (parameter name -> placement, a layout's) keeps apart the sets it pins unalike: a pin
    means its parameter, whose rows a join makes rows of the joined weight, so a set with one
    weight pinned ``row`` (Llama-4's router beside its shared expert's gate and up) runs apart.
    ``only``: the sets to keep apart, decided already (another rank's plan rebuilt): that capture
    alone is attempted. The result's index records the sets kept apart (``GraphIndex.apart``).
    A way that fails is "no plan this way" (a memory limit) and the others are tried; a failure
    of the solver itself (:class:`~autotp.errors.SolverError`, a bug) is logged as one when
    another way plans, so the fallback is said, never silent. With no way left, the first
    failure is raised, a SolverError before any other."""
    sets = find_siblings(cap.graph, cap.param_names)
    if not sets:
        return attempt(cap), [], None
    tried: list[tuple[tuple, list, str | None]] = []
    failure: PlanError | None = None

    def trying(skip: frozenset, why: str) -> tuple | None:
        nonlocal failure
        try:
            if len(skip) == len(sets):
                result, fused = attempt(cap), []
            else:
                fused_cap, fused = fuse_products(cap, skip)
                result = attempt(fused_cap)
        except SolverError as exc:   # a bug: said, and the other way tried
            log.warning("autotp: %s (planning %d sibling product sets apart, %d joined); this is a bug in "
                        "autotp, please report it. Trying the other way", exc, len(skip), len(sets) - len(skip))
            failure = failure if isinstance(failure, SolverError) else exc
            return None
        except PlanError as exc:   # no plan this way (a memory limit): another way may have one
            failure = failure or exc
            return None
        result[1].apart = skip
        tried.append((result, fused, _apart_note(len(skip), why)))
        return result

    if only is not None:
        skip, why = only, "as decided"
    elif plan is not None:
        skip, why = apart_in(plan.params, cap), "the plan splits their weights differently"
    else:
        skip, why = apart_in(pins or {}, cap, free=True), "the layout pins their weights differently"
    first = trying(skip, why)
    if only is not None:
        if first is None:
            raise failure
        return tried[0]
    if first is not None and plan is None and tp > 1:
        whole = frozenset(s.key for s in sets
                          if all(first[0].params.get(name, REPLICATE) == REPLICATE for name in _weights(cap, s)))
        if whole and len(whole) < len(sets):
            trying(whole, "joined, their product would run whole: apart, the plan splits them cheaper")
    if len(skip) < len(sets):
        trying(frozenset(s.key for s in sets), "joined, the predicted step is slower: the join copies the "
               "weights each step")
    if not tried:
        raise failure
    return min(tried, key=lambda t: t[0][2].total_s)


def _apart_note(n: int, why: str) -> str | None:
    if not n:
        return None
    return f"sibling products kept apart: {n} set{'s' if n > 1 else ''} ({why})"
