"""ParallelModule: this rank's parameter shards + the rewritten graph, called like the model.

``pm(**kwargs)`` takes the keyword inputs the model was captured with and returns the same
output structure as the serial model (a HuggingFace ``ModelOutput`` for HF models), with
logits and loss whole on every rank. ``pm.graph_module`` is the per-rank program (print its
``.code`` to see the f/g nodes); ``pm.plan`` is the plan it executes.

Before its first collective a ParallelModule checks that the ranks of its TP group agree on
what they run (:mod:`autotp.distributed.agreement`): one small all-reduce at construction, and one
per call for the inputs' names, shapes and dtypes (``pm.check_inputs = False`` keeps the shapes
alone) and the state the call runs in: grad mode, autocast, the frozen parameters and the
optimizer steps taken over the module's parameters (``pm.check_replicas_every = n`` adds the
replicated parameters' digests after every n-th step). A disagreement raises
``DisagreementError`` on every rank instead of a hang; one about the module's state (replicas
that differ, optimizer steps taken on some ranks only) leaves the module refusing calls until
``pm.check_replicas()`` finds the replicas equal again.

With ``pm.deferred_checks`` (the default where the TP collectives are NCCL's) a call never stops
its host for the group or for the device in steady state: the call's agreement is issued as the
call starts and read before its outputs are handed back (a backward pass's: issued as it starts,
read as it ends), and its index inputs' bounds are computed on the device, copied to the host
behind the call's work and read as the next call starts (or at ``pm.flush_checks()``). What this
leaves open is in docs/errors.md ("Checks read late").
"""
from __future__ import annotations

import logging
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch import fx, nn

from ...capture import Capture, bind_inputs, flat_inputs, unflatten_outputs
from ...errors import CaptureError, ConfigError, DisagreementError, InputError
from ...plan import Plan
from ...placements import Placement, Shard
from . import dtensor
from ...distributed.agreement import (Fingerprint, check_agreement, check_call, constant_entries, fingerprint, grad_entries,
                        input_signature, start_call_check, state_entries, value_digest)
from ...distributed.comm import group_ranks
from ...distributed.faults import StepGuard, watch_backward
from .input_kinds import check_input_kinds
from .inputs import StagedBounds, check_index_bounds, check_not_empty, index_bounds, stage_index_bounds
from .leaves import LeavesSwitch, LocalLeaves, local_tensor, program_tensor
from ...distributed.mesh import device_mesh_of
from .outline import layer_paths, outline
from .program import Program, ProgramBuilder, broken_guards, fixed_length, unequal_symbol, within_ranges
from .state import RankState, refuse_dtype_change


log = logging.getLogger(__name__)


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
        # Built in stage order: the groups it talks over and the ranks' agreement on what they
        # run, this rank's state (parameter shards, buffers), the programs, then what its calls
        # check and keep on those groups.
        # -- the mesh and the agreement
        self.mesh, self.device = mesh, device
        #: the group the agreement checks talk over (CPU/gloo: no accelerator sync per call)
        self._control = control_group(mesh)
        #: this module as every rank of its group names it: "GPT2LMHeadModel #2"
        self.name = f"{type(model).__name__} #{agree_on_module(capture, plan, graph_module, model, self._control)}"
        # -- the state: each parameter a DTensor on the (dp, tp) mesh whose local tensor is this
        # rank's shard: the programs run on those local tensors (to_local() each call, so gradients
        # arrive in param.grad as DTensors), optimizers and clip_grad_norm_ see the whole
        self._state = RankState(capture, plan, model, mesh, device, weights)
        #: held FQN -> the parameter (one per tied group, under the name the programs use)
        self._held = self._state.put_on(self)
        #: each DTensor parameter's local leaf (see :class:`LocalLeaves`); None under FSDP2,
        #: which reads its unsharded parameters' gradients from autograd itself
        self._leaves: LocalLeaves | None = LocalLeaves()
        #: what pm.generate needs of the serial model (autotp.generation)
        self._generation = _generation_info(model)
        #: the model's repeated layers (runtime.module.outline.layer_paths); under per-layer FSDP2
        #: (runtime.fsdp.fully_shard) each one's subtree of this module, by path, runs its ops
        self._layers = layer_paths(model)
        self._units: dict[str, nn.Module] = {}
        # -- the programs
        self._build = build
        self._graphs = nn.ModuleDict()
        self._programs: list[Program] = []
        self._warned_lengths = False   # a program per length was said once (runtime.module.program.fixed_length)
        self._warned_eager = False     # a call torch.compile did not trace was said once (_after_compile_gave_up)
        self._current = self._add_program(capture, plan, graph_module)
        self.train(capture.training)   # the model's mode: a model in eval() gives a module in eval()
        # -- the gradients over dp, once the parameters and the programs that read them are in place
        self._average_over_dp(getattr(mesh, "dp_group", None), getattr(mesh, "dp", 1))
        # -- the calls
        #: calls (and generation steps) made so far: each call's check names its number
        self._calls = 0
        self._caller: int | None = None   # the thread inside a call, if any
        #: compare every call's input names, shapes and dtypes across the TP group (True), also
        #: their values ("values"), or their shapes alone (False), with the call's place in the
        #: order of calls and its state; one tiny CPU all-reduce per call in each case
        self.check_inputs = True
        #: read the per-call checks without stopping the host (see the module docs): by default
        #: where the TP collectives are NCCL's, which the host queues without waiting for; where
        #: they run on the host (gloo), a disagreeing call would stop in its first collective
        #: before a late check could explain it, so the checks are read before it
        self.deferred_checks = getattr(mesh, "backend", None) == "nccl"
        #: the last call's index bounds, staged on the host and not yet read (deferred_checks)
        self._staged: StagedBounds | None = None
        #: optimizer steps over this module's parameters since the ranks last agreed on its replicas
        #: (every call's check compares them: a step on some ranks only is refused at the next call)
        self._steps = 0
        #: compare the digests of the replicated parameters and buffers at the first call after
        #: every n-th optimizer step (0: never; each check reads them to the host)
        self.check_replicas_every = 0
        self._steps_checked = 0
        #: load_state_dict calls since the ranks last agreed on the replicas
        self._loads = 0
        self.register_load_state_dict_post_hook(_after_load)
        #: why this module refuses calls (a disagreement about its state), until check_replicas passes
        self._refusal: str | None = None
        self._held_ids: tuple[Any, frozenset[int]] = (None, frozenset())
        _count_optimizer_steps(self)
        #: a call that raises on some ranks only leaves none of them out of step (autotp.distributed.faults)
        self._guard = StepGuard(self._control, group_ranks(self._control) if self._control is not None else None)
        #: the tp dim's DeviceMesh, taken once (a split output is a DTensor on it)
        device_mesh = device_mesh_of(mesh, device)
        self._tp_mesh = device_mesh["tp"] if device_mesh is not None else None

    def _apply(self, fn: Callable, recurse: bool = True) -> "ParallelModule":
        if refuse_dtype_change(self, fn):
            return self   # a conversion to what the parameters are already (torch's would fail on DTensors)
        out = super()._apply(fn, recurse)
        self._refresh_leaves()
        return out

    def _refresh_leaves(self) -> None:
        """The leaves of local tensors replaced (a move that swaps the tensors), made again now:
        a compiled call reads the leaves made before it (runtime.module.leaves.program_tensor)."""
        if getattr(self, "_leaves", None) is not None:
            self._leaves.make(self._held.values())

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

    def _new_program(self, capture: Capture, plan: Plan, graph_module: fx.GraphModule, inputs: dict[str, Any],
                     step: str = "", arriving: dict | None = None) -> Program:
        """A program built for a call (or a generation step) no program served: agreed by the group
        before its first collective (the first program was agreed at construction), added, and
        checked to compute ``inputs``."""
        check_agreement(fingerprint(plan, graph_module, capture.graph), self._control,
                        "before a new program's first collective", doing=f"a new program for {self._doing()}")
        program = self._add_program(capture, plan, graph_module, step, arriving)
        _check_serves(program, inputs, self.training)
        return program

    def _add_program(self, capture: Capture, plan: Plan, graph_module: fx.GraphModule, step: str = "",
                     arriving: dict | None = None) -> Program:
        param_order = [capture.aliases.get(fqn, fqn) for fqn in capture.param_names.values()]
        buffer_order = list(capture.buffer_names.values())
        self._state.put_buffers(self, buffer_order)
        values = self._state.constants(capture)
        constants = [values[name] for name in capture.constant_names.values()]
        self._graphs[f"program_{len(self._programs)}"] = graph_module
        split = []
        for i, (name, node) in enumerate(zip(capture.output_names, capture.output_nodes)):
            placement = plan.sharded_outputs.get(name) if not step else None
            # split on a static dim only: one along a dynamic dim was gathered (GraphIndex.keeps_split)
            if placement is not None and not isinstance(node.meta["val"].shape[placement.dim], torch.SymInt):
                size = int(node.meta["val"].shape[placement.dim])
                split.append((i, placement.dim, size, dtensor.torch_placement(placement, size, plan.tp)))
        program = Program(capture, plan, graph_module, param_order, buffer_order, constants,
                          index_bounds(capture), step, dict(arriving or {}), tuple(split))
        if self._units:
            self._outline(program)
        if self._leaves is not None:   # now: torch.compile cannot make one in the region it traces
            self._leaves.make(self._held[fqn] for fqn in param_order)
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
                    and (not in_ranges or within_ranges(program.capture, kwargs)):
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
        return self._new_program(capture, plan, graph_module, kwargs)

    def _average_over_dp(self, group: Any, dp: int) -> None:
        """Data parallelism across TP groups: each parameter's gradient is averaged over the DP
        group as soon as backward has accumulated it (the ranks of a DP group hold the same
        shard, run the same graph, and so reach the hooks in the same order)."""
        self._dp_hooks: list = []
        if group is None or dp <= 1:
            return
        import torch.distributed as dist

        from ...distributed.comm import _comm

        def average(param: torch.Tensor) -> None:
            grad = local_tensor(param.grad)
            with _comm("the data-parallel gradient all-reduce", group):   # a lost peer named as in TP
                dist.all_reduce(grad, group=group)
            grad.div_(dp)

        #: removed when FSDP2 takes data parallelism over (autotp.runtime.fsdp)
        self._dp_hooks = [param.register_post_accumulate_grad_hook(average)
                          for param in self._held.values() if param.requires_grad]

    def check_replicas(self, when: str = "on what they replicate", advice: str | None = None) -> None:
        """Raise DisagreementError on every rank of the TP group unless its ranks hold the same
        values in every parameter the plan replicates and every buffer (one small all-reduce,
        and a hash of each tensor): a load that gave one rank other values (a shard of another
        save, a damaged file), an optimizer stepped on some ranks only or with other settings,
        a parameter written on one rank would otherwise compute silently wrong results. Run
        after a load (autotp.runtime.dcp.load does), an optimizer step, and before every save
        (``autotp.runtime.dcp``: ``when`` and ``advice`` then say so in the error); while the
        replicas differ the module refuses calls, and once they agree it takes them again."""
        steps, loads = self._steps, self._loads
        since = (f"{steps} optimizer step{'s' if steps != 1 else ''}, {loads} load_state_dict "
                 f"call{'s' if loads != 1 else ''}")
        try:
            check_agreement(
                Fingerprint((("the replicated parameters and buffers differ (a hash of each tensor's values)",
                              self._replica_entries()),)),
                self._control, when, doing=f"the replicas' check of {self.name}",
                note=("what each rank did since the ranks last agreed on them", since),
                advice=advice or (
                    "Every rank of a TP group must hold the same values in what it replicates: load one "
                    "checkpoint, written by one save, on every rank; step the optimizer on every rank alike (the "
                    "same calls, the same settings); write a parameter on every rank or on none. The module "
                    "refuses calls until the replicas agree: load one checkpoint on every rank "
                    "(autotp.runtime.dcp.load), or make them equal and call pm.check_replicas() again."))
        except DisagreementError:
            self._refusal = "the replicated parameters differ across its ranks"
            raise
        self._refusal = None
        self._steps = self._steps_checked = self._loads = 0

    def _replica_entries(self, prefix: str = "") -> tuple[str, ...]:
        """``name: hash`` of every parameter the plan replicates and every buffer, on this rank."""
        plan = self.plan
        entries = tuple(f"{prefix}{fqn}: {value_digest(local_tensor(p))}" for fqn, p in self.named_parameters()
                        if not isinstance(plan.params.get(plan.aliases.get(fqn, fqn)), Shard))
        return entries + tuple(f"{prefix}{fqn}: {value_digest(b)}" for fqn, b in self.named_buffers())

    def _owns_any(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` steps any parameter of this module (``_held``: FSDP2 replaces the
        dict with its own parameters, which renews the ids)."""
        if self._held_ids[0] is not self._held:
            self._held_ids = (self._held, frozenset(id(p) for p in self._held.values()))
        mine = self._held_ids[1]
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    def local_parameter(self, fqn: str) -> torch.Tensor:
        """This rank's shard of parameter ``fqn`` (any of a tied parameter's names): the tensor
        the programs compute with, sharing storage with the DTensor parameter."""
        return local_tensor(self._held[self.plan.aliases.get(fqn, fqn)])

    def local_grad(self, fqn: str) -> torch.Tensor | None:
        """This rank's shard of parameter ``fqn``'s gradient (None before a backward)."""
        grad = self._held[self.plan.aliases.get(fqn, fqn)].grad
        return None if grad is None else local_tensor(grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``: every parameter's gradient reset, found by a plain loop over the
        submodules' parameter dicts, read as they are now (a parameter FSDP2 or a load put in
        place, a module added since). ``Module.parameters()``'s walk is generators nested as
        deep as the modules (the model's tree of names, the programs' graphs and their
        collective modules): each step of each one a Python call, about 2,300 a step of a rank
        of gpt2, 12 layers, under sequence parallelism. A parameter held twice is reset twice."""
        stack = [self]
        while stack:
            module = stack.pop()
            for p in module._parameters.values():
                if p is None or p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:   # (as nn.Module.zero_grad)
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
            stack.extend(module._modules.values())

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's shard on this rank, once per tied group, under the name the plan
        and the programs use (``lm_head.weight`` for GPT-2's tied embedding)."""
        return {fqn: local_tensor(param) for fqn, param in self._held.items()}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._compiled_forward(args, kwargs)
        if compile_gave_up():
            return self._after_compile_gave_up(args, kwargs)
        return self._eager_forward(args, kwargs)

    def _eager_forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        with self._sole_caller(), self._guard:   # an exception on some ranks only never leaves them out of step
            return self._forward(args, kwargs)

    def _after_compile_gave_up(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A call torch.compile was asked for and dynamo did not trace: under its defaults (no
        ``fullgraph``) an exception raised while tracing (``_compiled_forward``'s refusals, a bad
        argument) makes dynamo run this frame as Python while still tracing the frames it calls
        (a recompile limit does not: it runs the frame and its callees untraced). The refusals
        are raised again here, where dynamo does not take them for a graph break; a call that
        passes them (an exception only the traced call raised) runs eagerly, with dynamo kept out
        of the frames it calls (which once traced parts of the eager path, with the checks and
        DTensors it keeps out of a graph)."""
        self._compiled_program(bind_inputs(self.capture.signature, args, kwargs, self.capture.model_name))
        if not self._warned_eager:
            self._warned_eager = True
            log.warning("autotp: torch.compile did not trace a call of %s (dynamo ran its frame as Python: see "
                        "TORCH_LOGS=graph_breaks,recompiles): it ran eagerly, uncompiled (said once)", self.name)
        return torch.compiler.disable(self._eager_forward, recursive=True)(args, kwargs)

    @property
    def check_inputs(self) -> bool | str:
        return self._check_inputs

    @check_inputs.setter
    def check_inputs(self, mode: bool | str) -> None:
        self._check_inputs = _check_inputs_mode(mode)

    def _doing(self, backward: bool = False) -> str:
        call = f"call {self._calls} of {self.name}"
        return f"the backward pass of {call}" if backward else call

    @contextmanager
    def _agreed_call(self, names: list[str], values: list[Any], extra: tuple[str, ...] = (),
                     settings: tuple[str, ...] = ()):
        """The per-call check (one small all-reduce): every rank of the group is in this same call
        of this same module, with inputs of the same names, shapes and dtypes (and values, with
        ``check_inputs="values"``; the shapes alone with False), in the same state (:meth:`_context`,
        and ``settings``: a generation's arguments). The call is counted only once agreed, so a
        refused call is made again under the same number; a module whose ranks disagreed on its
        state refuses, on every rank alike. Read before the block runs, or, with
        ``deferred_checks``, after it (yielding the pending check, which the block reads early
        where it must: before a new program is captured). An error inside the block still reads
        the check first, on every rank alike: a disagreement is the error every rank raises."""
        if self._refusal is not None:
            raise DisagreementError(
                f"{self.name} refuses calls: {self._refusal}, so every result would be silently wrong. Load one "
                "checkpoint on every rank (autotp.runtime.dcp.load), or make the replicas equal and call "
                "pm.check_replicas(), to go on.")
        mode = self.check_inputs
        if mode:
            signature = input_signature(names, values, digest_values=mode == "values") + extra
        else:   # what would abort a collective, at no cost: the shapes
            signature = tuple(f"{n}: {tuple(v.shape)}" for n, v in zip(names, values) if isinstance(v, torch.Tensor))
        replicas = bool(self.check_replicas_every) and self._steps - self._steps_checked >= self.check_replicas_every
        self._calls += 1
        pending = start_call_check(self._doing(), signature, self._control,
                                   context=self._context(replicas) + settings)
        if not self.deferred_checks:
            self._finish_call_check(pending)
        try:
            yield pending
        except BaseException:
            self._finish_call_check(pending)
            raise
        self._finish_call_check(pending)
        if replicas:
            self._steps_checked = self._steps

    def _finish_call_check(self, pending: Any) -> None:
        try:
            pending.finish()
        except DisagreementError as exc:
            self._calls -= 1
            keys = getattr(exc, "context_keys", frozenset())
            if keys & {"optimizer steps", "replicated"}:
                self._refusal = ("its ranks took other numbers of optimizer steps" if "optimizer steps" in keys
                                 else "its replicated parameters drifted apart")
            raise
        except BaseException:
            self._calls -= 1
            raise

    def _context(self, replicas: bool = False) -> tuple[str, ...]:
        """The state this rank runs a call in, as the agreement compares it (see
        autotp.distributed.agreement.CONTEXT_ADVICE): what decides which collectives it runs, and
        how many optimizer steps its replicas went through; ``replicas``: their hashes too."""
        kind = self.device.type
        autocast = (f"{kind} {str(torch.get_autocast_dtype(kind)).removeprefix('torch.')}"
                    if torch.is_autocast_enabled(kind) else "off")
        frozen = ", ".join(fqn for fqn, p in self._held.items() if not p.requires_grad)
        context = (f"grad mode: {'enabled' if torch.is_grad_enabled() else 'disabled'}", f"autocast: {autocast}",
                   f"frozen: {frozen or '(none)'}", f"optimizer steps: {self._steps}")
        return context + (self._replica_entries("replicated ") if replicas else ())

    def flush_checks(self) -> None:
        """Read the checks ``deferred_checks`` leaves pending now (the last call's index bounds:
        a token id outside the vocabulary raises its InputError here), waiting for the device
        where it has not reached them yet. A training loop need not call it: the next call reads
        them; call it after the last one."""
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.check()

    @contextmanager
    def _sole_caller(self):
        """One thread in a call at a time, of this module and of every other module on the same
        process groups: the ranks pair their collectives by the order of calls, which two
        threads calling at once cannot keep the same on every rank."""
        me = threading.get_ident()
        groups = [g for g in {id(self._control): self._control, id(getattr(self.mesh, "tp_group", None)):
                              getattr(self.mesh, "tp_group", None)}.values() if g is not None]
        with _CALLERS:
            owner = self._caller
            if owner is not None and owner != me:
                raise ConfigError(
                    f"this {self.name} is already running a call in another thread: the ranks pair up their "
                    "collectives by the order of calls, which calls from two threads at once cannot keep the same "
                    "on every rank; call it from one thread at a time")
            other = next((_RUNNING[g] for g in groups if g in _RUNNING and _RUNNING[g][0] != me), None)
            if other is not None:
                raise ConfigError(
                    f"{other[1]} is running a call in another thread, on the process group this {self.name} "
                    "talks over: the ranks pair up their collectives by the order of calls, which calls from two "
                    "threads at once cannot keep the same on every rank (a process abort, or one module's tensors "
                    "summed with the other's); call the modules of one group from one thread at a time")
            self._caller = me
            entered = [g for g in groups if g not in _RUNNING]
            for g in entered:
                _RUNNING[g] = (me, self.name)
        try:
            yield
        finally:
            with _CALLERS:
                for g in entered:
                    _RUNNING.pop(g, None)
            if owner is None:
                self._caller = None

    def _compiled_forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A call traced by torch.compile: a program an eager call built, run as it is. What
        talks to the store or reads tensor values stays out of the traced region (the ranks'
        input agreement, the index bounds, the step guard); a program for a new kind of call
        is captured with torch.export, which cannot run inside a compiled region."""
        kwargs = bind_inputs(self.capture.signature, args, kwargs, self.capture.model_name)
        return self._run(self._compiled_program(kwargs), kwargs, compiled=True)

    def _compiled_program(self, kwargs: dict[str, Any]) -> Program:
        """The program a compiled call runs, built by an eager call before (else an InputError)."""
        program = self._serving(kwargs, in_ranges=True)
        if program is None:
            raise InputError(
                f"no program of this module serves a call with inputs {sorted(kwargs)} (training={self.training}) "
                "inside torch.compile: call the module once eagerly with such inputs first (a new kind of call is "
                "captured with torch.export, which cannot run in a compiled region)")
        return program

    def _forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        # Positional inputs are named by the model's forward signature, as at capture.
        kwargs = bind_inputs(self.capture.signature, args, kwargs, self.capture.model_name)
        self.flush_checks()   # the last call's, where deferred
        # first: the checks below then fail on every rank or on none
        names = sorted(kwargs)
        with self._agreed_call(names, [kwargs[n] for n in names], (f"training: {self.training}",)) as agreed:
            check_not_empty(kwargs)   # after the shapes are known to agree: every rank or none
            check_input_kinds([self.capture, *(p.capture for p in self._programs)], kwargs)   # before a capture for them
            fixed = fixed_length([self.capture, *(p.capture for p in self._programs if not p.step)], kwargs)
            if fixed is not None and not self._warned_lengths:   # the call gets a program traced at its length
                self._warned_lengths = True
                log.warning("autotp: %s", fixed)
            if self._serving(kwargs) is None:
                guarded = broken_guards([self._current, *self._programs], kwargs, self.training)
                if guarded is not None:   # another chunk count: a program of its own, said each time
                    log.warning("autotp: %s", guarded)
                self._finish_call_check(agreed)   # the ranks agree on the call before capturing for it
            program = self._current = self._program_for(kwargs)
            self._check_ranges(kwargs)
            return self._run(program, kwargs)

    def _run(self, program: Program, kwargs: dict[str, Any], compiled: bool = False) -> Any:
        flat = flat_inputs(program.capture, kwargs)
        if not compiled and self.deferred_checks:
            self._staged = stage_index_bounds(program.bounds, kwargs, call=self._doing())
        elif not compiled:
            check_index_bounds(program.bounds, kwargs)
        grad = torch.is_grad_enabled()
        compiling = compiled or torch.compiler.is_compiling()   # asked once, not once per parameter
        params = [program_tensor(self._held[fqn], grad, self._leaves, compiling) if fqn not in program.outlined
                  else None for fqn in program.param_order]
        buffers = [self.get_buffer(fqn) for fqn in program.buffer_order]
        gm = program.graph_module
        if compiling:   # the graph module as fx made it: dynamo traces its ops and modules
            outputs = gm(*params, *buffers, *program.constants, *flat)
        else:   # its eager code: no Python of OpOverload.__call__ or of a module call between the ops
            run = program.eager if program.eager_of is gm._code else program.bind_eager()
            outputs = run(gm, *params, *buffers, *program.constants, *flat) if run is not None \
                else gm(*params, *buffers, *program.constants, *flat)
        outputs = list(outputs)
        if grad and self._guard.active and not compiled:   # a backward pass that raises is a fault of the call
            wanted = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            if wanted:   # every rank in the same backward pass before its first collective
                doing, control = self._doing(backward=True), self._control
                watch_backward(self._guard, wanted, _backward_check(doing, control, self.deferred_checks))
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
        from ...generation import generate
        from .fsdp import whole_parameters

        with whole_parameters(self):   # generate() runs the programs without this module's __call__
            return generate(self, input_ids, attention_mask, **kwargs)

    def _step(self, spec: Any, inputs: dict[str, torch.Tensor], settings: tuple[str, ...] = (),
              ) -> tuple[Program, dict[str, torch.Tensor]]:
        """Run one generation step (``spec``: an autotp.generation.StepSpec), building its
        program on first use. The token inputs are checked across the ranks like a call's; the
        cache is not (its split may give ranks different shapes). ``settings``: generate's
        arguments (``generate: ...`` entries), agreed with the step's state."""
        with self._sole_caller(), self._guard:
            return self._run_step(spec, inputs, settings)

    def _run_step(self, spec: Any, inputs: dict[str, torch.Tensor], settings: tuple[str, ...] = (),
                  ) -> tuple[Program, dict[str, torch.Tensor]]:
        self.flush_checks()
        names = sorted(spec.tokens)
        with self._agreed_call(names, [spec.tokens[n] for n in names],
                               (f"training: {self.training}", f"past: {spec.past}"), settings) as agreed:
            kind = "decode" if spec.cache is not None else "prefill"
            for program in self._programs:
                if program.step == kind and program.serves(inputs, self.training) \
                        and within_ranges(program.capture, inputs):
                    break
            else:
                if self._build is None:
                    raise InputError("this module cannot capture a generation step; build it with autotp.parallelize")
                self._finish_call_check(agreed)   # the ranks agree on the step before capturing for it
                capture, plan, graph_module = self._build(dict(inputs), self.training, spec)
                program = self._new_program(capture, plan, graph_module, inputs, kind, spec.input_placements)
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


def compile_gave_up() -> bool:
    """Whether this eager frame runs inside a torch.compile'd call that dynamo did not trace: its
    frame callback is still set, to trace the frames this one calls. (A torch without the private
    query answers False: such a call then runs as dynamo makes it.)"""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:
        return False
    callback = get_eval_frame_callback()
    return callback is not None and callback is not False


def _check_serves(program: Program, kwargs: dict[str, Any], training: bool) -> None:
    """A program just built for a call must compute it: never run one traced for other sizes."""
    if not program.serves(kwargs, training):
        sizes = {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        raise InputError(f"{program.capture.model_name}: the program captured for this call does not hold its inputs' "
                         f"sizes {sizes} (a dim fixed while tracing, or a guard torch.export traced under): "
                         "call with other lengths, or report this model")


#: ParallelModules (and pipeline stages) made in this process, as agreed with their groups (each
#: one's number: its name)
_modules_made = 0


def control_group(mesh: Any) -> Any:
    """The group a module's agreement checks talk over: the mesh's CPU (gloo) control group,
    else its TP group (no accelerator sync per call)."""
    return getattr(mesh, "control_group", None) or getattr(mesh, "tp_group", None)


def agree_on_module(capture: Capture, plan: Plan, graph_module: fx.GraphModule, model: nn.Module,
                    control: Any) -> int:
    """The ranks of ``control`` agree on what they run, on the weights they were handed, and on
    this module's number (the largest any of them would give it): its name in every later
    check, so that the calls of two modules never pair up. One small exchange, on every rank."""
    global _modules_made
    number = check_agreement(fingerprint(plan, graph_module, capture.graph, state_entries(model),
                                         constant_entries(capture.constants), grad_entries(model)),
                             control, number=_modules_made + 1)
    _modules_made = max(_modules_made, number)
    return number
#: guards the check-and-set of a module's calling thread
_CALLERS = threading.Lock()
#: the process groups a call is running over -> (its thread, its module's name)
_RUNNING: dict[Any, tuple[int, str]] = {}
#: the modules an optimizer step may concern (see _count_optimizer_steps)
_LIVE: "weakref.WeakSet[ParallelModule]" = weakref.WeakSet()
_step_hook: Any = None


def _after_load(module: "ParallelModule", keys: Any) -> None:
    """load_state_dict's post-hook: one more load since the ranks last agreed on the replicas,
    the parameters a load with ``assign=True`` put in place of the held ones held instead (the
    programs read ``_held``: they once kept reading the replaced parameters, the load silently
    ignored), and the leaves of any local tensor the load replaced made again."""
    module._loads += 1
    names = getattr(module, "_held_names", None) or {fqn: fqn for fqn in module._held}
    held = {}
    for fqn, name in names.items():
        old, new = module._held[fqn], module.get_parameter(name)
        if new is not old and not (type(new) is type(old) and new.shape == old.shape
                                   and getattr(new, "placements", None) == getattr(old, "placements", None)):
            raise ConfigError(f"load_state_dict(assign=True) put a {type(new).__name__} of shape {tuple(new.shape)} "
                              f"in place of {name}, a {type(old).__name__} of shape {tuple(old.shape)}"
                              f"{' placed ' + str(old.placements) if hasattr(old, 'placements') else ''}: assign "
                              f"the tensors of pm.state_dict() (DTensors, each rank its shard), or load without "
                              f"assign=True (whole tensors are copied into the shards)")
        held[fqn] = new
    module._held = held
    module._refresh_leaves()


def _count_optimizer_steps(module: ParallelModule) -> None:
    """Count each optimizer step over ``module``'s parameters in ``module._steps`` (every call's
    check compares the count): one global post-step hook of torch.optim, added with the first
    module, looks for the modules whose parameters the stepped optimizer holds."""
    global _step_hook
    _LIVE.add(module)
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
            for live in list(_LIVE):
                if live._owns_any(optimizer):
                    live._steps += 1

        _step_hook = register_optimizer_step_post_hook(stepped)


def _backward_check(doing: str, control: Any, deferred: bool) -> Callable[[], None]:
    """The check a backward pass makes as it starts (every rank in the same backward pass): read
    there, before its first collective; deferred, issued there and read as the pass ends (a
    callback autograd runs after the pass's last gradient), raising out of ``loss.backward()``."""
    if not deferred:
        return lambda: check_call(doing, (), control)

    def issue() -> None:
        pending = start_call_check(doing, (), control)
        torch.autograd.Variable._execution_engine.queue_callback(pending.finish)

    return issue


def _check_inputs_mode(mode: Any) -> bool | str:
    if mode is True or mode is False or mode == "values":
        return mode
    raise ConfigError(f"check_inputs={mode!r} is not valid: use True (names, shapes and dtypes of every call's "
                      "inputs compared across the TP group), \"values\" (their values too: a digest of each "
                      "tensor) or False (the order of calls and the inputs' shapes alone)")


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
