"""Repeated layers: found once, so the solver can solve one and reuse it.

A *layer* is a run of consecutive nodes of one numbered module (``transformer.h.7``). Layers
are grouped by a Weisfeiler-Lehman hash of their op graph (networkx), then each is checked node
by node against its group's first member (the representative): same ops, argument and shape
metas, column and row hints up to the layer's rotation, the same liveness after the layer, and external
inputs that correspond by where they are used. A layer that passes gets ``template`` (its
representative) and ``ext_map`` (the representative's external inputs -> its own).
"""
from __future__ import annotations

import operator
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
from torch import fx

from ..capture import module_path
from ..placements import Shard
from .propagate import GraphIndex, _even

_LAYER_PREFIX = re.compile(r"^(.*?\.\d+)(?:\.|$)")


@dataclass
class Layer:
    """A run of consecutive nodes of one numbered module; a repeat points at its representative."""

    nodes: list                  # call_function nodes of the layer, in order
    rotate: int | None           # the layer's rotation of uneven shards (None: no hints)
    ext: dict                    # external input node -> signature (its uses inside the block)
    template: "Layer | None" = None
    ext_map: dict | None = None  # template external node -> this block's external node


class LayerFinder:
    """Finds the layers of ``index``'s graph; ``pos`` is graph order, ``last_use`` the position of
    each node's last user, ``free`` the parameters placed by their first use (and how)."""

    def __init__(self, index: GraphIndex, pos: dict, last_use: dict, free: dict):
        self.index, self.pos, self.last_use, self.free = index, pos, last_use, free
        self.nodes = list(pos)

    def layers(self) -> list[Layer]:
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
        blocks = [self._layer(nodes) for _, nodes in runs if len(nodes) > 1]
        groups: dict[tuple, list[Layer]] = {}
        hashes: dict[tuple, str] = {}   # a layer's labelled graph -> its hash: computed once per kind of layer
        for b in blocks:
            graph = _labelled_graph(b.nodes)
            h = hashes.get(graph)
            if h is None:
                h = hashes[graph] = wl_hash(b.nodes)
            groups.setdefault((h, len(b.nodes)), []).append(b)
        for members in groups.values():
            rep = members[0]
            for b in members:
                if b is not rep:
                    b.ext_map = self._correspond(rep, b)
                    b.template = rep if b.ext_map is not None else None
        return blocks

    def _layer(self, nodes: list) -> Layer:
        inside = set(nodes)
        ext: dict = {}
        rotations = set()
        for k, n in enumerate(nodes):
            info = self.index.infos.get(n)
            if info is not None:
                rotations |= {h[2] % self.index.tp for d, h in info.hints.items()
                              if len(h) > 2 and _rotation_used(info, d)}
                rotations |= {h[2] % self.index.tp for key, h in info.input_hints.items()
                              if len(h) > 2 and _rotation_used(info, key)}
            for a, arg in enumerate(n.all_input_nodes):
                if arg not in inside:
                    ext.setdefault(arg, []).append((k, a))
        rotate = next(iter(rotations)) if len(rotations) == 1 else (None if not rotations else -1)
        return Layer(nodes, rotate, {a: tuple(sig) for a, sig in ext.items()})

    def _correspond(self, rep: Layer, b: Layer) -> dict | None:
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
                                   or _unrotated(ir.hints) != _unrotated(ib.hints)
                                   or _unrotated(ir.input_hints) != _unrotated(ib.input_hints)
                                   or ir.grad_inputs != ib.grad_inputs or ir.grad_uses != ib.grad_uses
                                   or ir.strided_inputs != ib.strided_inputs
                                   or ir.expert_share != ib.expert_share):   # a router's load per layer
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


def _rotation_used(info: Any, dim: int | tuple[int, int]) -> bool:
    """Does the rotation of ``info``'s hint for output ``dim`` (or for an input's dim, keyed
    (input index, dim) as ``OpInfo.input_hints``) reach a placement? Only an uneven
    fresh shard keeps it (an even one, or a dim that cannot be split, has rotation 0 whatever the
    hint says), so only such hints decide a layer's rotation. A hint whose rotation is lost does
    not tie the layer to its index: the experts' grouped products read their stacks through a
    transpose and carry rotation 0 in every layer, which split evenly, and counted they made every
    MoE layer not at a multiple of tp rotate two ways and be solved op by op."""
    if isinstance(dim, tuple):
        h = info.input_hints[dim]
        probe = replace(info, input_hints={**info.input_hints, dim: h[:2] + (1,) + h[3:]})
        shard = probe.fresh_shard_of(*dim)
    else:
        h = info.hints[dim]
        probe = replace(info, hints={**info.hints, dim: h[:2] + (1,) + h[3:]})
        shard = probe.fresh_shard(dim)
    return isinstance(shard, Shard) and shard.rotate != 0


def _unrotated(hints: dict) -> dict:
    return {d: h[:2] + h[3:] for d, h in hints.items()}


class Shift:
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
        # a shard of a dynamic dim (the sequence) is dealt in rank order in every layer: never rotated
        if isinstance(p, Shard) and meta is not None and meta.static(p.dim) is not None and not _even(meta, p, self.tp):
            return replace(p, rotate=(p.rotate + delta) % self.tp)
        return p

    def label(self, node: fx.Node, lab: tuple, forward: bool) -> tuple:
        delta = self.delta if forward else -self.delta
        if not delta:
            return lab
        meta = self.metas(node)
        p, paid = lab
        return (self._map(p, meta, delta), frozenset((self._map(w, meta, delta), f) for w, f in paid))


def _label(n: fx.Node) -> str:
    return str(n.target) + ("#" + str(n.args[1]) if n.target is operator.getitem else "")


def _labelled_graph(nodes: list) -> tuple:
    """The graph :func:`wl_hash` hashes, nodes numbered in order: layers equal here have equal
    hashes (the hash does not depend on the nodes' names)."""
    local = {n: k for k, n in enumerate(nodes)}
    return tuple((_label(n), tuple((local[arg], a) for a, arg in enumerate(n.all_input_nodes) if arg in local))
                 for n in nodes)


def wl_hash(nodes: list) -> str:
    """Weisfeiler-Lehman hash of a layer's op graph (ops as labels): equal for repeats."""
    g = nx.DiGraph()
    inside = set(nodes)
    for n in nodes:
        label = _label(n)
        g.add_node(n.name, label=label)
        for a, arg in enumerate(n.all_input_nodes):
            if arg in inside:
                g.add_edge(arg.name, n.name, label=str(a))
    with warnings.catch_warnings():   # networkx 3.5 notes that directed hashes changed; ours are compared in-process
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(g, node_attr="label", edge_attr="label", iterations=3)
