"""Narrow runs: stretches of the graph that read few of the tensors the solver's states hold.

The solver's state is the placement of every live tensor, so a tensor that waits across a long
stretch without being read (the residual stream past a layer's mixer, a gate kept for the norm
after a recurrence) multiplies the states of every op there by its own options, and each op
steps every state. Gated DeltaNet's chunked rule is such a stretch: its 63 row updates
(``attn[..., i, :i] = ...``, unrolled by capture) read only ``attn``, while about ten tensors
wait past them (q, k, v, the decay mask, the gate, the residual), 2048 states at every one of
some 600 ops, a minute of solving per layer kind.

A *segment* is a run of consecutive ops that reads at most :data:`MOST_READ` tensors made
before it and leaves at most :data:`MOST_LEFT` tensors of its own live after it, while at least
:data:`LEAST_WAITING` live tensors wait past it unread. What the run costs, and what it leaves,
depends on the labels of the tensors it reads and nothing else (a step reads its inputs' labels
alone), so the solver treats it as it treats a repeated layer (:mod:`.repeats`): the DP's
transfer through it is computed once per entry labelling of the tensors it reads, and every
state steps through the run in one min-plus step, the waiting tensors carried as they are.
Exact: the same predicted costs with fewer states stepped (the run's own DP never holds the
waiting tensors); between plans of equal cost the one kept may differ, the states being found in
another order. The limits are empirical: wider segments are solved apart per entry labelling
where op by op those labellings share their paths (at 4 or 5 tensors read, Mamba's unrolled scan
stepped 15-23x more states than at 3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import fx

from .repeats import Layer

#: a segment reads at most this many tensors made before it (their labels key its transfers)
MOST_READ = 3
#: ... and leaves at most this many of its own tensors live after it (its exit states)
MOST_LEFT = 3
#: ... and holds at least this many ops
LEAST_OPS = 8
#: ... while at least this many live tensors wait past it unread (each multiplies the states)
LEAST_WAITING = 2
#: the longest run looked at from one op (the search stays linear in the graph)
LONGEST = 4096


@dataclass
class Segment(Layer):
    """A narrow run: its own template (its transfer is computed on itself), ``ext_map`` the
    identity on the tensors made before it that it reads."""


def find_segments(nodes: list, pos: dict, last_use: dict, reads: Callable[[fx.Node], tuple],
                  tracked: Callable[[fx.Node], bool], skip: set) -> dict[fx.Node, Segment]:
    """The segments of ``nodes`` (the graph's ops in order), by their first op: greedily, the
    longest from each op that qualifies, then on after it. ``reads``: the tensors an op's step
    reads the labels of; ``tracked``: whether a node is a tensor the states hold; ``skip``: ops
    no segment may hold (the repeated layers' own, stepped by their transfers)."""
    found: dict[fx.Node, Segment] = {}
    live: set = set()   # tracked tensors made before nodes[k] and used at or after it
    dies: dict[int, list] = {}
    for n in nodes:
        if tracked(n):
            dies.setdefault(last_use[n], []).append(n)
    k = 0
    while k < len(nodes):
        seg = _longest(nodes, k, pos, last_use, reads, tracked, skip, live)
        stop = k + (len(seg.nodes) if seg is not None else 1)
        if seg is not None:
            found[seg.nodes[0]] = seg
        for n in nodes[k:stop]:
            if tracked(n) and last_use[n] > pos[n]:
                live.add(n)
            live.difference_update(dies.get(pos[n], ()))
        k = stop
    return found


def _longest(nodes: list, k: int, pos: dict, last_use: dict, reads: Callable, tracked: Callable, skip: set,
             live: set) -> Segment | None:
    """The longest segment starting at ``nodes[k]`` (``live``: the tensors live before it), or None."""
    start = pos[nodes[k]]
    outside: dict = {}   # tensors made before the run that it reads (in order of first read)
    left: set = set()    # the run's own tensors live after its last op
    waiting = len(live)   # live tensors it has not read: each waits past it
    best, read = None, []
    for j in range(k, min(len(nodes), k + LONGEST)):
        n = nodes[j]
        if n.op != "call_function" or n in skip:
            break
        for i in reads(n):
            if pos[i] < start and i not in outside:
                outside[i] = None
                waiting -= i in live
        if len(outside) > MOST_READ or waiting < LEAST_WAITING:
            break
        if tracked(n) and last_use[n] > pos[n]:
            left.add(n)
        left.difference_update([i for i in reads(n) if last_use[i] == pos[n]])
        if j - k + 1 >= LEAST_OPS and len(left) <= MOST_LEFT:
            best, read = j, list(outside)
    if best is None:
        return None
    seg = Segment(nodes=nodes[k:best + 1], rotate=None, ext={t: () for t in read}, ext_map={t: t for t in read})
    seg.template = seg
    return seg
