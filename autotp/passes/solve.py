"""Solve: choose each weight matrix's placement by the cost model.

Decision variables are the parameters of 2+ dims (weights, embeddings); everything else
follows by propagation. Parameters whose names differ only in a layer index (``h.3.mlp`` vs
``h.7.mlp``) form one *template* and share one choice, so a 48-layer model costs no more to
solve than a 1-layer one. The search is a descent over single and paired template moves
from the all-replicated plan (a pair is what turns a column split and its row partner on
together), repeated until no move lowers the predicted step time. Ties keep the earlier,
fewer-collectives choice; the order of everything is the graph's, so every rank finds the
same plan.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Mapping

from ..cost_model.devices import DeviceProfile
from ..errors import PlanError
from ..placements import REPLICATE, Placement, Shard
from .propagate import INF, GraphIndex, Propagation, propagate

_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def template_of(fqn: str) -> str:
    return _LAYER_INDEX.sub("*", fqn)


@dataclass
class Solution:
    decisions: dict[str, Placement]      # placeholder -> decided placement (dim only)
    propagation: Propagation
    evaluated: int


def decision_space(index: GraphIndex) -> dict[str, list[str]]:
    """template -> the placeholder names in it (in graph order)."""
    groups: dict[str, list[str]] = {}
    for node in index.capture.graph.nodes:
        if node.op != "placeholder" or node.name not in index.capture.param_names:
            continue
        if node.meta["val"].dim() < 2:
            continue
        groups.setdefault(template_of(index.capture.param_names[node.name]), []).append(node.name)
    return groups


def options_for(index: GraphIndex, placeholder: str) -> list[Placement]:
    node = next(n for n in index.capture.graph.nodes if n.name == placeholder)
    shape = node.meta["val"].shape
    return [REPLICATE] + [Shard(d) for d, size in enumerate(shape) if int(size) >= index.tp]


def solve(index: GraphIndex, profile: DeviceProfile, pinned: Mapping[str, Placement] | None = None,
          memory_limit: float | None = None) -> Solution:
    pinned = dict(pinned or {})
    groups = decision_space(index)
    free = [t for t, names in groups.items() if not all(n in pinned for n in names)]
    options = {t: options_for(index, groups[t][0]) for t in free}
    choice = {t: REPLICATE for t in free}
    cache: dict[tuple, Propagation] = {}

    def decisions_of(ch: Mapping[str, Placement]) -> dict[str, Placement]:
        out = dict(pinned)
        for t, p in ch.items():
            for name in groups[t]:
                out.setdefault(name, p)
        return out

    def evaluate(ch: Mapping[str, Placement]) -> Propagation:
        key = tuple(ch[t] for t in free)
        if key not in cache:
            prop = propagate(index, decisions_of(ch), profile)
            if memory_limit is not None and not prop.infeasible:
                from ..plan import param_bytes_per_rank

                if max(param_bytes_per_rank(index, prop)) > memory_limit:
                    prop.infeasible = "parameters exceed the memory limit"
            cache[key] = prop
        return cache[key]

    if index.tp == 1:
        prop = evaluate(choice)
        return Solution(decisions_of(choice), prop, len(cache))

    best = evaluate(choice)
    for _ in range(8):
        improved = False
        moves = [((t,), (o,)) for t in free for o in options[t]]
        moves += [((a, b), (oa, ob)) for a, b in itertools.combinations(free, 2)
                  for oa in options[a] for ob in options[b]]
        for templates, opts in moves:
            trial = dict(choice)
            trial.update(zip(templates, opts))
            if trial == choice:
                continue
            prop = evaluate(trial)
            if prop.total_s < best.total_s * (1 - 1e-9):
                choice, best, improved = trial, prop, True
        if not improved:
            break
    if best.infeasible:
        raise PlanError(f"no feasible plan: {best.infeasible}")
    return Solution(decisions_of(choice), best, len(cache))
