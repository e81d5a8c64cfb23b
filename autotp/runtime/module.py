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

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn

from ..capture import Capture, bind_inputs, flat_inputs, unflatten_outputs
from ..errors import CaptureError, CheckpointError, ConfigError, InputError
from ..plan import Plan
from ..placements import Placement, Shard
from . import dtensor
from .agreement import check_agreement, check_call, fingerprint, input_signature, state_entries
from .collectives import group_ranks, local_shard
from .faults import StepGuard, watch_backward
from .input_kinds import check_input_kinds
from .inputs import check_index_bounds, check_not_empty, index_bounds
from .mesh import device_mesh_of
from .outline import layer_paths, outline


class _ParamTree(nn.Module):
    """A submodule on the path to a parameter or buffer under its original dotted name
    (``transformer.h.0.attn...``): the module's ``named_parameters()`` and ``state_dict()``
    use the model's own names.

    A repeated layer's subtree runs the layer's outlined graph (``runtime.outline``) when
    sharded per layer with FSDP2: its forward reads its parameters as FSDP2's pre-forward hook
    left them (gathered over dp) and feeds them, in the graph's order (``names``), first."""

    def forward(self, block: fx.GraphModule, names: tuple[str, ...], *args: Any) -> Any:
        grad = torch.is_grad_enabled()
        return block(*(_program_tensor(self.get_parameter(n), grad) for n in names), *args)


def _put(root: nn.Module, fqn: str, value: torch.Tensor, buffer: bool = False, persistent: bool = True) -> None:
    *path, leaf = fqn.split(".")
    mod: nn.Module = root
    for part in path:
        child = getattr(mod, part, None)
        if child is None:
            mod.add_module(part, _ParamTree())
        elif not isinstance(child, _ParamTree):
            raise ConfigError(
                f"the model's {fqn} cannot be held under its own name: {part!r} is already an attribute of "
                f"{type(mod).__name__}; rename the model's submodule")
        mod = getattr(mod, part)
    if buffer:
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        mod.register_parameter(leaf, value)


@dataclass
class Program:
    """One call signature's program: its capture, its plan (the module's one parameter layout,
    this graph's collectives) and this rank's rewritten graph, with what feeds the graph."""

    capture: Capture
    plan: Plan
    graph_module: fx.GraphModule
    param_order: list[str]          # the parameter FQN fed to each parameter placeholder
    buffer_order: list[str]         # the buffer FQN fed to each buffer placeholder
    constants: list[torch.Tensor]
    bounds: dict = field(default_factory=dict)   # input key -> the table it indexes (runtime/inputs.py)
    step: str = ""   # "prefill"/"decode": a generation step's program (autotp.generation), not a call's
    arriving: dict = field(default_factory=dict)   # input key -> its placement when it comes in split
    #: (flat output index, the split dim, its whole size, the DTensor placement over tp) for each
    #: output a call returns split, as a DTensor (``gather_logits``); made once, outside any trace
    split: tuple = ()
    #: tensor input key -> (dtype, rank, the (dim, size) pairs the capture kept static), read off
    #: the graph once (not per call: torch.compile traces the calls, and the graph with them)
    inputs: dict = field(init=False, default_factory=dict)
    #: parameter FQNs the program's layer calls read themselves (per-layer FSDP: runtime.outline)
    outlined: frozenset = frozenset()

    def serves(self, kwargs: dict[str, Any], training: bool, tied: bool = True) -> bool:
        """Does this program compute a call with these inputs, in this mode? Same tensor inputs
        (names, dtypes, ranks), same non-tensor flags (a flag left out takes the captured value),
        and equal sizes where the capture has one symbol (``tied=False``: all but that)."""
        cap = self.capture
        if cap.training != training:
            return False
        for key, value in kwargs.items():
            if key in cap.constant_inputs:
                if isinstance(value, torch.Tensor) or value != cap.constant_inputs[key]:
                    return False
            elif key not in cap.input_keys or not isinstance(value, torch.Tensor):
                return False
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        wanted = [k for k in cap.input_keys if k not in cap.constant_inputs]
        if sorted(tensors) != sorted(wanted):
            return False
        for key, (dtype, ndim, static) in self.inputs.items():
            if key in tensors:
                if dtype != tensors[key].dtype or ndim != tensors[key].dim():
                    return False
                # a dim the capture kept static (a float input's features) must have its size:
                # another size is another program, never a silently wrong answer
                split = self.arriving.get(key)
                skip = split.dim if isinstance(split, Shard) else -1   # a local size: the plan's split
                if any(tensors[key].shape[i] != n and i != skip for i, n in static):
                    return False
        # dims the capture made one symbol must be equal: a call whose lengths differ there (an
        # encoder-decoder's source and target) is another program
        return not tied or unequal_symbol(cap, tensors, self.arriving) is None

    def __post_init__(self) -> None:
        metas = {n.name: n.meta.get("val") for n in self.capture.graph.nodes if n.op == "placeholder"}
        for key, node_name in zip(self.capture.input_keys, self.capture.user_inputs):
            val = metas.get(node_name)
            if isinstance(val, torch.Tensor):
                static = tuple((i, int(d)) for i, d in enumerate(val.shape) if not isinstance(d, torch.SymInt))
                self.inputs[key] = (val.dtype, val.dim(), static)


#: builds a program for a call: (inputs, training[, generation step]) -> (capture, plan, rewritten graph)
ProgramBuilder = Callable[..., tuple]


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


class ParallelModule(LeavesSwitch, nn.Module):
    def __init__(self, capture: Capture, plan: Plan, graph_module: fx.GraphModule, mesh: Any,
                 model: nn.Module, device: torch.device,
                 weights: Callable[[str, Placement], torch.Tensor] | None = None,
                 build: ProgramBuilder | None = None):
        """``weights(fqn, placement)``, when given, returns this rank's part of a parameter (read
        from a checkpoint); otherwise the parts are sliced from ``model``'s own tensors.

        ``build(inputs, training)`` makes the program of a call no program so far serves (other
        inputs present, other dtypes, eval instead of train): captured on first use under this
        module's parameter layout (``plan``), agreed by the TP group, then cached. Without it
        the module runs the one program it was given."""
        super().__init__()
        #: the group the agreement checks talk over (CPU/gloo: no accelerator sync per call)
        self._control = getattr(mesh, "control_group", None) or getattr(mesh, "tp_group", None)
        self._guard = StepGuard(self._control, group_ranks(self._control) if self._control is not None else None)
        global _modules_made
        # the ranks agree on what they run, on the weights they were handed, and on this module's
        # number (the largest any of them would give it): its name in every later call's check
        number = check_agreement(fingerprint(plan, graph_module, capture.graph, state_entries(model)),
                                 self._control, number=_modules_made + 1)
        _modules_made = max(_modules_made, number)
        #: this module as every rank of its group names it: "GPT2LMHeadModel #2"
        self.name = f"{type(model).__name__} #{number}"
        #: calls (and generation steps) made so far: each call's check names its number
        self._calls = 0
        self._caller: int | None = None   # the thread inside a call, if any
        #: compare every call's input names, shapes and dtypes across the TP group (True), also
        #: their values ("values"), or only the call's place in the order of calls (False); one
        #: tiny CPU all-reduce per call in each case
        self.check_inputs = True
        self.mesh = mesh
        device_mesh = device_mesh_of(mesh, device)
        #: the tp dim's DeviceMesh, taken once (a split output is a DTensor on it)
        self._tp_mesh = device_mesh["tp"] if device_mesh is not None else None
        self.device = device
        self._build = build
        #: what pm.generate needs of the serial model (autotp.generation)
        self._generation = _generation_info(model)
        #: the model's repeated layers (runtime.outline.layer_paths); under per-layer FSDP2
        #: (runtime.fsdp.fully_shard) each one's subtree of this module, by path, runs its ops
        self._layers = layer_paths(model)
        self._units: dict[str, nn.Module] = {}
        # Each parameter is a DTensor on the (dp, tp) mesh whose local tensor is this rank's
        # shard: the programs run on those local tensors (to_local() each call, so gradients
        # arrive in param.grad as DTensors), optimizers and clip_grad_norm_ see the whole.
        held = hold_parameters(capture, plan, model, mesh, device, weights)
        #: held FQN -> the parameter (one per tied group, under the name the programs use)
        self._held = held
        #: each DTensor parameter's local leaf (see :class:`LocalLeaves`); None under FSDP2,
        #: which reads its unsharded parameters' gradients from autograd itself
        self._leaves: LocalLeaves | None = LocalLeaves()
        put_parameters(self, model, capture, held)
        self._model_buffers = dict(model.named_buffers(remove_duplicate=False))
        #: values for tensors the model holds on the meta device (from_pretrained computes the
        #: buffers a checkpoint does not hold; the model itself stays on meta for later captures)
        self._computed: dict[str, torch.Tensor] = dict(getattr(weights, "buffers", None) or {})
        # later programs are captured from a weightless copy of the model (capture.shape_twin): a
        # tensor its forward makes on a parameter's device is lifted there with no values; the
        # first capture, of the model itself, holds them
        for name, value in capture.constants.items():
            if not value.is_meta:
                self._computed.setdefault(name, value)
        self._persistent = persistent_buffers(model)
        self._buffers_held: set[str] = set()   # buffer FQNs registered here (under their own names)
        self._graphs = nn.ModuleDict()
        self._programs: list[Program] = []
        self._current = self._add_program(capture, plan, graph_module)
        self.train(capture.training)   # the model's mode: a model in eval() gives a module in eval()
        self._average_over_dp(getattr(mesh, "dp_group", None), getattr(mesh, "dp", 1))

    def _apply(self, fn: Callable, recurse: bool = True) -> "ParallelModule":
        if refuse_dtype_change(self, fn):
            return self   # a conversion to what the parameters are already (torch's would fail on DTensors)
        return super()._apply(fn, recurse)

    # ---- the programs ---------------------------------------------------------------------
    @property
    def programs(self) -> list[Program]:
        """Every program built so far, the first one the one ``parallelize`` captured."""
        return list(self._programs)

    @property
    def capture(self) -> Capture:
        return self._current.capture

    @property
    def plan(self) -> Plan:
        """The plan of the program that ran last (the first one before any call): every program
        holds the same parameter layout; their collectives differ with the inputs."""
        return self._current.plan

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._current.graph_module

    def _add_program(self, capture: Capture, plan: Plan, graph_module: fx.GraphModule, step: str = "",
                     arriving: dict | None = None) -> Program:
        if self._programs:   # the first was agreed at construction
            check_agreement(fingerprint(plan, graph_module, capture.graph), self._control,
                            "before a new program's first collective", doing=f"a new program for {self._doing()}")
        param_order = [capture.aliases.get(fqn, fqn) for fqn in capture.param_names.values()]
        buffer_order = list(capture.buffer_names.values())
        for fqn in buffer_order:
            if fqn not in self._buffers_held:
                put_buffer(self, fqn, self._model_buffers, self._computed, self._persistent, self.device)
                self._buffers_held.add(fqn)
        constants = [constant_value(capture, name, self._computed, self.device)
                     for name in capture.constant_names.values()]
        self._graphs[f"program_{len(self._programs)}"] = graph_module
        split = []
        for i, (name, node) in enumerate(zip(capture.output_names, capture.output_nodes)):
            placement = plan.sharded_outputs.get(name) if not step else None
            if placement is not None:
                size = int(node.meta["val"].shape[placement.dim])
                split.append((i, placement.dim, size, dtensor.torch_placement(placement, size, plan.tp)))
        program = Program(capture, plan, graph_module, param_order, buffer_order, constants,
                          index_bounds(capture), step, dict(arriving or {}), tuple(split))
        if self._units:
            self._outline(program)
        self._programs.append(program)
        return program

    def _outline(self, program: Program) -> None:
        """Run ``program``'s layers through their subtrees of this module (per-layer FSDP2)."""
        _, outlined = outline(program.graph_module, program.param_order, list(self._units), self._units)
        program.outlined = frozenset(outlined)

    def _serving(self, kwargs: dict[str, Any], in_ranges: bool = False) -> Program | None:
        """The call program that serves ``kwargs`` in this mode (the current one first), or None;
        ``in_ranges``: its captured dim ranges must hold the inputs too."""
        for program in [self._current, *self._programs]:
            if not program.step and program.serves(kwargs, self.training) \
                    and (not in_ranges or _in_ranges(program.capture, kwargs)):
                return program
        return None

    def _program_for(self, kwargs: dict[str, Any]) -> Program:
        found = self._serving(kwargs)
        if found is not None:
            return found
        tied = next((p for p in [self._current, *self._programs]
                     if not p.step and p.serves(kwargs, self.training, tied=False)), None)
        if self._build is None:
            if tied is not None:
                raise InputError(f"{unequal_symbol(tied.capture, kwargs)}; pass inputs of equal length, or capture "
                                 "with example inputs whose lengths differ")
            raise InputError(
                f"this call's inputs {sorted(kwargs)} (training={self.training}) are not the captured call's "
                f"{self.capture.input_keys} (training={self.capture.training}), and this module cannot "
                "capture another program; build it with autotp.parallelize"
            )
        try:
            capture, plan, graph_module = self._build(dict(kwargs), self.training)
        except CaptureError as exc:
            if tied is None:
                raise
            # the lengths this call has unequal are one symbol in a program that serves it
            # otherwise, and a capture with them unequal fails: the model's forward ties them
            cause = exc.__cause__ or exc
            why = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:300]}"
            raise InputError(f"{unequal_symbol(tied.capture, kwargs)}, and its forward fails with them unequal "
                             f"({why}); pass inputs of equal length") from exc
        return self._add_program(capture, plan, graph_module)

    def _average_over_dp(self, group: Any, dp: int) -> None:
        """Data parallelism across TP groups: each parameter's gradient is averaged over the DP
        group as soon as backward has accumulated it (the ranks of a DP group hold the same
        shard, run the same graph, and so reach the hooks in the same order)."""
        self._dp_hooks: list = []
        if group is None or dp <= 1:
            return
        import torch.distributed as dist

        from .collectives import _comm

        def average(param: torch.Tensor) -> None:
            grad = _local(param.grad)
            with _comm("the data-parallel gradient all-reduce", group):   # a lost peer named as in TP
                dist.all_reduce(grad, group=group)
            grad.div_(dp)

        #: removed when FSDP2 takes data parallelism over (autotp.runtime.fsdp)
        self._dp_hooks = [param.register_post_accumulate_grad_hook(average)
                          for param in self._held.values() if param.requires_grad]

    def check_replicas(self) -> None:
        """Raise DisagreementError on every rank of the TP group unless its ranks hold the same
        values in every parameter the plan replicates and every buffer (one small all-reduce,
        and a digest of each tensor): a load that gave one rank other values (a shard of another
        save, a damaged file) would otherwise compute silently wrong results. Run after a load."""
        from .agreement import Fingerprint, value_digest

        plan = self.plan
        entries = tuple(f"{fqn}: {value_digest(_local(p))}" for fqn, p in self.named_parameters()
                        if not isinstance(plan.params.get(plan.aliases.get(fqn, fqn)), Shard))
        entries += tuple(f"{fqn}: {value_digest(b)}" for fqn, b in self.named_buffers())
        check_agreement(Fingerprint((("the replicated parameters and buffers differ (a digest of each tensor's values)",
                                      entries),)),
                        self._control, "after loading", doing=f"the replicas' check of {self.name}",
                        advice="Every rank of a TP group must load the same values into what it replicates: load "
                               "one checkpoint, written by one save, on every rank.")

    def local_parameter(self, fqn: str) -> torch.Tensor:
        """This rank's shard of parameter ``fqn`` (any of a tied parameter's names): the tensor
        the programs compute with, sharing storage with the DTensor parameter."""
        return _local(self._held[self.plan.aliases.get(fqn, fqn)])

    def local_grad(self, fqn: str) -> torch.Tensor | None:
        """This rank's shard of parameter ``fqn``'s gradient (None before a backward)."""
        grad = self._held[self.plan.aliases.get(fqn, fqn)].grad
        return None if grad is None else _local(grad)

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's shard on this rank, once per tied group, under the name the plan
        and the programs use (``lm_head.weight`` for GPT-2's tied embedding)."""
        return {fqn: _local(param) for fqn, param in self._held.items()}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._compiled_forward(args, kwargs)
        with self._sole_caller(), self._guard:   # an exception on some ranks only never leaves them out of step
            return self._forward(args, kwargs)

    @property
    def check_inputs(self) -> bool | str:
        return self._check_inputs

    @check_inputs.setter
    def check_inputs(self, mode: bool | str) -> None:
        self._check_inputs = _check_inputs_mode(mode)

    def _doing(self, backward: bool = False) -> str:
        call = f"call {self._calls} of {self.name}"
        return f"the backward pass of {call}" if backward else call

    def _agree_on_call(self, names: list[str], values: list[Any], extra: tuple[str, ...] = ()) -> None:
        """The per-call check (one small all-reduce): every rank of the group is in this same call
        of this same module, with inputs of the same names, shapes and dtypes (and values, with
        ``check_inputs="values"``). The call is counted only once agreed, so a refused call is
        made again under the same number."""
        mode = self.check_inputs
        signature = (input_signature(names, values, digest_values=mode == "values") + extra) if mode else ()
        self._calls += 1
        try:
            check_call(self._doing(), signature, self._control)
        except BaseException:
            self._calls -= 1
            raise

    @contextmanager
    def _sole_caller(self):
        """One thread in a call at a time: the ranks pair their collectives by the order of calls,
        which two threads calling at once cannot keep the same on every rank."""
        me = threading.get_ident()
        with _CALLERS:
            owner = self._caller
            if owner is not None and owner != me:
                raise ConfigError(
                    f"this {self.name} is already running a call in another thread: the ranks pair up their "
                    "collectives by the order of calls, which calls from two threads at once cannot keep the same "
                    "on every rank; call it from one thread at a time")
            self._caller = me
        try:
            yield
        finally:
            if owner is None:
                self._caller = None

    def _compiled_forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A call traced by torch.compile: a program an eager call built, run as it is. What
        talks to the store or reads tensor values stays out of the traced region (the ranks'
        input agreement, the index bounds, the step guard); a program for a new kind of call
        is captured with torch.export, which cannot run inside a compiled region."""
        kwargs = bind_inputs(self.capture.signature, args, kwargs, self.capture.model_name)
        program = self._serving(kwargs, in_ranges=True)
        if program is None:
            raise InputError(
                f"no program of this module serves a call with inputs {sorted(kwargs)} (training={self.training}) "
                "inside torch.compile: call the module once eagerly with such inputs first (a new kind of call is "
                "captured with torch.export, which cannot run in a compiled region)")
        if any(isinstance(over_tp, dtensor.RunShard) for *_, over_tp in program.split):
            raise ConfigError(
                "under torch.compile a call cannot return an output split unevenly over tp (here the logits: "
                "the vocabulary is not a multiple of tp); pass gather_logits=True to parallelize, or compile "
                "a call without labels, whose logits come back whole")
        return self._run(program, kwargs, compiled=True)

    def _forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        # Positional inputs are named by the model's forward signature, as at capture.
        kwargs = bind_inputs(self.capture.signature, args, kwargs, self.capture.model_name)
        # first: the checks below then fail on every rank or on none
        names = sorted(kwargs)
        self._agree_on_call(names, [kwargs[n] for n in names], (f"training: {self.training}",))
        check_not_empty(kwargs)   # after the shapes are known to agree: every rank or none
        check_input_kinds([self.capture, *(p.capture for p in self._programs)], kwargs)   # before a capture for them
        program = self._current = self._program_for(kwargs)
        self._check_ranges(kwargs)
        return self._run(program, kwargs)

    def _run(self, program: Program, kwargs: dict[str, Any], compiled: bool = False) -> Any:
        flat = flat_inputs(program.capture, kwargs)
        if not compiled:
            check_index_bounds(program.bounds, kwargs)
        grad = torch.is_grad_enabled()
        params = [_program_tensor(self._held[fqn], grad, self._leaves) if fqn not in program.outlined else None
                  for fqn in program.param_order]
        buffers = [self.get_buffer(fqn) for fqn in program.buffer_order]
        outputs = program.graph_module(*params, *buffers, *program.constants, *flat)
        outputs = list(outputs)
        if grad and self._guard.active and not compiled:   # a backward pass that raises is a fault of the call
            wanted = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            if wanted:   # every rank in the same backward pass before its first collective
                doing, control = self._doing(backward=True), self._control
                watch_backward(self._guard, wanted, lambda: check_call(doing, (), control))
        if program.split:
            outputs = self._split_outputs(program, outputs, compiled)
        return unflatten_outputs(program.capture, outputs)

    def _split_outputs(self, program: Program, outputs: list, compiled: bool = False) -> list:
        """A call's outputs kept split (logits by vocabulary: ``gather_logits``) as DTensors on
        the tp mesh: their shape is the whole one, ``full_tensor()`` gathers them and
        ``to_local()`` is this rank's part. A generation step's split cache stays local.

        Under torch.compile a split output carries no gradient (the loss does): AOTAutograd
        cannot take the plain zero tangent a DTensor output gets when backward starts from
        the loss alone (pytorch/pytorch#172556), so backward from it raises instead."""
        from torch.distributed.tensor import DTensor

        if self._tp_mesh is None:
            raise ConfigError("a split output needs the tp DeviceMesh; parallelize inside an initialized world")
        for i, dim, size, over_tp in program.split:
            if not isinstance(outputs[i], torch.Tensor):
                continue
            shape = list(outputs[i].shape)
            shape[dim] = size   # the split dim is static
            local = outputs[i].detach() if compiled else outputs[i]
            outputs[i] = DTensor.from_local(local, self._tp_mesh, [over_tp], run_check=False,
                                            shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        return outputs

    # ---- generation -----------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Decoding with a KV cache split by head on each rank, token for token what the serial
        model's ``generate`` returns, greedy or sampled (``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``); see :mod:`autotp.generation`."""
        from ..generation import generate
        from .fsdp import whole_parameters

        with whole_parameters(self):   # generate() runs the programs without this module's __call__
            return generate(self, input_ids, attention_mask, **kwargs)

    def _step(self, spec: Any, inputs: dict[str, torch.Tensor]) -> tuple[Program, dict[str, torch.Tensor]]:
        """Run one generation step (``spec``: an autotp.generation.StepSpec), building its
        program on first use. The token inputs are checked across the ranks like a call's; the
        cache is not (its split may give ranks different shapes)."""
        with self._sole_caller(), self._guard:
            return self._run_step(spec, inputs)

    def _run_step(self, spec: Any, inputs: dict[str, torch.Tensor]) -> tuple[Program, dict[str, torch.Tensor]]:
        names = sorted(spec.tokens)
        self._agree_on_call(names, [spec.tokens[n] for n in names], (f"training: {self.training}", f"past: {spec.past}"))
        kind = "decode" if spec.cache is not None else "prefill"
        for program in self._programs:
            if program.step == kind and program.serves(inputs, self.training) and _in_ranges(program.capture, inputs):
                break
        else:
            if self._build is None:
                raise InputError("this module cannot capture a generation step; build it with autotp.parallelize")
            capture, plan, graph_module = self._build(dict(inputs), self.training, spec)
            program = self._add_program(capture, plan, graph_module, kind, spec.input_placements)
        return program, self._run(program, inputs)

    def _check_ranges(self, kwargs: dict[str, Any]) -> None:
        unequal = unequal_symbol(self.capture, kwargs)
        if unequal is not None:
            raise InputError(f"{unequal}; pass inputs of equal length, or capture with example inputs whose "
                             "lengths differ")
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


#: ParallelModules made in this process, as agreed with their groups (each one's number: its name)
_modules_made = 0
#: guards the check-and-set of a module's calling thread
_CALLERS = threading.Lock()


def _check_inputs_mode(mode: Any) -> bool | str:
    if mode is True or mode is False or mode == "values":
        return mode
    raise ConfigError(f"check_inputs={mode!r} is not valid: use True (names, shapes and dtypes of every call's "
                      "inputs compared across the TP group), \"values\" (their values too: a digest of each "
                      "tensor) or False (only the order of calls)")


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
    now = _local(probe)
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


def unequal_symbol(capture: Capture, kwargs: dict[str, Any], arriving: dict | None = None) -> str | None:
    """Where ``kwargs`` give two input dims of one symbol of ``capture`` different sizes, a
    sentence naming them (None where they agree). A dim ``arriving`` split holds a local size."""
    seen: dict[str, tuple[str, int]] = {}   # symbol -> (first input dim carrying it, its size)
    for key, sym in capture.input_dims.items():
        name, dim = key.rsplit(".", 1)
        value = kwargs.get(name)
        split = (arriving or {}).get(name)
        if not isinstance(value, torch.Tensor) or value.dim() <= int(dim) \
                or (isinstance(split, Shard) and split.dim == int(dim)):
            continue
        size = value.shape[int(dim)]
        first = seen.setdefault(sym, (key, size))
        if first[1] != size:
            return (f"{first[0].replace('.', ' dim ')} has size {first[1]} but {key.replace('.', ' dim ')} has {size}: "
                    f"the model was captured with these dims equal (one symbol, {sym})")
    return None


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
            _put(owner, name, held[target])


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
    _put(owner, fqn, full.to(device, copy=True), buffer=True, persistent=fqn in persistent)


def _distributed(local: torch.Tensor, placement: Placement, shape: tuple[int, ...], tp: int, device_mesh: Any) -> torch.Tensor:
    """``local`` (this rank's part) as a DTensor on the (dp, tp) mesh: replicated over dp, over
    tp the placement that describes ``placement`` exactly (autotp.runtime.dtensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    size = shape[placement.dim] if isinstance(placement, Shard) else None
    over_tp = dtensor.torch_placement(placement, size, tp)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh, [Replicate(), over_tp], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the same tensor object every time), a plain tensor itself."""
    return getattr(t, "_local_tensor", t)


def _program_tensor(param: nn.Parameter, grad_enabled: bool, leaves: "LocalLeaves | None" = None) -> torch.Tensor:
    """What a program is fed for ``param``: its local tensor; where a gradient must flow back
    into ``param.grad`` (a DTensor with the parameter's placements), the local tensor's leaf
    (``leaves``, :class:`LocalLeaves`) or, where that cannot stand in for the parameter, the
    local tensor through an autograd Function."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):   # (not hasattr: torch.compile answers it for plain tensors only)
        if not (grad_enabled and param.requires_grad):
            return param._local_tensor
        if torch.compiler.is_compiling():
            return param.to_local()
        if leaves is not None and not param._backward_hooks:
            return leaves.leaf(param)
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
    state dict loaded with ``assign=True``)."""

    def __init__(self) -> None:
        #: id(param) -> (a weak reference to it, its local tensor then, the leaf): by id, as a
        #: tensor key would be compared by value
        self._of: dict[int, tuple] = {}

    def leaf(self, param: nn.Parameter) -> torch.Tensor:
        local = param._local_tensor
        held = self._of.get(id(param))
        if held is not None and held[0]() is param and held[1] is local:
            return held[2]
        import weakref

        leaf = local.detach().requires_grad_()
        ref = weakref.ref(param)
        leaf.register_post_accumulate_grad_hook(_into_param_grad(ref))
        self._of[id(param)] = (ref, local, leaf)
        return leaf

    def clear(self) -> None:
        self._of.clear()


def _into_param_grad(param_ref: Any) -> Callable[[torch.Tensor], None]:
    import copy

    from torch.distributed.tensor import DTensor   # imported once per leaf, not per step

    def hook(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        param = param_ref()
        if param is None or grad is None:
            return
        spec = param._spec
        if grad.requires_grad:   # backward(create_graph=True): the gradient is differentiable
            grad = DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False,
                                      shape=spec.shape, stride=spec.stride)
            param.grad = grad if param.grad is None else param.grad + grad
        elif param.grad is None:
            param.grad = DTensor(grad, copy.copy(spec), requires_grad=False)
        else:
            _local(param.grad).add_(grad)
        for post in tuple((param._post_accumulate_grad_hooks or {}).values()):
            post(param)

    return hook


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
        import copy

        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._api import _ToTorchTensor

        if grad is None:
            return None
        if grad.stride() == ctx.local_tensor_stride and not isinstance(grad, DTensor) and not torch.is_grad_enabled():
            return DTensor(grad, copy.copy(ctx.dtensor_spec), requires_grad=False)
        return _ToTorchTensor.backward(ctx, grad)[0]


def _in_ranges(capture: Capture, kwargs: dict[str, Any]) -> bool:
    """Are the inputs' dynamic dims within what the capture was traced for?"""
    for key, (lo, hi) in capture.range_constraints.items():
        name, dim = key.rsplit(".", 1)
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() > int(dim) and not lo <= value.shape[int(dim)] <= hi:
            return False
    return True


def _generation_info(model: nn.Module) -> dict[str, Any]:
    import copy
    import inspect

    config = getattr(model, "config", None)
    try:
        params = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = set()
    positions = next((v for name in ("n_positions", "max_position_embeddings", "n_ctx")
                      if isinstance(v := getattr(config, name, None), int) and not isinstance(v, bool)), None)
    return {"generation_config": copy.deepcopy(getattr(model, "generation_config", None)),
            "config": copy.deepcopy(config), "max_positions": positions,
            "is_encoder_decoder": bool(getattr(config, "is_encoder_decoder", False)),
            "has_config": config is not None, "forward_params": params,
            "model_name": type(model).__name__}
