"""A module's state: this rank's parameter shards, the model's buffers and the captures' constants.

:class:`RankState` is built once per module, after the ranks agree on what they run and before
the programs: each parameter the programs read is a DTensor on the (dp, tp) mesh whose local
tensor is this rank's shard (sliced from the model or read from a checkpoint), the buffers and
constants copies on the run device, never the source model's tensors. The module that runs the
programs (a ParallelModule, a pipeline stage) puts it under the model's own dotted names
(``named_parameters()`` and ``state_dict()`` read as the model's). :func:`refuse_dtype_change`
keeps the parameters in the dtype the programs were captured in.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn

from ...capture import Capture
from ...errors import CheckpointError, ConfigError
from ...plan import Plan
from ...placements import Placement
from . import dtensor
from .leaves import local_tensor, program_tensor


class ParamTree(nn.Module):
    """A submodule on the path to a parameter or buffer under its original dotted name
    (``transformer.h.0.attn...``): the module's ``named_parameters()`` and ``state_dict()``
    use the model's own names.

    A repeated layer's subtree runs the layer's outlined graph (``runtime.module.outline``) when
    sharded per layer with FSDP2: its forward reads its parameters as FSDP2's pre-forward hook
    left them (gathered over dp) and feeds them, in the graph's order (``names``), first."""

    def forward(self, block: fx.GraphModule, names: tuple[str, ...], *args: Any) -> Any:
        grad = torch.is_grad_enabled()
        return block(*(program_tensor(self.get_parameter(n), grad) for n in names), *args)


def put_named(root: nn.Module, fqn: str, value: torch.Tensor, buffer: bool = False, persistent: bool = True) -> None:
    *path, leaf = fqn.split(".")
    mod: nn.Module = root
    for part in path:
        child = getattr(mod, part, None)
        if child is None:
            mod.add_module(part, ParamTree())
        elif not isinstance(child, ParamTree):
            raise ConfigError(
                f"the model's {fqn} cannot be held under its own name: {part!r} is already an attribute of "
                f"{type(mod).__name__}; rename the model's submodule")
        mod = getattr(mod, part)
    if buffer:
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        mod.register_parameter(leaf, value)


class RankState:
    """This rank's state of ``model`` under ``plan``: its part of each parameter the programs
    read (``wanted``: of those alone), one per tied group under the name the programs use, read
    from ``weights`` or sliced from ``model``'s own tensors; the model's buffers and the values
    of the captures' constants, put on ``device`` as the programs ask for them."""

    def __init__(self, capture: Capture, plan: Plan, model: nn.Module, mesh: Any, device: torch.device,
                 weights: Callable[[str, Placement], torch.Tensor] | None = None, wanted: set[str] | None = None):
        self.device = device
        full_params = dict(model.named_parameters(remove_duplicate=False))
        #: held FQN -> the parameter: a DTensor on the (dp, tp) mesh whose local tensor is this
        #: rank's shard, until :meth:`put_on` hands them to the module
        self.params: dict[str, nn.Parameter] = {}
        for fqn in capture.param_names.values():
            if fqn in capture.aliases or (wanted is not None and fqn not in wanted):   # a tied twin: fed its target
                continue
            full, p = full_params[fqn], plan.params[fqn]
            local = weights(fqn, p) if weights is not None else None
            self.params[fqn] = nn.Parameter(dtensor.parameter(full, p, plan.tp, mesh, device, local),
                                            requires_grad=full.requires_grad)
        #: (each name the model gives a parameter, the held name it reads), in the model's order
        self._names = [(name, capture.aliases.get(name, name)) for name in full_params]
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self._persistent = persistent_buffers(model)
        self._buffers_put: set[str] = set()   # those on the owner already
        #: values for tensors the model holds on the meta device: from_pretrained computes the
        #: buffers a checkpoint does not hold; later programs are captured from a weightless copy
        #: of the model (capture.shape_twin), whose lifted constants have no values, which the
        #: first capture, of the model itself, holds
        self._computed: dict[str, torch.Tensor] = dict(getattr(weights, "buffers", None) or {})
        for name, value in capture.constants.items():
            if not value.is_meta:
                self._computed.setdefault(name, value)

    def put_on(self, owner: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters on ``owner`` under every name the model gives each of them, in the
        model's order (``named_parameters()`` then lists a tied pair once, under the model's
        first name, as the model does), handed over: returns them by held name, and the state
        keeps none (FSDP2 replaces the owner's with its own)."""
        params, self.params = self.params, {}
        for name, held in self._names:
            if held in params:
                put_named(owner, name, params[held])
        return params

    def put_buffers(self, owner: nn.Module, fqns: list[str]) -> None:
        """The model's buffers ``fqns`` on ``owner`` (the one module this state is put on) under
        their own names, on the run device, those not there yet (a meta buffer takes the value
        from_pretrained computed for it)."""
        for fqn in fqns:
            if fqn in self._buffers_put:
                continue
            full = self._buffers[fqn]
            if full.is_meta:
                full = self._computed.get(fqn, full)
            if full.is_meta:
                raise CheckpointError(f"buffer {fqn} is on the meta device: it is neither in the checkpoint "
                                      "nor computed by the model's constructor; load the model for real")
            # a copy, as the parameters are: the module owns its state (the source model changing its
            # buffer, or pm.load_state_dict writing this one, never reaches the other; .to(device) alone
            # would hand over the source's own tensor where the device is the same)
            put_named(owner, fqn, full.to(self.device, copy=True), buffer=True, persistent=fqn in self._persistent)
            self._buffers_put.add(fqn)

    def constants(self, capture: Capture) -> dict[str, torch.Tensor]:
        """The values of ``capture``'s lifted constants on the run device, by name. One captured
        from a meta model has no values: a non-persistent buffer or tensor attribute lifted as a
        constant takes the value computed for it (from_pretrained) or the one the model's first
        capture held; an empty one needs none; anything else is reported."""
        values = {}
        for name in capture.constant_names.values():
            value = capture.constants[name]
            if value.is_meta:
                value = self._computed.get(name, value)
            if value.is_meta and value.numel() == 0:   # no values to lose (a cache's first, empty keys)
                values[name] = torch.empty(value.shape, dtype=value.dtype, device=self.device)
            elif value.is_meta:
                raise CheckpointError(f"the captured constant {name} has no values (the model was captured on the "
                                      "meta device and its forward makes this tensor there): load the model for "
                                      "real and call autotp.parallelize")
            else:
                values[name] = value.to(self.device, copy=True)   # never the source model's own tensor
        return values


def persistent_buffers(model: nn.Module) -> set[str]:
    """The FQNs of ``model``'s buffers that its state_dict holds."""
    return {f"{prefix}.{b}" if prefix else b for prefix, m in model.named_modules(remove_duplicate=False)
            for b in m._buffers if b not in m._non_persistent_buffers_set}


def refuse_dtype_change(module: nn.Module, fn: Callable) -> bool:
    """Raise ConfigError where ``fn`` (what ``module.to``/``.double()``/``.half()``... apply to
    each tensor) would change the floating-point parameters' dtype: the programs were captured
    and planned in the old one (their casts, a loss's dtype, the planned bytes), so converting
    the tensors alone would run them half converted (a call with labels kept returning float32
    logits). A device move goes on; True where ``fn`` leaves a tensor as it is (a conversion to
    the dtype and device the parameters have: nothing to do)."""
    held = getattr(module, "_held", None) or {}
    probe = next((p for p in held.values() if p.is_floating_point()), None)
    if probe is None:
        return False
    now = local_tensor(probe)
    before = torch.empty(0, dtype=now.dtype, device=now.device)
    after = fn(before)
    if after is before:
        return True
    if isinstance(after, torch.Tensor) and after.dtype != now.dtype:
        raise ConfigError(
            f"pm.double() / pm.to(dtype) after parallelize would turn the parameters from {now.dtype} into "
            f"{after.dtype} but not the programs captured and planned in {now.dtype}, so calls would compute "
            f"in a mix of the two; convert the model first and parallelize that: "
            f"autotp.parallelize(model.to({after.dtype}), ...)")
