"""Work a program does, counted device-independently: FLOPs of products, bytes written by the rest.

``with WorkCounter() as work: step()`` counts every ATen op the step dispatches (forward and
backward): a product (``mm``, ``bmm``, attention, a grouped product of experts: transformers'
fallback op and its backward included) adds its FLOPs, any other op the bytes of the tensors
it writes (views write none). ``work.by_op`` keeps both per op name, so a test can hold one
kind of op to account (the experts' products of a rank against its rows); ``_unsafe_view``, an
alias the dispatcher does not mark a view, writes none either. ``work.moved`` (and
``moved_by_op``) counts what an op's kernels read too, the memory traffic a GPU pays for it;
allocations (which touch no memory) and collectives (communication) are left out of it.
``WorkCounter(sites=True)`` splits ``moved_by_op`` by where each op was made (``moved_by_site``,
:func:`op_site`: the program's node, the backward formula, autotp's function, or a serial model's
own file and function), so a rank's bytes over its share can be traced to what made them.

``with CopyCounter() as copies: step()`` records every copy and cast a step makes (``copy_``,
``_to_copy``, ``clone``, ``cat``, ``stack``, ``constant_pad_nd``) with the bytes it writes and
the place it was made (:class:`Copy`): the model's program (an fx node's line, or autograd's
formula for one), or autotp's own code around it (``gather_scatter._all_gather``, ...), so a rank's
copies can be held against serial's. A collective's own writes (c10d's ops, below the dispatch
mode) are not among them, except the copy a functional all-reduce makes of its input before
reducing it (``_c10d_functional.all_reduce`` clones inside its kernel): recorded as an
``all_reduce`` copy of the input's bytes, where the collective was called.
"""
from __future__ import annotations

import linecache
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ..runtime.module.eager_code import FILENAME_PREFIX as EAGER_CODE

#: grouped products (rows sorted by expert, offs the cumulative rows per expert), by name
GROUPED = ("aten._grouped_mm", "transformers.grouped_mm_fallback")


def _grouped_flops(name: str, args: tuple) -> int | None:
    """FLOPs of a grouped product: each routed row through its expert's [in, out] matrix (rows
    beyond the last expert's end, if any, are not computed); its backward twice that."""
    if name not in GROUPED and name != "transformers.grouped_mm_fallback_backward":
        return None
    x, w = args[0], args[1]
    if name in GROUPED:
        return 2 * int(x.shape[0]) * int(x.shape[1]) * int(w.shape[-1])
    if name == "transformers.grouped_mm_fallback_backward":   # d input and d weight
        return 4 * int(x.shape[0]) * int(x.shape[1]) * int(w.shape[-1])
    return None


#: attention ops laid out [batch, heads, seq, head dim], the gradient first in backward
_ATTENTION = {"aten._scaled_dot_product_flash_attention": 0, "aten._scaled_dot_product_efficient_attention": 0,
              "aten._scaled_dot_product_cudnn_attention": 0,
              "aten._scaled_dot_product_flash_attention_backward": 1,
              "aten._scaled_dot_product_efficient_attention_backward": 1,
              "aten._scaled_dot_product_cudnn_attention_backward": 1}


def _grouped_query_args(name: str, args: tuple) -> tuple:
    """An attention op's arguments with a grouped-query call's key and value (fewer heads than
    the query: CUDA's kernels take them so with ``enable_gqa``) given as the query's heads' shapes,
    the work the kernel does; torch 2.11's formulas refuse such shapes, 2.13's count them so."""
    first = _ATTENTION.get(name)
    if first is None or len(args) < first + 3:
        return args
    q, k, v = args[first:first + 3]
    if q.dim() != 4 or k.dim() != 4 or k.shape[1] == q.shape[1]:
        return args
    heads = q.shape[1]
    k_shape = torch.Size((k.shape[0], heads) + tuple(k.shape[2:]))
    v_shape = torch.Size((v.shape[0], heads) + tuple(v.shape[2:]))
    return args[:first + 1] + (k_shape, v_shape) + args[first + 3:]


def _name(func) -> str:
    return str(func.overloadpacket).replace("::", ".").removeprefix("aten.aten.")


class WorkCounter(TorchDispatchMode):
    """Counts FLOPs of products and bytes written by every other op while active."""

    #: ops that allocate without touching memory, and communication (not the rank's compute)
    UNCOUNTED = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "c10d", "_c10d",
                 "wait_tensor", "all_reduce", "all_gather", "_allgather", "reduce_scatter", "_reduce_scatter",
                 "allreduce", "broadcast", "all_to_all", "alltoall")

    #: ops that return an alias without being marked views (``_unsafe_view``: a reshape's or a
    #: matmul's result over the same storage); they write nothing
    ALIASES = (torch.ops.aten._unsafe_view,)

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0
        self.moved = 0
        self.by_op: Counter = Counter()
        self.moved_by_op: Counter = Counter()
        #: with ``sites``: ``moved_by_op`` split by where each op was made, ``(op, site)`` ->
        #: bytes (:func:`op_site`); a frame walk per op, so off unless asked for
        self.sites = sites
        self.moved_by_site: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        flops = _grouped_flops(name, args)
        if flops is None and func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*_grouped_query_args(name, args), **kwargs, out_val=out)
        if flops is not None:
            self.flops += int(flops)
            self.by_op[name] += int(flops)
            return out
        if not func.is_view and func.overloadpacket not in self.ALIASES:
            written = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.bytes += written
            self.by_op[name] += written
            short = name.split(".")[-1] if name.startswith("aten.") else name
            if not short.startswith(self.UNCOUNTED):
                read = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
                self.moved += read + written
                self.moved_by_op[short] += read + written
                if self.sites:
                    self.moved_by_site[(short, op_site())] += read + written
        return out


#: the autotp package's folder, and its test helpers' (whose frames are the caller's, not autotp's)
_AUTOTP = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TESTING = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass(frozen=True)
class Copy:
    """One copy or cast: the op, the bytes it wrote, whether its source was laid out as its
    result already (``duplicate``: one contiguous input of as many elements and the same dtype,
    written to a whole tensor, not into part of a buffer: a copy nothing needed), whether it
    changed the dtype (``cast``), and where it was made (``site``): ``"program"`` (a node of the
    model's program), ``"autograd"`` (a backward formula the engine ran for one), or the autotp
    function (``"gather_scatter._all_gather"``)."""

    op: str
    bytes: int
    site: str
    duplicate: bool
    cast: bool


def _site() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(("<eval_with_key>", EAGER_CODE)):   # fx's code of the program, or its eager code
            return "program"
        if path.startswith(_AUTOTP) and not path.startswith(_TESTING):
            module = os.path.splitext(os.path.basename(path))[0]
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "autograd"


_ASSIGNED = re.compile(r"\s*(\w+)(\s*,\s*\w+)*\s*=")


def op_site() -> str:
    """Where the op being dispatched was made, finer than :func:`_site`: ``program <node>`` (the
    node of the program's code whose line called it: the variable fx names after it),
    ``backward <AutogradNode>`` (the backward formula autograd's engine is running, such as
    ``MaskedFillBackward0``), autotp's function (``experts.routed_combine``; ``functional.backward``
    for one of its autograd functions' backward), or, outside autotp's program (a serial model),
    the model's own ``file.py:function`` (``modeling_mixtral.py:forward``)."""
    node = torch._C._current_autograd_node()
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(("<eval_with_key>", EAGER_CODE)) and node is None:
            line = linecache.getline(path, frame.f_lineno)
            found = _ASSIGNED.match(line)
            return f"program {found.group(1)}" if found else "program"
        if path.startswith(_AUTOTP) and not path.startswith(_TESTING):
            return f"{os.path.splitext(os.path.basename(path))[0]}.{frame.f_code.co_name}"
        if node is None and os.sep + "site-packages" + os.sep in path and os.sep + "torch" + os.sep not in path:
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        if node is not None and not path.startswith("<") and os.sep + "torch" + os.sep not in path:
            break   # the caller of backward(): the engine's formula made it
        frame = frame.f_back
    return f"backward {node.name()}" if node is not None else "autograd"


class CopyCounter(TorchDispatchMode):
    """Records every copy and cast dispatched while active (module docs)."""

    OPS = ("copy_", "_to_copy", "clone", "cat", "stack", "constant_pad_nd")
    #: functional collectives that copy their input and reduce the copy, inside their kernel
    #: (below this mode): each is recorded as a copy of its input under its own name
    CLONING = ("all_reduce", "all_reduce_coalesced")

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[Copy] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and op in self.CLONING:
            for t in tree_leaves(args[:1]):
                # a contiguous copy of the input, as ``clone(memory_format=contiguous_format)``
                self.copies.append(Copy(op, t.numel() * t.element_size(), _site(), t.is_contiguous(), False))
            return out
        if op not in self.OPS:
            return out
        written = args[0] if op == "copy_" else out
        sources = [args[1]] if op == "copy_" else [t for t in tree_leaves(args[:1]) if isinstance(t, torch.Tensor)]
        src = sources[0] if len(sources) == 1 else None
        whole = op != "copy_" or (written._base is None and written.is_contiguous())   # not a part of a buffer
        duplicate = (whole and src is not None and src.is_contiguous() and src.numel() == written.numel()
                     and src.dtype == written.dtype and op != "constant_pad_nd")
        cast = any(t.dtype != written.dtype for t in sources)
        self.copies.append(Copy(op, written.numel() * written.element_size(), _site(), duplicate, cast))
        return out

    def by_site(self) -> Counter:
        """Bytes written per (site, op)."""
        out: Counter = Counter()
        for c in self.copies:
            out[(c.site, c.op)] += c.bytes
        return out

    def autotp_copies(self) -> list[Copy]:
        """The copies made by autotp's own code, not by the model's program or its backward."""
        return [c for c in self.copies if c.site not in ("program", "autograd")]
