"""A ParallelModule's state: this rank's parameter shards and the buffers, under the model's names.

:func:`hold_parameters` makes each parameter the programs read a DTensor on the (dp, tp) mesh
whose local tensor is this rank's shard (sliced from the model or read from a checkpoint);
:func:`put_parameters` and :func:`put_buffer` register them under the model's own dotted names
(``named_parameters()`` and ``state_dict()`` read as the model's); buffers and constants are
copies, never the source model's tensors. :func:`refuse_dtype_change` keeps the parameters in
the dtype the programs were captured in.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn

from ...capture import Capture
from ...errors import CheckpointError, ConfigError
from ...plan import Plan
from ...placements import Placement, Shard
from . import dtensor
from ...distributed.collectives import local_shard
from .leaves import local_tensor, program_tensor
from ...distributed.mesh import device_mesh_of


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


def hold_parameters(capture: Capture, plan: Plan, model: nn.Module, mesh: Any, device: torch.device,
                    weights: Callable[[str, Placement], torch.Tensor] | None,
                    wanted: set[str] | None = None) -> dict[str, nn.Parameter]:
    """This rank's part of each parameter the programs read (``wanted``: of those alone), one per
    tied group under the name the programs use: a DTensor on the (dp, tp) mesh whose local
    tensor is this rank's shard, read from ``weights`` or sliced from ``model``'s own tensors."""
    full_params = dict(model.named_parameters(remove_duplicate=False))
    tp, rank = plan.tp, mesh.tp_rank if mesh is not None else 0
    device_mesh = device_mesh_of(mesh, device)
    if device_mesh is not None:
        dtensor.install()
    held: dict[str, nn.Parameter] = {}
    for fqn in capture.param_names.values():
        if fqn in capture.aliases or (wanted is not None and fqn not in wanted):   # a tied twin: fed its target
            continue
        p = plan.params[fqn]
        if weights is not None:
            local = weights(fqn, p).to(device)
        else:
            full = full_params[fqn].detach()
            local = local_shard(full, p, tp, rank) if isinstance(p, Shard) else full
            local = local.to(device).clone()
        requires_grad = full_params[fqn].requires_grad
        if device_mesh is not None:
            local = _distributed(local, p, tuple(full_params[fqn].shape), tp, device_mesh)
        held[fqn] = nn.Parameter(local, requires_grad=requires_grad)
    return held


def put_parameters(owner: nn.Module, model: nn.Module, capture: Capture, held: dict[str, nn.Parameter]) -> None:
    """``held`` under every name the model gives each of them, in the model's order:
    ``named_parameters()`` then lists a tied pair once, under the model's first name, as the
    model does."""
    for name, _ in model.named_parameters(remove_duplicate=False):
        target = capture.aliases.get(name, name)
        if target in held:
            put_named(owner, name, held[target])


def constant_value(capture: Capture, name: str, computed: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """A lifted constant on the run device. One captured from a meta model has no values: a
    non-persistent buffer or tensor attribute lifted as a constant takes the value computed for
    it (from_pretrained) or the one the model's first capture held; an empty one needs none;
    anything else is reported."""
    value = capture.constants[name]
    if value.is_meta:
        value = computed.get(name, value)
    if value.is_meta and value.numel() == 0:   # no values to lose (a cache's first, empty keys)
        return torch.empty(value.shape, dtype=value.dtype, device=device)
    if value.is_meta:
        raise CheckpointError(f"the captured constant {name} has no values (the model was captured on the "
                              "meta device and its forward makes this tensor there): load the model for real "
                              "and call autotp.parallelize")
    return value.to(device, copy=True)   # never the source model's own tensor (see put_buffer)


def persistent_buffers(model: nn.Module) -> set[str]:
    """The FQNs of ``model``'s buffers that its state_dict holds."""
    return {f"{prefix}.{b}" if prefix else b for prefix, m in model.named_modules(remove_duplicate=False)
            for b in m._buffers if b not in m._non_persistent_buffers_set}


def put_buffer(owner: nn.Module, fqn: str, model_buffers: dict[str, torch.Tensor], computed: dict[str, torch.Tensor],
               persistent: set[str], device: torch.device) -> None:
    """Register the model's buffer ``fqn`` on ``owner`` under its own name, on the run device
    (a meta buffer takes the value from_pretrained computed for it)."""
    full = model_buffers[fqn]
    if full.is_meta:
        full = computed.get(fqn, full)
    if full.is_meta:
        raise CheckpointError(f"buffer {fqn} is on the meta device: it is neither in the checkpoint "
                              "nor computed by the model's constructor; load the model for real")
    # a copy, as the parameters are: the module owns its state (the source model changing its
    # buffer, or pm.load_state_dict writing this one, never reaches the other; .to(device) alone
    # would hand over the source's own tensor where the device is the same)
    put_named(owner, fqn, full.to(device, copy=True), buffer=True, persistent=fqn in persistent)


def _distributed(local: torch.Tensor, placement: Placement, shape: tuple[int, ...], tp: int, device_mesh: Any) -> torch.Tensor:
    """``local`` (this rank's part) as a DTensor on the (dp, tp) mesh: replicated over dp, over
    tp the placement that describes ``placement`` exactly (autotp.runtime.module.dtensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    size = shape[placement.dim] if isinstance(placement, Shard) else None
    over_tp = dtensor.torch_placement(placement, size, tp)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh, [Replicate(), over_tp], run_check=False,
                              shape=torch.Size(shape), stride=stride)


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
