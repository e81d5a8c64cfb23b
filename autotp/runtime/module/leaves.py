"""How a program is fed a DTensor parameter: its local tensor, with the gradient handed back.

The programs compute on each parameter's local shard; the parameters themselves are DTensors
(optimizers, ``clip_grad_norm_`` and DCP see the whole). :func:`program_tensor` gives a program
the local tensor, through a persistent leaf (:class:`LocalLeaves`, the default) or a per-call
autograd Function (:class:`_LocalOf`), so that ``loss.backward()`` fills ``param.grad`` as a
DTensor of the parameter's spec.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor   # here, not in program_tensor: an import per parameter per call

from ...errors import ConfigError


class LeavesSwitch:
    """``module.local_leaves``: whether the programs read each parameter through its local leaf
    (:class:`LocalLeaves`, the default) or through a per-call autograd Function.

    With the leaves the DTensor parameters themselves are not in autograd's graph, only their
    leaves: ``loss.backward()`` fills ``param.grad`` and runs the parameters' hooks as always,
    but ``torch.autograd.grad(loss, module.parameters())`` finds the parameters unused (an error,
    or None with ``allow_unused=True``). Set ``local_leaves = False`` before such a call (its
    eager steps cost more host time). Under FSDP2 the Function is always used."""

    _leaves: "LocalLeaves | None"

    @property
    def local_leaves(self) -> bool:
        return self._leaves is not None

    @local_leaves.setter
    def local_leaves(self, on: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        if on and isinstance(self, FSDPModule):
            raise ConfigError("local_leaves cannot be turned on under FSDP2, which reads its unsharded "
                              "parameters' gradients from autograd itself")
        if bool(on) != self.local_leaves:
            self._leaves = LocalLeaves() if on else None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the same tensor object every time), a plain tensor itself."""
    return getattr(t, "_local_tensor", t)


def program_tensor(param: nn.Parameter, grad_enabled: bool, leaves: "LocalLeaves | None" = None,
                   compiling: bool | None = None) -> torch.Tensor:
    """What a program is fed for ``param``: its local tensor; where a gradient must flow back
    into ``param.grad`` (a DTensor with the parameter's placements), the local tensor's leaf
    (``leaves``, :class:`LocalLeaves`) or, where that cannot stand in for the parameter, the
    local tensor through an autograd Function.

    Under torch.compile the leaf is fed as eagerly (a graph input like a plain parameter, its
    gradient accumulated and handed on outside the graph), where one was made before: a
    traced region cannot make one (a tensor made a leaf, a hook registered). The traced call
    reads nothing of the parameter itself but its identity (:meth:`LocalLeaves.made`): an
    attribute read would make the DTensor an input of the compiled function, whose
    gradient-less accumulation node would run the parameter's post-accumulate hooks (the
    data-parallel average) once more, on no gradient. So the leaf's hook, eagerly, runs the
    parameter's gradient hooks (``param.register_hook``) and refuses a leaf whose parameter's
    local tensor was replaced since. Where there is no leaf the program reads
    ``param.to_local()``, whose backward accumulates a DTensor gradient through DTensor's
    dispatch for every parameter (a tenth of a small compiled MoE step on CPU).

    ``compiling``: whether a torch.compile trace is running, where the caller knows it (a call
    feeds every parameter: asked once for all of them, not once each); None asks."""
    if isinstance(param, DTensor):   # (not hasattr: torch.compile answers it for plain tensors only)
        if not (grad_enabled and param.requires_grad):
            return param._local_tensor
        if torch.compiler.is_compiling() if compiling is None else compiling:
            leaf = leaves.made(param) if leaves is not None else None
            return leaf if leaf is not None else param.to_local()
        if leaves is not None and not param._backward_hooks:
            # the steady step's case inline (leaves.leaf's first lines): one Python call per
            # parameter per step, this one
            held = leaves._of.get(id(param))
            return held[2] if held is not None and held[1] is param._local_tensor else leaves.leaf(param)
        return _LocalOf.apply(param)
    return param


class LocalLeaves:
    """One persistent leaf per DTensor parameter: its local tensor detached (same storage and
    version counter), requiring a gradient, fed to the programs in its place. Autograd
    accumulates the local gradient into the leaf as into any plain parameter; a hook on the
    leaf then hands it to ``param.grad`` as a DTensor of the parameter's spec (added to the
    local tensor of one already there) and runs the parameter's own post-accumulate-grad hooks
    (the data-parallel average, a user's), as autograd would have.

    The per-call autograd Function this replaces (:class:`_LocalOf`, still used for a
    parameter with a gradient hook of its own, ``param.register_hook``, which must see the
    gradient before it is accumulated) cost its forward, its Python backward and a DTensor
    gradient accumulated through DTensor's dispatch, for every parameter and step: a 39-parameter
    stack on CPU, 3.0 ms a step through it against 1.7 ms through the leaves (1.3 ms plain).
    A leaf is made again when the parameter's local tensor is replaced (``param.data = ...``, a
    state dict loaded with ``assign=True``). A ParallelModule makes its programs' leaves when it
    adds a program (:meth:`make`), so that a call compiled before any eager call with gradients
    reads them too."""

    def __init__(self) -> None:
        #: id(param) -> (a weak reference to it, its local tensor then, the leaf): by id, as a
        #: tensor key would be compared by value. An entry goes when its parameter does (the
        #: reference's callback), before another object can take the id: an entry is always
        #: the live parameter's of that id
        self._of: dict[int, tuple] = {}

    def made(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s leaf if one was made, else None; makes none and reads nothing of
        ``param`` but its identity (what a region torch.compile traces may ask: see
        :func:`program_tensor`; dynamo guards the identity itself, in C++). Whether the leaf is
        still ``param``'s local tensor's is checked by the leaf's hook, in backward. No
        comparison of the entry's reference with ``param`` here: under torch.compile that was a
        Python guard per parameter, checked before every call."""
        held = self._of.get(id(param))
        return held[2] if held is not None else None

    def leaf(self, param: nn.Parameter) -> torch.Tensor:
        local = param._local_tensor
        held = self._of.get(id(param))
        if held is not None and held[1] is local:
            return held[2]
        import weakref

        leaf = local.detach().requires_grad_()
        key, entries = id(param), self._of

        def gone(ref: Any) -> None:   # the parameter is freed: its id may be another object's next
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        ref = weakref.ref(param, gone)
        leaf.register_post_accumulate_grad_hook(_into_param_grad(ref, local))
        self._of[key] = (ref, local, leaf)
        return leaf

    def make(self, params: "Iterable[nn.Parameter]") -> None:
        """Make the leaves of ``params`` (DTensors that require a gradient) now, outside any
        traced region."""
        for param in params:
            if isinstance(param, DTensor) and param.requires_grad:
                self.leaf(param)

    def clear(self) -> None:
        self._of.clear()


def _spec_copy(spec: Any) -> Any:
    """``copy.copy(spec)`` (a DTensorSpec: a dataclass kept in its ``__dict__``) without copy's
    Python, four calls made for every parameter in every backward. A gradient gets its own spec,
    as torch's ``to_local`` backward gives it: sharding propagation may write an op's spec."""
    if not hasattr(spec, "__dict__"):
        import copy

        return copy.copy(spec)
    new = object.__new__(type(spec))
    new.__dict__.update(spec.__dict__)
    return new


#: ``DTensor(local, spec, requires_grad=False)`` without its ``__init__``: DTensor's constructor is
#: C++ (``Tensor._dtensor__new__``, which sets ``_spec`` and ``_local_tensor``); its ``__init__``
#: calls ``Tensor.__init__`` and nothing else, through dynamo's disable wrapper and export's
#: constructor marker, seven Python calls per parameter in every backward for an eager caller
_new_dtensor = DTensor.__new__


def _into_param_grad(param_ref: Any, local: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def hook(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        param = param_ref()
        if param is None or grad is None:
            return
        if param._local_tensor is not local:
            raise ConfigError(
                "a compiled call read a parameter's former local tensor: it was replaced (torch.utils.swap_tensors, "
                "an assignment to its _local_tensor) after this module's last eager call, and a compiled call "
                "cannot make the new one's leaf; call the module once eagerly after replacing parameters, then "
                "call the compiled module")
        spec = param._spec
        if param._backward_hooks:   # the parameter's gradient hooks, before accumulation (under compile)
            grad = _hooked(param, DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False,
                                                     shape=spec.shape, stride=spec.stride))
            if grad is None:
                return
        if grad.requires_grad:   # backward(create_graph=True): the gradient is differentiable
            grad = DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False,
                                      shape=spec.shape, stride=spec.stride)
            param.grad = grad if param.grad is None else param.grad + grad
        elif param.grad is None:   # the steady step's case: one Python call, this hook
            if hasattr(spec, "__dict__"):   # (_spec_copy inline)
                copied = object.__new__(type(spec))
                copied.__dict__.update(spec.__dict__)
            else:
                copied = _spec_copy(spec)
            param.grad = _new_dtensor(DTensor, grad, copied, requires_grad=False)
        else:
            local_tensor(param.grad).add_(grad)
        for post in tuple((param._post_accumulate_grad_hooks or {}).values()):
            post(param)

    return hook


def _hooked(param: nn.Parameter, grad: Any) -> torch.Tensor | None:
    """``grad`` (a DTensor) through ``param``'s gradient hooks as autograd runs them on a leaf:
    each may return a replacement; the local tensor of the result."""
    for fn in tuple(param._backward_hooks.values()):
        out = fn(grad)
        if out is not None:
            grad = out
    return None if grad is None else getattr(grad, "_local_tensor", grad)


class _LocalOf(torch.autograd.Function):
    """``param.to_local()`` for a DTensor parameter, its gradient handed back as a DTensor of
    the parameter's own spec. torch's to_local builds that DTensor through ``from_local`` (an
    autograd Function, the global shape and stride worked out again, its checks) in every
    backward, for every parameter: about a tenth of a tiny Llama's CPU step at tp 1. A gradient
    laid out as the parameter's local tensor (the usual case) gets a copy of the spec at once;
    any other, and a backward that builds a graph (``create_graph=True``), goes through torch's
    own path."""

    @staticmethod
    def forward(ctx, param):
        local = param._local_tensor
        # the attributes torch's _ToTorchTensor.forward sets, which its backward (our fallback)
        # reads: torch 2.14 added local_tensor_stride
        ctx.dtensor_spec, ctx.grad_placements, ctx.local_tensor_stride = param._spec, None, local.stride()
        ctx.set_materialize_grads(False)
        return local.view_as(local)   # a fresh tensor object: autograd's metadata goes on it

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor._api import _ToTorchTensor

        if grad is None:
            return None
        if grad.stride() == ctx.local_tensor_stride and not isinstance(grad, DTensor) and not torch.is_grad_enabled():
            return DTensor(grad, _spec_copy(ctx.dtensor_spec), requires_grad=False)
        return _ToTorchTensor.backward(ctx, grad)[0]
