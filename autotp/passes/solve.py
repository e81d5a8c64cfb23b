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
count stays in the tens. With a memory limit a state keeps its Pareto front of (time, memory)
instead of one best (memory only grows, so a partial plan over the limit is dropped): still
exact. What is *not* searched: strategies no rule offers, and placements outside
:class:`~autotp.placements.Placement` (the rules are the space).

**Repeated layers are solved once.** Runs of consecutive nodes of one numbered module
(``transformer.h.7``) are grouped by a Weisfeiler-Lehman hash of their op graph (networkx) and
checked node by node (ops, shapes, arguments, hints up to the layer's rotation). For one
representative, the DP's transfer from each entry state to each exit state is computed once
and reused for every layer with the same entry state, so a 72-layer model costs about as much
as a 2-layer one plus a chain of small min-plus steps. Reuse requires that no tensor entering
the layer is sharded (then the layer's placements differ from the representative's only by
the rotation of uneven shards, which moves no cost); otherwise that layer is solved node by
node. The chosen strategies are then replayed by :func:`propagate` (``forced``), which builds
the plan; its cost must equal the solver's, and a mismatch raises.
"""
from __future__ import annotations

import operator
import re
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import networkx as nx
import torch
import torch.utils._pytree as pytree
from torch import fx

from ..capture import module_path
from ..cost_model.devices import DeviceProfile
from ..errors import PlanError
from ..placements import REPLICATE, Partial, Placement, Shard, same_placement
from .propagate import (INF, GraphIndex, Propagation, _dim_size, _even, _meta, _out_meta, _sharded_compute,
                        conversion_seconds, internal_seconds, param_memory, propagate, wants_f)

_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")
_LAYER_PREFIX = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def template_of(fqn: str) -> str:
    return _LAYER_INDEX.sub("*", fqn)


@dataclass
class Solution:
    decisions: dict[str, Placement]      # placeholder -> pinned placement
    propagation: Propagation
    evaluated: int                       # DP transitions evaluated
    choices: dict                        # op node -> index of its strategy in its rule's list
    layers_reused: int = 0               # layers whose transfer came from a solved representative


# An entry of a DP state's front: (time, memory, choice, previous entry). ``choice`` is
# (node, strategy index) for one op or ("block", block, template choices) for a reused layer.
Entry = tuple


def _pareto_add(front: list, entry: Entry, keep_front: bool) -> list:
    t, m = entry[0], entry[1]
    if not keep_front:
        if not front or (t, m) < (front[0][0], front[0][1]):
            return [entry]
        return front
    for e in front:
        if e[0] <= t and e[1] <= m:
            return front
    return [e for e in front if not (t <= e[0] and m <= e[1])] + [entry]


@dataclass
class _Block:
    nodes: list                  # call_function nodes of the layer, in order
    rotate: int | None           # the layer's rotation of uneven shards (None: no hints)
    ext: dict                    # external input node -> signature (its uses inside the block)
    template: "_Block | None" = None
    ext_map: dict | None = None  # template external node -> this block's external node


class _Solver:
    def __init__(self, index: GraphIndex, profile: DeviceProfile, pinned: Mapping[str, Placement],
                 memory_limit: float | None):
        self.index, self.profile, self.pinned = index, profile, dict(pinned)
        self.limit = memory_limit
        self.keep_front = memory_limit is not None
        self.cap = index.capture
        self.nodes = list(self.cap.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.last_use = {n: max((self.pos[u] for u in n.users), default=-1) for n in self.nodes}
        self.transitions = 0
        self.fixed: dict[fx.Node, Placement] = {}    # placed from the start: inputs, pinned-whole params
        self.free: dict[fx.Node, Any] = {}           # params placed by first use: None or Shard(d)
        self.memory0 = 0.0
        for n in self.nodes:
            if n.op != "placeholder":
                continue
            if n.name in self.cap.param_names:
                decided = self.pinned.get(n.name)
                if n.meta["val"].dim() >= 2 and decided is not None and not (
                        isinstance(decided, Shard) and (decided.chunks, decided.unit) == (1, 1)):
                    self.fixed[n] = decided
                    self.memory0 += param_memory(index, profile, n, decided)
                elif n.users:
                    self.free[n] = decided if n.meta["val"].dim() >= 2 else None
                elif self.cap.param_names[n.name] not in self.cap.aliases:   # a tied name holds nothing itself
                    self.memory0 += param_memory(index, profile, n, REPLICATE)
            else:
                self.fixed[n] = REPLICATE
        for n in self.nodes:
            if n.op not in ("placeholder", "call_function", "output"):
                self.fixed[n] = REPLICATE   # get_attr and the like: whole on every rank
        self.transfers: dict = {}

    # ---- one op --------------------------------------------------------------------------
    def step(self, node: fx.Node, state: dict) -> list[tuple[int, float, float, dict]]:
        """Each feasible strategy of ``node`` from ``state``: (index, seconds, bytes, new labels)."""
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
            cost = index.compute_time(node, strat, profile) + internal_seconds(index, profile, strat)
            mem = index.activation_bytes(node, strat, profile)
            labels: dict = {}
            for inp, meta, want in zip(inputs, info.inputs, strat.inputs):
                f = wants_f(want, sharded, meta)
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
                    paid = frozenset()
                    if f:
                        cost += conversion_seconds(index, profile, meta, want, want, True)
                        paid = frozenset({(want, True)})
                    labels[inp] = (want, paid)
                    continue
                have, paid = label
                if inp.name in self.cap.param_names and not same_placement(have, want, _dim_size(meta, want), tp):
                    cost = INF   # a parameter is never moved at run time: it is sharded at load
                    break
                if (f or have != want) and (want, f) not in paid:
                    cost += conversion_seconds(index, profile, meta, have, want, f)
                    labels[inp] = (have, paid | {(want, f)})
                if cost == INF:
                    break
            if cost == INF:
                continue
            if self._tracked(node):
                labels[node] = (strat.output, frozenset())
            out.append((j, cost, mem, labels))
        return out

    def output_cost(self, node: fx.Node, state: dict) -> float:
        cost = 0.0
        for i, leaf in enumerate(pytree.tree_leaves(node.args)):
            if not isinstance(leaf, fx.Node) or leaf not in state:
                continue
            have, paid = state[leaf]
            if isinstance(have, (Shard, Partial)) and not (i in self.index.sharded_outputs and isinstance(have, Shard)):
                if (REPLICATE, False) not in paid:
                    cost += conversion_seconds(self.index, self.profile, _meta(leaf), have, REPLICATE, False)
                    state[leaf] = (have, paid | {(REPLICATE, False)})
        return cost

    def _tracked(self, node: fx.Node) -> bool:
        if not node.users:
            return False
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) or (
            isinstance(val, (list, tuple)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val))

    # ---- the DP over a range of nodes ---------------------------------------------------------
    def run(self, nodes: list, states: dict) -> dict:
        """Advance ``states`` (frozen state -> front) over ``nodes`` one op at a time."""
        for node in nodes:
            p = self.pos[node]
            nxt: dict = {}
            for key, front in states.items():
                state = dict(key)
                for j, dt, dm, labels in self.step(node, state):
                    new = dict(state)
                    new.update(labels)
                    for n in list(new):
                        if self.last_use[n] <= p:
                            del new[n]
                    nkey = tuple(sorted(new.items(), key=lambda kv: self.pos[kv[0]]))
                    for e in front:
                        t, m = e[0] + dt, e[1] + dm
                        if self.limit is not None and m + self.memory0 > self.limit:
                            continue
                        nxt[nkey] = _pareto_add(nxt.get(nkey, []), (t, m, (node, j), e), self.keep_front)
            states = nxt
            if not states:
                raise PlanError(f"no feasible plan: no strategy fits {node.name} ({node.target})"
                                + self._memory_note())
        return states

    def _memory_note(self) -> str:
        if self.limit is None:
            return ""
        return (f" within the memory limit of {self.limit / 2**30:.2f} GiB per rank; raise memory_limit, "
                "use a larger tp, or a smaller batch/seq")

    # ---- repeated layers -------------------------------------------------------------------------
    def blocks(self) -> list[_Block]:
        runs: list[tuple[str, list]] = []
        for n in self.nodes:
            if n.op != "call_function":
                continue
            m = _LAYER_PREFIX.match(module_path(n))
            key = m.group(1) if m else None
            if key is not None and runs and runs[-1][0] == key and self.pos[runs[-1][1][-1]] == self.pos[n] - 1:
                runs[-1][1].append(n)
            elif key is not None:
                runs.append((key, [n]))
        blocks = [self._block(nodes) for _, nodes in runs if len(nodes) > 1]
        groups: dict[tuple, list[_Block]] = {}
        for b in blocks:
            groups.setdefault((_wl_hash(b.nodes), len(b.nodes)), []).append(b)
        for members in groups.values():
            rep = members[0]
            for b in members:
                if b is not rep:
                    b.ext_map = self._correspond(rep, b)
                    b.template = rep if b.ext_map is not None else None
        return blocks

    def _block(self, nodes: list) -> _Block:
        inside = set(nodes)
        ext: dict = {}
        rotations = set()
        for k, n in enumerate(nodes):
            info = self.index.infos.get(n)
            if info is not None:
                rotations |= {h[2] % self.index.tp for h in info.hints.values() if len(h) > 2}
            for a, arg in enumerate(n.all_input_nodes):
                if arg not in inside:
                    ext.setdefault(arg, []).append((k, a))
        rotate = next(iter(rotations)) if len(rotations) == 1 else (None if not rotations else -1)
        return _Block(nodes, rotate, {a: tuple(sig) for a, sig in ext.items()})

    def _correspond(self, rep: _Block, b: _Block) -> dict | None:
        """Template external node -> b's external node, if b repeats rep node for node."""
        if rep.rotate == -1 or b.rotate == -1:
            return None   # a layer whose ops rotate differently: solve it op by op
        end_rep, end_b = self.pos[rep.nodes[-1]], self.pos[b.nodes[-1]]
        for nr, nb in zip(rep.nodes, b.nodes):
            if nr.target != nb.target:
                return None
            ir, ib = self.index.infos.get(nr), self.index.infos.get(nb)
            if (ir is None) != (ib is None):
                return None
            if ir is not None and (ir.args != ib.args or ir.kwargs != ib.kwargs or ir.inputs != ib.inputs
                                   or ir.output != ib.output
                                   or {d: h[:2] for d, h in ir.hints.items()} != {d: h[:2] for d, h in ib.hints.items()}):
                return None
            if nr.target is operator.getitem and nr.args[1] != nb.args[1]:
                return None
            if (self.last_use[nr] > end_rep) != (self.last_use[nb] > end_b):
                return None
        by_sig = {sig: a for a, sig in b.ext.items()}
        if len(by_sig) != len(b.ext) or sorted(rep.ext.values()) != sorted(by_sig):
            return None
        mapping = {}
        for a, sig in rep.ext.items():
            other = by_sig[sig]
            # a parameter placed by its first use here must be as free in both; anything else
            # enters through the state, whose labels key the transfer
            if (a in self.free) != (other in self.free) or (a in self.free and self.free[a] != self.free[other]):
                return None
            if a in self.free and (self._first_use(a) >= self.pos[rep.nodes[0]]) != (
                    self._first_use(other) >= self.pos[b.nodes[0]]):
                return None   # placed inside one layer, before the other (a tied weight)
            if (self.last_use[a] > end_rep) != (self.last_use[other] > end_b):
                return None
            mapping[a] = other
        return mapping

    def _first_use(self, n: fx.Node) -> int:
        return min(self.pos[u] for u in n.users)

    def apply_block(self, b: _Block, states: dict) -> dict:
        """Advance ``states`` over layer ``b`` by its representative's transfer."""
        rep = b.template
        back = {v: k for k, v in b.ext_map.items()}
        to_b = dict(zip(rep.nodes, b.nodes))
        to_b.update(b.ext_map)
        end = self.pos[b.nodes[-1]]
        shift = _Shift(((b.rotate or 0) - (rep.rotate or 0)) % self.index.tp, self.index.tp, _out_meta)
        nxt: dict = {}
        for key, front in states.items():
            state = dict(key)
            consumed = {n: lab for n, lab in state.items() if n in back}
            passing = {n: lab for n, lab in state.items() if n not in back}
            tkey = tuple(sorted(((back[n], shift.label(n, lab, False)) for n, lab in consumed.items()),
                                key=lambda kv: self.pos[kv[0]]))
            transfer = self.transfers.get((id(rep), tkey))
            if transfer is None:
                transfer = self.transfers[(id(rep), tkey)] = self._transfer(rep, tkey)
            for okey, tfront in transfer.items():
                new = dict(passing)
                for n, lab in okey:
                    nb = to_b[n]
                    if self.last_use[nb] > end:
                        new[nb] = shift.label(nb, lab, True)
                nkey = tuple(sorted(new.items(), key=lambda kv: self.pos[kv[0]]))
                for e in front:
                    for dt, dm, choices in tfront:
                        t, m = e[0] + dt, e[1] + dm
                        if self.limit is not None and m + self.memory0 > self.limit:
                            continue
                        nxt[nkey] = _pareto_add(nxt.get(nkey, []), (t, m, ("block", b, choices), e),
                                                self.keep_front)
        if not nxt:
            raise PlanError(f"no feasible plan: no strategy fits layer {module_path(b.nodes[0])}" + self._memory_note())
        return nxt

    def _transfer(self, rep: _Block, tkey: tuple) -> dict:
        """exit state -> front of (seconds, bytes, strategy indices) through ``rep`` from ``tkey``."""
        start = {tkey: [(0.0, 0.0, None, None)]}
        saved, self.limit = self.limit, None if self.limit is None else float("inf")
        try:
            out = self.run(rep.nodes, start)
        finally:
            self.limit = saved
        result = {}
        for okey, front in out.items():
            result[okey] = [(e[0], e[1], _choices(e)) for e in front]
        return result

    # ---- the whole graph ---------------------------------------------------------------------------
    def solve(self) -> tuple[dict, float, float]:
        blocks = {b.nodes[0]: b for b in self.blocks()}
        start = tuple(sorted(((n, (p, frozenset())) for n, p in self.fixed.items() if n.users),
                             key=lambda kv: self.pos[kv[0]]))
        states = {start: [(0.0, 0.0, None, None)]}
        reused = 0
        i = 0
        body = [n for n in self.nodes if n.op != "placeholder"]
        while i < len(body):
            n = body[i]
            b = blocks.get(n)
            if b is not None and b.template is not None:
                states, i, reused = self.apply_block(b, states), i + len(b.nodes), reused + 1
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
        return _expand(_choices(best)), best[0], best[1] + self.memory0


class _Shift:
    """Maps labels between a representative layer and a repeat of it. Uneven shards are
    rotated by layer; rotating every uneven shard by the same amount changes no cost (every
    rank's share and every layout comparison are kept), so a repeat's labels are the
    representative's with uneven rotations moved by the layers' difference. Even shards
    always have rotation 0 and stay as they are."""

    def __init__(self, delta: int, tp: int, metas):
        self.delta, self.tp, self.metas = delta, tp, metas

    def _map(self, p: Any, meta: Any, delta: int) -> Any:
        if isinstance(p, tuple):
            ms = meta if isinstance(meta, tuple) else (meta,) * len(p)
            return tuple(self._map(x, m, delta) for x, m in zip(p, ms))
        if isinstance(p, Shard) and meta is not None and not _even(meta, p, self.tp):
            return Shard(p.dim, p.chunks, p.unit, (p.rotate + delta) % self.tp)
        return p

    def label(self, node: fx.Node, lab: tuple, forward: bool) -> tuple:
        delta = self.delta if forward else -self.delta
        if not delta:
            return lab
        meta = self.metas(node)
        p, paid = lab
        return (self._map(p, meta, delta), frozenset((self._map(w, meta, delta), f) for w, f in paid))


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


def _wl_hash(nodes: list) -> str:
    """Weisfeiler-Lehman hash of a layer's op graph (ops as labels): equal for repeats."""
    g = nx.DiGraph()
    inside = set(nodes)
    for n in nodes:
        label = str(n.target) + ("#" + str(n.args[1]) if n.target is operator.getitem else "")
        g.add_node(n.name, label=label)
        for a, arg in enumerate(n.all_input_nodes):
            if arg in inside:
                g.add_edge(arg.name, n.name, label=str(a))
    with warnings.catch_warnings():   # networkx 3.5 notes that directed hashes changed; ours are compared in-process
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(g, node_attr="label", edge_attr="label", iterations=3)


def decision_space(index: GraphIndex) -> dict[str, list[str]]:
    """template -> the weight placeholders in it (in graph order): the parameters of 2+ dims
    whose placement (column / row / vocab / replicate) the plan decides."""
    groups: dict[str, list[str]] = {}
    for node in index.capture.graph.nodes:
        if node.op != "placeholder" or node.name not in index.capture.param_names:
            continue
        if node.meta["val"].dim() < 2:
            continue
        groups.setdefault(template_of(index.capture.param_names[node.name]), []).append(node.name)
    return groups


def solve(index: GraphIndex, profile: DeviceProfile, pinned: Mapping[str, Placement] | None = None,
          memory_limit: float | None = None) -> Solution:
    """The minimum-cost plan (see the module docstring); ``memory_limit`` in bytes per rank.

    The unconstrained optimum is found first; only if it does not fit is the DP run again
    with (time, memory) fronts, which is slower."""
    pinned = dict(pinned or {})
    solver = _Solver(index, profile, pinned, None)
    forced, seconds, memory = solver.solve()
    if memory_limit is not None and memory > memory_limit:
        solver = _Solver(index, profile, pinned, memory_limit)
        forced, seconds, memory = solver.solve()
    prop = propagate(index, pinned, profile, forced=forced)
    if prop.infeasible:
        raise PlanError(f"internal: the solver's plan does not replay: {prop.infeasible}")
    if abs(prop.total_s - seconds) > 1e-8 * max(1e-3, seconds) or abs(prop.memory_bytes - memory) > 1e-6 * max(1.0, memory):
        raise PlanError(f"internal: the solver predicted {seconds:.6g} s / {memory:.6g} B but the plan costs "
                        f"{prop.total_s:.6g} s / {prop.memory_bytes:.6g} B")
    return Solution(pinned, prop, solver.transitions, forced, solver.reused)
