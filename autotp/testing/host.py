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
    with HostReads(device_tensors(module, inputs)) as reads:   # what a GPU would stop the host for
        step()
    reads.reads                      # (what, the stack) per read of a device value on the host

Each counter runs its own step: a dispatch mode's own Python would be counted as the step's. A
generator's resumption is a 'call' event too (a generator context manager costs two), as it is a
frame the interpreter enters.

The Python calls are this thread's: on CPU the autograd engine runs backward on the calling
thread, so a backward's Python (autograd Functions' ``backward``, hooks) is counted too.
"""
from __future__ import annotations

import os
import sys
import traceback
import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MEGATRON", "AtenCalls", "HostReads", "PythonCalls", "SIZED_BY_VALUES", "autograd_nodes", "device_tensors"]

aten = torch.ops.aten

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


#: ops whose output's size depends on the values: on a GPU the host reads the size back before
#: it can go on (nothing to see on CPU, where no op waits)
SIZED_BY_VALUES = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                   aten.unique_consecutive.default, aten.repeat_interleave.Tensor}


class HostReads(TorchDispatchMode):
    """Counts the reads of device values a step makes on the host, and its blocking copies to the
    host, as a GPU would wait on them. On CPU nothing waits, so a tensor "would live on the
    device" if it is one of ``device_tensors`` (a module's parameters, buffers, the call's
    inputs: what :func:`device_tensors` gives), was computed from one, or was made by a factory
    op given a device. A read is a value read (``aten._local_scalar_dense``: ``.item()``,
    ``int(t)``, ``bool(t)``; ``aten.equal``), an op whose output's size the host reads back
    (:data:`SIZED_BY_VALUES`), ``Tensor.tolist``/``numpy``/``cpu``, or a copy to the host
    without ``non_blocking`` (a ``non_blocking`` one makes a host tensor: a staged copy).
    ``reads``: (what was read, the functions on the stack when it was)."""

    def __init__(self, device_tensors):
        super().__init__()
        self._ids: dict[int, weakref.ref] = {}
        self._storages = {t.untyped_storage().data_ptr() for t in device_tensors}
        #: (what was read, the functions on the stack when it was)
        self.reads: list[tuple[str, tuple[str, ...]]] = []
        self._patched = {}

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._ids.get(id(t))
        if ref is not None and ref() is t:
            return True
        try:
            return t.untyped_storage().data_ptr() in self._storages
        except (RuntimeError, NotImplementedError):   # a tensor without storage (a DTensor)
            return False

    def _mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._ids[id(t)] = weakref.ref(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        from_device = any(self.on_device(t) for t in tensors)
        # a copy to the host: a device move alone (a cast's device argument is the program's own
        # device, the rewrite sets it, which on CPU reads "cpu" too)
        to_host = (func in (aten._to_copy.default, aten.copy_.default) and kwargs.get("device") == torch.device("cpu")
                   and kwargs.get("dtype", args[0].dtype) == args[0].dtype)
        if func in (aten._local_scalar_dense.default, aten.equal.default) and from_device:
            self.read(f"{func} of {tuple(args[0].shape)}")
        if func in SIZED_BY_VALUES and from_device:
            self.read(f"{func} of {tuple(args[0].shape)} (its size read back)")
        if to_host and from_device and not kwargs.get("non_blocking", False):
            self.read(f"blocking {func} to the host")
        out = func(*args, **kwargs)
        staged = to_host and kwargs.get("non_blocking", False)
        if not staged and (from_device or (not tensors and kwargs.get("device") is not None)):
            self._mark(out)
        return out

    def read(self, what: str) -> None:
        self.reads.append((what, tuple(f.name for f in traceback.extract_stack(limit=40))))

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu"):
            original = self._patched[name] = getattr(torch.Tensor, name)

            def read(t, *a, _original=original, _name=name, **k):
                if self.on_device(t):
                    self.read(f"Tensor.{_name} of {tuple(t.shape)}")
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def device_tensors(module: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    """What a GPU would hold of a call: the module's parameters (a DTensor's local tensor) and
    buffers, and the call's tensor inputs (the roots :class:`HostReads` follows)."""
    held = [getattr(p, "_local_tensor", p) for p in module.parameters()] + list(module.buffers())
    return held + [v for v in inputs.values() if isinstance(v, torch.Tensor)]
