"""Megatron's tensor-parallel mappings as autograd Functions, forward and backward side by side.

Every mapping takes the TP ``group`` (a torch.distributed ProcessGroup). ``group=None`` means a
group of one rank: every mapping is then the identity (or plain slicing), with no communication.

    mapping          forward                              backward
    f  copy_to_tp    identity                             all-reduce(sum)
    g  reduce_from   all-reduce(sum)                      identity
    gather_from_tp   all-gather shards -> full            keep this rank's slice
    scatter_to_tp    keep this rank's slice               all-gather -> full
    reduce_scatter   sum over ranks, keep this rank's     all-gather -> full
                     slice (Partial -> Shard)
    reshard_tp       all-to-all: one split -> another     the reverse all-to-all
                     (Shard(a) -> Shard(b), or the same
                     dim dealt another way)

Sharded layouts follow ``autotp.placements.Shard`` (chunks, unit, uneven runs). Collectives need
equal sizes on every rank, so uneven shards are padded to ``max_local_size`` and cut back (a
reduce-scatter of uneven or interleaved shards is still one reduce-scatter, over padded blocks).
Collectives write into fresh tensors, never into their inputs, except an f's or a g's
all-reduce that the rewrite marked ``in_place`` (:mod:`autotp.passes.in_place`), and a failed
torch.distributed call surfaces as ``autotp.errors.CommError`` naming the op and the group, or
as ``LostRankError`` naming the rank that is gone (the roll call of :mod:`autotp.distributed.faults`).

What the Functions call lives beside them, one idea a module: :mod:`.comm` (groups, the
all-reduce, a failure named), :mod:`.shards` (layouts, no communication), :mod:`.gather_scatter`
(the backends' all-gather and reduce-scatter), :mod:`.exchange` (the all-to-all reshard).
:mod:`.comm_modules` wraps the mappings as ``nn.Module``s (``CopyToTP``, ``ReduceFromTP``, ...)
so that rewritten torch.fx graphs call them as ``call_module`` nodes and ``print(gm.code)``
shows them by name.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from autotp.errors import PlanError
from autotp.placements import Shard, resharded_by_all_to_all

from .comm import _all_reduce, group_rank, group_size
from .exchange import _all_to_all
from .gather_scatter import _all_gather, _reduce_scatter
from .shards import rank_slice

__all__ = [
    "copy_to_tp", "reduce_from_tp", "gather_from_tp", "gather_into_tp", "scatter_to_tp", "reduce_scatter_to_tp",
    "reshard_tp", "traced_as_now",
]


def _output(t: Tensor, compiling: bool) -> Tensor:
    """An autograd Function's forward output: under torch.compile a view of what it computed.
    torch 2.11's dynamo loses the gradient of some outputs returned as they are: a functional
    collective's result (g's input gradient came out zero in a compiled program at tp 2) and a
    rank's slice made by ``torch.cat`` of one narrowed run (scatter's); a view of either is traced
    right. Eager code returns it as it is: the view was one more ATen call and one more view's
    autograd bookkeeping per collective, for nothing there."""
    return t.view_as(t) if compiling else t


def traced_as_now(x: Tensor) -> Tensor:
    """``x`` as an autograd Function's input: under ``torch.compile``, a view of it, so that
    dynamo reads whether it requires grad from the tensor as it is now. Dynamo (torch 2.13) keeps
    the flag a tensor had when it was made: a buffer made without grad (``new_empty``) and then
    written through a slice with a tensor that requires grad (DeepSeek-V3's key, its ``k_nope``
    and ``k_rot`` copied into two slices) still reads as needing none, so the Function's forward
    is traced inline and its own backward dropped (scatter_to_tp's all-gather: only this rank's
    heads' gradient reached ``k_rot``). A fresh view's flag is read from the traced value, which
    is right. Eager code takes ``x`` as it is."""
    return x.view_as(x) if torch.compiler.is_compiling() else x


class _Mapping(torch.autograd.Function):
    """A mapping's autograd Function. Each takes, after its tensor, whether a compile trace runs
    (``compiling``, asked once by the caller, :func:`_apply`), and hands its backward none for it.
    ``_c_apply``: autograd's own C++ ``apply`` of the class, which :func:`_apply` calls in eager
    code."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._c_apply = super(torch.autograd.Function, cls).apply


def _apply(fn: type, compiling: bool, x: Tensor, *args: Any) -> Tensor:
    """``fn.apply(x, *args, compiling)``. Under torch.compile, or a functorch transform, through
    ``Function.apply`` (which dynamo traces; x a fresh view, :func:`traced_as_now`). Eagerly through
    autograd's C++ ``apply`` itself, the one ``Function.apply`` ends in: its Python before that
    (whether ``setup_context`` is defined, functorch's dead wrappers unwrapped argument by
    argument) was seven Python calls per collective in every step, to the same result: this
    Function defines no ``setup_context``, and ``x``, if a dead functorch wrapper, is unwrapped
    here as there."""
    if compiling:
        return fn.apply(x.view_as(x), *args, True)
    if _functorch_active():
        return fn.apply(x, *args, False)
    return fn._c_apply(_unwrap_if_dead(x), *args, False)


_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


class _CopyToTP(_Mapping):
    """f: identity forward, all-reduce of the gradient backward (``in_place``: in the gradient's
    own storage, where no other backward formula holds it)."""

    @staticmethod
    def forward(ctx, x, group, in_place, compiling):
        ctx.group, ctx.in_place = group, in_place
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "all_reduce in f (backward)", ctx.in_place), None, None, None


class _ReduceFromTP(_Mapping):
    """g: all-reduce forward (``in_place``: in the partial's own storage, where nothing else
    reads it), identity backward."""

    @staticmethod
    def forward(ctx, x, group, in_place, compiling):
        out = _all_reduce(x, group, "all_reduce in g (forward)", in_place, compiling)
        return out.view_as(out) if compiling else out   # (_output, inline: a call less per eager g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherFromTP(_Mapping):
    """Shard -> Replicate: all-gather forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard = group, shard
        out = _all_gather(x, group, shard, full_size, "all_gather in gather_from_tp (forward)", compiling)
        return out.view_as(out) if compiling else out   # (_output, inline)

    @staticmethod
    def backward(ctx, grad):
        # the rank's slice of the gradient as a view, strided where the split is not of the
        # outermost dims (the heads of attention's output): the formula it goes to reads it so
        g, s, compiling = ctx.group, ctx.shard, torch.compiler.is_compiling()
        if g is not None and not compiling:   # (group_size's and group_rank's answers, inline)
            return rank_slice(grad, s, g.size(), g.rank(), strided=True, compiling=False), None, None, None, None
        cut = rank_slice(grad, s, group_size(g, compiling), group_rank(g, compiling), strided=True, compiling=compiling)
        return cut, None, None, None, None


class _GatherIntoTP(_Mapping):
    """Shard -> Replicate into tensor-parallel compute (Megatron-SP's f̄: f fused with the
    all-gather): all-gather forward; the gradient there is a summand, so backward
    reduce-scatters it, each rank keeping its slice of the sum."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard, ctx.full_size = group, shard, full_size
        out = _all_gather(x, group, shard, full_size, "all_gather in gather_into_tp (forward)", compiling)
        return out.view_as(out) if compiling else out   # (_output, inline)

    @staticmethod
    def backward(ctx, grad):
        op = "reduce_scatter in gather_into_tp (backward)"
        return _reduce_scatter(grad, ctx.group, ctx.shard, ctx.full_size, op), None, None, None, None


class _ScatterToTP(_Mapping):
    """Replicate -> Shard: keep this rank's slice forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard, ctx.full_size = group, shard, full_size
        if group is not None and not compiling:   # (group_size's and group_rank's answers, inline)
            return rank_slice(x, shard, group.size(), group.rank(), compiling=False)
        cut = rank_slice(x, shard, group_size(group, compiling), group_rank(group, compiling), compiling=compiling)
        return _output(cut, compiling)

    @staticmethod
    def backward(ctx, grad):
        op = "all_gather in scatter_to_tp (backward)"
        return _all_gather(grad, ctx.group, ctx.shard, ctx.full_size, op), None, None, None, None


class _ReduceScatterToTP(_Mapping):
    """Partial -> Shard: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, shard, full_size, compiling):
        ctx.group, ctx.shard, ctx.full_size = group, shard, full_size
        out = _reduce_scatter(x, group, shard, full_size, "reduce_scatter in reduce_scatter_to_tp (forward)", compiling)
        return out.view_as(out) if compiling else out   # (_output, inline)

    @staticmethod
    def backward(ctx, grad):
        op = "all_gather in reduce_scatter_to_tp (backward)"
        return _all_gather(grad, ctx.group, ctx.shard, ctx.full_size, op), None, None, None, None


class _ReshardTP(_Mapping):
    """Shard -> Shard (another dim, or the same dealt another way): all-to-all forward; the
    reverse all-to-all backward (the gradient of a part is that part's gradient, sent back to
    the rank it came from)."""

    @staticmethod
    def forward(ctx, x, group, have, want, full_size, compiling):
        # the whole size of want's dim, the backward's full_size: x holds it whole, or it is have's
        other = x.shape[want.dim] if want.dim != have.dim else full_size
        ctx.group, ctx.have, ctx.want, ctx.other = group, have, want, other
        return _output(_all_to_all(x, group, have, want, full_size, "all_to_all in reshard_tp (forward)"), compiling)

    @staticmethod
    def backward(ctx, grad):
        op = "all_to_all in reshard_tp (backward)"
        return _all_to_all(grad, ctx.group, ctx.want, ctx.have, ctx.other, op), None, None, None, None, None


def copy_to_tp(x: Tensor, group, in_place: bool = False) -> Tensor:
    """f: a Replicate activation enters sharded compute. ``in_place``: its gradient is a tensor
    no other backward formula holds (:mod:`autotp.passes.in_place`), summed in its storage."""
    return _apply(_CopyToTP, torch.compiler.is_compiling(), x, group, in_place)


def reduce_from_tp(x: Tensor, group, in_place: bool = False) -> Tensor:
    """g: a Partial activation becomes Replicate. ``in_place``: nothing else reads ``x`` and no
    backward formula saved it (:mod:`autotp.passes.in_place`); the sum is written over it."""
    return _apply(_ReduceFromTP, torch.compiler.is_compiling(), x, group, in_place)


# In a group of one, a shard is the whole tensor: the three layout changes below are plain
# tensor ops there, outside their autograd Functions. (torch 2.11's dynamo drops the gradient
# of an autograd Function whose forward or backward returns a detached alias of its input, as
# ``x.detach().contiguous()`` is: every gradient of a compiled tp=1 program came out zero.)

def gather_from_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Shard becomes Replicate; ``full_size`` is the gathered size of ``shard.dim``."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.contiguous()
    return _apply(_GatherFromTP, compiling, x, group, shard, full_size)


def gather_into_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Shard becomes Replicate where it feeds sharded compute: all-gather forward,
    reduce-scatter of the gradient backward (an all-gather and an f, in the bytes of one)."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.contiguous()
    return _apply(_GatherIntoTP, compiling, x, group, shard, full_size)


def scatter_to_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Replicate tensor becomes this rank's Shard (``full_size`` = ``x.shape[shard.dim]``)."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return _apply(_ScatterToTP, compiling, x, group, shard, full_size)


def reduce_scatter_to_tp(x: Tensor, group, shard: Shard, full_size: int) -> Tensor:
    """A Partial tensor becomes this rank's Shard of the sum."""
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return _apply(_ReduceScatterToTP, compiling, x, group, shard, full_size)


def reshard_tp(x: Tensor, group, have: Shard, want: Shard, full_size: int) -> Tensor:
    """This rank's part of a tensor split as ``have`` becomes its part of the tensor split as
    ``want`` (another dim, or the same dealt another way) by one all-to-all; ``full_size`` is the
    whole size of ``have.dim``. Layouts one all-to-all does not move
    (:func:`~autotp.placements.resharded_by_all_to_all`: a tail or blocks every rank holds whole,
    per-block dealing) are a PlanError: the plan gathers and cuts those."""
    if not resharded_by_all_to_all(have, want):
        raise PlanError(f"reshard_tp cannot move {have!r} -> {want!r} by one all-to-all (it moves splits "
                        "whose every element one rank holds: no tail, whole block or per-block dealing); "
                        "plan it as an all-gather and a cut (autotp.passes.propagate.gather_parts lists "
                        "such a reshard so)")
    compiling = torch.compiler.is_compiling()
    if group_size(group, compiling) == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return _apply(_ReshardTP, compiling, x, group, have, want, full_size)
