"""The mappings of :mod:`.collectives` as ``nn.Module``s, so that rewritten torch.fx graphs call
them as ``call_module`` nodes and ``print(gm.code)`` shows them by name.

``CopyToTP`` (f), ``ReduceFromTP`` (g), ``GatherFromTP``, ``GatherIntoTP`` (f̄), ``ScatterToTP``,
``ReduceScatterToTP`` and ``ReshardTP`` each hold their group (a deep copy of the graph talks over
the same one), their shard and sizes (``full_size=None``: a dynamic dim, passed at call time),
and ``in_place`` for an f or a g (:mod:`autotp.passes.in_place`). ``forward`` calls the mapping;
``eager_forward``, what a program's eager code calls (:mod:`autotp.runtime.module.eager_code`),
applies its autograd Function at once. No state beyond what the rewrite gave them.
"""
from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from autotp.errors import CommError
from autotp.placements import Shard

from .collectives import (_CopyToTP, _functorch_active, _GatherFromTP, _GatherIntoTP, _ReduceFromTP,
                          _ReduceScatterToTP, _ScatterToTP, _unwrap_if_dead, copy_to_tp, gather_from_tp,
                          gather_into_tp, reduce_from_tp, reduce_scatter_to_tp, reshard_tp, scatter_to_tp)
from .comm import group_ranks

__all__ = ["CopyToTP", "ReduceFromTP", "GatherFromTP", "GatherIntoTP", "ScatterToTP", "ReduceScatterToTP",
           "ReshardTP"]


class _CommModule(nn.Module):
    kind = ""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group  # a ProcessGroup is neither a parameter nor a buffer: plain attribute

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; a copied graph talks over the same group.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key == "group" else copy.deepcopy(value, memo)
        return new

    def eager_forward(self, *args: Any) -> Any:
        """``forward``, for eager code that runs outside any trace (a program's eager code,
        :mod:`autotp.runtime.module.eager_code`, calls it in place of the module call). The
        mappings' own (below) apply their autograd Function through autograd's C++ ``apply`` at
        once: no module call (``__getattr__``, ``_wrapped_call_impl``, ``_call_impl``), no
        compile check, no mapping function between (five to seven Python calls a collective).
        Module hooks do not run on this path; autotp registers none on these modules."""
        return self.forward(*args)

    def _group_repr(self) -> str:
        ranks = group_ranks(self.group)
        return "group=None" if self.group is None else f"ranks={list(ranks) if ranks else '?'}"

    def extra_repr(self) -> str:
        return self._group_repr()


class _ShardedCommModule(_CommModule):
    """``full_size=None``: the sharded dim is dynamic (the sequence, under sequence parallelism);
    the graph passes its size at call time, or the input, when whole, shows it."""

    #: the mapping's autograd Function (None: ``forward`` itself runs eagerly too)
    _function: type | None = None
    #: whether the input is whole along the sharded dim (it shows the size where none is given)
    _whole_input = False

    def __init__(self, group, shard: Shard, full_size: int | None) -> None:
        super().__init__(group)
        self.shard = shard
        self.full_size = None if full_size is None else int(full_size)

    def eager_forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        """``forward`` outside any trace (:meth:`_CommModule.eager_forward`)."""
        group, fn = self.group, self._function
        if fn is None or group is None or group.size() == 1:   # (a group of one: plain tensor ops, as forward's)
            return self.forward(x, full_size)
        size = int(full_size) if full_size is not None else self.full_size
        if size is None:   # (size's answer where the input is whole, inline; else its error)
            size = x.shape[self.shard.dim] if self._whole_input else self.size(x, None, False)
        if _functorch_active():
            return fn.apply(x, group, self.shard, size, False)
        return fn._c_apply(_unwrap_if_dead(x), group, self.shard, size, False)

    def size(self, x: Tensor, full_size: int | None, whole_input: bool) -> int:
        if full_size is not None:
            return int(full_size)
        if self.full_size is not None:
            return self.full_size
        if whole_input:
            return x.shape[self.shard.dim]
        raise CommError(
            f"{self.kind} of {self.shard!r}: the gathered size of a dynamic dim is unknown; the "
            "rewrite must pass it (a sym_size node) as the module's second argument"
        )

    def extra_repr(self) -> str:
        size = "dynamic" if self.full_size is None else self.full_size
        return f"{self._group_repr()}, shard={self.shard!r}, full_size={size}"


class _ReduceModule(_CommModule):
    """An f or a g; ``in_place`` (set by :mod:`autotp.passes.in_place`): its all-reduce writes the
    sum over the tensor it reduces, which nothing else reads."""

    _function: type

    def __init__(self, group, in_place: bool = False) -> None:
        super().__init__(group)
        self.in_place = in_place

    def eager_forward(self, x: Tensor) -> Tensor:
        """``forward`` outside any trace (:meth:`_CommModule.eager_forward`)."""
        if _functorch_active():
            return self._function.apply(x, self.group, self.in_place, False)
        return self._function._c_apply(_unwrap_if_dead(x), self.group, self.in_place, False)

    def extra_repr(self) -> str:
        return f"{self._group_repr()}, in_place" if self.in_place else self._group_repr()


class CopyToTP(_ReduceModule):
    """f: identity forward, all-reduce of the gradient backward."""

    kind = "f"
    _function = _CopyToTP

    def forward(self, x: Tensor) -> Tensor:
        return copy_to_tp(x, self.group, self.in_place)


class ReduceFromTP(_ReduceModule):
    """g: all-reduce forward, identity backward."""

    kind = "g"
    _function = _ReduceFromTP

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_tp(x, self.group, self.in_place)


class GatherFromTP(_ShardedCommModule):
    kind = "all_gather"
    _function = _GatherFromTP

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return gather_from_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=False))


class GatherIntoTP(_ShardedCommModule):
    """f̄: all-gather forward, reduce-scatter backward (a sequence shard entering a
    column-parallel product)."""

    kind = "all_gather_f"
    _function = _GatherIntoTP

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return gather_into_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=False))


class ScatterToTP(_ShardedCommModule):
    kind = "scatter"
    _function, _whole_input = _ScatterToTP, True

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return scatter_to_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=True))


class ReduceScatterToTP(_ShardedCommModule):
    kind = "reduce_scatter"
    _function, _whole_input = _ReduceScatterToTP, True

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return reduce_scatter_to_tp(x, self.group, self.shard, self.size(x, full_size, whole_input=True))


class ReshardTP(_ShardedCommModule):
    """A split along one dim resharded along another by one all-to-all (``shard``: the split the
    input holds, ``want``: the one it leaves with; ``full_size``: the whole size of the input's
    split dim, None where it is dynamic and the graph passes it)."""

    kind = "all_to_all"

    def __init__(self, group, shard: Shard, want: Shard, full_size: int | None) -> None:
        super().__init__(group, shard, full_size)
        self.want = want

    def forward(self, x: Tensor, full_size: int | None = None) -> Tensor:
        return reshard_tp(x, self.group, self.shard, self.want, self.size(x, full_size, whole_input=False))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, want={self.want!r}"
