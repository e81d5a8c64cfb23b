"""The host work of a step, counted device-independently: ATen calls, Python calls, autograd nodes.

A GPU rank whose kernels are small waits on its host: what the host does per step (the Python
around the ops, the autograd engine's nodes, the dispatcher's calls) decides the step time there.
Timings of that on a shared CPU move; these counts do not, so tests hold them:

    with AtenCalls() as aten:        # a dispatch mode: ATen calls, forward and backward, by op
        step()
    with PythonCalls() as python:    # sys.setprofile: Python function calls, by "file:function"
        step()
    aten.total, python.total, python.by_function.most_common(20)
    autograd_nodes(loss)             # nodes of the backward graph reachable from loss

Each counter runs its own step: a dispatch mode's own Python would be counted as the step's. A
generator's resumption is a 'call' event too (a generator context manager costs two), as it is a
frame the interpreter enters.

The Python calls are this thread's: on CPU the autograd engine runs backward on the calling
thread, so a backward's Python (autograd Functions' ``backward``, hooks) is counted too.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MEGATRON", "AtenCalls", "PythonCalls", "autograd_nodes"]

#: Megatron's layout of the zoo's GPT-2 and Llama, to pin: the plan a real-width model gets, whatever
#: tiny widths would cost (the host-work benchmark and its tests run it)
MEGATRON = {
    "gpt2": {"*c_attn.weight": "column", "*attn.c_proj.weight": "row", "*c_fc.weight": "column",
             "*mlp.c_proj.weight": "row", "lm_head.weight": "vocab"},
    "llama": {"*q_proj.weight": "column", "*k_proj.weight": "column", "*v_proj.weight": "column",
              "*o_proj.weight": "row", "*gate_proj.weight": "column", "*up_proj.weight": "column",
              "*down_proj.weight": "row", "model.embed_tokens.weight": "vocab", "lm_head.weight": "vocab"},
}


def _where(code: Any) -> str:
    """``package/path.py:function`` of a code object (site-packages and the repo root cut off)."""
    path = code.co_filename.replace(os.sep, "/")
    for root in ("site-packages/", "/lib/python"):
        if root in path:
            path = path.split(root, 1)[1]
            break
    if "/autotp/" in path:
        path = "autotp/" + path.rsplit("/autotp/", 1)[1]
    return f"{path}:{code.co_name}"


class AtenCalls(TorchDispatchMode):
    """Counts the ATen calls dispatched while active (forward and backward), by op."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class PythonCalls:
    """Counts this thread's Python function calls made while active (``sys.setprofile``'s 'call'
    events), by ``file:function``. Not to be combined with a dispatch mode: a mode's Python
    would be counted as the step's."""

    def __init__(self) -> None:
        self.by_function: Counter = Counter()
        #: "caller file:function -> callee file:function" -> calls
        self.by_caller: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_function.values())

    def __enter__(self) -> "PythonCalls":
        counts: Counter = Counter()

        def profile(frame, event, arg):
            if event == "call":
                counts[(frame.f_back.f_code if frame.f_back is not None else None, frame.f_code)] += 1

        self._counts = counts
        self._previous = sys.getprofile()
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._previous)
        for (caller, code), n in self._counts.items():
            if code is not PythonCalls.__exit__.__code__:
                self.by_function[_where(code)] += n
                self.by_caller[f"{_where(caller) if caller is not None else '?'} -> {_where(code)}"] += n

    def by_file(self) -> Counter:
        """Python calls by file (``autotp/distributed/collectives.py``, ``torch/autograd/function.py``)."""
        out: Counter = Counter()
        for key, n in self.by_function.items():
            out[key.rsplit(":", 1)[0]] += n
        return out


def autograd_nodes(*outputs: torch.Tensor) -> int:
    """The nodes of the backward graph reachable from ``outputs`` (each counted once)."""
    seen: set = set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return len(seen)
