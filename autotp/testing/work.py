"""Work a program does, counted device-independently: FLOPs of products, bytes written by the rest.

``with WorkCounter() as work: step()`` counts every ATen op the step dispatches (forward and
backward): a product (``mm``, ``bmm``, attention, a grouped product of experts: transformers'
fallback op and its backward included) adds its FLOPs, any other op the bytes of the tensors
it writes (views write none). ``work.by_op`` keeps both per op name, so a test can hold one
kind of op to account (the experts' products of a rank against its rows). ``work.moved`` (and
``moved_by_op``) counts what an op's kernels read too, the memory traffic a GPU pays for it;
allocations (which touch no memory) and collectives (communication) are left out of it.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

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


def _name(func) -> str:
    return str(func.overloadpacket).replace("::", ".").removeprefix("aten.aten.")


class WorkCounter(TorchDispatchMode):
    """Counts FLOPs of products and bytes written by every other op while active."""

    #: ops that allocate without touching memory, and communication (not the rank's compute)
    UNCOUNTED = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "c10d", "_c10d",
                 "wait_tensor", "all_reduce", "all_gather", "_allgather", "reduce_scatter", "_reduce_scatter",
                 "allreduce", "broadcast", "all_to_all", "alltoall")

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0
        self.moved = 0
        self.by_op: Counter = Counter()
        self.moved_by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        flops = _grouped_flops(name, args)
        if flops is None and func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        if flops is not None:
            self.flops += int(flops)
            self.by_op[name] += int(flops)
            return out
        if not func.is_view:
            written = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.bytes += written
            self.by_op[name] += written
            short = name.split(".")[-1] if name.startswith("aten.") else name
            if not short.startswith(self.UNCOUNTED):
                read = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
                self.moved += read + written
                self.moved_by_op[short] += read + written
        return out
