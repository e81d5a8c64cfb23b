"""Solve: the plan of least predicted step time under the cost model, found exactly.

**The decision space** is the one propagation walks: every op chooses one of the strategies its
rule offers for its inputs' placements, and every parameter takes the placement the op that
first uses it asks for (a pinned parameter: the pinned dim, or the pinned placement). A weight's
placement is therefore not a separate variable: it is the choice of its first op (column,
row, vocab, replicate...). The **objective** is what :func:`~.propagate.propagate` charges for
those choices: compute of every op on its largest rank, every redistribution (f, g, all-gather,
...; a conversion of one tensor to one placement is paid once), the collectives inside ops,
under a per-rank memory limit on training state + activations.

**Exact** means: no other assignment of strategies in that space has a lower predicted step
time (ties keep the first found, in graph and rule order). The graph is processed in order
as a dynamic program whose state is the placement of every *live* tensor (defined, still to be
used) and which of its conversions are already paid. The cost still to come depends on nothing
else, so merging equal states and keeping the cheapest is exact; a transformer's live set is
small (the residual stream, the attention mask, a few tensors inside a layer), so the state
count stays in the tens. A graph whose live set grows with a dim the capture fixed (a recurrent
scan unrolled over the sequence, Mamba's on CPU: every step's output stays live until they are
stacked) would multiply the states by each step; past :data:`MAX_STATES` the DP keeps the
cheapest states and says so in a log line (the plan is then still a valid plan, the best
among those kept, not proven optimal). A tensor the output returns is paid for (its gather, or
nothing where it is kept split) and dropped from the states past its last other use, exactly as
the output would pay it: a generation step's caches do not multiply the states. With a memory limit a state keeps its Pareto front of (time, memory)
instead of one best (memory only grows, so a partial plan over the limit is dropped): still
exact. What is *not* searched: strategies no rule offers, and placements outside
:class:`~autotp.placements.Placement` (the rules are the space).

**Repeated layers are solved once** (:mod:`.repeats` finds them: runs of one numbered module
such as ``transformer.h.7``, grouped by a Weisfeiler-Lehman hash of their op graph with
networkx, then checked node by node). For one representative per group, the DP's transfer from
each entry state to each exit state is computed once and reused for every repeat entered in
the same state, so a 72-layer model costs about as much as a 2-layer one plus a chain of small
min-plus steps. Uneven shards rotate by layer; rotating every uneven shard by the same amount
moves no cost, so a repeat's labels are the representative's shifted by the layers' rotation
difference (:class:`~.repeats.Shift`). A narrow run (:mod:`.segments`: a few tensors read while others wait
past it unread) is stepped the same way, its own template. The chosen strategies are then replayed by
:func:`propagate` (``forced``), which builds the plan; its time and memory must equal the
solver's, and a mismatch raises.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree
from torch import fx

from ..capture import module_path
from ..cost_model.devices import DeviceProfile
from ..errors import MemoryLimitError, PlanError, SolverError
from ..placements import REPLICATE, Partial, Placement, Shard, same_placement
from .rules import Strategy
from .propagate import (INF, GraphIndex, Propagation, _dim_size, _even, _meta, _out_meta,
                        _sharded_compute, added_seconds, conversion_seconds, gathers_seconds, gathers_whole,
                        internal_seconds, load_share, param_memory, param_update_seconds, pay, propagate,
                        wants_f)
from .repeats import Layer, LayerFinder, Shift
from .segments import Segment, find_segments

log = logging.getLogger(__name__)

#: DP states kept after an op: a transformer's stay in the tens to thousands (at tp 8, the default
#: workload, sequence parallelism offered, after dominated states go: Llama-3-8B and Mixtral-8x7B
#: 1242, DeepSeek-V3 1382, Qwen1.5-MoE 4500, in the attention's rotary region); beyond this many
#: (an unrolled scan's live outputs: Mamba at 8 tokens reaches 5120 after one layer, and doubles
#: per token) the cheapest are kept and the solve is no longer exact. A cut scan keeps this many
#: states at every op after: Mamba-130M's one layer at 11 tokens plans in 6.5 s at 1024, 10.8 s at
#: 2048, 29 s at 8192, which is why the cap is not higher (Qwen1.5-MoE's 4500 are still cut)
MAX_STATES = 2048

@dataclass
class Solution:
    decisions: dict[str, Placement]      # placeholder -> pinned placement
    propagation: Propagation
    evaluated: int                       # DP transitions evaluated
    choices: dict                        # op node -> index of its strategy in its rule's list
    layers_reused: int = 0               # layers whose transfer came from a solved representative
    #: (seconds, bytes) of the fastest plan when it did not fit the memory limit, else None
    over_limit: tuple | None = None
    #: (op, tensors live there) where the search began to keep only MAX_STATES states, else None
    pruned: tuple | None = None

    def warn_pruned(self) -> None:
        """Log that the search was cut (:data:`MAX_STATES`), where it was."""
        if self.pruned is not None:
            log.warning("autotp: the plan's search kept the %d cheapest of its states from %s on (%d tensors live "
                        "at once there, each with placements of its own: a rotary region of a wide attention, a "
                        "sequence loop unrolled by capture): the plan is valid but not proven the cheapest",
                        MAX_STATES, *self.pruned)


_tensor = operator.itemgetter(0)   # a state key's (tensor, label) pair's tensor


# An entry of a DP state's front: (time, memory, choice, previous entry). ``choice`` is
# (node, strategy index) for one op or ("block", block, template choices) for a reused layer.
Entry = tuple


def _no_worse(ey: Entry, ex: Entry, extra: float, memory_free: bool) -> bool:
    """Whether a front entry ``ey`` that pays ``extra`` seconds more later is no worse than
    ``ex``: no later, and with no more memory unless memory never binds (then, at an equal time,
    no more memory: the order the final pick breaks ties by)."""
    t = ey[0] + extra
    if memory_free:
        return t < ex[0] or (t == ex[0] and ey[1] <= ex[1])
    return t <= ex[0] and ey[1] <= ex[1]


def _pareto_add(front: list, entry: Entry, keep_front: bool) -> list:
    t, m = entry[0], entry[1]
    if not keep_front:
        if not front or (t, m) < (front[0][0], front[0][1]):
            return [entry]
        return front
    for e in front:
        if e[0] <= t and e[1] <= m:
            return front
    front = [e for e in front if not (t <= e[0] and m <= e[1])] + [entry]
    return _thinned(front) if len(front) > 2 * FRONT_SIZE else front


#: entries a (time, memory) front keeps per DP state when it is thinned
FRONT_SIZE = 8


def _thinned(front: list) -> list:
    """``FRONT_SIZE`` entries of a Pareto front spread along it: the least memory and the least
    time always, the rest evenly between. Under a memory limit the DP is then approximate in
    time but never loses feasibility: each state's least-memory entry is kept, and least memory
    is additive along the DP, so the least-memory plan is still found exactly. Unthinned, a
    front of many uneven-head options grows without bound (T5 at tp=8: minutes)."""
    front = sorted(front, key=lambda e: e[1])
    last = len(front) - 1
    keep = {round(i * last / (FRONT_SIZE - 1)) for i in range(FRONT_SIZE)}
    return [front[i] for i in sorted(keep)]


class _Solver:
    def __init__(self, index: GraphIndex, profile: DeviceProfile, pinned: Mapping[str, Placement],
                 memory_limit: float | None, exact: bool = False):
        self.index, self.profile, self.pinned = index, profile, dict(pinned)
        self.limit = memory_limit
        self.solve_limit = memory_limit   # self.limit, also while a layer's transfer lifts it
        self.keep_front = memory_limit is not None
        self.cap = index.capture
        self.nodes = list(self.cap.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.last_use = {n: max((self.pos[u] for u in n.users), default=-1) for n in self.nodes}
        self.transitions = 0   # strategies priced (once per op and labels of its inputs)
        self.stepped = 0       # states stepped through an op, or through a layer or segment at once
        self.pruned: fx.Node | None = None   # the first op after which states were dropped (MAX_STATES)
        self.live_at_prune = 0
        self.fixed: dict[fx.Node, Placement] = {}    # placed from the start: inputs, pinned-whole params
        self.free: dict[fx.Node, Any] = {}           # params placed by first use: None or Shard(d)
        self.memory0 = 0.0
        self.seconds0 = 0.0     # the optimizer step on parameters placed before solving
        for n in self.nodes:
            if n.op != "placeholder":
                continue
            if n.name in self.cap.param_names:
                decided = self.pinned.get(n.name)
                # exact: a plan's own placements, every parameter's as it is (propagate's ``exact``)
                if decided is not None and (exact or n.meta["val"].dim() >= 2 and not (
                        isinstance(decided, Shard) and (decided.chunks, decided.unit) == (1, 1))):
                    self.fixed[n] = decided
                    self.memory0 += param_memory(index, profile, n, decided)
                    self.seconds0 += param_update_seconds(index, profile, n, decided)
                elif n.users:
                    self.free[n] = decided if n.meta["val"].dim() >= 2 else None
                elif self.cap.param_names[n.name] not in self.cap.aliases:   # a tied name holds nothing itself
                    self.memory0 += param_memory(index, profile, n, REPLICATE)
                    self.seconds0 += param_update_seconds(index, profile, n, REPLICATE)
            else:
                self.fixed[n] = index.input_placements.get(n.name, REPLICATE)
        for n in self.nodes:
            if n.op not in ("placeholder", "call_function", "output"):
                self.fixed[n] = REPLICATE   # get_attr and the like: whole on every rank
        self.transfers: dict = {}
        self.segments: dict = {}   # first op -> Segment (.segments), found by solve()
        # A state holds only tensors still to be used (each is dropped at its last use), so an
        # op's step drops the state's tensors whose last use it is and nothing else.
        self.dies_at: dict[int, list] = {}
        for n, last in self.last_use.items():
            self.dies_at.setdefault(last, []).append(n)
        # A tensor the graph's output returns, past its last other use, costs only its own
        # conversion at the output (gathered, or kept split), whatever else the state holds: the
        # main walk pays it there and drops it (:meth:`_settled`), so that a generation step's
        # caches, returned by every layer, do not multiply the states layer after layer
        out = next((n for n in reversed(self.nodes) if n.op == "output"), None)
        self.out_leaves: dict[fx.Node, list[int]] = {}
        for i, leaf in enumerate(pytree.tree_leaves(out.args) if out is not None else ()):
            if isinstance(leaf, fx.Node):
                self.out_leaves.setdefault(leaf, []).append(i)
        self.settle_at = sorted((max((self.pos[u] for u in n.users if u is not out), default=self.pos[n]), self.pos[n], n)
                                for n in self.out_leaves)
        self.steps: dict = {}   # (op, its inputs' labels) -> step's result: the rest of a state never matters
        self.inputs_of: dict = {}   # op -> the tensors step() reads the labels of
        # A state maps each live tensor to a label (placement, conversions paid), held as its
        # number in ``labels``: states key dicts per transition, and numbers hash without calls
        self.labels: list = []
        self.label_ids: dict = {}
        self._upgrades: dict = {}   # (tensor, label, label) -> _upgrade_seconds
        self._never_binds: bool | None = None   # _memory_never_binds, once known

    def label_id(self, label: tuple) -> int:
        found = self.label_ids.get(label)
        if found is None:
            found = self.label_ids[label] = len(self.labels)
            self.labels.append(label)
        return found

    # ---- one op --------------------------------------------------------------------------
    def step(self, node: fx.Node, state: dict) -> list[tuple[int, float, float, dict, tuple, bool]]:
        """Each feasible strategy of ``node`` from ``state`` (tensor -> label number): (index,
        seconds, bytes, the new label numbers it sets of tensors the state holds, the (tensor,
        label number) pairs it adds to the state in order, whether one of those is a parameter
        it places); only what outlives the op. Only the labels of the op's inputs matter, so the
        result is kept per (op, those labels)."""
        inputs = self.inputs_of.get(node)
        if inputs is None:
            inputs = self.inputs_of[node] = self._reads(node)
        key = (node, tuple(map(state.get, inputs)))
        found = self.steps.get(key)
        if found is None:
            seen = {i: self.labels[state[i]] for i in inputs if i in state}
            p, last = self.pos[node], self.last_use
            found = []
            for j, dt, dm, labels in self._step(node, seen):
                kept = [(n, self.label_id(lab)) for n, lab in labels.items() if last[n] > p]
                found.append((j, dt, dm, {n: lab for n, lab in kept if n in seen},
                              tuple((n, lab) for n, lab in kept if n not in seen),
                              any(n not in seen and n is not node for n, _ in kept)))
            self.steps[key] = found
        return found

    def _reads(self, node: fx.Node) -> tuple:
        """The tensors whose labels :meth:`step` reads for ``node``."""
        return (node.args[0],) if node.target is operator.getitem else tuple(self.index.tensor_inputs.get(node, ()))

    def _step(self, node: fx.Node, state: dict) -> list[tuple[int, float, float, dict]]:
        """:meth:`step`'s strategies from the labels of the op's inputs (``state``: tensor ->
        label), their new labels unfiltered."""
        index, profile, tp = self.index, self.profile, self.index.tp
        if node.target is operator.getitem:
            src = state[node.args[0]][0]
            p = src[node.args[1]] if isinstance(src, tuple) else REPLICATE
            return [(-1, 0.0, 0.0, {node: (p, frozenset())})]
        info = index.infos[node]
        inputs = index.tensor_inputs[node]
        actual = tuple(state[i][0] if i in state else self.free[i] for i in inputs)
        out = []
        for j, strat in enumerate(index.strategies(node, actual)):
            self.transitions += 1
            sharded = _sharded_compute(strat)
            cost = index.compute_time(node, strat, profile) + internal_seconds(index, profile, strat, node)
            mem = 0.0
            converted: set = set()   # inputs arriving converted: a copy of their own, kept where the op keeps them
            labels: dict = {}
            for i, (inp, meta, want) in enumerate(zip(inputs, info.inputs, strat.inputs)):
                f = wants_f(want, sharded, meta, inp in index.grads, apart=strat.f_runs_only and i == 0)
                if isinstance(want, Shard) and not index.uneven and not _even(meta, want, tp):
                    cost = INF
                    break
                label = labels.get(inp) or state.get(inp)
                if label is None:                        # a parameter's first use places it
                    have = self.free[inp]
                    if isinstance(want, Partial) or (
                            have is not None and not (isinstance(want, Shard) and want.dim == have.dim)):
                        cost = INF
                        break
                    mem += param_memory(index, profile, inp, want)
                    cost += param_update_seconds(index, profile, inp, want)
                    paid = frozenset()
                    if f:
                        cost += conversion_seconds(index, profile, meta, want, want, True)
                        paid = frozenset({(want, True)})
                    labels[inp] = (want, paid)
                    continue
                have, paid = label
                if not same_placement(have, want, _dim_size(meta, want), tp):
                    converted.add(i)
                if index.moves_parameter(inp, have, want, meta):
                    cost = INF   # a parameter is never moved at run time: it is sharded at load
                    break
                if index.moves_written(node, i, have, want, meta):
                    cost = INF   # an in-place write lands in the tensor later ops read, not a copy
                    break
                if (f or have != want) and (want, f) not in paid:
                    # a gather shares the all-gather of the tensor's other gathers (gather_parts);
                    # a collective with an f after it serves a consumer that wants no f
                    seconds, paid = pay(index, profile, meta, have, paid, want, f, inp in index.grads,
                                        load_share(index, inp), inp in index.converted_again)
                    cost += seconds
                    labels[inp] = (have, paid)
                if cost == INF:
                    break
            if cost == INF:
                continue
            mem += index.activation_bytes(node, strat, profile, frozenset(converted))
            if self._tracked(node):
                labels[node] = (strat.output, frozenset())
            out.append((j, cost, mem, labels))
        return out

    def output_cost(self, node: fx.Node, state: dict) -> float:
        return sum(self._returned(leaf, state[leaf]) for leaf in self.out_leaves if leaf in state)

    def _returned(self, leaf: fx.Node, label: int) -> float:
        """What the output pays for ``leaf`` in ``label``: where it returns it whole (not kept
        split), its gather, once however often it returns it."""
        have, paid = self.labels[label]
        for i in self.out_leaves[leaf]:
            if isinstance(have, (Shard, Partial)) and not self.index.keeps_split(i, leaf, have) \
                    and (REPLICATE, False) not in paid:
                return added_seconds(self.index, self.profile, _meta(leaf), have, paid, REPLICATE, False,
                                     leaf in self.index.grads)
        return 0.0

    def _settled(self, states: dict, done: int, upto: int) -> tuple[dict, int]:
        """``states`` with the returned tensors whose last use but the output is at or before
        position ``upto`` (``settle_at[done:]``) paid for as the output pays (:meth:`_returned`)
        and dropped: exact, as nothing but that label decides what they cost still. Returns the
        states and how many of ``settle_at`` are settled."""
        end = done
        while end < len(self.settle_at) and self.settle_at[end][0] <= upto:
            end += 1
        if end == done:
            return states, done
        going = {n for _, _, n in self.settle_at[done:end]}
        nxt: dict = {}
        for key, front in states.items():
            dt = sum(self._returned(n, lab) for n, lab in key if n in going)
            nkey = tuple(kv for kv in key if kv[0] not in going)
            for e in front:
                nxt[nkey] = _pareto_add(nxt.get(nkey, []), (e[0] + dt, e[1], None, e), self.keep_front)
        return nxt, end

    def _tracked(self, node: fx.Node) -> bool:
        if not node.users:
            return False
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) or (
            isinstance(val, (list, tuple)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val))

    # ---- the DP over a range of nodes ---------------------------------------------------------
    def run(self, nodes: list, states: dict, raise_empty: bool = True, segments: bool = True) -> dict:
        """Advance ``states`` (frozen state -> front) over ``nodes`` one op at a time, a segment
        (:mod:`.segments`) wholly among them in one step by its transfer (``segments``); when no
        state survives, raise (or, with ``raise_empty=False``, return nothing)."""
        pos = self.pos
        bound = None if self.limit is None else self.limit * (1 + 1e-12)
        k = 0
        while k < len(nodes):
            node = nodes[k]
            seg = self.segments.get(node) if segments else None
            if seg is not None and k + len(seg.nodes) <= len(nodes) and nodes[k + len(seg.nodes) - 1] is seg.nodes[-1]:
                states = self.apply_block(seg, states)
                k += len(seg.nodes)
                if not states and raise_empty:
                    raise self._infeasible(f"no feasible plan: no strategy fits the ops from {node.name} to "
                                           f"{seg.nodes[-1].name}")
                if not states:
                    return states
                continue
            k += 1
            self.stepped += len(states)
            p = pos[node]
            dying = self.dies_at.get(p, ())
            stays = dict.fromkeys(dying, False)   # tensor -> whether it stays; absent: it does
            nxt: dict = {}
            for key, front in states.items():
                # the tensors this op reads last leave every state it makes (filtered in C: the
                # DP's innermost loop)
                kept = tuple(compress(key, map(stays.get, map(_tensor, key), repeat(True)))) if dying else key
                for j, dt, dm, relabelled, added, placed in self.step(node, dict(key)):
                    # a state's key lists its tensors in graph order: a tensor it holds keeps its
                    # place, the op's output comes last, a parameter it places (a placeholder)
                    # goes before the rest
                    nkey = tuple((n, relabelled.get(n, lab)) for n, lab in kept) if relabelled else kept
                    if added:
                        nkey = tuple(sorted(nkey + added, key=lambda kv: pos[kv[0]])) if placed else nkey + added
                    if not self.keep_front:   # one entry per state: the fastest (ties: the first found)
                        e = front[0]
                        t, m = e[0] + dt, e[1] + dm
                        best = nxt.get(nkey)
                        if best is None or (t, m) < (best[0][0], best[0][1]):
                            nxt[nkey] = [(t, m, (node, j), e)]
                        continue
                    for e in front:
                        t, m = e[0] + dt, e[1] + dm
                        if bound is not None and m + self.memory0 > bound:
                            continue
                        nxt[nkey] = _pareto_add(nxt.get(nkey, []), (t, m, (node, j), e), self.keep_front)
            if len(nxt) > MAX_STATES:
                nxt = self._undominated(nxt)
            states = nxt if len(nxt) <= MAX_STATES else self._cheapest(node, nxt)
            if not states and not raise_empty:
                return states
            if not states:
                raise self._infeasible(f"no feasible plan: no strategy fits {node.name} ({node.target})")
        return states

    def _undominated(self, states: dict) -> dict:
        """``states`` less those another state dominates, in their order: exact, so tried before
        :meth:`_cheapest` cuts. A state Y dominates X where every live tensor has the same
        placement in both, Y's conversions made of each are X's or fewer, and each of X's
        (time, memory) entries is matched by one of Y's with no more memory and a time no later
        than X's once Y pays the conversions it lacks (:meth:`_upgrade_seconds`): whatever X does
        next, Y can do for no more. What multiplies a layer's states past the bound (Mixtral's
        rotary and residual region: the same placements with a gather made or not yet made) is
        such pairs."""
        groups: dict = {}
        for key in states:
            groups.setdefault(tuple(self.labels[lab][0] for _, lab in key), []).append(key)
        free = self._memory_never_binds()
        dropped: set = set()
        for keys in groups.values():
            for x in keys:
                for y in keys:
                    if y is x or y in dropped:
                        continue
                    extra = self._extra_seconds(y, x)
                    if extra is not None and all(any(_no_worse(ey, ex, extra, free) for ey in states[y])
                                                 for ex in states[x]):
                        dropped.add(x)
                        break
        return {k: v for k, v in states.items() if k not in dropped} if dropped else states

    def _memory_never_binds(self) -> bool:
        """Whether no plan can exceed the memory limit: every parameter whole and every op's
        saved inputs whole (what a rank holds at most: a split holds a part) fit under it. Then
        a state's memory decides nothing, and :meth:`_undominated` compares time alone."""
        if self._never_binds is None:
            index, profile = self.index, self.profile
            most = self.memory0 + sum(param_memory(index, profile, n, REPLICATE) for n in self.free)
            for n in self.nodes:
                if n.op == "call_function" and n in index.infos:
                    info = index.infos[n]
                    whole = Strategy(tuple(REPLICATE for _ in info.inputs), REPLICATE)
                    most += index.activation_bytes(n, whole, profile)
            self._never_binds = self.solve_limit is None or most <= self.solve_limit
        return self._never_binds

    def _extra_seconds(self, y: tuple, x: tuple) -> float | None:
        """Seconds at most that state ``y`` pays beyond ``x`` over all that follows, from the
        conversions each made of its tensors (same tensors, same placements), or None where no
        bound holds (:meth:`_upgrade_seconds`)."""
        if [t for t, _ in y] != [t for t, _ in x]:
            return None
        extra = 0.0
        for (tensor, ly), (_, lx) in zip(y, x):
            if ly != lx:
                found = self._upgrade_seconds(tensor, self.labels[ly], self.labels[lx])
                if found is None:
                    return None
                extra += found
        return extra

    def _upgrade_seconds(self, tensor: fx.Node, ly: tuple, lx: tuple) -> float | None:
        """A bound on what a tensor labelled ``ly`` pays, over all that follows, beyond the same
        tensor labelled ``lx`` (same placement), or None where there is none. ``ly``'s conversions
        a superset of ``lx``'s with the same gathers: nothing (a conversion other than a gather
        costs the same whatever else was made). A subset: the conversions ``lx`` holds that are
        not gathers of it at their own price
        (:func:`~.propagate.conversion_seconds`, which no other conversion changes), and the
        gathers, which share one all-gather (:func:`~.propagate.gathers_seconds`, a cost that
        grows with the set gathered), at the difference of the two sets' prices."""
        key = (tensor, ly, lx)
        found = self._upgrades.get(key, False)
        if found is not False:
            return found
        (have, py), (_, px) = ly, lx
        index, profile, tp = self.index, self.profile, self.index.tp
        meta, grad = _meta(tensor), tensor in index.grads
        gathered = [sorted((e for e in p if gathers_whole(meta, have, e[0], tp)), key=repr) for p in (py, px)]
        if py >= px and gathered[0] == gathered[1]:
            # more made, none of them a gather: every later conversion costs the same or nothing
            self._upgrades[key] = 0.0
            return 0.0
        if not py <= px:
            self._upgrades[key] = None
            return None
        extra = 0.0
        if gathered[0] != gathered[1]:
            extra += gathers_seconds(index, profile, meta, have, gathered[1], grad) \
                - gathers_seconds(index, profile, meta, have, gathered[0], grad)
        for want, f in px - py:
            if not gathers_whole(meta, have, want, tp):
                extra += conversion_seconds(index, profile, meta, have, want, f, grad, load_share(index, tensor))
        self._upgrades[key] = extra
        return extra

    def _cheapest(self, node: fx.Node, states: dict) -> dict:
        """The MAX_STATES states of least time so far (ties: the first found), in their order."""
        if self.pruned is None:
            self.pruned, self.live_at_prune = node, len(next(iter(states)))
        best = sorted(range(len(states)), key=lambda i, fronts=list(states.values()): min(e[0] for e in fronts[i]))
        keep = set(best[:MAX_STATES])
        # a tensor later written in place through a view (GraphIndex.moves_written) must already
        # be placed as that write wants: the cheapest state of each placement of such tensors is
        # kept too, or the cheap placements alone would survive to a write none of them can take
        roots = self.index.written_roots
        if roots:
            seen: set = set()
            keys = list(states)
            for i in best:
                written = tuple(kv for kv in keys[i] if kv[0] in roots)
                if written and written not in seen:
                    seen.add(written)
                    keep.add(i)
        return {k: v for i, (k, v) in enumerate(states.items()) if i in keep}

    def _infeasible(self, what: str) -> PlanError:
        """The error for a walk left with no state: under a memory limit, a MemoryLimitError
        (the planner then finds out whether the limit alone is the cause, and what it takes)."""
        if self.limit is None:
            return PlanError(what)
        return MemoryLimitError(f"{what} within the memory limit of {self.limit / 2**30:.2f} GiB per rank; raise "
                                "memory_limit, use a larger tp, or a smaller batch/seq", limit_bytes=self.limit)

    def least_memory(self) -> float:
        """A floor under the bytes per rank of every plan: each parameter's training state split
        ``tp`` ways (the largest rank holds at least its share of any split) and no activations."""
        per = self.profile.state_bytes_per_param / self.index.tp
        return self.memory0 + sum(per * n.meta["val"].numel() for n in self.free)

    # ---- repeated layers -------------------------------------------------------------------------
    def apply_block(self, b: Layer, states: dict) -> dict:
        """Advance ``states`` over layer ``b`` by its representative's transfer."""
        rep = b.template
        back = {v: k for k, v in b.ext_map.items()}
        to_b = dict(zip(rep.nodes, b.nodes))
        to_b.update(b.ext_map)
        end = self.pos[b.nodes[-1]]
        shift = Shift(((b.rotate or 0) - (rep.rotate or 0)) % self.index.tp, self.index.tp, _out_meta)
        nxt: dict = {}
        self.stepped += len(states)
        for key, front in states.items():
            state = dict(key)
            consumed = {n: lab for n, lab in state.items() if n in back}
            passing = {n: lab for n, lab in state.items() if n not in back}
            tkey = tuple(sorted(((back[n], self._shifted(shift, n, lab, False)) for n, lab in consumed.items()),
                                key=lambda kv: self.pos[kv[0]]))
            transfer = self.transfers.get((id(rep), tkey))
            if transfer is None:
                transfer = self.transfers[(id(rep), tkey)] = self._transfer(rep, tkey)
            for okey, tfront in transfer.items():
                new = dict(passing)
                for n, lab in okey:
                    nb = to_b[n]
                    if self.last_use[nb] > end:
                        new[nb] = self._shifted(shift, nb, lab, True)
                nkey = tuple(sorted(new.items(), key=lambda kv: self.pos[kv[0]]))
                for e in front:
                    for dt, dm, choices in tfront:
                        t, m = e[0] + dt, e[1] + dm
                        if self.limit is not None and m + self.memory0 > self.limit * (1 + 1e-12):
                            continue
                        nxt[nkey] = _pareto_add(nxt.get(nkey, []), (t, m, ("block", b, choices), e),
                                                self.keep_front)
        return nxt

    def _shifted(self, shift: Shift, node: fx.Node, label: int, forward: bool) -> int:
        return self.label_id(shift.label(node, self.labels[label], forward)) if shift.delta else label

    def _transfer(self, rep: Layer, tkey: tuple) -> dict:
        """exit state -> front of (seconds, bytes, strategy indices) through ``rep`` from ``tkey``."""
        start = {tkey: [(0.0, 0.0, None, None)]}
        saved, self.limit = self.limit, None if self.limit is None else float("inf")
        try:
            # a dead end from this entry state; a segment's own ops one by one
            out = self.run(rep.nodes, start, raise_empty=False, segments=not isinstance(rep, Segment))
        finally:
            self.limit = saved
        result = {}
        for okey, front in out.items():
            result[okey] = [(e[0], e[1], _choices(e)) for e in front]
        return result

    # ---- the whole graph ---------------------------------------------------------------------------
    def solve(self) -> tuple[dict, float, float]:
        blocks = {b.nodes[0]: b for b in LayerFinder(self.index, self.pos, self.last_use, self.free).layers()}
        repeated = {n for b in blocks.values() if b.template is not None for n in b.nodes}
        body = [n for n in self.nodes if n.op != "placeholder"]
        self.segments = find_segments(body, self.pos, self.last_use, self._reads, self._tracked, repeated)
        start = tuple(sorted(((n, self.label_id((p, frozenset()))) for n, p in self.fixed.items() if n.users),
                             key=lambda kv: self.pos[kv[0]]))
        states = {start: [(0.0, 0.0, None, None)]}
        reused = settled = 0
        i = 0
        while i < len(body):
            n = body[i]
            states, settled = self._settled(states, settled, self.pos[n] - 1)
            b = blocks.get(n)
            if b is not None and b.template is not None:
                states, i, reused = self.apply_block(b, states), i + len(b.nodes), reused + 1
                if not states:
                    raise self._infeasible(f"no feasible plan: no strategy fits layer {module_path(b.nodes[0])}")
                continue
            seg = self.segments.get(n)
            if seg is not None:
                states = self.run(seg.nodes, states)
                i += len(seg.nodes)
                continue
            if n.op == "output":
                nxt: dict = {}
                for key, front in states.items():
                    state = dict(key)
                    dt = self.output_cost(n, state)
                    for e in front:
                        nxt.setdefault((), [])
                        nxt[()] = _pareto_add(nxt[()], (e[0] + dt, e[1], None, e), self.keep_front)
                states = nxt
            elif n.op == "call_function":
                states = self.run([n], states)
            i += 1
        front = states[()]
        best = min(front, key=lambda e: (e[0], e[1]))
        self.reused = reused
        return _expand(_choices(best)), best[0] + self.seconds0, best[1] + self.memory0


def _choices(entry: Entry) -> tuple:
    out = []
    while entry is not None:
        if entry[2] is not None:
            out.append(entry[2])
        entry = entry[3]
    return tuple(reversed(out))


def _expand(choices: tuple) -> dict:
    """(node, j) and reused-layer choices -> op node -> strategy index."""
    forced = {}
    for c in choices:
        if c[0] == "block":
            _, b, inner = c
            to_b = dict(zip(b.template.nodes, b.nodes))
            for n, j in _expand(inner).items():
                forced[to_b[n]] = j
        elif c[1] >= 0:
            forced[c[0]] = c[1]
    return forced


def solve(index: GraphIndex, profile: DeviceProfile, pinned: Mapping[str, Placement] | None = None,
          memory_limit: float | None = None, exact: bool = False) -> Solution:
    """The minimum-cost plan (see the module docstring); ``memory_limit`` in bytes per rank.
    ``exact``: every pinned placement held as it is, 1-D parameters' and plain shards' included (a
    saved plan's, which a later program of the same parameters must keep: they were sliced at load).

    The unconstrained optimum is found first; only if it does not fit is the DP run again
    with (time, memory) fronts, which is slower, and not at all where the parameters' training
    state alone, split ``tp`` ways, exceeds the limit. Where no plan fits, the MemoryLimitError
    carries the unconstrained optimum as ``fastest`` (a Solution, as ``memory_limit=None`` returns)."""
    pinned = dict(pinned or {})
    solver = _Solver(index, profile, pinned, None, exact)
    forced, seconds, memory = solver.solve()
    over_limit = None
    if memory_limit is not None and memory > memory_limit:
        over_limit, fastest = (seconds, memory), forced
        fastest_solver, floor = solver, solver.least_memory()
        try:
            if floor > memory_limit * (1 + 1e-12):   # as the DP's own test: no search can succeed
                raise MemoryLimitError(
                    f"no feasible plan: the parameters' training state alone, each split {index.tp} ways, takes "
                    f"{floor / 2**30:.2f} GiB per rank, over the memory limit of {memory_limit / 2**30:.2f} GiB; "
                    "raise memory_limit, use a larger tp, or a smaller batch/seq", limit_bytes=memory_limit)
            solver = _Solver(index, profile, pinned, memory_limit, exact)
            forced, seconds, memory = solver.solve()
        except MemoryLimitError as exc:   # plans exist, none within the limit: say what the fastest needs
            # the fastest plan, as solve(..., memory_limit=None) returns it: a caller may show it (autotp.planner)
            exc.fastest = _solution(index, profile, pinned, fastest_solver, fastest, *over_limit, None, exact)
            # (its search's cut, if any, is said where the plan is shown: Solution.warn_pruned)
            prop = exc.fastest.propagation
            exc.needed_bytes, exc.state_bytes = prop.memory_bytes, prop.memory_bytes - prop.activation_bytes
            exc.activation_bytes = prop.activation_bytes
            raise
    solution = _solution(index, profile, pinned, solver, forced, seconds, memory, over_limit, exact)
    solution.warn_pruned()
    return solution


def priced(index: GraphIndex, profile: DeviceProfile, choices: Mapping[Any, int],
           pinned: Mapping[str, Placement] | None = None, exact: bool = False) -> Propagation:
    """A given assignment priced as the solver prices it: ``choices`` maps every op (its node, or
    its name: an assignment found on another index of the same capture, or kept from an earlier
    solve) to the index of its strategy in its rule's list, as :attr:`Solution.choices` does. The
    plan the walk replays from them (:func:`~.propagate.propagate`, ``forced``) is returned, its
    ``total_s`` what :func:`solve` would charge for it: so any plan can be held against the
    solver's under the same prices. A name no op of the capture has, or an assignment the walk
    cannot replay (an op left without a choice, a strategy its inputs' placements do not offer, a
    conversion that cannot be made), is a PlanError naming it."""
    nodes = {n.name: n for n in index.capture.graph.nodes}
    forced = {}
    for op, j in choices.items():
        node = nodes.get(op) if isinstance(op, str) else op
        if node is None or nodes.get(node.name) is not node:
            raise PlanError(f"the assignment names {op if isinstance(op, str) else op.name}, which is no op of "
                            f"this capture ({index.capture.model_name}): price it on an index of the capture "
                            "it was made for")
        forced[node] = j
    prop = propagate(index, pinned or {}, profile, forced=forced, exact=exact)
    if prop.infeasible:
        raise PlanError(f"the assignment does not replay on this capture: {prop.infeasible}")
    return prop


def _solution(index: GraphIndex, profile: DeviceProfile, pinned: dict, solver: _Solver, forced: dict,
              seconds: float, memory: float, over_limit: tuple | None, exact: bool = False) -> Solution:
    """The solver's choices replayed by :func:`propagate` into a plan, which must cost what the
    solver predicted."""
    prop = propagate(index, pinned, profile, forced=forced, exact=exact)
    if prop.infeasible:
        raise SolverError(f"internal: the solver's plan does not replay: {prop.infeasible}")
    if (abs(prop.total_s - seconds) > 1e-8 * max(1e-3, seconds)
            or abs(prop.memory_bytes - memory) > 1e-6 * max(1.0, memory)):
        raise SolverError(f"internal: the solver predicted {seconds:.6g} s / {memory:.6g} B but the plan costs "
                        f"{prop.total_s:.6g} s / {prop.memory_bytes:.6g} B")
    pruned = None if solver.pruned is None else (solver.pruned.name, solver.live_at_prune)
    return Solution(pinned, prop, solver.transitions, forced, solver.reused, over_limit, pruned)
