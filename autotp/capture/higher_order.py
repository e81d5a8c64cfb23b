"""Higher-order ops in a captured graph: inline the regions that can be inlined exactly.

torch.export wraps a ``with torch.no_grad():`` / ``torch.enable_grad()`` block inside forward in
``wrap_with_set_grad_enabled(enabled, submodule, *args)`` and a ``with torch.autocast(...)``
block in ``wrap_with_autocast(device, dtype, enabled, cache, submodule, *args)``: one node whose
body is a child GraphModule (a ``get_attr`` operand). Every rotary model in transformers computes
its cos/sin that way. The planner sees ATen ops only, so these regions are spliced into the
parent graph, between the same side-effect calls torch itself traces before it wraps them:

* grad mode: ``prev = torch.is_grad_enabled(); torch._C._set_grad_enabled(enabled)`` before the
  body and ``torch._C._set_grad_enabled(prev)`` after it;
* autocast: ``mode = torch.amp._enter_autocast(...)`` before, ``torch.amp._exit_autocast(mode)``
  after (a user's outer ``torch.autocast`` is still switched off inside a disabled region).

Inlined, the body's ops run exactly as they did inside the wrapper, and each becomes an op with
its own rule. Other higher-order ops (``cond``, ``while_loop``, ...) are data-dependent: they stay
one node that runs replicated (``autotp.passes.rules.misc``), and the rewrite carries their branch
submodules into the per-rank program.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

_ops = torch.ops.higher_order
#: grad-mode and autocast regions: (enter, exit) side-effect calls delimit them once inlined
REGION_CALLS = (torch.is_grad_enabled, torch._C._set_grad_enabled, torch.amp._enter_autocast,
                torch.amp._exit_autocast)


def _inlinable() -> dict[Any, int]:
    """Inlinable higher-order op -> position of its body (the GraphModule operand)."""
    found = {}
    if hasattr(_ops, "wrap_with_set_grad_enabled"):
        found[_ops.wrap_with_set_grad_enabled] = 1
    if hasattr(_ops, "wrap_with_autocast"):
        found[_ops.wrap_with_autocast] = 4
    return found


def inline_regions(gm: fx.GraphModule) -> int:
    """Splice every grad-mode and autocast region of ``gm`` (nested ones too) into its graph.
    Returns how many were inlined; the graph is linted and recompiled."""
    bodies = _inlinable()
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in bodies:
            continue
        pos = bodies[node.target]
        body = getattr(gm, node.args[pos].target)
        count += inline_regions(body)    # innermost first: the copied nodes hold no wrappers
        _splice(gm, node, body, node.args[:pos], node.args[pos + 1:])
        count += 1
    if count:
        for name, child in list(gm.named_children()):
            if isinstance(child, fx.GraphModule) and not any(
                    n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
                delattr(gm, name)    # an inlined body: nothing refers to it any more
        gm.graph.lint()
        gm.recompile()
    return count


def _splice(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule, head: tuple, operands: tuple) -> None:
    graph = gm.graph
    carried = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}

    def call(target: Any, args: tuple) -> fx.Node:
        new = graph.call_function(target, args)
        new.meta.update(carried)
        return new

    with graph.inserting_before(node):
        if node.target is _ops.wrap_with_set_grad_enabled:
            prev = call(torch.is_grad_enabled, ())
            call(torch._C._set_grad_enabled, (head[0],))
        else:
            mode = call(torch.amp._enter_autocast, tuple(head))
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(placeholders, operands):
            env[ph] = value
        result: Any = None
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = fx.map_arg(inner.args[0], lambda n: env[n])
                continue
            if inner.op == "get_attr":    # a constant or a nested data-dependent op's branch
                name = _free_name(gm, inner.target)
                setattr(gm, name, _get(body, inner.target))
                env[inner] = graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
                continue
            env[inner] = graph.node_copy(inner, lambda n: env[n])
        if node.target is _ops.wrap_with_set_grad_enabled:
            call(torch._C._set_grad_enabled, (prev,))
        else:
            call(torch.amp._exit_autocast, (mode,))
    outputs = result if isinstance(result, (list, tuple)) else (result,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is __import__("operator").getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    if node.users:   # used whole (a single output)
        node.replace_all_uses_with(result)
    graph.erase_node(node)


def _get(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _free_name(gm: fx.GraphModule, base: str) -> str:
    base = base.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
