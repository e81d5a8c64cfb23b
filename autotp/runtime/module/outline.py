"""Outlining: a rank program's repeated layers as calls of the modules that hold their parameters.

A rank program is one graph whose parameters are placeholders, fed by the ParallelModule. FSDP2
gathers and frees parameters per module, in that module's forward hooks; for it to work layer by
layer (``fully_shard`` per repeated layer, the torchtitan composition), each layer's ops must run
inside a forward of the module that holds the layer's parameters.

:func:`layer_paths` names the layers: the children of each outermost ``nn.ModuleList`` of the
model that hold parameters (``transformer.h.0`` ... ``transformer.h.11``). :func:`outline` then
cuts the program's graph: a layer's *span* runs from its first op to its last (ops whose module
path is under the layer's; the collectives and size computations the rewrite put between them
belong to the span, and so do those right before its first op that only the span reads: the
conversions made for that op, e.g. the f over a norm's replicated weight in a sequence-parallel
region). Each span becomes a graph of its own, whose placeholders are the layer's
parameters (in a fixed order, by name relative to the layer) and the values the span reads from
before it, and whose outputs are the span's values read after it. In the program the span is
replaced by one call of a :class:`LayerCall`, which calls the layer's module (a
``_ParamTree`` of the ParallelModule, FSDP-wrapped) with that graph: the module's forward reads
its own parameters, as FSDP2's pre-forward hook left them, and runs the graph.

An activation-checkpointed program (``passes/checkpoint.py``) runs each layer as one call that
carries the layer's module path: that call is the span, outlined whole (FSDP2 gathers the
layer's parameters again before its recomputation in backward). A program whose layers cannot be
cut (spans that interleave, a layer's parameter read outside its span or by no op of the layer)
raises :class:`~autotp.errors.ConfigError`: per-layer FSDP cannot run it.
"""
from __future__ import annotations

from typing import Any

from torch import fx, nn

from ...capture import layer_of
from ...errors import ConfigError


def layer_paths(model: nn.Module) -> list[str]:
    """The repeated layers of ``model``: every child holding parameters of an ``nn.ModuleList``
    that is not inside another such layer, in module order."""
    found: list[str] = []
    for path, module in model.named_modules():
        if not path or not isinstance(module, nn.ModuleList):
            continue
        if any(path == f or path.startswith(f + ".") for f in found):
            continue
        for i, child in enumerate(module):
            if any(True for _ in child.parameters()):
                found.append(f"{path}.{i}")
    return found


class LayerCall(nn.Module):
    """A program's call of one layer: runs ``block`` (the layer's outlined graph) through the
    layer's module ``unit``, so that its forward hooks (FSDP2's) fire around it. ``unit`` is
    held outside the module tree (it belongs to the ParallelModule's parameter tree)."""

    def __init__(self, unit: nn.Module, block: fx.GraphModule, names: tuple[str, ...]):
        super().__init__()
        self.block = block
        self.names = names
        object.__setattr__(self, "_unit", unit)

    def forward(self, *args: Any) -> Any:
        return self._unit(self.block, self.names, *args)

    def __deepcopy__(self, memo: dict) -> "LayerCall":   # the unit is the module's, not the copy's
        import copy

        new = LayerCall(self._unit, copy.deepcopy(self.block, memo), self.names)
        memo[id(self)] = new
        return new


def outline(gm: fx.GraphModule, param_order: list[str], layers: list[str],
            units: dict[str, nn.Module], check_only: bool = False) -> tuple[fx.GraphModule, set[str]]:
    """``gm`` (a rank program whose first ``len(param_order)`` placeholders take the parameters
    ``param_order`` names) with each layer of ``layers`` that has ops in it outlined into a
    :class:`LayerCall` of ``units[layer]``; also returns the parameter FQNs the layer calls read
    themselves (the program is no longer fed them). Edits ``gm`` in place, unless
    ``check_only``: then only raises where it could not."""
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    fqn_of = {p: fqn for p, fqn in zip(placeholders, param_order)}
    spans: dict[str, list[int]] = {}
    for n in nodes:
        if n.op in ("call_function", "call_module", "call_method"):
            layer = layer_of(n, layers)
            if layer is not None:
                lo_hi = spans.setdefault(layer, [pos[n], pos[n]])
                lo_hi[1] = pos[n]
    for lo_hi in spans.values():   # the conversions the rewrite made for the layer's first ops join it
        lo_hi[0] = _conversions_before(nodes, pos, lo_hi[0], lo_hi[1], layers)
    for layer in layers:
        read = [fqn_of[p] for p in placeholders if fqn_of.get(p, "").startswith(layer + ".") and p.users]
        if read and layer not in spans:
            raise ConfigError(f"per-layer FSDP cannot outline {layer}: the program reads its parameters "
                              f"({read[0]}, ...) but none of its ops carries the layer's module path; shard the "
                              "whole module (fully_shard(pm, per_layer=False))")
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for (a, (_, a_hi)), (b, (b_lo, _)) in zip(ordered, ordered[1:]):
        if b_lo <= a_hi:
            raise ConfigError(f"per-layer FSDP cannot outline {a} and {b}: their ops interleave in the program; "
                              "shard the whole module (autotp.runtime.fsdp.fully_shard(pm, per_layer=False))")
    cuts = []   # checked for every layer before the graph is changed
    for layer, (lo, hi) in ordered:
        span = nodes[lo:hi + 1]
        inside = set(span)
        own = [p for p in placeholders if fqn_of.get(p, "").startswith(layer + ".")]
        for p in own:
            if any(u not in inside for u in p.users):
                raise ConfigError(f"per-layer FSDP cannot outline {layer}: its parameter {fqn_of[p]} is read outside "
                                  "the layer's ops; shard the whole module (fully_shard(pm, per_layer=False))")
        cuts.append((layer, span, inside, [p for p in own if p.users]))
    outlined: set[str] = set()
    if check_only:
        return gm, outlined
    for index, (layer, span, inside, own) in enumerate(cuts):
        # read now: a layer before this one was outlined, and this one reads its call's items
        externals: list[fx.Node] = []
        for n in span:
            for x in n.all_input_nodes:
                if x not in inside and x not in own and x not in externals:
                    externals.append(x)
        results = [n for n in span if any(u not in inside for u in n.users)]
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for x in own + externals:
            env[x] = sub.placeholder(x.name)
            env[x].meta = dict(x.meta)
        for n in span:
            env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output(tuple(env[r] for r in results))
        block = fx.GraphModule(gm, sub, class_name="LayerGraph")
        names = tuple(fqn_of[p][len(layer) + 1:] for p in own)
        name = f"layer_{index}"
        gm.add_module(name, LayerCall(units[layer], block, names))
        with graph.inserting_before(span[0]):
            call = graph.call_module(name, tuple(externals))
            outs = [graph.call_function(_item, (call, i)) for i in range(len(results))]
        for r, out in zip(results, outs):
            r.replace_all_uses_with(out, delete_user_cb=lambda user, inside=inside: user not in inside)
        for n in reversed(span):
            graph.erase_node(n)
        outlined.update(fqn_of[p] for p in own)
    graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, outlined


def _conversions_before(nodes: list[fx.Node], pos: dict[fx.Node, int], lo: int, hi: int,
                        layers: list[str]) -> int:
    """The start of the span ``nodes[lo:hi + 1]`` pulled back over the ops of no layer right
    before it that only the span reads: the conversions the rewrite made for the layer's first
    op (carrying no module path of their own), such as the f over a replicated norm weight that a
    sequence-parallel norm reads. The same rule as the checkpoint pass's: a communication node
    belongs to the layer of the op it feeds."""
    while lo > 0:
        n = nodes[lo - 1]
        if n.op not in ("call_function", "call_module", "call_method") or layer_of(n, layers) is not None \
                or not n.users or any(not lo <= pos[u] <= hi for u in n.users):
            break
        lo -= 1
    return lo


def _item(values: tuple, i: int) -> Any:
    return values[i]
