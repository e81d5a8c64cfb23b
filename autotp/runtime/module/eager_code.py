"""A program's eager code: fx's generated ``forward`` with its calls bound, for steps outside a trace.

fx writes each ATen op of a graph as ``torch.ops.aten.add.Tensor(x, y)``: an ``OpOverload``
object called through its Python ``__call__``, whose one line calls the C++ callable the
overload holds (``op._op``); a serial model calls such C++ functions directly. A rank's program
of gpt2, 12 layers, calls about 490 of them a step, each one Python call more than serial's. And
fx writes a submodule's call as ``self.f_0(x)``: ``Module.__getattr__`` (a submodule is not an
instance attribute), then the module call (``_wrapped_call_impl``, ``_call_impl``) to its
``forward``.

:func:`eager_forward` makes the same ``forward`` from the same fx source with those call sites
bound to globals: each ``OpOverload`` (of that exact class: others, such as a TorchBind op's,
decide in their ``__call__``) to its C++ callable; each collective module
(:class:`~autotp.distributed.comm_modules._CommModule`) to its ``eager_forward`` (the mapping
applied through autograd's C++ ``apply``, no module call, no compile check: this code never
runs inside a trace); any other submodule to the module object (its ``__call__``: hooks run,
FSDP2's among them). The graph itself is untouched (passes, agreement fingerprints, printed
code and torch.compile read ``node.target``): a compiled call runs the graph module as fx made
it. A call site that cannot be found exactly as fx writes it (another torch's codegen) leaves
the whole graph on fx's own ``forward``.
"""
from __future__ import annotations

import linecache
import re
from typing import Any, Callable

import torch
from torch import fx

from ...distributed.comm_modules import _CommModule

__all__ = ["eager_forward"]

_OpOverload = torch._ops.OpOverload
_count = 0
#: the file name each eager code is compiled under starts so (tools that tell a program's own
#: lines from autotp's, such as ``autotp.testing.work``'s copy sites, read it as fx's ``<eval_with_key>``)
FILENAME_PREFIX = "<autotp eager code"


def _call_expression(target: str) -> str | None:
    """How fx's code calls submodule ``target`` of ``self`` (``self.a.b``), or None where fx writes
    it through ``getattr`` (a name that is not an identifier): left to fx's own forward."""
    parts = target.split(".")
    return "self." + target if all(p.isidentifier() for p in parts) else None


def eager_forward(gm: fx.GraphModule) -> Callable[..., Any] | None:
    """``gm``'s forward (called as ``f(gm, *inputs)``) with its ATen ops bound to their C++
    callables and its submodules to what they run (module docs), or None where a call site
    is not where fx writes it (the caller runs ``gm`` itself)."""
    global _count
    code = gm.graph.python_code(root_module="self")
    src, scope = code.src, dict(code.globals)
    sites: dict[str, tuple[Any, int]] = {}   # the expression fx calls -> (what to call instead, calls)
    for node in gm.graph.nodes:
        if node.op == "call_function" and type(node.target) is _OpOverload \
                and isinstance(getattr(node.target, "_op", None), type(len)):
            expression = fx.node._get_qualified_name(node.target)
            bound = node.target._op
        elif node.op == "call_module":
            expression = _call_expression(node.target)
            if expression is None:
                continue
            module = gm.get_submodule(node.target)
            bound = module.eager_forward if isinstance(module, _CommModule) else module
        else:
            continue
        _, n = sites.get(expression, (bound, 0))
        sites[expression] = (bound, n + 1)
    for i, (expression, (bound, n)) in enumerate(sites.items()):
        name = f"_bound_{i}"
        src, found = re.subn(r"(?<![\w.])" + re.escape(expression) + r"\(", name + "(", src)
        if found != n:
            return None
        scope[name] = bound
    _count += 1
    filename = f"{FILENAME_PREFIX} {_count}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)   # tracebacks show the line
    exec(compile(src, filename, "exec", dont_inherit=True), scope)
    return scope["forward"]
