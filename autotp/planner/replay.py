"""A saved plan's parameter placements on another program: a later program of
:func:`autotp.parallelize` (an inference call, a padded one, a generation step) planned under the
first plan's pins. The activations' placements are the solver's under those pins, or the op-by-op
walk's where that is cheaper and keeps every pin in fact, not in name (no sharded parameter moved
at run time); where neither holds them, a PlanError names the weight that would move.

Input: the program's :class:`~autotp.passes.propagate.GraphIndex`, a device profile, the pinned
placements. Output: the :class:`~autotp.passes.propagate.Propagation` the plan is written from
(:mod:`autotp.planner.planner`)."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from ..errors import PlanError
from ..passes.propagate import GraphIndex, Propagation, propagate
from ..passes.solve import solve
from ..placements import REPLICATE, Placement
from .sequence import sequence_regions

log = logging.getLogger(__name__)


def under_pins(index: GraphIndex, prof: Any, pinned: Mapping[str, Placement]) -> Propagation:
    """A saved plan's parameter placements on another capture (a later program of ``parallelize``:
    an inference call, a padded one, a generation step): the solver's plan of the activations
    under those placements held exactly, or the op-by-op greedy walk's where that is cheaper (the
    search cut at MAX_STATES) or the solver finds none. The greedy walk alone chose each op's
    placement without the conversions it leaves to later ops: Mixtral's inference program at batch
    64 reduce-scattered the attention's partial sum along the hidden dim into the residual add (half
    an all-reduce, half the add) and then all-gathered it twice for the norm, 2% slower by the
    cost model than the solver's plan under the same pins. Forced (``index.force_sequence``), a
    walk that splits fewer regions along the sequence than the solver's plan is not taken however
    cheap: Falcon's prefill step at tp 3 walked to its row-parallel products with x whole and
    gathered their pinned weights (through the transpose, which the solver never does), leaving
    no partial sum to reduce-scatter. Nor is a walk taken that moves a sharded parameter (a view of
    it converted, :meth:`GraphIndex.moves_parameter`, which the solver never does): the pin would
    hold in name only. Falcon's decode step at tp 4 walked its row-pinned weights through their
    transposes into an all-to-all to ``S(1)``, its inference call at a small workload all-gathered
    them, each cheaper by the cost model; where the solver finds no plan and the walk moves one,
    the program is a PlanError naming the weight."""
    greedy = propagate(index, pinned, prof, exact=True)
    moved = [] if greedy.infeasible else moved_parameters(index, greedy)
    try:
        solved = solve(index, prof, pinned, exact=True).propagation
    except PlanError as exc:
        if greedy.infeasible:
            raise PlanError(f"the given plan does not fit this model: {exc}") from exc
        if moved:
            param, placed, tensor, src, dst = moved[0]
            more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
            raise PlanError(
                f"under the plan's parameter placements this program ({index.capture.model_name}, tp={index.tp}) "
                f"runs only by moving {param}, placed {placed}: {tensor} would be converted {src} -> {dst} at run "
                f"time, so the placement would hold in name only{more} (the solver found no plan that keeps it: "
                f"{exc}). Pin {param} another way (layout=), or let the planner choose its layout") from exc
        # the walk is a path the search holds, so only a search cut at MAX_STATES loses it
        log.info("autotp: a later program is planned op by op (the solver found no plan under the given "
                 "placements: %s)", exc)
        return greedy
    if moved:
        return solved
    if index.force_sequence and not greedy.infeasible \
            and sequence_regions(index, greedy) < sequence_regions(index, solved):
        return solved
    return greedy if not greedy.infeasible and greedy.total_s < solved.total_s else solved


def moved_parameters(index: GraphIndex, prop: Propagation) -> list[tuple[str, Placement, str, Placement, Placement]]:
    """The sharded parameters ``prop`` moves at run time (:meth:`GraphIndex.moves_parameter`: a
    parameter, or a view of a sharded one, converted), as (parameter, its placement, the tensor
    converted, from, to)."""
    from ..passes.propagate import _meta

    nodes = {n.name: n for n in index.capture.graph.nodes}
    found = []
    for c in prop.comms:
        node = nodes.get(c.tensor)
        if node is None or node not in index.param_views:
            continue
        meta = _meta(node)
        if meta is not None and index.moves_parameter(node, c.src, c.dst, meta):
            root = node
            while root.name not in index.capture.param_names and root.args:
                root = root.args[0]
                if isinstance(root, (list, tuple)):   # weights joined (autotp/passes/products.py): the first
                    root = root[0]
            found.append((index.capture.param_names.get(root.name, root.name), prop.params.get(root.name, REPLICATE),
                          c.tensor, c.src, c.dst))
    return found
