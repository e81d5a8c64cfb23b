"""Which pinned parameter makes a plan infeasible, in words a user can act on.

A layout pin (``layout={"*k_proj.weight": "column"}``) fixes how a parameter is split before the
solver runs. Where no strategy of the op that reads it accepts that split (2 key/value heads
dealt to 4 ranks: two ranks would hold no head), the solver can only say which op has no
strategy. :func:`unholdable_pin` finds the pin to blame by propagating each pin alone (the
others free) and describes it: the parameter, the heads (or other atoms) its split dim holds as
the graph reads them, the ranks that would be left without one, and what to pin instead.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Any, Mapping

from ..placements import Placement, Shard
from .propagate import GraphIndex, propagate


def unholdable_pin(index: GraphIndex, pinned: Mapping[str, Placement], profile: Any,
                   layout: Mapping[str, Any] | None = None) -> str | None:
    """A sentence naming the first pinned parameter that cannot hold on its own, or None where
    every pin holds alone (the pins conflict with each other, or something else is infeasible)."""
    cap = index.capture
    for placeholder, placement in pinned.items():
        if not isinstance(placement, Shard):
            continue
        if not propagate(index, {placeholder: placement}, profile).infeasible:
            continue
        fqn = cap.param_names[placeholder]
        return _describe(index, placeholder, fqn, placement, _pattern_of(fqn, layout))
    return None


def _pattern_of(fqn: str, layout: Mapping[str, Any] | None) -> str | None:
    for pattern in layout or {}:
        if fnmatch.fnmatchcase(fqn, pattern):
            return pattern
    return None


def _describe(index: GraphIndex, placeholder: str, fqn: str, placement: Shard, pattern: str | None) -> str:
    cap, tp = index.capture, index.tp
    node = next(n for n in cap.graph.nodes if n.op == "placeholder" and n.name == placeholder)
    shape = tuple(int(s) for s in node.meta["val"].shape)
    size = shape[placement.dim]
    user = next((u for u in node.users if u in index.infos), None)
    pinned_by = f"layout pin {pattern!r}" if pattern else "its pin"
    what = f"{fqn} (shape {list(shape)}, split along dim {placement.dim} by {pinned_by})"
    atoms = None
    if user is not None:
        info = index.infos[user]
        out_dim = _output_dim(info, size)
        if out_dim is not None:
            chunks, unit, _, tail, _, sizes, _ = info.hint(out_dim)
            if unit > 1 and size % (chunks * unit) == 0:
                atoms = (size // (chunks * unit) - tail) * chunks, unit
                if sizes:
                    return _describe_blocks(what, size, tuple(x * size // (sum(sizes) * unit) for x in sizes), unit,
                                            tp, index.uneven)
    if atoms is not None and atoms[0] < tp:
        heads, head_dim = atoms
        idle = f"rank {heads}" if tp - heads == 1 else f"ranks {heads}-{tp - 1}"
        fits = ", ".join(str(t) for t in range(1, heads + 1) if heads % t == 0)
        return (f"{what} cannot be split {tp} ways: the graph reads its {size} features as {heads} heads of "
                f"{head_dim}, so {idle} of {tp} would hold no head. Pin it 'replicate' (or leave it out of "
                f"layout: the planner then keeps the heads whole on the ranks whose query heads use them), or use "
                f"tp in {{{fits}}}")
    if len(shape) == 3 and placement.dim in (1, 2):
        # a stack of experts split inside every expert (expert tensor parallelism)
        return (f"{what} cannot be split {tp} ways: each of its {shape[0]} experts has {size} features along dim "
                f"{placement.dim}, too few to give each of {tp} ranks a slice"
                f"{'' if index.uneven else ' of equal size (uneven=False)'}. Pin it 'expert' (whole experts per "
                f"rank) or 'replicate', or leave it out of layout and the planner chooses")
    op = f"{user.name} ({user.target}), the op that reads it," if user is not None else "the op that reads it"
    return (f"{what} cannot be split {tp} ways: no sharding rule of {op} accepts that split at tp={tp} (its "
            f"{size} elements along dim {placement.dim}). Pin it 'replicate' or leave it out of layout, and the "
            f"planner chooses its split")


def _describe_blocks(what: str, size: int, heads: tuple[int, ...], head_dim: int, tp: int, uneven: bool) -> str:
    """A fused projection read back as blocks of unequal heads (Phi-3's q | k | v with fewer
    key/value heads): split by head where every rank gets a group (a key/value head with its
    query heads), evenly unless ``uneven``."""
    groups = math.gcd(*heads)   # a key/value head with its query heads
    counts = " | ".join(str(h) for h in heads)
    fits = ", ".join(str(t) for t in range(1, groups + 1) if uneven or groups % t == 0)
    if groups < tp:
        idle = f"rank {groups}" if tp - groups == 1 else f"ranks {groups}-{tp - 1}"
        why = f"{idle} of {tp} would hold none of its {groups} groups of heads"
    else:
        why = f"{tp} does not divide its {groups} groups of heads (uneven=False)"
    return (f"{what} cannot be split {tp} ways by head: the graph reads its {size} features as blocks of "
            f"{counts} heads of {head_dim} (query heads, then key and value heads), each split by head across "
            f"the ranks so that every rank's query heads find their key/value heads, and {why}. Pin it "
            f"'replicate' (or leave it out of layout: the planner then chooses, keeping the key/value heads "
            f"whole where it must), or use tp in {{{fits}}}")


def _output_dim(info: Any, size: int) -> int | None:
    """The output dim a product's weight dim of ``size`` becomes where it is the output's
    features (a linear's weight [out, in] dim 0, a Conv1D's [in, out] dim 1): the last."""
    out = info.output
    if out is None or not hasattr(out, "static") or not out.ndim:
        return None
    return out.ndim - 1 if out.static(out.ndim - 1) == size else None
