"""Export's op order made canonical: one program whatever order a process ran independent work in.

torch.export records ops in the order the forward ran them. Where a forward loops over a set of
strings, that order follows the interpreter's string-hash seed (``PYTHONHASHSEED``, drawn afresh
by every process unless fixed): transformers builds its attention masks and rotary tables once
per layer type, ``for layer_type in set(config.layer_types)``. Two ranks that torchrun started
would record the same ops in two orders, name them differently (ops are named in graph order:
:func:`autotp.capture.normalize._renamed`) and so fingerprint different programs
(:mod:`autotp.distributed.agreement`).

:func:`canonical_order` reorders the exported graph, before its grad-mode and autocast regions
are inlined (each is still one op then), so that its order is a function of the graph alone:

* **anchored** ops keep export's order: every op whose tensor result is computed from a
  parameter (the layers, which run in module order, never in a set's), and every op with an
  effect: an in-place write, a random draw, a grad-mode or autocast switch, a higher-order op
  other than a grad-mode or autocast region whose body has none (a check export records,
  ``_assert_tensor_metadata`` or ``_assert_scalar``, has none: it reads and raises or not);
* every other op is **free** (pure, computing no tensor from a parameter's values: masks,
  rotary tables, position ids, shifted labels, sizes). A free op stays in its *run*, between
  the same two anchored ops as in export's order; within a run the free ops are placed by
  demand: the anchored ops are walked in order (the output last) and, for each, the free ops
  it reads that are not yet placed are placed depth first, argument by argument, each after
  the free ops it reads. Free ops that nothing anchored reads follow in their run, by their
  structure (:func:`_structure`).

Only free ops move, only among themselves and never across an anchored op, so every op with an
effect keeps its place among all others and the program computes exactly what export's does
(bit for bit: the same ops on the same values). The order no longer depends on which of two
independent pieces of work the forward ran first: the demand walk reaches them from the
anchored ops, whose order is the model's. Each node's users (``node.users``, in the order
export traced them) are listed in the new graph order too.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Collection

import torch
from torch import fx

from .higher_order import REGION_CALLS, _inlinable
from .program import op_name


def canonical_order(graph: fx.Graph, params: Collection[str]) -> int:
    """Reorder ``graph`` in place as the module docstring says; ``params``: the placeholder
    names of the model's parameters. Returns how many nodes changed place."""
    nodes = list(graph.nodes)
    anchored = _anchored(nodes, frozenset(params))
    rank = _demand_ranks(nodes, anchored)
    order: list[fx.Node] = []
    run: list[fx.Node] = []
    for node in nodes:
        if node in anchored:
            order.extend(sorted(run, key=rank.__getitem__))
            run = []
            order.append(node)
        else:
            run.append(node)
    order.extend(sorted(run, key=rank.__getitem__))   # none: the output is anchored and last
    moved = sum(a is not b for a, b in zip(nodes, order))
    if moved:
        for before, node in zip(order, order[1:]):
            if node.prev is not before:
                before.append(node)
        graph.lint()   # still topological: each free op follows what it reads (checked here)
    # each node's users in graph order, not in the order export traced them (a pass that walks
    # ``node.users`` meets them alike in every process)
    place = {node: i for i, node in enumerate(order)}
    for node in order:
        if len(node.users) > 1:
            node.users = dict.fromkeys(sorted(node.users, key=place.__getitem__))
    return moved


def _anchored(nodes: list[fx.Node], params: frozenset[str]) -> set[fx.Node]:
    """The ops that keep export's order: placeholders, the output, every op with an effect and
    every op whose tensor result is computed from a parameter's values (a size read off one,
    ``sym_size``, is not)."""
    from_params: set[fx.Node] = set()
    anchored: set[fx.Node] = set()
    for node in nodes:
        if node.op in ("placeholder", "output"):
            anchored.add(node)
            if node.name in params:
                from_params.add(node)
            continue
        if node.op != "get_attr" and (node.op != "call_function" or _has_effect(node)):
            anchored.add(node)
        if _holds_tensors(node.meta.get("val")) and any(a in from_params for a in node.all_input_nodes):
            from_params.add(node)
            anchored.add(node)
    return anchored


def _has_effect(node: fx.Node) -> bool:
    """Does running ``node`` do anything besides computing its result from its inputs (or
    checking them): write in place, draw random numbers, switch grad mode or autocast, run a body that does
    (a higher-order op: only grad-mode and autocast regions are looked into)?"""
    target = node.target
    bodies = _inlinable()
    if target in bodies:
        body = getattr(node.graph.owning_module, node.args[bodies[target]].target)
        return any(_has_effect(inner) for inner in body.graph.nodes if inner.op == "call_function")
    if isinstance(target, torch._ops.HigherOrderOperator) or target in REGION_CALLS:
        return True
    return target not in _CHECKS and node.is_impure()


#: checks torch.export records (fx counts them impure, to keep them): they read values and
#: raise or not, computing and changing nothing, so their place among pure ops is free
_CHECKS = frozenset({torch._assert, torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg,
                     torch.ops.aten._assert_scalar.default, torch.ops.aten._assert_tensor_metadata.default,
                     torch.ops.aten.sym_constrain_range.default, torch.ops.aten.sym_constrain_range_for_size.default})


def _holds_tensors(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(_holds_tensors(v) for v in val)


def _demand_ranks(nodes: list[fx.Node], anchored: set[fx.Node]) -> dict[fx.Node, int]:
    """Each free op's place in the demand walk (see the module docstring); the free ops no
    anchored op reads after them, by :func:`_structure`."""
    rank: dict[fx.Node, int] = {}

    def place(root: fx.Node) -> None:   # depth first, inputs in argument order; iterative
        if root in rank or root in anchored:
            return
        stack, entered = [(root, iter(root.all_input_nodes))], {root}
        while stack:
            node, inputs = stack[-1]
            for a in inputs:
                if a not in rank and a not in anchored and a not in entered:
                    entered.add(a)
                    stack.append((a, iter(a.all_input_nodes)))
                    break
            else:
                stack.pop()
                rank[node] = len(rank)

    for node in nodes:
        if node in anchored:
            for a in node.all_input_nodes:
                place(a)
    unread = [n for n in nodes if n not in anchored and n not in rank]
    if unread:
        keys: dict[fx.Node, str] = {}
        for node in sorted(unread, key=lambda n: _structure(n, keys)):
            place(node)
    return rank


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _structure(node: fx.Node, keys: dict[fx.Node, str]) -> str:
    """A digest of what ``node`` computes: its op and constant arguments, and the digests of
    the nodes it reads, down to placeholders (named by what they hold). Two nodes alike here
    compute the same thing from the same inputs."""
    if node in keys:
        return keys[node]
    todo = [node]
    while todo:   # inputs first, iteratively
        n = todo[-1]
        missing = [a for a in n.all_input_nodes if a not in keys]
        if missing:
            todo.extend(missing)
            continue
        todo.pop()
        if n in keys:
            continue
        if n.op == "placeholder":
            text = f"placeholder {n.name}"
        elif n.op == "get_attr":
            owner = n.graph.owning_module
            value = getattr(owner, n.target, None) if owner is not None else None
            # a region's body by its ops (export numbers bodies in the order it traced them)
            text = ("body " + ",".join(op_name(m.target) for m in value.graph.nodes)
                    if isinstance(value, fx.GraphModule) else f"get_attr {n.target}")
        else:
            args = fx.map_arg((n.args, n.kwargs), lambda a: f"<{keys[a]}>")
            text = _ADDRESS.sub("", f"{n.op} {op_name(n.target)} {args!r}")   # an object's address is the process's
        keys[n] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return keys[node]
