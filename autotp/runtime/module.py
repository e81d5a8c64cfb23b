"""ParallelModule: this rank's parameter shards + the rewritten graph, called like the model.

``pm(**kwargs)`` takes the keyword inputs the model was captured with and returns the same
output structure as the serial model (a HuggingFace ``ModelOutput`` for HF models), with
logits and loss whole on every rank. ``pm.graph_module`` is the per-rank program (print its
``.code`` to see the f/g nodes); ``pm.plan`` is the plan it executes.

Before its first collective a ParallelModule checks that the ranks of its TP group agree on
what they run (:mod:`autotp.runtime.agreement`): one small all-reduce at construction, and one
per call for the inputs' names, shapes and dtypes (``pm.check_inputs = False`` skips the latter
once the data pipeline is trusted). A disagreement raises ``DisagreementError`` on every rank
instead of a hang.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn

from ..capture import Capture, bind_inputs, flat_inputs, unflatten_outputs
from ..errors import CheckpointError, InputError
from ..plan import Plan
from ..placements import Placement, Shard
from .agreement import check_agreement, check_same_inputs, fingerprint, input_signature
from .collectives import local_shard


class _ParamTree(nn.Module):
    """Holds parameters under their original dotted names (``transformer.h.0.attn...``)."""

    def put(self, fqn: str, param: nn.Parameter) -> None:
        *path, leaf = fqn.split(".")
        mod: nn.Module = self
        for part in path:
            if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
                mod.add_module(part, _ParamTree())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, param)


class ParallelModule(nn.Module):
    def __init__(self, capture: Capture, plan: Plan, graph_module: fx.GraphModule, mesh: Any,
                 model: nn.Module, device: torch.device,
                 weights: Callable[[str, Placement], torch.Tensor] | None = None):
        """``weights(fqn, placement)``, when given, returns this rank's part of a parameter (read
        from a checkpoint); otherwise the parts are sliced from ``model``'s own tensors."""
        super().__init__()
        #: the group the agreement checks talk over (CPU/gloo: no accelerator sync per call)
        self._control = getattr(mesh, "control_group", None) or getattr(mesh, "tp_group", None)
        check_agreement(fingerprint(plan, graph_module), self._control)
        #: compare every call's input shapes across the TP group (one tiny CPU all-reduce)
        self.check_inputs = True
        self.capture = capture
        self.plan = plan
        self.graph_module = graph_module
        self.mesh = mesh
        self.device = device
        self.local = _ParamTree()
        full_params = dict(model.named_parameters(remove_duplicate=False))
        full_buffers = dict(model.named_buffers(remove_duplicate=False))
        tp, rank = plan.tp, mesh.tp_rank if mesh is not None else 0
        self._param_order: list[str] = []
        for placeholder, fqn in capture.param_names.items():
            if fqn in capture.aliases:      # a tied twin: fed the tensor it is tied to
                self._param_order.append(capture.aliases[fqn])
                continue
            p = plan.params[fqn]
            if weights is not None:
                local = weights(fqn, p).to(device)
            else:
                full = full_params[fqn].detach()
                local = local_shard(full, p, tp, rank) if isinstance(p, Shard) else full
                local = local.to(device).clone()
            self.local.put(fqn, nn.Parameter(local, requires_grad=full_params[fqn].requires_grad))
            self._param_order.append(fqn)
        self._buffers_in: list[torch.Tensor] = []
        for placeholder, fqn in capture.buffer_names.items():
            if full_buffers[fqn].is_meta:
                raise CheckpointError(f"buffer {fqn} is on the meta device: it is neither in the checkpoint "
                                      "nor computed by the model's constructor; load the model for real")
            self.register_buffer(f"_buf_{len(self._buffers_in)}", full_buffers[fqn].to(device))
            self._buffers_in.append(getattr(self, f"_buf_{len(self._buffers_in)}"))
        self._constants = [capture.constants[name].to(device) for name in capture.constant_names.values()]
        self._average_over_dp(getattr(mesh, "dp_group", None), getattr(mesh, "dp", 1))

    def _average_over_dp(self, group: Any, dp: int) -> None:
        """Data parallelism across TP groups: each parameter's gradient is averaged over the DP
        group as soon as backward has accumulated it (the ranks of a DP group hold the same
        shard, run the same graph, and so reach the hooks in the same order)."""
        if group is None or dp <= 1:
            return
        import torch.distributed as dist

        def average(param: torch.Tensor) -> None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(dp)

        for param in self.local.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(average)

    def local_parameter(self, fqn: str) -> nn.Parameter:
        return self.local.get_parameter(self.plan.aliases.get(fqn, fqn))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Positional inputs are named by the model's forward signature, as at capture.
        kwargs = bind_inputs(self.capture.signature, args, kwargs, self.capture.model_name)
        if self.check_inputs:  # first: the checks below then fail on every rank or on none
            names = sorted(kwargs)
            check_same_inputs(input_signature(names, [kwargs[n] for n in names]), self._control)
        flat = flat_inputs(self.capture, kwargs)
        self._check_ranges(kwargs)
        params = [self.local.get_parameter(fqn) for fqn in self._param_order]
        buffers = [getattr(self, f"_buf_{i}") for i in range(len(self._buffers_in))]
        outputs = self.graph_module(*params, *buffers, *self._constants, *flat)
        return unflatten_outputs(self.capture, outputs)

    def _check_ranges(self, kwargs: dict[str, Any]) -> None:
        seen: dict[str, tuple[str, int]] = {}   # symbol -> (first input dim carrying it, its size)
        for key, sym in self.capture.input_dims.items():
            name, dim = key.rsplit(".", 1)
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > int(dim):
                size = value.shape[int(dim)]
                first = seen.setdefault(sym, (key, size))
                if first[1] != size:
                    raise InputError(
                        f"{first[0].replace('.', ' dim ')} has size {first[1]} but {key.replace('.', ' dim ')} has "
                        f"{size}: the model was captured with these dims equal (one symbol, {sym}); pass inputs "
                        "of equal length, or capture with example inputs whose lengths differ"
                    )
        for key, (lo, hi) in self.capture.range_constraints.items():
            name, dim = key.rsplit(".", 1)
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > int(dim):
                size = value.shape[int(dim)]
                if 2 < lo and size < lo:
                    raise InputError(
                        f"{name} has {size} elements in dim {dim} but the model needs at least {lo} there "
                        "(torch.export found this bound in its forward); pass a longer input"
                    )
                if size > hi:
                    raise InputError(
                        f"{name} has {size} elements in dim {dim} but the model was captured for at most "
                        f"{hi} there (the model's maximum positions); shorten the input or use a model "
                        "with more positions"
                    )
